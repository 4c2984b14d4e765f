import sys

import pytest
import torch
from hypothesis import example, given

import lstrain
from lstrain._backend import multiprocessor_count, record_backends
from lstrain.ops import gemm, gemm_ref
from lstrain.ops._lib.activations import activation_index, activation_ref
from lstrain.ops._lib.layout import cdiv
from lstrain.ops.gemm import (
    GemmFunction,
    GemmPlan,
    gemm_fwd,
    gemm_fwd_saving_preactivation_op,
    gemm_plan,
    small_grid_plan,
)
from lstrain.testing import assert_all_passed, check_function, check_module
from lstrain.testing.checks import OP_CHECKS
from lstrain.testing.strategies import gemm_cases
from tests.conftest import DEVICE, EXPECTED_BACKEND

CHECK = OP_CHECKS["gemm"]
LOW = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # the interpreter's bf16 dot is wrong


def _case(
    mnk=(5, 7, 3), dtype=torch.float32, ta=False, tb=False, c=False, bias=False, alpha=1.0, beta=0.0, act=None, seed=0
):
    return {
        "mnk": mnk,
        "dtype": dtype,
        "transpose_a": ta,
        "transpose_b": tb,
        "c": c,
        "bias": bias,
        "alpha": alpha,
        "beta": beta,
        "activation": act,
        "seed": seed,
    }


@given(case=gemm_cases(DEVICE))
@example(case=_case(mnk=(1, 1, 1)))
@example(case=_case(mnk=(33, 65, 17), dtype=LOW, ta=True, c=True, bias=True, beta=0.5, act="gelu"))
@example(case=_case(mnk=(64, 64, 130), tb=True, c=True, beta=0.0, act="silu"))  # C ignored
@example(case=_case(mnk=(70, 3, 9), dtype=LOW, bias=True, alpha=-2.0, act="relu"))
@example(case=_case(mnk=(8, 40, 8), c=True, beta=1.0, act="gelu_tanh"))
@example(case=_case(mnk=(1, 43, 431), act="gelu"))  # a long fp32 K chain (4x torch's error before)
# torch runs a GEMV here: 3.4x its error on the H200 with fp32 K tiles of 32
@example(case=_case(mnk=(216, 1, 216), act="gelu", seed=216))
@example(
    case=_case(mnk=(98, 98, 98), dtype=torch.float16, ta=True, tb=True, c=True, bias=True, beta=0.3, act="relu")
    | {"seed": 795}
)  # a pre-activation within rounding of relu's kink (H200)
def test_matches_torch(case):
    result = CHECK.run(case, DEVICE)
    assert set(result.backends) == {EXPECTED_BACKEND}
    assert_all_passed(result.comparisons, str(case))


def test_relu_epilogue_propagates_nan(device):
    a = torch.ones(16, 8, device=device, dtype=torch.float16)
    a[3, 2] = float("nan")
    d = gemm(a, torch.ones(8, 4, device=device, dtype=torch.float16), activation="relu")
    assert torch.isnan(d[3]).all() and not torch.isnan(d[:3]).any()


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "silu"])
def test_epilogue_nan_and_infinities_as_torch(device, activation):
    """NaN and +-inf pre-activations (from the bias) give torch's values forward and
    backward, relu's slope read off D included (a NaN passes the gradient, as in torch)."""
    special = [float("nan"), float("inf"), float("-inf"), 0.0, 1.0, -1.0, 30.0, -30.0]
    a = torch.randn(5, 4, device=device, requires_grad=True)
    b = torch.randn(4, len(special), device=device, requires_grad=True)
    bias = torch.tensor(special, device=device, requires_grad=True)
    d = gemm(a, b, bias=bias, activation=activation)
    grads = torch.autograd.grad(d, (a, b, bias), torch.ones_like(d))
    inputs64 = [t.detach().double().requires_grad_() for t in (a, b, bias)]
    d64 = gemm_ref(inputs64[0], inputs64[1], bias=inputs64[2], activation=activation)
    grads64 = torch.autograd.grad(d64, inputs64, torch.ones_like(d64))
    torch.testing.assert_close(d.double(), d64, equal_nan=True, rtol=1e-5, atol=1e-5)
    for grad, grad64 in zip(grads, grads64, strict=True):
        torch.testing.assert_close(grad.double(), grad64, equal_nan=True, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "silu"])
