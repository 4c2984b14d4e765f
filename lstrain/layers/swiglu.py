"""LLaMA's MLP, ``down_proj(silu(gate_proj(x)) * up_proj(x))``, fused or in plain torch ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import lstrain.nn
from lstrain.ops.swiglu import PAIR_BLOCK

__all__ = ["SwiGLU"]


class SwiGLU(lstrain.nn.SwiGLUMLP):
    """:class:`lstrain.nn.SwiGLUMLP` (bias-free; state_dict keys ``gate_proj.weight``,
    ``up_proj.weight``, ``down_proj.weight`` as HF's ``LlamaMLP``) with a plain-torch twin.

    Fused: :func:`lstrain.ops.swiglu_mlp`, SwiGLU in one pass each way over the pair layout. Unfused: the same
    parameters (the gate and up weights packed in the pair layout of
    :mod:`lstrain.ops.swiglu`) through matmuls, ``F.silu`` and a product: one GEMM for
    gate and up together, as a careful PyTorch user packs them, and no copy of the weights.

    Args:
        hidden_size: model width D.
        intermediate_size: inner width F.
        fused: lstrain's kernels, or plain torch ops.
        device, dtype: of the parameters.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, fused: bool = True, device=None, dtype=None) -> None:
        super().__init__(hidden_size, intermediate_size, device=device, dtype=dtype)
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return super().forward(x)
        h = x @ self.gate_up_weight  # [*, 2F], the pair layout
        features = self.intermediate_size
        whole = features - features % PAIR_BLOCK
        parts = []
        if whole:
            pairs = h[..., : 2 * whole].unflatten(-1, (whole // PAIR_BLOCK, 2, PAIR_BLOCK))
            parts.append((F.silu(pairs[..., 0, :]) * pairs[..., 1, :]).flatten(-2))
        if whole < features:
            tail = h[..., 2 * whole :]
            parts.append(F.silu(tail[..., : features - whole]) * tail[..., features - whole :])
        a = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return a @ self.down_weight

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fused={self.fused}"
