import pytest
import torch
from hypothesis import example, given

import lstrain
from lstrain._backend import record_backends
from lstrain.ops import swiglu_mlp, swiglu_mlp_ref
from lstrain.ops.swiglu import (
    PAIR_BLOCK,
    SwiGLUFunction,
    _fwd_plan,
    _swiglu_act_launch,
    pack_gate_up,
    swiglu_act,
    swiglu_act_bwd,
    swiglu_fwd,
    unpack_gate_up,
)
from lstrain.testing import assert_all_passed, compare_to_reference
from lstrain.testing.checks import OP_CHECKS
from lstrain.testing.strategies import swiglu_cases
from tests.conftest import DEVICE, EXPECTED_BACKEND

CHECK = OP_CHECKS["swiglu_mlp"]


@given(case=swiglu_cases(DEVICE))
@example(case={"tokens": 1, "hidden": 1, "intermediate": 1, "dtype": torch.float32, "seed": 0})
# a [1, 2] weight gradient summed over 260 tokens, where one draw of torch's error was lucky
@example(case={"tokens": 260, "hidden": 1, "intermediate": 1, "dtype": torch.float32, "seed": 0})
@example(case={"tokens": 70, "hidden": 33, "intermediate": 65, "dtype": torch.float16, "seed": 1})
# a long fp32 K chain through the two-accumulator mainloop of a partial pair block
@example(case={"tokens": 3, "hidden": 431, "intermediate": 43, "dtype": torch.float32, "seed": 2})
def test_matches_torch(case):
    result = CHECK.run(case, DEVICE)
    assert set(result.backends) == {EXPECTED_BACKEND}
    assert_all_passed(result.comparisons, str(case))


# 1000 tokens: the last row tile is partial, which TMA stores clip
@pytest.mark.parametrize(
    "tokens, intermediate", [(4096, 1068), pytest.param(1024, 2100, marks=pytest.mark.gpu), (1000, 2100)]
)
def test_epilogue_forward_kernel_matches_the_gemm_and_the_pass(device, tokens, intermediate):
    """:func:`swiglu_fwd`, the GEMM with SwiGLU in its epilogue (pattern A's kernel): 16-bit
    inputs take pair-block-wide persistent tiles whose h leaves through TMA (more tiles than
    an H200's 132 SMs at 4096 tokens), the partial last block its own launch. h is the
    product within the tolerance rule, a is :func:`swiglu_act` of that h bit for bit, and
    without h (``store_h=False``) a is the same."""
    low = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter's bf16 dot is wrong
    assert _fwd_plan(tokens, intermediate, 16, 2).persistent and intermediate % PAIR_BLOCK
    gen = torch.Generator(device=device).manual_seed(3)
    x = (torch.randn(tokens, 16, device=device, generator=gen) / 4).to(low)
    w = (torch.randn(16, 2 * intermediate, device=device, generator=gen) / 4).to(low)
    a, h = swiglu_fwd(x, w)
    comparison = compare_to_reference("h", h, x.double() @ w.double(), x.float() @ w.float())
    assert_all_passed([comparison])
    assert torch.equal(a, swiglu_act(h))
    a_only, no_h = swiglu_fwd(x, w, store_h=False)
    assert no_h is None and torch.equal(a_only, a)


def test_pair_layout_round_trip(device):
    """F = 300: two whole pair blocks (128 gate columns, then their 128 up columns) and a
    partial one (44 and 44)."""
    gate, up = torch.randn(6, 300, device=device), torch.randn(6, 300, device=device)
    packed = pack_gate_up(gate, up)
    assert packed.shape == (6, 600)
    for block in range(2):
        assert torch.equal(packed[:, 256 * block : 256 * block + 128], gate[:, 128 * block : 128 * (block + 1)])
        assert torch.equal(packed[:, 256 * block + 128 : 256 * (block + 1)], up[:, 128 * block : 128 * (block + 1)])
    assert torch.equal(packed[:, 512:556], gate[:, 256:]) and torch.equal(packed[:, 556:], up[:, 256:])
    g, u = unpack_gate_up(packed)
    assert torch.equal(g, gate) and torch.equal(u, up)