def test_activation_backward_of_an_expanded_gradient(device, activation):
    """Backward takes act'(z) from the pre-activation the forward stored; the gradient of a
    sum arrives expanded (strides 0); fp32 operands, bias and alpha, against autograd
    through gemm_ref in fp64."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(37, 24, generator=gen).to(device).requires_grad_()
    b = torch.randn(24, 45, generator=gen).to(device).requires_grad_()
    bias = torch.randn(45, generator=gen).to(device).requires_grad_()
    gemm(a, b, bias=bias, alpha=0.5, activation=activation).sum().backward()
    inputs = [t.detach().double().requires_grad_() for t in (a, b, bias)]
    gemm_ref(inputs[0], inputs[1], bias=inputs[2], alpha=0.5, activation=activation).sum().backward()
    for ours, ref in zip((a, b, bias), inputs, strict=True):
        torch.testing.assert_close(ours.grad, ref.grad.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("retain_graph", [False, True])
def test_activation_backward_writes_dz_over_z_only_when_the_graph_is_freed(device, monkeypatch, retain_graph):
    """Every gradient at once (dC's pass runs first, reading z; the last pass may write dz
    over it), against autograd through gemm_ref in fp64."""
    gemm_module = sys.modules["lstrain.ops.gemm"]
    outs = []
    real = gemm_module.bias_act_dropout_bwd
    monkeypatch.setattr(
        gemm_module, "bias_act_dropout_bwd", lambda *args, out=None: outs.append(out) or real(*args, out=out)
    )
    gen = torch.Generator().manual_seed(2)
    inputs = [
        torch.randn(*shape, generator=gen).to(device).requires_grad_() for shape in ((9, 5), (5, 7), (9, 7), (7,))
    ]
    dd = torch.randn(9, 7, generator=gen).to(device)
    options = {"alpha": 1.5, "beta": 0.5, "activation": "gelu"}
    d = gemm(inputs[0], inputs[1], c=inputs[2], bias=inputs[3], **options)
    grads = torch.autograd.grad(d, inputs, dd, retain_graph=retain_graph)
    assert [out is not None for out in outs] == [False, not retain_graph]
    ref = [t.detach().double().requires_grad_() for t in inputs]
    expected = torch.autograd.grad(gemm_ref(ref[0], ref[1], c=ref[2], bias=ref[3], **options), ref, dd.double())
    for ours, theirs in zip(grads, expected, strict=True):
        torch.testing.assert_close(ours, theirs.float(), rtol=1e-5, atol=1e-5)


def test_relu_keeps_no_preactivation(device, monkeypatch):
    """relu's slope is read off D, as torch's relu backward reads its output: the forward
    stores no z, and D changed in place before backward is caught as torch catches it."""
    gemm_module = sys.modules["lstrain.ops.gemm"]
    monkeypatch.setattr(gemm_module, "gemm_fwd_saving_preactivation_op", None)  # called: a TypeError
    gen = torch.Generator().manual_seed(3)
    a, b = (torch.randn(*shape, generator=gen).to(device).requires_grad_() for shape in ((6, 5), (5, 4)))
    (grad,) = torch.autograd.grad(gemm(a, b, alpha=-2.0, activation="relu").sum(), a)
    a64 = a.detach().double().requires_grad_()
    (expected,) = torch.autograd.grad(gemm_ref(a64, b.detach().double(), alpha=-2.0, activation="relu").sum(), a64)
    torch.testing.assert_close(grad, expected.float(), rtol=1e-5, atol=1e-5)
    d = gemm(a, b, activation="relu")
    d.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        d.sum().backward()


def test_no_autograd_node_when_nothing_is_differentiated(device, monkeypatch):
    """Inference (no_grad, or no input requiring grad) launches the kernel without an
    autograd Function (its host cost, and what it saves for backward)."""
    applied = []
    apply = GemmFunction.apply
    monkeypatch.setattr(GemmFunction, "apply", lambda *args: applied.append(1) or apply(*args))
    a = torch.randn(8, 4, device=device)
    b = torch.randn(4, 6, device=device, requires_grad=True)
    with torch.no_grad():
        d = gemm(a, b, activation="gelu")
    torch.testing.assert_close(gemm(a, b.detach(), activation="gelu"), d)
    assert not applied
    gemm(a, b, activation="gelu").sum().backward()
    assert applied and b.grad is not None


def test_strided_bias(device):
    """A bias that is a strided view (every other element of a buffer) is read by value,
    and its gradient reaches the buffer's elements."""
    a, b = torch.randn(8, 4, device=device), torch.randn(4, 6, device=device)
    buffer = torch.randn(12, device=device, requires_grad=True)
    d = gemm(a, b, bias=buffer[::2], activation="relu")
    torch.testing.assert_close(d, torch.relu(a @ b + buffer.detach()[::2]))
    (grad,) = torch.autograd.grad(d.sum(), buffer)
    assert not grad[1::2].any()
    torch.testing.assert_close(grad[::2], (a @ b + buffer.detach()[::2] > 0).float().sum(0))


