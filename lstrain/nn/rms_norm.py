"""``lstrain.nn.RMSNorm``: a drop-in for ``torch.nn.RMSNorm`` over lstrain's kernels."""

from __future__ import annotations

import torch

from lstrain.ops.rms_norm import rms_norm

__all__ = ["RMSNorm"]


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with lstrain's fused forward and backward.

    Same constructor (``normalized_shape, eps=None, elementwise_affine=True, device=None,
    dtype=None``), parameter and state_dict key (``weight``, as Hugging Face's
    LlamaRMSNorm), so checkpoints move freely between the two.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` over ``normalized_shape``.

        Args:
            x: input of shape ``[*, *normalized_shape]``.

        Returns:
            The normalised tensor, shaped and typed like ``x``.

        Raises:
            ValueError: from :func:`lstrain.ops.rms_norm` for a bad input.
        """
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)
