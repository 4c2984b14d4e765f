"""The fused end of a sublayer: ``residual + dropout(y + bias)`` in one kernel, alone or with
the LayerNorm that follows it."""

from __future__ import annotations

import torch

import lstrain.nn
from lstrain.ops import bias_dropout_residual, dropout_add_layer_norm


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


def add_residual_norm(
    y: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    dropout: float,
    training: bool,
    norm: torch.nn.LayerNorm,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(h), h)`` for ``h = residual + dropout(y + bias)``, through
    :func:`lstrain.ops.dropout_add_layer_norm` with ``norm``'s weight, bias and eps (one kernel
    each way, ``norm``'s forward and its hooks not called); a norm over more than the last dim,
    or of another class than torch's and lstrain's LayerNorm, takes :func:`add_residual` and
    ``norm`` itself.

    Args:
        y, bias, residual, dropout, training: as for :func:`add_residual`.
        norm: the LayerNorm applied to the new residual stream.

    Returns:
        ``(normed, new_residual)``, in the dtype torch's ``residual + y`` would have.
    """
    # Only LayerNorms whose forward is known: a subclass's own forward (or its hooks) runs as a module
    if type(norm) not in (torch.nn.LayerNorm, lstrain.nn.LayerNorm) or len(norm.normalized_shape) != 1:
        h = add_residual(y, bias, residual, dropout, training)
        return norm(h), h
    dtype = torch.promote_types(y.dtype, residual.dtype)
    return dropout_add_layer_norm(
        y.to(dtype), bias, residual.to(dtype), norm.weight, norm.bias, eps=norm.eps, dropout=dropout, training=training
    )
