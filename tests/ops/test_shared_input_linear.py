"""shared_input_linear: several F.linear of one input, the input gradient summed in the GEMMs."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lstrain import _backend
from lstrain.ops import shared_input_linear, shared_input_linear_ref
from lstrain.optim import FlatParameters
from lstrain.optim.flat import _same_memory
from tests.conftest import DEVICE, EXPECTED_BACKEND

FEW = settings(max_examples=15, deadline=None) if DEVICE == "cpu" else settings(deadline=None)
DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if DEVICE == "cuda" else [])


def _tolerance(dtype: torch.dtype, k: int) -> dict:
    """The input gradient is summed before its one rounding, autograd's after each
    product's: in low precision they differ by a rounding of the sum, growing with K."""
    if dtype == torch.float32:
        return {}
    eps = torch.finfo(dtype).eps
    return {"atol": 4 * eps * k**0.5, "rtol": 2 * eps}


@FEW
@given(
    lead=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    features=st.integers(1, 70),
    outs=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    bias=st.booleans(),
    transposed=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_matches_torch(lead, features, outs, bias, transposed, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, features, generator=generator).to(DEVICE, dtype)
    # a weight held transposed (w.t() of a [in, out] tensor) takes the other GEMM layout
    weights = [
        (
            torch.randn(features, out, generator=generator).t()
            if transposed
            else torch.randn(out, features, generator=generator)
        )
        .to(DEVICE, dtype)
        .requires_grad_()
        for out in outs
    ]
    biases = [
        torch.randn(out, generator=generator).to(DEVICE, dtype).requires_grad_() if bias else None for out in outs
    ]
    x.requires_grad_()
    inputs = [x, *weights, *(b for b in biases if b is not None)]
    with _backend.record_backends() as ran:
        ours = shared_input_linear(x, weights, biases)
    assert ran == [("shared_input_linear", EXPECTED_BACKEND)]
    theirs = shared_input_linear_ref(x, weights, biases)
    dys = [torch.randn(y.shape, generator=generator).to(DEVICE, dtype) for y in theirs]
    assert len(ours) == len(theirs)
    for mine, reference in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, reference)
    mine_grads = torch.autograd.grad(ours, inputs, dys)
    reference_grads = torch.autograd.grad(theirs, inputs, dys)
    torch.testing.assert_close(mine_grads[0], reference_grads[0], **_tolerance(dtype, sum(outs)))
    for mine, reference in zip(mine_grads[1:], reference_grads[1:], strict=True):
        assert mine.shape == reference.shape
        # the same layout (strides of size-1 dims mean nothing)
        assert [s for s, n in zip(mine.stride(), mine.shape, strict=True) if n > 1] == [
            s for s, n in zip(reference.stride(), reference.shape, strict=True) if n > 1
        ]
        torch.testing.assert_close(mine, reference)


@pytest.mark.parametrize(("features", "outs"), [(4, (0, 3)), (0, (5, 2))], ids=["no-output-rows", "no-input-columns"])
def test_zero_width_weights_and_inputs_have_gradients(features, outs):
    """A weight of no rows, or an input of no columns (zero elements with a zero last dim:
    ``reshape(-1, 0)`` cannot size its rows), gets autograd's gradients."""
    x = torch.randn(2, 3, features, device=DEVICE, requires_grad=True)
    weights = [torch.randn(out, features, device=DEVICE, requires_grad=True) for out in outs]
    expected = torch.autograd.grad(sum(y.sum() for y in shared_input_linear_ref(x, weights)), [x, *weights])
    got = torch.autograd.grad(sum(y.sum() for y in shared_input_linear(x, weights)), [x, *weights])
    for mine, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, reference)


