import pytest
import torch
from hypothesis import example, given

from lstrain._backend import record_backends
from lstrain.ops import add_rms_norm, linear, linear_add_rms_norm_swiglu, linear_add_rms_norm_swiglu_ref, swiglu_mlp
from lstrain.ops.gemm import gemm_plan
from lstrain.ops.linear_add_rms_norm_swiglu import SLOT_COLS, LinearAddRMSNormSwiGLUFunction, squares_slots
from lstrain.testing import assert_all_passed
from lstrain.testing.checks import OP_CHECKS
from lstrain.testing.strategies import linear_add_rms_norm_swiglu_cases
from tests.conftest import DEVICE, EXPECTED_BACKEND

CHECK = OP_CHECKS["linear_add_rms_norm_swiglu"]


def _case(tokens, in_features, hidden, intermediate, dtype, bias=False, seed=0):
    return {
        "tokens": tokens,
        "in_features": in_features,
        "hidden": hidden,
        "intermediate": intermediate,
        "bias": bias,
        "dtype": dtype,
        "seed": seed,
    }


@given(case=linear_add_rms_norm_swiglu_cases(DEVICE))
@example(case=_case(1, 1, 1, 1, torch.float32))
# the last tile's right half lies past D (slots of zeros); a partial pair block
@example(case=_case(37, 24, 130, 300, torch.float32, bias=True, seed=1))
@example(case=_case(70, 33, 65, 140, torch.float32, seed=2))
def test_matches_torch(case):
    result = CHECK.run(case, DEVICE)
    assert set(result.backends) == {EXPECTED_BACKEND}
    assert_all_passed(result.comparisons, str(case))


@pytest.mark.gpu  # 16-bit: bf16 (the interpreter's bf16 dot is wrong, fp16 is refused)
def test_16_bit_large_plan_runs_persistent():
    """D = 2048 and 2048 tokens: the projection's 128 x 256 persistent plan, its epilogue in
    halves (32 slots a row), and SwiGLU's persistent pair-block launch with the row scale."""
    plan = gemm_plan(2048, 2048, 16, 2)
    assert plan.persistent and plan.block_n == 256
    result = CHECK.run(_case(2048, 16, 2048, 136, torch.bfloat16, seed=3), "cuda")
    assert set(result.backends) == {EXPECTED_BACKEND}
    assert_all_passed(result.comparisons, "2048 x 16 -> 2048, F 136")


@pytest.mark.parametrize("n, slots", [(1, 1), (32, 1), (64, 1), (65, 2), (130, 3), (2048, 32)])
def test_squares_slots(n, slots):
    """One partial sum of squares per 64 columns, whatever the plan."""
    assert squares_slots(n) == slots


@pytest.mark.parametrize("m, n", [(5, 16), (5, 48), (5, 100), (300, 130), (2048, 2048)])
def test_every_plan_covers_the_slots_once(m, n):
    """Each plan's epilogue chunks are SLOT_COLS-aligned multiples of it (in halves from 128
    columns), or one tile covers all of N: every slot is written by exactly one chunk."""
    plan = gemm_plan(m, n, 64, 2)
    chunk = plan.block_n // 2 if plan.block_n >= 2 * SLOT_COLS else plan.block_n
    assert chunk % SLOT_COLS == 0 or plan.block_n >= n


def _inputs(device, dtype, m=6, k=12, d=16, f=20, seed=0, bias=False):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape, scale=1.0, mean=0.0):
        return ((torch.randn(shape, generator=gen) * scale) + mean).to(device=device, dtype=dtype)

    tensors = [
        randn(m, k),
        randn(d, k, scale=k**-0.5),
        randn(m, d),
        randn(d, mean=1.0),
        randn(d, 2 * f, scale=d**-0.5),
        randn(f, d, scale=f**-0.5),
    ]
    return tensors, (randn(d) if bias else None)


