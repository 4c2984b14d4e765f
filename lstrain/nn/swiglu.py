"""``lstrain.nn.SwiGLUMLP``: a LLaMA-style MLP over gate and up packed in one matrix."""

from __future__ import annotations

import torch

from lstrain.ops.swiglu import pack_gate_up, swiglu_mlp, unpack_gate_up

__all__ = ["SwiGLUMLP"]


class SwiGLUMLP(torch.nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, bias-free, as in LLaMA.

    The weights are held in the ``x @ W`` convention the kernels read fastest: one
    ``gate_up_weight`` of shape ``[D, 2F]`` whose columns are in the pair layout of
    :mod:`lstrain.ops.swiglu`, and ``down_weight`` ``[F, D]`` (a ``.t()`` view of either
    made the forward GEMM K-major, which the epilogue kernel ran slower). The state_dict
    uses the familiar keys and shapes: ``gate_proj.weight`` and
    ``up_proj.weight`` ``[F, D]``, ``down_proj.weight`` ``[D, F]`` — checkpoints of
    HF-style MLPs load as they are. Unlike torch's state dicts, ``gate_proj.weight`` and
    ``up_proj.weight`` are copies (the pair layout interleaves them; ``down_proj.weight``
    is a view): write to the module through ``load_state_dict``, not into its state dict's
    tensors (as an EMA that updates a state dict in place would).

    Args:
        hidden_size: D.
        intermediate_size: F.
        keep_activation: keep silu(gate) * up for backward (F values per token) instead
            of writing it again there (see :func:`lstrain.ops.swiglu_mlp`).
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, device=None, dtype=None, *, keep_activation: bool = False
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.keep_activation = keep_activation
        bound_in, bound_out = hidden_size**-0.5, intermediate_size**-0.5
        gate_up = torch.empty(hidden_size, 2 * intermediate_size, device=device, dtype=dtype).uniform_(
            -bound_in, bound_in
        )
        down = torch.empty(intermediate_size, hidden_size, device=device, dtype=dtype).uniform_(-bound_out, bound_out)
        self.gate_up_weight = torch.nn.Parameter(gate_up)
        self.down_weight = torch.nn.Parameter(down)
        self._register_state_dict_hook(_to_separate_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu_mlp(x, self.gate_up_weight, self.down_weight, keep_activation=self.keep_activation)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
            f"keep_activation={self.keep_activation}"
        )

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        """Load the checkpoint keys (``gate_proj.weight``, ``up_proj.weight``,
        ``down_proj.weight``) into the packed parameters, reporting missing keys and size
        mismatches by those names, as torch reports an HF-style MLP's: a key that is there
        loads even when another is missing (the other half of the pair keeps its values)."""
        features, hidden = self.intermediate_size, self.hidden_size
        shapes = {"gate_proj.weight": (features, hidden), "up_proj.weight": (features, hidden)}
        shapes["down_proj.weight"] = (hidden, features)
        loaded = {}
        for name, shape in shapes.items():
            key = prefix + name
            if key not in state_dict:
                if strict:
                    missing_keys.append(key)
            elif tuple(state_dict[key].shape) != shape:
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {state_dict[key].shape} from checkpoint, "
                    f"the shape in current model is {torch.Size(shape)}."
                )
                state_dict.pop(key)
            else:
                loaded[name] = state_dict.pop(key)
        if "gate_proj.weight" in loaded or "up_proj.weight" in loaded:
            with torch.no_grad():
                gate, up = unpack_gate_up(self.gate_up_weight)
            # the half not in the checkpoint keeps its values: the loaded half takes its dtype
            if "gate_proj.weight" in loaded:
                gate = loaded["gate_proj.weight"].t().to(gate)
            if "up_proj.weight" in loaded:
                up = loaded["up_proj.weight"].t().to(up)
            state_dict[prefix + "gate_up_weight"] = pack_gate_up(gate, up)
        if "down_proj.weight" in loaded:
            # contiguous: load_state_dict(assign=True) would otherwise make the parameter a
            # transposed view, which swiglu_mlp's backward copies every step
            state_dict[prefix + "down_weight"] = loaded["down_proj.weight"].t().contiguous()
        first_new = len(missing_keys)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        # the packed parameters' own names mean nothing to a checkpoint: its keys were reported above
        internal = (prefix + "gate_up_weight", prefix + "down_weight")
        missing_keys[first_new:] = [key for key in missing_keys[first_new:] if key not in internal]


def _to_separate_weights(module, state_dict, prefix, local_metadata):
    gate, up = unpack_gate_up(state_dict.pop(prefix + "gate_up_weight"))
    state_dict[prefix + "gate_proj.weight"] = gate.t()
    state_dict[prefix + "up_proj.weight"] = up.t()
    state_dict[prefix + "down_proj.weight"] = state_dict.pop(prefix + "down_weight").t()
