"""linear: F.linear whose weight gradient lands in a flat gradient buffer."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lstrain import _backend
from lstrain.ops import linear, linear_ref
from tests.conftest import DEVICE, EXPECTED_BACKEND

FEW = settings(max_examples=15, deadline=None) if DEVICE == "cpu" else settings(deadline=None)
DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if DEVICE == "cuda" else [])


@FEW
@given(
    lead=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    features=st.integers(1, 70),
    out=st.integers(1, 70),
    bias=st.booleans(),
    transposed=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_matches_torch(lead, features, out, bias, transposed, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, features, generator=generator).to(DEVICE, dtype)
    # a weight held transposed (w.t() of a [in, out] tensor) takes the other GEMM layout
    weight = torch.randn(features, out, generator=generator).t() if transposed else torch.randn(out, features)
    weight = weight.to(DEVICE, dtype)
    b = torch.randn(out, generator=generator).to(DEVICE, dtype) if bias else None
    inputs = [t.requires_grad_() for t in (x, weight, b) if t is not None]
    with _backend.record_backends() as ran:
        ours = linear(x, weight, b)
    assert ran == [("linear", EXPECTED_BACKEND)]
    theirs = linear_ref(x, weight, b)
    dy = torch.randn(ours.shape, generator=generator).to(DEVICE, dtype)
    torch.testing.assert_close(ours, theirs)
    grads = zip(torch.autograd.grad(ours, inputs, dy), torch.autograd.grad(theirs, inputs, dy), strict=True)
    for mine, reference in grads:
        # the same layout (strides of size-1 dims mean nothing)
        assert mine.shape == reference.shape
        assert [s for s, n in zip(mine.stride(), mine.shape, strict=True) if n > 1] == [
            s for s, n in zip(reference.stride(), reference.shape, strict=True) if n > 1
        ]
        torch.testing.assert_close(mine, reference)


@pytest.mark.parametrize(("features", "out"), [(0, 5), (4, 0)], ids=["no-input-columns", "no-output-rows"])
def test_zero_width_gets_autograds_gradients(features, out):
    x = torch.randn(2, 3, features, device=DEVICE, requires_grad=True)
    weight = torch.randn(out, features, device=DEVICE, requires_grad=True)
    expected = torch.autograd.grad(linear_ref(x, weight).sum(), [x, weight])
    got = torch.autograd.grad(linear(x, weight).sum(), [x, weight])
    for mine, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, reference)


def test_no_grad_makes_no_graph():
    x = torch.randn(3, 4, device=DEVICE)
    assert linear(x, torch.randn(5, 4, device=DEVICE)).grad_fn is None


@pytest.mark.parametrize(
    ("x", "weight", "bias", "match"),
    [
        ((3, 4), (5, 3), None, r"weight must be \[out, 4\], got shape \(5, 3\)"),
        ((3, 4), (5, 4), (4,), r"bias has shape \(4,\), expected \(5,\)"),
        ((), (5, 4), None, "x must have at least one dim"),
    ],
)
def test_bad_shapes_are_named(x, weight, bias, match):
    with pytest.raises(ValueError, match=match):
        linear(
            torch.randn(x, device=DEVICE),
            torch.randn(weight, device=DEVICE),
            None if bias is None else torch.randn(bias, device=DEVICE),
        )


def test_bad_dtypes_are_named():
    x = torch.randn(3, 4, device=DEVICE)
    with pytest.raises(ValueError, match="weight is torch.float64"):
        linear(x, torch.randn(5, 4, device=DEVICE, dtype=torch.float64))


def test_second_derivatives_are_refused():
    x = torch.randn(3, 4, device=DEVICE, requires_grad=True)
    weight = torch.randn(5, 4, device=DEVICE, requires_grad=True)
    with pytest.raises(RuntimeError, match="second derivatives"):
        torch.autograd.grad(linear(x, weight).sum(), x, create_graph=True)