@pytest.mark.gpu  # bf16 (see above)
def test_unfused_path_error_is_no_smaller():
    """Issue 33's check of the rounding pattern A moves: against an fp64 reference, the fused
    op's error in y (the MLP output) and s is no worse than lstrain's unfused path (projection,
    add_rms_norm, swiglu_mlp) in bf16, summed over seeds."""
    fused_err = unfused_err = 0.0
    for seed in range(4):
        tensors, _ = _inputs("cuda", torch.bfloat16, m=256, k=256, d=512, f=384, seed=seed)
        x, w, r, g, wg, wd = tensors
        exact_y, exact_s = linear_add_rms_norm_swiglu_ref(*(t.double() for t in tensors), eps=1e-6)
        y, s = linear_add_rms_norm_swiglu(x, w, r, g, wg, wd, eps=1e-6)
        normed, s_unfused = add_rms_norm(linear(x, w), r, 512, g, 1e-6)
        y_unfused = swiglu_mlp(normed, wg, wd)
        fused_err += (y.double() - exact_y).norm().item() + (s.double() - exact_s).norm().item()
        unfused_err += (y_unfused.double() - exact_y).norm().item() + (s_unfused.double() - exact_s).norm().item()
    assert fused_err <= 1.02 * unfused_err, (fused_err, unfused_err)


@pytest.mark.parametrize("bias", [False, True])
def test_inference_matches_training_forward(device, monkeypatch, bias):
    """Without grad the op runs no autograd Function and writes no h; its outputs are the
    training forward's bit for bit."""
    tensors, b = _inputs(device, torch.float32, bias=bias)
    applied = []
    apply = LinearAddRMSNormSwiGLUFunction.apply
    monkeypatch.setattr(LinearAddRMSNormSwiGLUFunction, "apply", lambda *args: applied.append(1) or apply(*args))
    with torch.no_grad():
        y, s = linear_add_rms_norm_swiglu(*tensors, bias=b)
    assert not applied
    trained = [t.clone().requires_grad_() for t in tensors]
    y_train, s_train = linear_add_rms_norm_swiglu(*trained, bias=b)
    assert applied
    assert torch.equal(y, y_train) and torch.equal(s, s_train)


@pytest.mark.parametrize("used", ["y", "s"])
def test_one_output_used(device, used):
    """A gradient of only one output: the other's stays None inside backward (nothing to read)."""
    tensors, _ = _inputs(device, torch.float32)
    ours = [t.clone().requires_grad_() for t in tensors]
    ref = [t.double().requires_grad_() for t in tensors]
    y, s = linear_add_rms_norm_swiglu(*ours)
    y_ref, s_ref = linear_add_rms_norm_swiglu_ref(*ref, eps=torch.finfo(torch.float32).eps)
    (y if used == "y" else s).square().sum().backward()
    (y_ref if used == "y" else s_ref).square().sum().backward()
    for mine, theirs in zip(ours, ref, strict=True):
        if theirs.grad is None or not theirs.grad.any():
            assert mine.grad is None or not mine.grad.any()
        else:
            torch.testing.assert_close(mine.grad.double(), theirs.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("trained", [("w_down",), ("w_gate_up", "w_down"), ("norm_weight",)])
def test_only_some_inputs_require_grad(device, trained):
    """Frozen inputs (a fine-tuned MLP over a frozen projection, say): the gradients asked
    for match the reference, and backward skips what only the frozen ones would need."""
    names = ("x", "weight", "residual", "norm_weight", "w_gate_up", "w_down")
    tensors, _ = _inputs(device, torch.float32)
    ours = [t.clone().requires_grad_(name in trained) for name, t in zip(names, tensors, strict=True)]
    ref = [t.double().requires_grad_(name in trained) for name, t in zip(names, tensors, strict=True)]
    y, s = linear_add_rms_norm_swiglu(*ours)
    y_ref, s_ref = linear_add_rms_norm_swiglu_ref(*ref, eps=torch.finfo(torch.float32).eps)
    (y.square().sum() + s.sum()).backward()
    (y_ref.square().sum() + s_ref.sum()).backward()
    for name, mine, theirs in zip(names, ours, ref, strict=True):
        assert (mine.grad is None) == (name not in trained)
        if name in trained:
            torch.testing.assert_close(mine.grad.double(), theirs.grad, rtol=1e-4, atol=1e-5)


def test_torch_compile_fullgraph(device):
    tensors, b = _inputs(device, torch.float32, bias=True)
    params = [t.clone().requires_grad_() for t in tensors[1:]] + [b.clone().requires_grad_()]

    def f(x):
        y, s = linear_add_rms_norm_swiglu(x, *params[:5], bias=params[5])
        return y.square().sum() + s.sum()

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    out = compiled(tensors[0])
    grads = torch.autograd.grad(out, params)
    ref_out = f(tensors[0])
    ref_grads = torch.autograd.grad(ref_out, params)
    torch.testing.assert_close(out, ref_out)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r)