def test_beta_zero_never_reads_c(device):
    a, b = torch.randn(16, 8, device=device), torch.randn(8, 12, device=device)
    c = torch.full((16, 12), float("nan"), device=device)
    d = gemm(a, b, c=c, beta=0.0)
    assert torch.isfinite(d).all()
    torch.testing.assert_close(d, a @ b)


def test_out_dtype_and_fp32_accumulation(device):
    a = torch.randn(32, 256, device=device).to(LOW)
    b = torch.randn(256, 24, device=device).to(LOW)
    d = gemm(a, b, alpha=0.25, out_dtype=torch.float32)
    assert d.dtype == torch.float32
    torch.testing.assert_close(d, 0.25 * (a.float() @ b.float()), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("activation", [None, "relu"])
def test_fp32_output_of_a_persistent_launch(device, activation):
    """16-bit operands, an fp32 D from a persistent launch, whose epilogue overlaps the next
    tile's loads and so cannot reuse the pipeline's shared memory for its layout conversion:
    in one piece a 128 x 256 fp32 tile took 272 KiB on the H200, over its 227."""
    m, n, k = 2048, 2304, 16
    assert gemm_plan(m, n, k, 2).persistent
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(m, k, generator=gen).to(device, LOW)
    b = torch.randn(k, n, generator=gen).to(device, LOW)
    d = gemm(a, b, alpha=0.5, activation=activation, out_dtype=torch.float32)
    expected = gemm_ref(a.double(), b.double(), alpha=0.5, activation=activation)
    torch.testing.assert_close(d.double(), expected, rtol=1e-5, atol=1e-5)


def _check_persistent_forward(mnk, *, tb=False, c=False, act=None, seed=0, preactivation=False):
    """A persistent launch's D (and, with ``preactivation``, the z it stores for backward)
    against gemm_ref by the tolerance rule, forward only: its backward is cuBLAS and
    bias_act_dropout's pass, checked at small shapes above, and at these sizes the
    interpreter's elementwise pass alone took a minute."""
    m, n, k = mnk
    assert gemm_plan(m, n, k, 2).persistent
    gen = torch.Generator().manual_seed(seed)
    inputs = {
        "a": torch.randn(m, k, generator=gen).to(DEVICE, LOW),
        "b": torch.randn(n, k, generator=gen).to(DEVICE, LOW).t()
        if tb
        else torch.randn(k, n, generator=gen).to(DEVICE, LOW),
        "c": torch.randn(m, n, generator=gen).to(DEVICE, LOW) if c else None,
        "bias": torch.randn(n, generator=gen).to(DEVICE, LOW),
    }
    alpha, beta = 0.5, 0.75 if c else 0.0

    def ours(a, b, c, bias):
        if preactivation:
            return torch.stack(
                gemm_fwd_saving_preactivation_op(a, b, c, bias, alpha, beta, activation_index(act, "gemm"), LOW)
            )
        return gemm(a, b, c=c, bias=bias, alpha=alpha, beta=beta, activation=act)

    def reference(a, b, c, bias):
        options = {"c": c, "bias": bias, "alpha": alpha, "beta": beta}
        d = gemm_ref(a, b, activation=act, **options)
        return torch.stack((d, gemm_ref(a, b, **options))) if preactivation else d

    with record_backends() as ran:
        comparisons = check_function(ours, reference, inputs, grad_inputs=(), generator=gen)
    if not preactivation:  # gemm records where it ran; the kernel op below it records nothing
        assert {backend for _, backend in ran} == {EXPECTED_BACKEND}
    assert_all_passed(comparisons, f"{mnk} tb={tb} c={c} act={act}")


@pytest.mark.parametrize("activation", ["relu", "silu", "gelu_tanh"])
def test_persistent_launch_storing_the_preactivation(activation):
    """The same persistent launch writing D and the pre-activation z for backward, which in
    one piece took 272 KiB of shared memory for relu."""
    _check_persistent_forward((2048, 2304, 16), act=activation, seed=7, preactivation=True)


def test_launch_plan():
    big = gemm_plan(16384, 11008, 4096, 2)
    assert (big.block_m, big.block_n, big.block_k, big.num_warps) == (128, 256, 64, 8)
    assert big.persistent and not gemm_plan(16384, 11008, 4096, 4).persistent
    mid = gemm_plan(4096, 1024, 4096, 2)  # 128 tiles of 128 x 256: more than one wave of 128 x 128
    assert (mid.block_n, mid.num_warps, mid.num_stages, mid.persistent) == (256, 8, 4, False)
    one_wave = gemm_plan(2048, 1024, 8192, 2)
    assert (one_wave.block_n, one_wave.num_warps, one_wave.num_stages) == (128, 8, 4)
    narrow = gemm_plan(32768, 128, 64, 2)  # 256 tiles, too narrow for 128 x 256
    assert (narrow.block_n, narrow.num_warps, narrow.num_stages) == (128, 4, 3)
    for smaller_shared in (101376, 99 * 1024):  # sm_86 / sm_89: 128 x 256 tiles do not fit
        plan = gemm_plan(16384, 11008, 4096, 2, smaller_shared)
        assert (plan.block_n, plan.num_warps, plan.num_stages, plan.persistent) == (128, 4, 3, False)
    assert gemm_plan(16384, 11008, 4096, 2, 166912) == big  # an A100 holds the large plan
    small = gemm_plan(5, 7, 3, 4)
    assert small.block_m == 16 and small.block_n == 16 and small.block_k == 16
    assert gemm_plan(4096, 4096, 4096, 4).block_k == 16


@pytest.mark.parametrize("b_layout", ["row-major", "w.t()"])
def test_persistent_launch_and_the_last_column_strip(b_layout):
    """More whole column tiles than programs (an H200 has 132 SMs, the interpreter 4): one
    persistent launch over them, a launch per tile for the partial last column strip
    (views of b, c, bias and d), every epilogue term."""
    m, n, k = mnk = (2048, 2404, 72)
    plan = gemm_plan(m, n, k, 2)
    programs = multiprocessor_count(-1 if DEVICE == "cpu" else torch.cuda.current_device())
    assert cdiv(m, plan.block_m) * (n // plan.block_n) > programs and n % plan.block_n
    _check_persistent_forward(mnk, tb=b_layout == "w.t()", c=True, act="gelu", seed=n)


def test_small_grid_plan():
    """The H200 labs' shapes (thirteenth session, runs 2, 6 and 7): 64-row tiles where they
    fill the SMs or K is short, else K split where 128-row tiles leave SMs idle."""
    expected = {  # (M, N, K): (tile rows, tile columns, chunks); None: gemm_plan's plan
        (1024, 1024, 1024): (64, 128, 1),
        (1024, 1024, 4096): (64, 128, 1),
        (256, 4096, 4096): (64, 128, 1),
        (512, 1024, 2048): (64, 128, 1),  # half a wave, but a short K
        (512, 1024, 8192): (128, 128, 4),
        (512, 512, 4096): (128, 128, 4),
        (2048, 1024, 8192): (128, 256, 2),
        (512, 4096, 4096): (128, 256, 2),
        (3072, 1024, 4096): None,
        (1536, 1536, 1536): None,
        (64, 4096, 8192): None,  # narrow: gemm_plan's smaller tiles
    }
    for mnk, want in expected.items():
        plan = small_grid_plan(*mnk, 2)
        assert (plan and (plan.block_m, plan.block_n, plan.splits)) == want, mnk
    assert small_grid_plan(1024, 1024, 4096, 4) is None  # fp32
    assert small_grid_plan(1024, 1024, 4096, 2, 99 * 1024) is None  # sm_86 / sm_89
    assert gemm_plan(1024, 1024, 4096, 2).splits == 1  # what SwiGLU plans with


@pytest.mark.parametrize("b_layout", ["row-major", "w.t()"])
def test_split_k_launch(b_layout):
    """Few output tiles and a long K: K split over programs (4 tiles of 128 x 128, K = 2100
    in two chunks, the second partial), fp32 partials summed in split order by the epilogue
    kernel, every epilogue term; the same bits on a second run."""
    mnk = (256, 256, 2100)
    assert small_grid_plan(*mnk, 2).splits == 2
    case = _case(mnk, LOW, tb=b_layout == "w.t()", c=True, bias=True, alpha=0.5, beta=0.75, act="gelu", seed=7)
    result = CHECK.run(case, DEVICE)
    assert set(result.backends) == {EXPECTED_BACKEND}
    assert_all_passed(result.comparisons, str(case))
    a = torch.randn(256, 2100, device=DEVICE).to(LOW)
    b = torch.randn(2100, 256, device=DEVICE).to(LOW)
    assert torch.equal(gemm(a, b, activation="relu"), gemm(a, b, activation="relu"))


def test_split_k_wide_tiles_ragged_edges():
    """The 256-wide split plan with M, N off the tiles and three chunks of K = 2100 (the last
    shorter), against one program per tile."""
    m, n, k = 200, 300, 2100
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(m, k, generator=gen).to(DEVICE, LOW)
    b = (torch.randn(n, k, generator=gen) * k**-0.5).to(DEVICE, LOW).t()
    c = torch.randn(m, n, generator=gen).to(DEVICE, LOW)
    bias = torch.randn(n, generator=gen).to(DEVICE, LOW)
    act = activation_index("gelu", "gemm")
    split = GemmPlan(128, 256, 64, 8, num_warps=8, num_stages=4, splits=3)
    d = gemm_fwd(a, b, c, bias, 0.5, 0.75, act, LOW, split)
    expected = gemm_fwd(a, b, c, bias, 0.5, 0.75, act, torch.float32, gemm_plan(m, n, k, 2))
    torch.testing.assert_close(d.float(), expected, rtol=2**-8, atol=2**-8)
    torch.testing.assert_close(d, gemm_ref(a, b, c=c, bias=bias, alpha=0.5, beta=0.75, activation="gelu"))
    # an explicit split plan keeps fp32 products full fp32 (IEEE), as gemm does for fp32 input
    a32, b32 = a.float(), b.float()
    split32 = GemmPlan(64, 64, 16, 8, num_warps=4, num_stages=3, splits=3)
    d32 = gemm_fwd(a32, b32, None, None, 1.0, 0.0, -1, torch.float32, split32)
    torch.testing.assert_close(d32, a32.double().matmul(b32.double()).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda a: gemm(a, a), "need a \\[M, K\\] and b \\[K, N\\]"),
        (lambda a: gemm(a[0], a.t()), "need a"),
        (lambda a: gemm(a, a.t().double()), "share a float dtype"),
        (lambda a: gemm(a.double(), a.t().double()), r"float32, float16 or bfloat16\), got torch.float64 and"),
        (lambda a: gemm(a, a.t(), c=torch.zeros(3, 3, device=a.device)), "c has shape \\(3, 3\\), expected \\(4, 4\\)"),
        (lambda a: gemm(a, a.t(), bias=torch.zeros(5, device=a.device)), "bias has shape"),
        (lambda a: gemm(a, a.t(), activation="tanh"), "activation must be None or one of"),
        (lambda a: gemm(a, a.t(), bias=torch.zeros(4, device="meta")), "bias is on meta"),
        (lambda a: gemm(a, a.t(), bias=torch.zeros(4, dtype=torch.long, device=a.device)), "bias must be a float"),
        (lambda a: gemm(a, a.t(), out_dtype=torch.int32), "out_dtype must be float32, float16 or bfloat16"),
    ],
)
def test_bad_input_names_the_argument(device, call, match):
    with pytest.raises(ValueError, match=match):
        call(torch.randn(4, 6, device=device))