class _HFStyleMLP(torch.nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.gate_proj = torch.nn.Linear(d, f, bias=False)
        self.up_proj = torch.nn.Linear(d, f, bias=False)
        self.down_proj = torch.nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("intermediate", [40, 300])  # a partial pair block only; whole blocks and a partial one
def test_module_loads_and_saves_separate_weights(device, intermediate):
    theirs = _HFStyleMLP(16, intermediate).to(device)
    ours = lstrain.nn.SwiGLUMLP(16, intermediate, device=device)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 5, 16, device=device, requires_grad=True)
    y = ours(x)
    torch.testing.assert_close(y, theirs(x))
    y.sum().backward()
    assert x.grad.shape == x.shape and ours.gate_up_weight.grad.shape == (16, 2 * intermediate)
    again = _HFStyleMLP(16, intermediate).to(device)
    again.load_state_dict(ours.state_dict())
    torch.testing.assert_close(again(x), theirs(x))


@pytest.mark.parametrize(
    "shapes, match",
    [
        (((4, 8), (8, 11), (5, 8)), "w_gate_up must be \\[D, 2F\\]"),
        (((4, 8), (7, 10), (5, 8)), "w_gate_up must be"),
        (((4, 8), (8, 10), (4, 8)), "w_down must be \\[F, D_out\\] with F = 5"),
    ],
)
def test_bad_shapes(device, shapes, match):
    x, w, wd = (torch.randn(s, device=device) for s in shapes)
    with pytest.raises(ValueError, match=match):
        swiglu_mlp(x, w, wd)


def test_dtype_mismatch(device):
    with pytest.raises(ValueError, match="share a float dtype"):
        swiglu_mlp(
            torch.randn(2, 4, device=device), torch.randn(4, 6, device=device).half(), torch.randn(3, 4, device=device)
        )


@pytest.mark.parametrize("keep_activation", [False, True])
def test_torch_compile_fullgraph(device, keep_activation):
    w = torch.randn(8, 12, device=device, requires_grad=True)
    wd = torch.randn(6, 8, device=device, requires_grad=True)

    def f(x):
        return swiglu_mlp(x, w, wd, keep_activation=keep_activation).square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    x = torch.randn(5, 8, device=device)
    out = compiled(x)
    grads = torch.autograd.grad(out, (w, wd))
    ref_out = f(x)
    ref_grads = torch.autograd.grad(ref_out, (w, wd))
    torch.testing.assert_close(out, ref_out)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r)


def test_custom_ops_pass_opcheck(device):
    """The passes' ops, h contiguous and not (the fake dh is contiguous, as the op's is)."""
    x, w = torch.randn(5, 8, device=device), torch.randn(8, 12, device=device)
    torch.library.opcheck(torch.ops.lstrain.swiglu_fwd_activation, (x, w))
    da = torch.randn(5, 6, device=device)
    for h in (torch.randn(5, 12, device=device), torch.randn(12, 5, device=device).t()):
        torch.library.opcheck(torch.ops.lstrain.swiglu_act, (h,))
        for write_a in (False, True):
            torch.library.opcheck(torch.ops.lstrain.swiglu_act_bwd, (da, h, write_a))


