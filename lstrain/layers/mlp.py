"""The Transformer MLP: ``residual + dropout(c_proj(act(c_fc(x))))``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lstrain.layers._residual import add_residual
from lstrain.ops import bias_act_dropout, linear

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

    Fused: both GEMMs are cuBLAS's without their biases; ``c_fc``'s bias and the
    activation are one :func:`lstrain.ops.bias_act_dropout` kernel (it keeps only the
    GEMM's output for backward, whose kernel also sums the bias gradient), and
    ``c_proj``'s bias, the dropout and the residual add are one
    :func:`lstrain.ops.bias_dropout_residual` kernel, whose mask is regenerated from a
    seed in backward. (lstrain's Triton GEMM with the bias and activation in its epilogue
    measured slower on the H200 than cuBLAS's GEMM plus that kernel: docs/notes/step_profiles.md.)
    Unfused: ``nn.Linear``, the activation, ``nn.Linear``, ``F.dropout`` and an add, with
    the same parameters.

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

    ``forward(x, residual, norm=None, seed=None)`` returns ``residual +
    dropout(c_proj(act(c_fc(x))))``; with a LayerNorm ``norm``, ``(norm(stream), stream)``,
    fused into the residual add's kernel (:func:`lstrain.ops.dropout_add_layer_norm`).
    ``seed`` (fused only): the dropout's seed, a 1-element int64 tensor (drawn when None).
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
        self.c_fc = torch.nn.Linear(dim, hidden, device=device, dtype=dtype)
        self.c_proj = torch.nn.Linear(hidden, dim, device=device, dtype=dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        norm: torch.nn.LayerNorm | None = None,
        seed: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            h = bias_act_dropout(linear(x, self.c_fc.weight), self.c_fc.bias, activation=self.activation)
            y = linear(h, self.c_proj.weight)
            return add_residual(y, self.c_proj.bias, residual, self.dropout, self.training, norm, seed)
        y = self.c_proj(ACTIVATIONS[self.activation](self.c_fc(x)))
        h = residual + F.dropout(y, self.dropout, self.training)
        return h if norm is None else (norm(h), h)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, dropout={self.dropout}, fused={self.fused}"