def test_reference_matches_torch_addmm(device):
    a, b = torch.randn(5, 4, device=device), torch.randn(4, 3, device=device)
    c, bias = torch.randn(5, 3, device=device), torch.randn(3, device=device)
    expected = torch.relu(torch.addmm(c, a, b, beta=0.5, alpha=2.0) + bias)
    torch.testing.assert_close(gemm_ref(a, b, c=c, bias=bias, alpha=2.0, beta=0.5, activation="relu"), expected)


def test_torch_compile_fullgraph(device):
    w = torch.randn(16, 24, device=device, requires_grad=True)
    bias = torch.randn(24, device=device, requires_grad=True)

    def f(x):
        return gemm(x, w, bias=bias, activation="gelu").sum()

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    x = torch.randn(8, 16, device=device)
    out = compiled(x)
    grads = torch.autograd.grad(out, (w, bias))
    ref_out = f(x)
    ref_grads = torch.autograd.grad(ref_out, (w, bias))
    torch.testing.assert_close(out, ref_out)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r)


def test_custom_op_passes_opcheck(device):
    a, b = torch.randn(6, 5, device=device), torch.randn(5, 7, device=device)
    c, bias = torch.randn(6, 7, device=device), torch.randn(7, device=device)
    torch.library.opcheck(torch.ops.lstrain.gemm, (a, b, c, bias, 1.5, 0.5, 3, torch.float32))
    torch.library.opcheck(torch.ops.lstrain.gemm_saving_preactivation, (a, b, c, bias, 1.5, 0.5, 0, torch.float32))