# F: a partial block alone, whole blocks alone, whole blocks and a partial one
@pytest.mark.parametrize("units", [3, 256, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_passes_match_the_formulas(device, units, dtype):
    """The forward and backward passes over the pair layout against fp64 formulas on the
    unpacked gate and up, by the tolerance rule; the backward's a is the forward's, bit for
    bit, and written over dA in place gives the same bits."""
    gen = torch.Generator(device=device).manual_seed(6)
    h = (torch.randn(33, 2 * units, device=device, generator=gen) * 3).to(dtype)
    da = torch.randn(33, units, device=device, generator=gen).to(dtype)
    gate, up = unpack_gate_up(h)

    def formulas(gate, up, da):
        sig = torch.sigmoid(gate)
        return gate * sig * up, pack_gate_up(da * up * sig * (1 + gate * (1 - sig)), da * gate * sig)

    precise = formulas(gate.double(), up.double(), da.double())
    lowp = formulas(gate, up, da)
    a = swiglu_act(h)
    dh, a_again = swiglu_act_bwd(da, h, True)
    comparisons = [
        compare_to_reference(name, ours, want, torch_lowp)
        for name, ours, want, torch_lowp in zip(("a", "dh"), (a, dh), precise, lowp, strict=True)
    ]
    assert_all_passed(comparisons)
    assert torch.equal(a_again, a)
    in_place_h, in_place_da = h.clone(), da.clone()
    _swiglu_act_launch(in_place_h, in_place_da, in_place_da, in_place_h)
    assert torch.equal(in_place_h, dh) and torch.equal(in_place_da, a)


def test_a_saved_h_handed_back_strided_gives_the_same_gradients(device):
    """A saved-tensor hook may unpack h as a non-contiguous tensor of the same values: the
    backward reads it by its strides (a copy), not as if it were contiguous."""
    gen = torch.Generator(device=device).manual_seed(7)
    x, w, wd = (torch.randn(s, device=device, generator=gen) for s in ((9, 8), (8, 2 * 130), (130, 8)))
    dy = torch.randn(9, 8, device=device, generator=gen)

    def grads(hooks):
        inputs = [t.clone().requires_grad_() for t in (x, w, wd)]
        with hooks:
            y = swiglu_mlp(*inputs)
        return torch.autograd.grad(y, inputs, dy)

    def is_h(t):
        return t.shape == (9, 2 * 130)

    transposed = torch.autograd.graph.saved_tensors_hooks(
        lambda t: t.t().contiguous() if is_h(t) else t, lambda t: t.t() if t.shape == (2 * 130, 9) else t
    )
    plain = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    for got, want in zip(grads(transposed), grads(plain), strict=True):
        assert torch.equal(got, want)


# 4096 tokens (the persistent epilogue GEMM without h) on a GPU only: on the CPU the
# interpreter takes half a minute, and the epilogue test above runs that kernel there
@pytest.mark.parametrize("tokens, intermediate", [(5, 300), pytest.param(4096, 1068, marks=pytest.mark.gpu)])
def test_inference_builds_no_graph_and_matches_training(device, monkeypatch, tokens, intermediate):
    """Under no_grad (or with nothing requiring grad) the forward runs without an autograd
    node, through the epilogue GEMM that writes no h; its output is the training
    forward's within the tolerance rule (the GEMMs sum in other orders)."""
    low = torch.bfloat16 if device == "cuda" else torch.float16
    dtype = torch.float32 if tokens < 100 else low
    gen = torch.Generator(device=device).manual_seed(4)
    shapes = ((tokens, 16), (16, 2 * intermediate), (intermediate, 16))
    x, w, wd = ((torch.randn(s, device=device, generator=gen) / 4).to(dtype) for s in shapes)
    applied = []
    apply = SwiGLUFunction.apply
    monkeypatch.setattr(SwiGLUFunction, "apply", lambda *args: applied.append(1) or apply(*args))
    with torch.no_grad():
        y = swiglu_mlp(x, w.requires_grad_(), wd)
    y_plain = swiglu_mlp(x, w.detach(), wd)
    assert not applied and torch.equal(y, y_plain)
    y_trained = swiglu_mlp(x, w, wd)
    assert applied and y_trained.requires_grad
    precise = swiglu_mlp_ref(x.double(), w.double(), wd.double())
    lowp = swiglu_mlp_ref(x, w.detach(), wd)
    outputs = (("no_grad", y), ("trained", y_trained))
    assert_all_passed([compare_to_reference(name, t, precise, lowp) for name, t in outputs])


def test_torch_compile_fullgraph_inference(device):
    w, wd = torch.randn(8, 12, device=device), torch.randn(6, 8, device=device)

    def f(x):
        return swiglu_mlp(x, w, wd)

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    x = torch.randn(5, 8, device=device)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), f(x))


def test_reference_is_the_familiar_mlp(device):
    x = torch.randn(3, 8, device=device)
    gate, up, down = (
        torch.randn(8, 5, device=device),
        torch.randn(8, 5, device=device),
        torch.randn(5, 8, device=device),
    )
    expected = (torch.nn.functional.silu(x @ gate) * (x @ up)) @ down
    torch.testing.assert_close(swiglu_mlp_ref(x, pack_gate_up(gate, up), down), expected)


