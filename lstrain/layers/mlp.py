"""The Transformer MLP: ``residual + dropout(c_proj(act(c_fc(x))))``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import lstrain.nn
from lstrain.layers._residual import add_residual

__all__ = ["ACTIVATIONS", "MLP"]

# lstrain's activation names -> the plain-torch function the unfused twin applies.
ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


class MLP(torch.nn.Module):
    """Linear -> activation -> Linear, with the output's dropout and the residual add.

    Fused: ``c_fc`` is an :class:`lstrain.nn.Linear` whose GEMM epilogue adds the bias and
    applies the activation (it keeps only the pre-activation for backward); ``c_proj``'s
    GEMM runs without its bias (cuBLAS: there is no epilogue to fuse), and the bias, the
    dropout and the residual add are one :func:`lstrain.ops.bias_dropout_residual`
    kernel, whose mask is regenerated from a seed in backward. Unfused: ``nn.Linear``,
    the activation, ``nn.Linear``, ``F.dropout`` and an add, with the same parameters.

    Args:
        dim: model width (input and output features).
        hidden: inner width (GPT-2: 4 * dim).
        activation: ``"gelu"`` (erf, BERT), ``"gelu_tanh"`` (GPT-2's gelu_new), ``"relu"``
            or ``"silu"``.
        dropout: drop probability of the output, in training mode only.
        fused: lstrain's kernels, or plain torch ops (same parameter names and shapes).
        device, dtype: of the parameters.

    Raises:
        ValueError: an unknown activation or a dropout outside [0, 1).

    ``forward(x, residual)`` returns ``residual + dropout(c_proj(act(c_fc(x))))``.
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        activation: str = "gelu_tanh",
        dropout: float = 0.0,
        fused: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"MLP: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"MLP: dropout must be in [0, 1), got {dropout}")
        self.activation = activation
        self.dropout = dropout
        self.fused = fused
        if fused:
            self.c_fc = lstrain.nn.Linear(dim, hidden, device=device, dtype=dtype, activation=activation)
        else:
            self.c_fc = torch.nn.Linear(dim, hidden, device=device, dtype=dtype)
        self.c_proj = torch.nn.Linear(hidden, dim, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.fused:
            y = F.linear(self.c_fc(x), self.c_proj.weight)
            return add_residual(y, self.c_proj.bias, residual, self.dropout, self.training)
        y = self.c_proj(ACTIVATIONS[self.activation](self.c_fc(x)))
        return residual + F.dropout(y, self.dropout, self.training)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, dropout={self.dropout}, fused={self.fused}"