@pytest.mark.parametrize("b_layout", ["row-major", "w.t()"])
def test_empty_k_leaves_the_epilogue(device, b_layout):
    # K = 0: the product is zero; a K-major B still runs one fully masked K step (mainloop)
    a = torch.randn(6, 0, device=device)
    w = torch.randn(5, 8, device=device)[:, :0]  # [N, K] row-major, K = 0
    b = w.t() if b_layout == "w.t()" else torch.randn(0, 5, device=device)
    assert (b.stride(0) == 1) == (b_layout == "w.t()")
    c, bias = torch.randn(6, 5, device=device), torch.randn(5, device=device)
    with record_backends() as ran:
        d = gemm(a, b, c=c, bias=bias, alpha=3.0, beta=0.5, activation="relu")
    assert ran == [("gemm", EXPECTED_BACKEND)]  # the kernel ran, not the reference
    torch.testing.assert_close(d, torch.relu(0.5 * c + bias))


class _LinearThenActivation(torch.nn.Linear):
    """The plain-PyTorch pair that ``lstrain.nn.Linear(..., activation=...)`` replaces."""

    def __init__(self, *args, activation, **kwargs):
        super().__init__(*args, **kwargs)
        self.activation = activation

    def forward(self, x):
        return activation_ref(self.activation, super().forward(x))