def test_nan_and_infinities_as_torch(device):
    """NaN and +-inf in gate or up give the familiar MLP's values and gradients (torch's
    silu: silu(-inf) = -inf * 0 = NaN, silu'(+-inf) NaN)."""
    special = [float("nan"), float("inf"), float("-inf"), 0.0, 1.0, -1.0, 30.0, -30.0]
    units, dim = 2 * len(special), 4
    gate, up = torch.randn(dim, units, device=device), torch.randn(dim, units, device=device)
    gate[0, : len(special)] = torch.tensor(special)  # x's rows are e_0: h's gate is this row
    up[0, len(special) :] = torch.tensor(special)
    x = torch.zeros(3, dim, device=device)
    x[:, 0] = 1.0
    inputs = (x.requires_grad_(), pack_gate_up(gate, up).requires_grad_(), torch.randn(units, dim, device=device))
    inputs[2].requires_grad_()
    y = swiglu_mlp(*inputs)
    grads = torch.autograd.grad(y, inputs, torch.ones_like(y))
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    y64 = swiglu_mlp_ref(*inputs64)
    grads64 = torch.autograd.grad(y64, inputs64, torch.ones_like(y64))
    torch.testing.assert_close(y.double(), y64, equal_nan=True, rtol=1e-4, atol=1e-4)
    for grad, grad64 in zip(grads, grads64, strict=True):
        torch.testing.assert_close(grad.double(), grad64, equal_nan=True, rtol=1e-4, atol=1e-4)


def test_a_retained_graph_keeps_the_saved_activations(device):
    """dh goes over h only when the graph is freed: a retained one backpropagates again."""
    x = torch.randn(4, 8, device=device, requires_grad=True)
    w = torch.randn(8, 12, device=device, requires_grad=True)
    wd = torch.randn(6, 8, device=device, requires_grad=True)
    y = swiglu_mlp(x, w, wd).sum()
    first = torch.autograd.grad(y, (x, w, wd), retain_graph=True)
    second = torch.autograd.grad(y, (x, w, wd))
    for one, again in zip(first, second, strict=True):
        torch.testing.assert_close(again, one)


@pytest.mark.parametrize("keep_activation", [False, True])
@pytest.mark.parametrize("wanted", [(True, False, False), (False, True, False), (False, False, True), (True,) * 3])
def test_gradients_of_any_subset_of_inputs(device, wanted, keep_activation):
    """Each gradient alone and all three, with F = 300: two whole pair blocks, launched as two
    halves of the units in backward, and the partial block; dW_down alone still needs a,
    which backward's kernel writes again unless it was kept."""
    gen = torch.Generator(device=device).manual_seed(0)
    inputs = [torch.randn(s, device=device, generator=gen) for s in ((9, 8), (8, 2 * 300), (300, 8))]
    ours = [t.clone().requires_grad_(w) for t, w in zip(inputs, wanted, strict=True)]
    ref = [t.double().requires_grad_(w) for t, w in zip(inputs, wanted, strict=True)]
    dy = torch.randn(9, 8, device=device, generator=gen)
    with record_backends() as ran:
        y = swiglu_mlp(*ours, keep_activation=keep_activation)
        grads = torch.autograd.grad(y, [t for t in ours if t.requires_grad], dy)
    assert ran == [("swiglu_mlp", EXPECTED_BACKEND)]
    y_ref = swiglu_mlp_ref(*ref)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-4)
    expected = torch.autograd.grad(y_ref, [t for t in ref if t.requires_grad], dy.double())
    for g, r in zip(grads, expected, strict=True):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("weights", ["row-major", "transposed"])
@pytest.mark.parametrize(
    "tokens, dim, units",
    [(2048, 8, 1068), pytest.param(8192, 64, 2048, marks=pytest.mark.gpu, id="more-tiles-than-programs")],
)
def test_large_tiles_whole_pair_blocks_and_a_partial_one(device, tokens, dim, units, weights):
    """2048 tokens and F = 1068: the SwiGLU passes over whole pair blocks plus the partial
    block's own launch; on a GPU also 8192 tokens x 2048 units. "transposed": both weights
    are ``.t()`` views of [out, in] matrices, as Linear layers hold them."""
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = ((tokens, dim), (dim, 2 * units), (units, dim))
    x, w, wd = (torch.randn(s, device=device, generator=gen) for s in shapes)
    if weights == "transposed":
        w, wd = w.t().contiguous().t(), wd.t().contiguous().t()
        assert w.stride(0) == 1 and wd.stride(0) == 1
    x.requires_grad_()
    dy = torch.randn(tokens, dim, device=device, generator=gen)
    with record_backends() as ran:
        y = swiglu_mlp(x, w, wd)
        (dx,) = torch.autograd.grad(y, x, dy)
    assert ran == [("swiglu_mlp", EXPECTED_BACKEND)]
    results = []
    for dtype in (torch.float64, torch.float32):  # the reference, then torch in fp32
        x_ref = x.detach().to(dtype).requires_grad_()
        y_ref = swiglu_mlp_ref(x_ref, w.to(dtype), wd.to(dtype))
        results.append((y_ref, *torch.autograd.grad(y_ref, x_ref, dy.to(dtype))))
    comparisons = [
        compare_to_reference(name, ours, precise, torch_fp32)
        for name, ours, precise, torch_fp32 in zip(("y", "grad x"), (y, dx), *results, strict=True)
    ]
    assert_all_passed(comparisons)


