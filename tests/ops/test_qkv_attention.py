"""qkv_attention: flash attention over a packed QKV projection, dropout from lstrain's Philox."""

import importlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings

from lstrain import _backend
from lstrain.ops import dropout_mask, qkv_attention, qkv_attention_ref
from lstrain.optim import FlatParameters
from lstrain.optim.flat import _same_memory
from lstrain.testing import assert_all_passed
from lstrain.testing.checks import OP_CHECKS
from lstrain.testing.strategies import qkv_attention_cases
from tests.conftest import DEVICE, EXPECTED_BACKEND

CHECK = OP_CHECKS["qkv_attention"]
# the module (lstrain.ops.qkv_attention the attribute is the function)
qkv_attention_module = importlib.import_module("lstrain.ops.qkv_attention")
# the interpreter runs the kernels element by element: few, short cases on the CPU
FEW = settings(max_examples=8, deadline=None) if DEVICE == "cpu" else settings(max_examples=40, deadline=None)


def _case(shape=(1, 20), in_features=8, heads=1, head_dim=16, causal=True, dropout_p=0.0, bias=True, **kw):
    dtype = kw.get("dtype", torch.float32)
    return {
        "shape": shape,
        "in_features": in_features,
        "heads": heads,
        "head_dim": head_dim,
        "causal": causal,
        "dropout_p": dropout_p,
        "bias": bias,
        "dtype": dtype,
        "seed": kw.get("seed", 0),
    }


@FEW
@given(case=qkv_attention_cases(DEVICE).filter(lambda c: c["dtype"] in CHECK.dtypes(DEVICE)))
@example(case=_case(shape=(1, 1)))
@example(case=_case(shape=(2, 37), causal=False, dropout_p=0.5))  # tails of every tile
@example(case=_case(shape=(1, 17), heads=2, head_dim=32, dropout_p=0.1, dtype=torch.float16))
# One input feature, large rank-1 scores: on an H100 the fp32 output errs 1.43e-5 against an
# allowed 1.31e-5 (5.3x torch's own error; the CPU interpreter passes). Open: docs/notes/attention.md.
@example(case=_case(shape=(1, 294), in_features=1, causal=False, bias=False)).xfail(
    DEVICE == "cuda", reason="fp32 output error over the tolerance rule on the GPU", raises=AssertionError
)
def test_matches_torch(case):
    result = CHECK.run(case, DEVICE)
    assert set(result.backends) == {EXPECTED_BACKEND}
    assert_all_passed(result.comparisons, str(case))


@pytest.mark.skipif(DEVICE == "cpu", reason="GPU shapes")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("seq", "head_dim", "causal"), [(1024, 64, True), (512, 64, False), (300, 128, True)])
def test_matches_torch_at_model_shapes(dtype, seq, head_dim, causal):
    case = _case(shape=(2, seq), in_features=256, heads=4, head_dim=head_dim, causal=causal, dropout_p=0.1, dtype=dtype)
    result = CHECK.run(case, DEVICE)
    assert_all_passed(result.comparisons, str(case))


def test_dropout_is_the_mask_dropout_mask_draws():
    """The probabilities the op drops are dropout_mask(seed, (batch, heads, seq, seq), p)'s."""
    torch.manual_seed(0)
    batch, seq, heads, head_dim = 1, 24, 2, 16
    x = torch.randn(batch, seq, 8, device=DEVICE)
    weight = torch.randn(3 * heads * head_dim, 8, device=DEVICE) * 0.3
    seed = torch.tensor([11], device=DEVICE)
    ours = qkv_attention(x, weight, None, heads, dropout_p=0.4, seed=seed)
    torch.testing.assert_close(ours, qkv_attention_ref(x, weight, None, heads, dropout_p=0.4, seed=seed))
    # the same, with the mask applied by hand to SDPA's probabilities
    q, k, v = F.linear(x, weight).view(batch, seq, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
    scores = (q @ k.transpose(-1, -2)) * head_dim**-0.5
    probs = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool, device=DEVICE).triu(1), float("-inf")).softmax(-1)
    keep = dropout_mask(seed, (batch, heads, seq, seq), 0.4)
    by_hand = ((probs * keep / 0.6) @ v).transpose(1, 2).reshape(batch, seq, heads * head_dim)
    torch.testing.assert_close(ours, by_hand)
    again = qkv_attention(x, weight, None, heads, dropout_p=0.4, seed=torch.tensor([12], device=DEVICE))
    assert not torch.equal(ours, again)


@pytest.mark.parametrize("causal", [True, False])
def test_stored_mask_bits_and_a_mask_drawn_again_agree_bit_for_bit(monkeypatch, causal):
    """Backward reads forward's mask as bits where they are small, else draws it again."""
    x = torch.randn(2, 37, 8, device=DEVICE, requires_grad=True)
    weight = (torch.randn(96, 8, device=DEVICE) * 0.3).requires_grad_()
    bias = torch.randn(96, device=DEVICE, requires_grad=True)
    seed = torch.tensor([3], device=DEVICE)
    runs = []
    for stored in (True, False):
        monkeypatch.setattr(qkv_attention_module, "keeps_mask_bits", lambda *args, stored=stored: stored)
        out = qkv_attention(x, weight, bias, 2, causal=causal, dropout_p=0.3, seed=seed)
        runs.append((out, *torch.autograd.grad(out.square().sum(), (x, weight, bias))))
    for with_bits, drawn in zip(*runs, strict=True):
        assert torch.equal(with_bits, drawn)