@pytest.mark.parametrize("activation, bias", [(None, True), ("gelu", True), ("relu", False), ("silu", True)])
def test_linear_module_is_a_drop_in(device, activation, bias):
    """Same state_dict as torch.nn.Linear; output, input and parameter gradients against
    torch.nn.Linear followed by the activation, any leading shape."""
    ours = lstrain.nn.Linear(24, 40, bias=bias, device=device, activation=activation)
    theirs = _LinearThenActivation(24, 40, bias=bias, device=device, activation=activation)
    assert ours.state_dict().keys() == torch.nn.Linear(24, 40, bias=bias).state_dict().keys()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 5, 24, device=device)
    with record_backends() as ran:
        assert_all_passed(check_module(ours, theirs, x))
    assert ran and {b for _, b in ran} == {EXPECTED_BACKEND}
    assert ours(torch.randn(24, device=device)).shape == (40,)
    assert f"activation={activation}" in repr(ours)


def test_linear_module_torch_compile_fullgraph(device):
    linear = lstrain.nn.Linear(16, 8, device=device, activation="gelu")
    compiled = torch.compile(linear, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    x = torch.randn(2, 3, 16, device=device)
    torch.testing.assert_close(compiled(x), linear(x))


def test_linear_module_errors():
    with pytest.raises(ValueError, match="activation"):
        lstrain.nn.Linear(4, 4, activation="tanh")
    with pytest.raises(ValueError, match="in_features=4"):
        lstrain.nn.Linear(4, 4)(torch.randn(2, 6))  # 12 values: a reshape to [3, 4] would pass


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")  # torch's init, as expected
def test_linear_module_with_no_in_features_as_torch(device):
    """in_features = 0: the output is the bias, as torch.nn.Linear's, not a reshape(-1, 0) failure."""
    ours = lstrain.nn.Linear(0, 5, device=device)
    theirs = torch.nn.Linear(0, 5, device=device)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 3, 0, device=device)
    torch.testing.assert_close(ours(x), theirs(x))
