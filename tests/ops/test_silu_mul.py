"""silu_mul: silu(gate) * up in one kernel each way."""

import math

import pytest
import torch
from hypothesis import example, given, settings

from lstrain.ops import silu_mul, silu_mul_linear, silu_mul_ref
from lstrain.testing import assert_all_passed
from lstrain.testing.checks import OP_CHECKS
from lstrain.testing.strategies import silu_mul_cases, silu_mul_linear_cases
from tests.conftest import DEVICE, EXPECTED_BACKEND

CHECK = OP_CHECKS["silu_mul"]
FEW = settings(max_examples=15) if DEVICE == "cpu" else settings()


def _case(shape=(3, 40), dtype=torch.float32, packed=False, scale=1.0, seed=0):
    return {"shape": shape, "dtype": dtype, "packed": packed, "scale": scale, "seed": seed}


@FEW
@given(case=silu_mul_cases(DEVICE))
@example(case=_case(shape=(1, 1)))
@example(case=_case(shape=(2, 3, 1025), dtype=torch.bfloat16, packed=True))  # two column blocks, strided rows
@example(case=_case(shape=(70, 33), dtype=torch.float16, scale=30.0))  # the sigmoid saturates both ways
def test_matches_torch(case):
    result = CHECK.run(case, DEVICE)
    assert set(result.backends) == {EXPECTED_BACKEND}
    assert_all_passed(result.comparisons, str(case))


def test_extremes_are_torchs():
    gate = torch.tensor([-math.inf, math.inf, -100.0, 100.0, math.nan, 0.0], device=DEVICE, requires_grad=True)
    up = torch.full_like(gate, 2.0, requires_grad=True)
    ours = silu_mul(gate, up)
    theirs = silu_mul_ref(gate, up)
    torch.testing.assert_close(ours, theirs, equal_nan=True)
    (dgate, dup) = torch.autograd.grad(ours.sum(), (gate, up))
    assert dgate[2].item() == 0.0 and dgate[3].item() == 2.0 and dup[3].item() == 100.0
    assert math.isnan(dgate[4].item()) and math.isnan(dup[4].item())


def test_only_the_inputs_are_saved_and_no_grad_makes_no_graph():
    gate = torch.randn(4, 8, device=DEVICE)
    assert silu_mul(gate, gate.clone()).grad_fn is None
    gate.requires_grad_()
    up = torch.randn(4, 8, device=DEVICE)
    out = silu_mul(gate, up)
    (dgate,) = torch.autograd.grad(out.sum(), gate)
    assert dgate.shape == gate.shape


@pytest.mark.parametrize(
    ("gate", "up", "match"),
    [
        ((3, 4), (3, 5), r"up has shape \(3, 5\), gate \(3, 4\)"),
        ((), (), "gate must have at least one dim"),
    ],
)
def test_bad_shapes_are_named(gate, up, match):
    with pytest.raises(ValueError, match=match):
        silu_mul(torch.randn(gate, device=DEVICE), torch.randn(up, device=DEVICE))


def test_bad_dtypes_are_named():
    gate = torch.randn(3, 4, device=DEVICE)
    with pytest.raises(ValueError, match="up is torch.float16 on"):
        silu_mul(gate, gate.half())
    with pytest.raises(ValueError, match="gate has dtype torch.int64"):
        silu_mul(torch.ones(3, dtype=torch.long, device=DEVICE), torch.ones(3, dtype=torch.long, device=DEVICE))


LINEAR_CHECK = OP_CHECKS["silu_mul_linear"]


def _linear_case(out_features=5, bias=True, **kwargs):
    return {**_case(**kwargs), "out_features": out_features, "bias": bias}


@settings(max_examples=10) if DEVICE == "cpu" else settings()
@given(case=silu_mul_linear_cases(DEVICE))
@example(case=_linear_case(shape=(1, 1), out_features=1))
@example(case=_linear_case(shape=(2, 3, 257), dtype=torch.bfloat16, packed=True, bias=False))
@example(case=_linear_case(shape=(33, 70), dtype=torch.float16, scale=30.0, out_features=40))
def test_with_the_down_projection_matches_torch(case):
    result = LINEAR_CHECK.run(case, DEVICE)
    assert set(result.backends) == {EXPECTED_BACKEND}
    assert_all_passed(result.comparisons, str(case))


def test_with_the_down_projection_the_product_is_not_saved():
    gate = torch.randn(64, 96, device=DEVICE, requires_grad=True)
    up = torch.randn(64, 96, device=DEVICE, requires_grad=True)
    weight = torch.randn(8, 96, device=DEVICE, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        y = silu_mul_linear(gate, up, weight)
    assert sorted(saved) == sorted([gate.shape, up.shape, weight.shape])  # no [64, 96] product beside them
    y.square().sum().backward()
    assert weight.grad.is_contiguous() and gate.grad.shape == gate.shape
    with pytest.raises(ValueError, match=r"weight must be \[out, 96\]"):
        silu_mul_linear(gate, up, torch.randn(8, 95, device=DEVICE))
    with pytest.raises(ValueError, match=r"bias has shape \(7,\), expected \(8,\)"):
        silu_mul_linear(gate, up, weight, torch.randn(7, device=DEVICE))
