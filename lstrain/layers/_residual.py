"""The fused end of a sublayer: ``residual + dropout(y + bias)`` in one kernel, alone or with
the LayerNorm that follows it."""

from __future__ import annotations

import torch

import lstrain.nn
from lstrain.ops import bias_dropout_residual, dropout_add_layer_norm


def add_residual(
    y: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    dropout: float,
    training: bool,
    norm: torch.nn.LayerNorm | None = None,
    seed: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + dropout(y + bias)`` through :func:`lstrain.ops.bias_dropout_residual`,
    or with a LayerNorm ``norm`` ``(norm(h), h)`` through
    :func:`lstrain.ops.dropout_add_layer_norm` with its weight, bias and eps (one kernel each
    way; the module's forward and hooks are not called). A norm over more than the last dim,
    or of another class than torch's and lstrain's LayerNorm, runs as a module after the add.

    Args:
        y: the sublayer's projection, computed without its bias.
        bias: the projection's bias, or None.
        residual: the sublayer's input, shaped like ``y``.
        dropout: drop probability, applied when ``training``.
        training: whether dropout is active.
        norm: the LayerNorm applied to the new residual stream, or None.
        seed: the dropout mask's seed (a 1-element int64 tensor on y's device), or None
            to draw one.

    Returns:
        The new residual stream, or ``(normed, new_residual)`` with ``norm``; in the dtype
        torch's ``residual + y`` would have.
    """
    # The kernels write y's dtype; under autocast y is bf16 while the stream may be fp32,
    # and torch's ``residual + y`` keeps the stream in fp32.
    dtype = torch.promote_types(y.dtype, residual.dtype)
    fusable = type(norm) in (torch.nn.LayerNorm, lstrain.nn.LayerNorm) and len(norm.normalized_shape) == 1
    if fusable:
        return dropout_add_layer_norm(
            y.to(dtype), bias, residual.to(dtype), norm.weight, norm.bias, eps=norm.eps, dropout=dropout,
            training=training, seed=seed,
        )  # fmt: skip
    h = bias_dropout_residual(y.to(dtype), bias, residual, dropout=dropout, training=training, seed=seed)
    return h if norm is None else (norm(h), h)
