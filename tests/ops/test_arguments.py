"""Every public op names a tensor argument that is no tensor, before it reads any of them."""

import inspect
import re

import pytest
import torch

import lstrain.ops

# the *_ref functions are plain PyTorch; the dropout helpers check their own arguments
OPS = [
    name for name in lstrain.ops.__all__ if not name.endswith("_ref") and name not in ("dropout_mask", "dropout_seeds")
]
# the ops' required arguments that are no tensors: any valid value, the tensor check comes first
OTHERS = {"normalized_shape": 1, "heads": 1, "num_heads": 1, "num_kv_heads": 1}


def _parameters(op: str) -> list[inspect.Parameter]:
    return list(inspect.signature(getattr(lstrain.ops, op)).parameters.values())


def _is_tensor(parameter: inspect.Parameter) -> bool:
    # a seed is refused by check_seed, with a message of its own (tests/ops/test_bias_dropout.py)
    return "Tensor" in str(parameter.annotation) and parameter.name != "seed"


CASES = [(op, p.name) for op in OPS for p in _parameters(op) if _is_tensor(p)]


def test_every_op_has_its_tensor_arguments_probed():
    assert {op for op, _ in CASES} == set(OPS)
    assert {("gemm", "c"), ("embedding", "positions"), ("shared_input_linear", "biases")} <= set(CASES)


@pytest.mark.parametrize("op, name", CASES)
def test_a_list_for_a_tensor_is_named(op, name):
    """A list in one tensor position, a tensor in the others; a sequence of tensors
    (shared_input_linear's weights and biases) holds the list as its first element."""
    kwargs = {p.name: OTHERS[p.name] for p in _parameters(op) if p.name in OTHERS}
    named = name
    for p in filter(_is_tensor, _parameters(op)):
        value = [[1.0, 2.0]] if p.name == name else torch.zeros(1)
        if str(p.annotation).startswith("Sequence"):
            value = [value]
            named = f"{name}[0]" if p.name == name else named
        kwargs[p.name] = value
    match = rf"^{op}: {re.escape(named)} must be a tensor( or None)?, got list$"
    with pytest.raises(ValueError, match=match):
        getattr(lstrain.ops, op)(**kwargs)
