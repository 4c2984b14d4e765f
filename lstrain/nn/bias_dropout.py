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


class BiasDropoutResidual(_BiasDropout):
    """``dropout(x + bias) + residual``: the end of an attention or MLP sublayer.

    Args:
        features: the last dim of ``x``.
        dropout: drop probability in [0, 1), applied in training mode only.
        bias: whether the module owns a bias (initialised to zeros).

    ``forward(x, residual)``.
    """

    def __init__(self, features: int, dropout: float = 0.0, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__(features, dropout, bias, device, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return bias_dropout_residual(x, self.bias, residual, dropout=self.dropout, training=self.training)


class BiasActDropout(_BiasDropout):
    """``dropout(act(x + bias))``: the middle of an MLP.

    Args:
        features: the last dim of ``x``.
        activation: ``"gelu"``, ``"gelu_tanh"``, ``"relu"`` or ``"silu"``.
        dropout: drop probability in [0, 1), applied in training mode only.
        bias: whether the module owns a bias (initialised to zeros).

    Raises:
        ValueError: an unknown activation or a dropout outside [0, 1).
    """

    def __init__(
        self, features: int, activation: str = "gelu", dropout: float = 0.0, bias: bool = True, device=None, dtype=None
    ) -> None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"BiasActDropout: activation must be one of {ACTIVATIONS}, got {activation!r}")
        super().__init__(features, dropout, bias, device, dtype)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bias_act_dropout(x, self.bias, activation=self.activation, dropout=self.dropout, training=self.training)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation!r}"