@pytest.mark.parametrize("dim, intermediate, dim_out", [(0, 300, 8), (8, 6, 0), (8, 0, 8)])
def test_zero_width_dims_as_torch(device, dim, intermediate, dim_out):
    """D, F or D_out of 0 give the familiar MLP's (zero or empty) values and gradients,
    not a reshape error (``reshape(-1, 0)`` cannot count the tokens)."""
    gate, up = torch.randn(dim, intermediate, device=device), torch.randn(dim, intermediate, device=device)
    inputs = [
        torch.randn(2, 3, dim, device=device),
        pack_gate_up(gate, up),
        torch.randn(intermediate, dim_out, device=device),
    ]
    assert torch.equal(unpack_gate_up(inputs[1])[0], gate)
    inputs = [t.requires_grad_() for t in inputs]
    y = swiglu_mlp(*inputs)
    grads = torch.autograd.grad(y, inputs, torch.ones_like(y))
    y_ref = swiglu_mlp_ref(*inputs)
    torch.testing.assert_close(y, y_ref)
    for grad, grad_ref in zip(grads, torch.autograd.grad(y_ref, inputs, torch.ones_like(y_ref)), strict=True):
        torch.testing.assert_close(grad, grad_ref)


def test_a_0_d_x_is_refused(device):
    with pytest.raises(ValueError, match="x must be \\[\\*, D\\] .*0-d"):
        swiglu_mlp(torch.tensor(1.0, device=device), torch.randn(1, 2, device=device), torch.randn(1, 1, device=device))


def test_a_shared_dtype_that_is_not_supported_is_named(device):
    """float64 everywhere is 'shared', so the message lists the dtypes that are supported."""
    with pytest.raises(ValueError, match=r"float32, float16 or bfloat16\), got torch.float64, torch.float64"):
        swiglu_mlp(*(torch.randn(s, device=device, dtype=torch.float64) for s in ((2, 4), (4, 6), (3, 4))))


# 1000 tokens, F 2100: 16-bit whole pair blocks (a partial row tile) and a partial pair block;
# F 300 in fp32: a partial block alone
@pytest.mark.parametrize("tokens, dim, units", [(1000, 16, 2100), (9, 8, 300)])
def test_recomputed_activation_is_the_kept_one_bit_for_bit(device, tokens, dim, units):
    """Backward writes a again from h with the forward's arithmetic: the same gradients to the
    bit as with a kept, and the [tokens, F] activation is not among the saved tensors."""
    low = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter's bf16 dot is wrong
    dtype = low if units > 1000 else torch.float32
    gen = torch.Generator(device=device).manual_seed(5)
    x, w, wd = (
        (torch.randn(s, device=device, generator=gen) / s[0] ** 0.5).to(dtype)
        for s in ((tokens, dim), (dim, 2 * units), (units, dim))
    )
    dy = torch.randn(tokens, dim, device=device, generator=gen).to(dtype)
    results = {}
    for keep in (True, False):
        inputs = [t.clone().requires_grad_() for t in (x, w, wd)]
        shapes = []

        def pack(t, shapes=shapes):
            shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = swiglu_mlp(*inputs, keep_activation=keep)
        results[keep] = (y, *torch.autograd.grad(y, inputs, dy))
        assert ((tokens, units) in shapes) == keep
    for kept, recomputed in zip(results[True], results[False], strict=True):
        assert torch.equal(kept, recomputed)


def test_keep_activation_must_be_a_bool(device):
    x, w, wd = torch.randn(2, 4, device=device), torch.randn(4, 6, device=device), torch.randn(3, 4, device=device)
    with pytest.raises(ValueError, match="keep_activation must be a bool, got 1"):
        swiglu_mlp(x, w, wd, keep_activation=1)
