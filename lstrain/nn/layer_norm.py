"""``lstrain.nn.LayerNorm``: a drop-in for ``torch.nn.LayerNorm`` over lstrain's kernels."""

from __future__ import annotations

import torch

from lstrain.ops.layer_norm import layer_norm

__all__ = ["LayerNorm"]


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` with lstrain's fused forward and backward.

    Same constructor (``normalized_shape, eps=1e-5, elementwise_affine=True, bias=True,
    device=None, dtype=None``), parameters and state_dict keys (``weight``, ``bias``), so
    checkpoints move freely between the two.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
