"""``lstrain.nn.AddRMSNorm``: the residual add and RMSNorm of a pre-norm layer in one module."""

from __future__ import annotations

import torch

from lstrain.ops.add_rms_norm import add_rms_norm

__all__ = ["AddRMSNorm"]


class AddRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` that first adds the residual stream, fused with lstrain's kernels.

    Same constructor (``normalized_shape, eps=None, elementwise_affine=True, device=None,
    dtype=None``), parameter and state_dict key (``weight``) as ``torch.nn.RMSNorm``, whose
    subclass it is so that code finding norms by type (weight-decay groups) finds it; only
    ``forward`` differs: it takes the residual and returns the new residual too.
    """

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add ``residual`` to ``x`` and normalise the sum over ``normalized_shape``.

        Args:
            x: input of shape ``[*, *normalized_shape]`` (a sublayer's output).
            residual: the residual stream, same shape and dtype.

        Returns:
            ``(normed, new_residual)``: ``rms_norm(x + residual)`` and ``x + residual``.

        Raises:
            ValueError: from :func:`lstrain.ops.add_rms_norm` for a bad input.
        """
        return add_rms_norm(x, residual, self.normalized_shape, self.weight, self.eps)