def test_input_gradient_is_no_worse_than_autograds():
    """Against an fp64 reference, the sum in the GEMMs is as close as autograd's sum of
    rounded products, or closer."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=generator)
    weights = [torch.randn(out, 256, generator=generator) / 16 for out in (256, 64, 64)]
    dys = [torch.randn(64, w.shape[0], generator=generator) for w in weights]
    exact = sum(dy.double() @ w.double() for dy, w in zip(dys, weights, strict=True))
    low = [t.to(DEVICE, torch.bfloat16) for t in (x, *weights)]
    low[0].requires_grad_()
    errors = []
    for function in (shared_input_linear, shared_input_linear_ref):
        out = function(low[0], low[1:])
        (dx,) = torch.autograd.grad(out, low[0], [dy.to(DEVICE, torch.bfloat16) for dy in dys])
        errors.append((dx.double().cpu() - exact).abs().mean().item())
    assert errors[0] <= errors[1] * 1.05


def test_weight_gradients_land_in_the_flat_buffer():
    layers = [torch.nn.Linear(16, out, device=DEVICE) for out in (16, 4, 4)]
    params = [p for layer in layers for p in layer.parameters()]
    buffer = FlatParameters([params]).buffers[0]
    for p in params:
        p.grad = None
    x = torch.randn(8, 16, device=DEVICE, requires_grad=True)
    weights, biases = [layer.weight for layer in layers], [layer.bias for layer in layers]
    expected = torch.autograd.grad(sum(y.square().sum() for y in shared_input_linear_ref(x, weights, biases)), weights)
    sum(y.square().sum() for y in shared_input_linear(x, weights, biases)).backward()
    for layer, reference in zip(layers, expected, strict=True):
        view = buffer.grad_views[next(i for i, q in enumerate(buffer.params) if q is layer.weight)]
        assert _same_memory(layer.weight.grad, view)
        torch.testing.assert_close(layer.weight.grad, reference)


def test_an_unused_output_gets_no_gradient_terms():
    x = torch.randn(5, 6, device=DEVICE, requires_grad=True)
    weights = [torch.randn(3, 6, device=DEVICE, requires_grad=True) for _ in range(2)]
    first, _ = shared_input_linear(x, weights)
    dx, dw0, dw1 = torch.autograd.grad(first.sum(), [x, *weights])
    torch.testing.assert_close(dx, torch.ones(5, 3, device=DEVICE) @ weights[0].detach())
    torch.testing.assert_close(dw1, torch.zeros_like(dw1))


def test_no_grad_makes_no_graph():
    x = torch.randn(3, 4, device=DEVICE)
    outputs = shared_input_linear(x, [torch.randn(5, 4, device=DEVICE, requires_grad=True)])
    assert isinstance(outputs, tuple) and outputs[0].grad_fn is not None
    with torch.no_grad():
        assert shared_input_linear(x, [torch.randn(5, 4, device=DEVICE)])[0].grad_fn is None


@pytest.mark.parametrize(
    ("weights", "biases", "match"),
    [
        ([], None, "weights must hold at least one weight"),
        ([(5, 4), (2, 3)], None, r"weights\[1\], biases\[1\]\): weight must be \[out, 4\], got shape \(2, 3\)"),
        ([(5, 4)], [(4,)], r"bias has shape \(4,\), expected \(5,\)"),
        ([(5, 4), (2, 4)], [(5,)], "one bias \\(or None\\) per weight: got 1 for 2 weights"),
    ],
)
def test_bad_shapes_are_named(weights, biases, match):
    with pytest.raises(ValueError, match=match):
        shared_input_linear(
            torch.randn(3, 4, device=DEVICE),
            [torch.randn(shape, device=DEVICE) for shape in weights],
            None if biases is None else [torch.randn(shape, device=DEVICE) for shape in biases],
        )


def test_one_weight_for_a_sequence_is_named_and_a_stack_is_a_sequence():
    x, w = torch.randn(3, 4, device=DEVICE), torch.randn(5, 4, device=DEVICE)
    with pytest.raises(ValueError, match=r"weights must be a sequence of them .*got one tensor of shape \(5, 4\)"):
        shared_input_linear(x, w)
    with pytest.raises(ValueError, match=r"biases must be a sequence of them .*got one tensor of shape \(5,\)"):
        shared_input_linear(x, [w], torch.randn(5, device=DEVICE))
    stacked, biases = torch.randn(2, 5, 4, device=DEVICE), torch.randn(2, 5, device=DEVICE)
    for ours, weight, bias in zip(shared_input_linear(x, stacked, biases), stacked, biases, strict=True):
        torch.testing.assert_close(ours, x @ weight.t() + bias)


def test_bad_dtypes_are_named():
    x = torch.randn(3, 4, device=DEVICE)
    with pytest.raises(ValueError, match=r"weights\[1\].*weight is torch.float64"):
        shared_input_linear(
            x, [torch.randn(5, 4, device=DEVICE), torch.randn(5, 4, device=DEVICE, dtype=torch.float64)]
        )


def test_second_derivatives_are_refused():
    x = torch.randn(3, 4, device=DEVICE, requires_grad=True)
    weights = [torch.randn(5, 4, device=DEVICE, requires_grad=True) for _ in range(2)]
    with pytest.raises(RuntimeError, match="second derivatives"):
        torch.autograd.grad(sum(y.sum() for y in shared_input_linear(x, weights)), x, create_graph=True)


def test_compiles_whole():
    x = torch.randn(6, 8, device=DEVICE, requires_grad=True)
    weights = [
        torch.randn(8, 8, device=DEVICE, requires_grad=True),
        torch.randn(4, 8, device=DEVICE, requires_grad=True),
    ]

    def loss(x, weights):
        q, k = shared_input_linear(x, weights)
        return q.square().sum() + k.sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    expected = torch.autograd.grad(loss(x, weights), [x, *weights])
    torch.testing.assert_close(torch.autograd.grad(compiled(x, weights), [x, *weights]), expected)
