"""qkv_projection: F.linear + a head split whose backward packs dq / dk / dv and sums dbias in one pass."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings

from lstrain.ops import qkv_projection, qkv_projection_ref
from lstrain.ops.qkv_projection import pack_heads_grad
from lstrain.testing import assert_all_passed
from lstrain.testing.checks import OP_CHECKS
from lstrain.testing.strategies import qkv_projection_cases
from tests.conftest import DEVICE, EXPECTED_BACKEND

CHECK = OP_CHECKS["qkv_projection"]
FEW = settings(max_examples=12) if DEVICE == "cpu" else settings()


def _case(shape=(2, 5), in_features=7, heads=3, head_dim=8, bias=True, dtype=torch.float32, seed=0):
    return {
        "shape": shape,
        "in_features": in_features,
        "heads": heads,
        "head_dim": head_dim,
        "bias": bias,
        "dtype": dtype,
        "seed": seed,
    }


@FEW
@given(case=qkv_projection_cases(DEVICE))
@example(case=_case(shape=(1, 1), in_features=1, heads=1, head_dim=1))
@example(case=_case(dtype=torch.bfloat16, bias=False))
@example(case=_case(shape=(3, 70), heads=2, head_dim=600, dtype=torch.float16))  # 2 column blocks, many walkers
@example(case=_case(shape=(2, 40), in_features=32, heads=2, head_dim=64, dtype=torch.bfloat16))  # GPT-2's heads
def test_matches_torch(case):
    result = CHECK.run(case, DEVICE)
    assert set(result.backends) == {EXPECTED_BACKEND}
    assert_all_passed(result.comparisons, str(case))


def _inputs(batch=2, seq=9, width=12, heads=4, head_dim=8, dtype=torch.float32):
    torch.manual_seed(0)
    dim = heads * head_dim
    x = torch.randn(batch, seq, width, device=DEVICE, dtype=dtype, requires_grad=True)
    weight = (torch.randn(3 * dim, width, device=DEVICE) * width**-0.5).to(dtype).requires_grad_()
    bias = torch.randn(3 * dim, device=DEVICE, dtype=dtype, requires_grad=True)
    return x, weight, bias


@pytest.mark.parametrize("causal", [True, False])
def test_under_attention_the_gradients_are_autograds(causal):
    """SDPA's backward leaves dq / dk / dv in its own layout: the packed gradient is the same."""
    x, weight, bias = _inputs()
    grads = []
    for fn in (qkv_projection, qkv_projection_ref):
        q, k, v = fn(x, weight, bias, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        grads.append(torch.autograd.grad(out.square().sum(), (x, weight, bias)))
    for ours, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_the_outputs_are_views_of_one_projection_and_the_weight_grad_is_contiguous():
    x, weight, bias = _inputs()
    q, k, v = qkv_projection(x, weight, bias, 4)
    assert q.shape == (2, 4, 9, 8) and q.stride(-1) == 1
    assert q.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    (q.sum() + 2 * k.sum() + 3 * v.sum()).backward()
    assert weight.grad.is_contiguous() and bias.grad.dtype == bias.dtype
    torch.testing.assert_close(bias.grad, torch.tensor([1.0, 2.0, 3.0], device=DEVICE).repeat_interleave(32) * 18)


def test_a_transposed_weight_gets_its_gradient_in_its_layout():
    """A Conv1D's [in, 3 * dim] weight, passed as its .t() view: its .grad add stays contiguous."""
    x, weight, bias = _inputs()
    conv_weight = weight.detach().t().contiguous().requires_grad_()
    q, k, v = qkv_projection(x, conv_weight.t(), bias, 4)
    (q.sum() + 2 * k.sum() + 3 * v.sum()).backward()
    q, k, v = qkv_projection_ref(x, weight, bias, 4)
    (q.sum() + 2 * k.sum() + 3 * v.sum()).backward()
    assert conv_weight.grad.is_contiguous()
    torch.testing.assert_close(conv_weight.grad, weight.grad.t(), rtol=1e-5, atol=1e-5)


def test_an_unused_output_has_a_zero_gradient():
    x, weight, bias = _inputs()
    dv = torch.randn(2, 4, 9, 8, device=DEVICE)
    ours = torch.autograd.grad(qkv_projection(x, weight, bias, 4)[2], (weight, bias), dv)
    theirs = torch.autograd.grad(qkv_projection_ref(x, weight, bias, 4)[2], (weight, bias), dv)
    assert bool(ours[1][:64].eq(0).all()) and bool(ours[0][:64].eq(0).all())  # q's and k's rows
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_bias_gradient_is_deterministic_and_only_where_asked():
    x, weight, bias = _inputs(batch=3, seq=700, width=8, heads=2, head_dim=64)
    dq, dk, dv = (torch.randn(3, 2, 700, 64, device=DEVICE) for _ in range(3))
    first = pack_heads_grad(dq, dk, dv, True, torch.float32)
    second = pack_heads_grad(dq, dk, dv, True, torch.float32)
    assert torch.equal(first[1], second[1]) and torch.equal(first[0], second[0])
    packed = torch.stack([g.transpose(1, 2) for g in (dq, dk, dv)], dim=2).flatten(2)
    assert torch.equal(first[0], packed)
    torch.testing.assert_close(first[1], packed.sum((0, 1)), rtol=1e-5, atol=1e-4)
    assert len(pack_heads_grad(dq, dk, dv, False, None)) == 1


def test_nan_in_gives_nan_out():
    x, weight, bias = _inputs()
    with torch.no_grad():
        x[0, 3, 0] = float("nan")
    q, k, v = qkv_projection(x, weight, bias, 4)
    (q.sum() + k.sum() + v.sum()).backward()
    assert bool(bias.grad.isfinite().all())  # every dq is 1: the NaN is in x alone
    assert bool(weight.grad.isnan().any()) and bool(q[0, :, 3].isnan().all())


def test_no_grad_and_frozen_weights():
    x, weight, bias = _inputs()
    with torch.no_grad():
        q, _, _ = qkv_projection(x, weight, bias, 4)
    assert q.grad_fn is None
    weight.requires_grad_(False)
    q, k, v = qkv_projection(x, weight, None, 4)
    (q.sum() + k.sum() + v.sum()).backward()
    assert weight.grad is None and x.grad is not None


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (((2, 5), (36, 7), (36,), 0), "heads must be an integer >= 1"),
        (((2, 5, 7), (36, 7), (36,), 5), r"weight must be \[3 \* dim, 7\] with dim a multiple of heads=5"),
        (((2, 5, 7), (36, 6), (36,), 3), r"weight must be \[3 \* dim, 7\]"),
        (((2, 5, 7), (36, 7), (35,), 3), r"bias has shape \(35,\), expected \(36,\)"),
        (((5, 7), (36, 7), None, 3), r"x must be \[batch, seq, dim\]"),
    ],
)
def test_bad_shapes_are_named(args, match):
    x_shape, w_shape, b_shape, heads = args
    x, weight = torch.randn(x_shape, device=DEVICE), torch.randn(w_shape, device=DEVICE)
    bias = None if b_shape is None else torch.randn(b_shape, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        qkv_projection(x, weight, bias, heads)


@pytest.mark.parametrize("heads", [np.int64(4), torch.tensor(4)], ids=["numpy", "0-d tensor"])
def test_heads_may_be_any_integer_scalar(heads):
    x, weight, bias = _inputs()
    for ours, plain in zip(qkv_projection(x, weight, bias, heads), qkv_projection(x, weight, bias, 4), strict=True):
        assert torch.equal(ours, plain)
    with pytest.raises(ValueError, match="heads must be an integer >= 1, got bool True"):
        qkv_projection(x, weight, bias, True)


@pytest.mark.parametrize("which", ["weight", "bias"])
def test_mixed_dtypes_are_named(which):
    x, weight = torch.randn(2, 3, 4, device=DEVICE), torch.randn(6, 4, device=DEVICE)
    bias = torch.randn(6, device=DEVICE)
    if which == "weight":
        weight = weight.to(torch.float16)
    else:
        bias = bias.to(torch.float16)
    with pytest.raises(ValueError, match=f"qkv_projection: {which} is torch.float16 on .*, x torch.float32"):
        qkv_projection(x, weight, bias, 1)


def test_integer_inputs_are_refused():
    with pytest.raises(ValueError, match="x has dtype torch.int64"):
        qkv_projection(torch.ones(2, 3, 4, dtype=torch.long, device=DEVICE), torch.ones(6, 4, device=DEVICE), None, 1)
