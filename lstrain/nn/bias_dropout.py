"""Modules for a Transformer layer's bias + activation + dropout (+ residual) tails.

Pair them with a bias-free ``torch.nn.Linear``: the module owns the bias, so the add,
the activation, the dropout and the residual add run as one kernel each way.
"""

from __future__ import annotations

import torch

from lstrain.ops._lib.options import float_option
from lstrain.ops.bias_act_dropout import ACTIVATIONS, bias_act_dropout
from lstrain.ops.bias_dropout_residual import bias_dropout_residual

__all__ = ["BiasActDropout", "BiasDropoutResidual"]


class _BiasDropout(torch.nn.Module):
    def __init__(self, features: int, dropout: float, bias: bool, device=None, dtype=None) -> None:
        super().__init__()
        self.features = features
        self.dropout = float_option(type(self).__name__, "dropout", dropout, 0, 1, high_open=True)
        self.bias = torch.nn.Parameter(torch.zeros(features, device=device, dtype=dtype)) if bias else None

    def extra_repr(self) -> str:
        return f"{self.features}, dropout={self.dropout}, bias={self.bias is not None}"

    def _check_features(self, x: torch.Tensor) -> None:
        if x.dim() == 0 or x.shape[-1] != self.features:
            raise ValueError(
                f"{type(self).__name__}: x's last dim must be features ({self.features}), got shape {tuple(x.shape)}"
            )


class BiasDropoutResidual(_BiasDropout):
    """``dropout(x + bias) + residual``: the end of an attention or MLP sublayer.

    Args:
        features: the last dim of ``x``.
        dropout: drop probability in [0, 1), applied in training mode only.
        bias: whether the module owns a bias (initialised to zeros).

    ``forward(x, residual)`` returns the dtype torch's ``residual + dropout(x + bias)``
    has: under autocast a bf16 ``x`` and an fp32 stream give an fp32 stream.

    Raises:
        ValueError: a dropout outside [0, 1); in forward, an ``x`` whose last dim is not
            ``features``, or a ``residual`` not shaped like ``x``.
    """

    def __init__(self, features: int, dropout: float = 0.0, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__(features, dropout, bias, device, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        self._check_features(x)
        # the kernel writes x's dtype: x takes the one torch's promotion gives the sum
        dtype = torch.promote_types(x.dtype, residual.dtype)
        if self.bias is not None:
            dtype = torch.promote_types(dtype, self.bias.dtype)
        return bias_dropout_residual(x.to(dtype), self.bias, residual, dropout=self.dropout, training=self.training)


class BiasActDropout(_BiasDropout):
    """``dropout(act(x + bias))``: the middle of an MLP, in the dtype torch's ``x + bias``
    has.

    Args:
        features: the last dim of ``x``.
        activation: ``"gelu"``, ``"gelu_tanh"``, ``"relu"`` or ``"silu"``.
        dropout: drop probability in [0, 1), applied in training mode only.
        bias: whether the module owns a bias (initialised to zeros).

    Raises:
        ValueError: an unknown activation or a dropout outside [0, 1); in forward, an
            ``x`` whose last dim is not ``features``.
    """

    def __init__(
        self, features: int, activation: str = "gelu", dropout: float = 0.0, bias: bool = True, device=None, dtype=None
    ) -> None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"BiasActDropout: activation must be one of {ACTIVATIONS}, got {activation!r}")
        super().__init__(features, dropout, bias, device, dtype)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_features(x)
        if self.bias is not None:  # torch's x + bias promotes: a bf16 x and an fp32 bias give fp32
            x = x.to(torch.promote_types(x.dtype, self.bias.dtype))
        return bias_act_dropout(x, self.bias, activation=self.activation, dropout=self.dropout, training=self.training)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation!r}"
