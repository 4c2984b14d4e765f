"""The fused end of a sublayer: ``residual + dropout(y + bias)`` in one kernel."""

from __future__ import annotations

import torch

from lstrain.ops import bias_dropout_residual


def add_residual(
    y: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, dropout: float, training: bool
) -> torch.Tensor:
    """``residual + dropout(y + bias)`` through :func:`lstrain.ops.bias_dropout_residual`.

    Args:
        y: the sublayer's projection, computed without its bias.
        bias: the projection's bias, or None.
        residual: the sublayer's input, shaped like ``y``.
        dropout: drop probability, applied when ``training``.
        training: whether dropout is active.

    Returns:
        The new residual stream, in the dtype torch's ``residual + y`` would have.
    """
    # The kernel writes y's dtype; under autocast y is bf16 while the stream may be fp32,
    # and torch's ``residual + y`` keeps the stream in fp32.
    out_dtype = torch.promote_types(y.dtype, residual.dtype)
    return bias_dropout_residual(y.to(out_dtype), bias, residual, dropout=dropout, training=training)
