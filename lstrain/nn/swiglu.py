"""``lstrain.nn.SwiGLUMLP``: a LLaMA-style MLP whose SwiGLU runs in GEMM epilogues."""

from __future__ import annotations

import torch

from lstrain.ops.swiglu import pack_gate_up, swiglu_mlp, unpack_gate_up

__all__ = ["SwiGLUMLP"]


class SwiGLUMLP(torch.nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, bias-free, as in LLaMA.

    The gate and up weights are held as one ``gate_up_weight`` of shape ``[2F, D]`` whose
    rows are in the pair layout of :mod:`lstrain.ops.swiglu`, but the
    state_dict uses the familiar keys and shapes: ``gate_proj.weight`` and
    ``up_proj.weight`` ``[F, D]``, ``down_proj.weight`` ``[D, F]`` — checkpoints of
    HF-style MLPs load as they are.

    Args:
        hidden_size: D.
        intermediate_size: F.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, device=None, dtype=None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        bound_in, bound_out = hidden_size**-0.5, intermediate_size**-0.5
        gate_up = torch.empty(2 * intermediate_size, hidden_size, device=device, dtype=dtype).uniform_(
            -bound_in, bound_in
        )
        down = torch.empty(hidden_size, intermediate_size, device=device, dtype=dtype).uniform_(-bound_out, bound_out)
        self.gate_up_weight = torch.nn.Parameter(gate_up)
        self.down_weight = torch.nn.Parameter(down)
        self._register_state_dict_hook(_to_separate_weights)
        self._register_load_state_dict_pre_hook(_from_separate_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu_mlp(x, self.gate_up_weight.t(), self.down_weight.t())

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}"


def _to_separate_weights(module, state_dict, prefix, local_metadata):
    gate, up = unpack_gate_up(state_dict.pop(prefix + "gate_up_weight").t())
    state_dict[prefix + "gate_proj.weight"] = gate.t()
    state_dict[prefix + "up_proj.weight"] = up.t()
    state_dict[prefix + "down_proj.weight"] = state_dict.pop(prefix + "down_weight")


def _from_separate_weights(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    keys = (prefix + "gate_proj.weight", prefix + "up_proj.weight", prefix + "down_proj.weight")
    if all(key in state_dict for key in keys):
        gate, up, down = (state_dict.pop(key) for key in keys)
        state_dict[prefix + "gate_up_weight"] = pack_gate_up(gate.t(), up.t()).t()
        state_dict[prefix + "down_weight"] = down