def test_custom_ops_pass_opcheck(device):
    (x, w, r, g, wg, _), b = _inputs(device, torch.float32, bias=True)
    torch.library.opcheck(torch.ops.lstrain.linear_add_rms_norm_fwd, (x, w, b, r, g))
    torch.library.opcheck(torch.ops.lstrain.linear_add_rms_norm_fwd, (x, w, None, r, g))
    _, scaled, squares = torch.ops.lstrain.linear_add_rms_norm_fwd(x, w, b, r, g)
    for store_h in (False, True):
        torch.library.opcheck(torch.ops.lstrain.swiglu_fwd_row_scaled, (scaled, wg, squares, 1e-6, store_h))


def test_runs_the_kernels(device):
    tensors, _ = _inputs(device, torch.float32)
    with record_backends() as ran:
        linear_add_rms_norm_swiglu(*tensors)
    assert ran == [("linear_add_rms_norm_swiglu", EXPECTED_BACKEND)]


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda t: t.__setitem__(1, t[1][:, :-1]), "weight must be \\[D, K\\] with K = 12"),
        (lambda t: t.__setitem__(2, t[2][:-1]), "residual must have shape \\(6, 16\\)"),
        (lambda t: t.__setitem__(3, t[3][:-1]), "norm_weight has shape \\(15,\\), expected normalized_shape \\(16,\\)"),
        (lambda t: t.__setitem__(3, None), "norm_weight must be a tensor, got NoneType"),
        (lambda t: t.__setitem__(4, t[4][:-1]), "w_gate_up must be \\[D, 2F\\] with D = 16"),
        (lambda t: t.__setitem__(5, t[5][:-1]), "w_down must be \\[F, D_out\\] with F = 20"),
        (lambda t: t.__setitem__(2, t[2].double()), "residual has dtype torch.float64, but x has dtype torch.float32"),
        (lambda t: t.__setitem__(0, t[0][0, 0]), "x must be \\[\\*, K\\]"),
    ],
)
def test_bad_input(device, change, match):
    tensors, _ = _inputs(device, torch.float32)
    change(tensors)
    with pytest.raises(ValueError, match=match):
        linear_add_rms_norm_swiglu(*tensors)


def test_a_strided_bias_is_read_as_it_is(device):
    """A bias that is a strided view (or an expanded one) is copied, not read as contiguous."""
    tensors, _ = _inputs(device, torch.float32)
    exact = [t.double() for t in tensors]
    for bias in (torch.randn(16, 2, device=device)[:, 0], torch.tensor([0.5], device=device).expand(16)):
        y, s = linear_add_rms_norm_swiglu(*tensors, bias=bias)
        y_ref, s_ref = linear_add_rms_norm_swiglu_ref(*exact, bias=bias.double(), eps=torch.finfo(torch.float32).eps)
        torch.testing.assert_close(s.double(), s_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)


def test_the_mlp_output_may_be_changed_in_place(device):
    """y is a tensor of its own, not a view of the autograd Function's output (which
    autograd would refuse to change in place); s is saved for backward, so changing it is
    refused at backward, as for any saved tensor."""
    tensors = [t.requires_grad_() for t in _inputs(device, torch.float32)[0]]
    y, s = linear_add_rms_norm_swiglu(*[t.unsqueeze(0) if i in (0, 2) else t for i, t in enumerate(tensors)])
    y.add_(1)
    (s.sum() + y.square().sum()).backward()
    assert all(t.grad is not None for t in tensors)


def test_float16_and_a_wider_stream_under_autocast_are_refused(device):
    """fp16 would overflow s * g before the 1/rms scale; autocast leaves the stream as it is,
    and a stream wider than the compute dtype is refused rather than rounded down."""
    tensors, _ = _inputs(device, torch.float32)
    with pytest.raises(ValueError, match="x has dtype torch.float16; expected float32 or bfloat16"):
        linear_add_rms_norm_swiglu(*[t.half() for t in tensors])
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        with pytest.raises(ValueError, match="residual has dtype torch.float32, but x has dtype torch.bfloat16"):
            linear_add_rms_norm_swiglu(*tensors)


def test_bad_bias_and_eps(device):
    tensors, _ = _inputs(device, torch.float32)
    with pytest.raises(ValueError, match="bias must be \\[D\\] with D = 16"):
        linear_add_rms_norm_swiglu(*tensors, bias=torch.zeros(3, device=device))
    with pytest.raises(ValueError, match="eps"):
        linear_add_rms_norm_swiglu(*tensors, eps=-1.0)