def test_no_dropout_matches_sdpa():
    torch.manual_seed(1)
    x = torch.randn(2, 19, 8, device=DEVICE)
    weight, bias = torch.randn(96, 8, device=DEVICE) * 0.3, torch.randn(96, device=DEVICE)
    for causal in (True, False):
        q, k, v = F.linear(x, weight, bias).view(2, 19, 3, 2, 16).permute(2, 0, 3, 1, 4)
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2).reshape(2, 19, 32)
        torch.testing.assert_close(qkv_attention(x, weight, bias, 2, causal=causal), expected)


def test_an_input_of_no_features_gets_autograds_gradients():
    """x with no columns (a projection that is its bias alone): the weight's gradient has no
    columns either, and rows of ``reshape(-1, 0)`` could not be counted."""
    x = torch.randn(1, 5, 0, device=DEVICE, requires_grad=True)
    weight = torch.randn(48, 0, device=DEVICE, requires_grad=True)
    bias = torch.randn(48, device=DEVICE, requires_grad=True)
    got = torch.autograd.grad(qkv_attention(x, weight, bias, 1).sum(), [x, weight, bias])
    expected = torch.autograd.grad(qkv_attention_ref(x, weight, bias, 1).sum(), [x, weight, bias])
    for mine, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, reference)


def test_nan_in_gives_nan_out():
    x = torch.randn(1, 20, 8, device=DEVICE)
    x[0, 3, 0] = float("nan")
    weight = torch.randn(48, 8, device=DEVICE)
    for causal in (True, False):
        out = qkv_attention(x, weight, None, 1, causal=causal)
        # where plain torch's is: v's NaN row reaches every row through 0 * NaN, as in torch
        expected = qkv_attention_ref(x, weight, None, 1, causal=causal)
        assert out.isnan().any() and torch.equal(out.isnan(), expected.isnan())


def test_gradients_land_in_the_flat_buffer():
    layer = torch.nn.Linear(8, 96, device=DEVICE)
    params = list(layer.parameters())
    buffer = FlatParameters([params]).buffers[0]
    for p in params:
        p.grad = None
    x = torch.randn(2, 20, 8, device=DEVICE)
    qkv_attention(x, layer.weight, layer.bias, 2).square().sum().backward()
    for p in params:
        view = buffer.grad_views[next(i for i, q in enumerate(buffer.params) if q is p)]
        assert _same_memory(p.grad, view)
    expected = torch.autograd.grad(qkv_attention_ref(x, layer.weight, layer.bias, 2).square().sum(), params)
    for p, reference in zip(params, expected, strict=True):
        torch.testing.assert_close(p.grad, reference)


def test_no_grad_makes_no_graph():
    x = torch.randn(1, 4, 8, device=DEVICE)
    with _backend.record_backends() as ran:
        out = qkv_attention(x, torch.randn(48, 8, device=DEVICE), None, 1)
    assert out.grad_fn is None and ran == [("qkv_attention", EXPECTED_BACKEND)]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"heads": 0}, "heads must be an integer >= 1"),
        ({"weight": (50, 8)}, r"weight must be \[3 \* dim, 8\]"),
        ({"bias": (5,)}, r"bias has shape \(5,\), expected \(96,\)"),
        ({"heads": 4}, r"head_dim = dim / heads = 8 is not one of"),
        ({"weight": (72, 8), "bias": (72,), "heads": 1}, r"head_dim = dim / heads = 24 is not one of"),
        ({"x": (4, 8)}, r"x must be \[batch, seq, dim\]"),
        ({"dropout_p": 1.0}, "dropout_p"),
        ({"causal": 1}, "causal must be a bool"),
        ({"seed": 3}, "seed must be a 1-element int64 tensor"),
    ],
)
def test_bad_input_is_named(kwargs, match):
    args = {"x": (1, 4, 8), "weight": (96, 8), "bias": (96,), "heads": 2, "dropout_p": 0.1, "causal": True}
    args["seed"] = None
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        qkv_attention(
            torch.randn(args["x"], device=DEVICE),
            torch.randn(args["weight"], device=DEVICE),
            torch.randn(args["bias"], device=DEVICE),
            args["heads"],
            causal=args["causal"],
            dropout_p=args["dropout_p"],
            seed=args["seed"],
        )


def test_a_weight_of_another_dtype_is_named():
    x, weight = torch.randn(1, 4, 8, device=DEVICE), torch.randn(96, 8, device=DEVICE, dtype=torch.float16)
    with pytest.raises(ValueError, match="qkv_attention: weight is torch.float16 on .*, x torch.float32"):
        qkv_attention(x, weight, None, 2)


def test_second_derivatives_are_refused():
    x = torch.randn(1, 4, 8, device=DEVICE, requires_grad=True)
    weight = torch.randn(48, 8, device=DEVICE, requires_grad=True)
    with pytest.raises(RuntimeError, match="second derivatives"):
        torch.autograd.grad(qkv_attention(x, weight, None, 1).sum(), x, create_graph=True)


@pytest.mark.parametrize("dropout", [False, True])
def test_torch_compile_fullgraph(dropout):
    x = torch.randn(1, 20, 8, device=DEVICE, requires_grad=True)
    weight = torch.randn(96, 8, device=DEVICE, requires_grad=True)
    bias = torch.randn(96, device=DEVICE, requires_grad=True)
    seed = torch.tensor([5], device=DEVICE)

    def f(x, weight, bias):
        # a literal, as a module's attribute is to dynamo (a float argument would be symbolic)
        return qkv_attention(x, weight, bias, 2, dropout_p=0.2 if dropout else 0.0, seed=seed).square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if DEVICE == "cuda" else "aot_eager")
    expected = torch.autograd.grad(f(x, weight, bias), [x, weight, bias])
    torch.testing.assert_close(torch.autograd.grad(compiled(x, weight, bias), [x, weight, bias]), expected)
