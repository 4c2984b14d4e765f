import pytest
import torch
from hypothesis import example, given

import lstrain
from lstrain import _backend
from lstrain.ops import rms_norm, rms_norm_ref
from lstrain.ops.layer_norm import MAX_TILE_COLS_BWD, MAX_TILE_COLS_FWD
from lstrain.ops.rms_norm import rms_norm_bwd_plan, rms_norm_fwd_plan
from lstrain.testing import assert_all_passed, check_module
from lstrain.testing.checks import OP_CHECKS
from lstrain.testing.strategies import rms_norm_cases
from tests.conftest import DEVICE, EXPECTED_BACKEND

CHECK = OP_CHECKS["rms_norm"]


def _case(shape, normalized_shape=None, dtype=torch.float32, weight=True, eps=None, scale=1.0, seed=0):
    return {
        "shape": shape,
        "normalized_shape": normalized_shape or shape[-1:],
        "dtype": dtype,
        "weight": weight,
        "eps": eps,
        "scale": scale,
        "seed": seed,
    }


@given(case=rms_norm_cases(DEVICE))
@example(case=_case((1, 1)))
@example(case=_case((1, 7), dtype=torch.bfloat16))
@example(case=_case((3, 1025), dtype=torch.float16, weight=False))
@example(case=_case((2, 3, 2, 40), normalized_shape=(2, 40), eps=1e-5))
@example(case=_case((2, MAX_TILE_COLS_FWD + 3), dtype=torch.bfloat16))  # chunked forward and backward
@example(case=_case((2, MAX_TILE_COLS_FWD + 5), eps=1e-6))
@example(case=_case((3, MAX_TILE_COLS_BWD + 1), weight=False))  # single-tile forward, chunked backward
@example(case=_case((5, 64), scale=1e-3, dtype=torch.float16))  # eps dominates the mean square
def test_matches_torch(case):
    result = CHECK.run(case, DEVICE)
    assert set(result.backends) == {EXPECTED_BACKEND}
    assert_all_passed(result.comparisons, str(case))


def test_reference_is_torch(device):
    """rms_norm_ref is torch's own RMSNorm, whose default eps it shares."""
    x = torch.randn(4, 3, 24, device=device, dtype=torch.bfloat16) * 1e-2
    w = torch.randn(3, 24, device=device, dtype=torch.bfloat16)
    torch.testing.assert_close(rms_norm_ref(x, (3, 24), w), torch.nn.functional.rms_norm(x, (3, 24), w))
    x = torch.randn(4, 24, device=device) * 1e-3
    torch.testing.assert_close(rms_norm_ref(x, 24), torch.nn.functional.rms_norm(x, (24,)))


def test_zero_rows_and_zero_width(device):
    x = torch.randn(0, 3, 16, device=device, requires_grad=True)
    w = torch.randn(16, device=device, requires_grad=True)
    y = rms_norm(x, 16, w)
    y.sum().backward()
    assert y.shape == x.grad.shape == (0, 3, 16)
    assert torch.equal(w.grad, torch.zeros(16, device=device))
    x = torch.randn(3, 0, device=device, requires_grad=True)
    w = torch.randn(0, device=device, requires_grad=True)
    rms_norm(x, 0, w).sum().backward()
    assert x.grad.shape == (3, 0) and w.grad.shape == (0,)


def test_fp32_weight_with_bf16_input(device):
    x = torch.randn(6, 96, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(96, device=device, requires_grad=True)
    y = rms_norm(x, 96, w)
    assert y.dtype == torch.bfloat16
    y.backward(torch.ones_like(y))
    assert w.grad.dtype == torch.float32
    xr = x.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    torch.nn.functional.rms_norm(xr, (96,), wr, torch.finfo(torch.float32).eps).backward(torch.ones_like(xr))
    torch.testing.assert_close(w.grad.double(), wr.grad, rtol=1e-2, atol=5e-2)


def test_strided_input(device):
    base = torch.randn(8, 2, 48, device=device)
    x = base[:, 1, :]  # row stride 96, last dim contiguous: no copy needed
    torch.testing.assert_close(rms_norm(x, 48), rms_norm_ref(x, 48))
    xt = torch.randn(48, 8, device=device).t()  # last dim strided: copied
    torch.testing.assert_close(rms_norm(xt, 48), rms_norm_ref(xt, 48))
    buffer = torch.randn(12, device=device, requires_grad=True)
    (grad,) = torch.autograd.grad(rms_norm(x[:, :6], 6, buffer[::2]).sum(), buffer)
    assert not grad[1::2].any() and grad[::2].any()


def test_nan_in_gives_nan_out(device):
    x = torch.randn(3, 40, device=device)
    x[1, 5] = float("nan")
    y = rms_norm(x, 40, torch.randn(40, device=device))
    assert torch.isnan(y[1]).all()
    assert not torch.isnan(y[0]).any() and not torch.isnan(y[2]).any()


def test_weight_gradient_is_deterministic(device):
    x = torch.randn(300, 200, device=device, requires_grad=True)
    w = torch.randn(200, device=device, requires_grad=True)
    dy = torch.randn(300, 200, device=device)
    grads = [torch.autograd.grad(rms_norm(x, 200, w), (x, w), dy) for _ in range(3)]
    for other in grads[1:]:
        for g0, g1 in zip(grads[0], other, strict=True):
            assert torch.equal(g0, g1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(normalized_shape=(32,)), "normalized_shape"),
        (dict(weight_shape=(8,)), "weight has shape"),
        (dict(dtype=torch.int32), "x has dtype"),
        (dict(weight_dtype=torch.int64), "weight has dtype"),
        (dict(eps=-1.0), "eps"),
        (dict(eps=float("nan")), "eps"),
        (dict(eps="1e-5"), "eps"),
        (dict(weight_device="meta"), "weight is on meta"),
    ],
)
def test_bad_input_names_the_argument(device, kwargs, match):
    x = torch.randn(4, 16, device=device).to(kwargs.get("dtype", torch.float32))
    weight = torch.ones(
        kwargs.get("weight_shape", (16,)),
        device=kwargs.get("weight_device", device),
        dtype=kwargs.get("weight_dtype", torch.float32),
    )
    with pytest.raises(ValueError, match=match):
        rms_norm(x, kwargs.get("normalized_shape", (16,)), weight, kwargs.get("eps"))


def test_launch_plans():
    plan = rms_norm_fwd_plan(1024)
    assert plan.single_tile and plan.block_cols == 1024 and plan.block_rows * 1024 <= 4096
    assert rms_norm_fwd_plan(7).block_cols == 8 and rms_norm_fwd_plan(7).block_rows > 1
    assert rms_norm_fwd_plan(MAX_TILE_COLS_FWD).single_tile
    long_row = rms_norm_fwd_plan(MAX_TILE_COLS_FWD + 1)
    assert not long_row.single_tile and long_row.block_rows == 1
    assert rms_norm_bwd_plan(MAX_TILE_COLS_BWD).single_tile
    assert not rms_norm_bwd_plan(MAX_TILE_COLS_BWD + 1).single_tile
    assert rms_norm_bwd_plan(8192, 4, shared_memory=99 * 1024).num_stages < rms_norm_bwd_plan(8192, 4).num_stages
    for cols in (1, 3, 64, 1000, 4096, 8192, 65536):
        for plan in (rms_norm_fwd_plan(cols), rms_norm_bwd_plan(cols)):
            assert 1 <= plan.num_warps <= 16
            assert plan.block_rows * plan.block_cols <= 16384


def test_module_is_a_drop_in(device):
    ours = lstrain.nn.RMSNorm((3, 16), eps=1e-6, device=device)
    theirs = torch.nn.RMSNorm((3, 16), eps=1e-6, device=device)
    assert isinstance(ours, torch.nn.RMSNorm)
    assert ours.state_dict().keys() == theirs.state_dict().keys() == {"weight"}
    with torch.no_grad():
        theirs.weight.normal_()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(5, 3, 16, device=device)
    with _backend.record_backends() as ran:
        assert_all_passed(check_module(ours, theirs, x))
    assert ran and {b for _, b in ran} == {EXPECTED_BACKEND}
    default = lstrain.nn.RMSNorm(8, device=device)
    assert default.eps is None
    torch.testing.assert_close(default(x[..., :8] * 1e-3), torch.nn.RMSNorm(8, device=device)(x[..., :8] * 1e-3))
    no_weight = lstrain.nn.RMSNorm(8, elementwise_affine=False)
    assert no_weight.weight is None and no_weight(torch.randn(2, 8)).shape == (2, 8)


def test_torch_compile_fullgraph(device):
    w = torch.randn(64, device=device, requires_grad=True)

    def f(x):
        return rms_norm(x * 2, 64, w).sum()

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    x = torch.randn(4, 64, device=device, requires_grad=True)
    out = compiled(x)
    gx, gw = torch.autograd.grad(out, (x, w))
    ref_out = f(x)
    ref_gx, ref_gw = torch.autograd.grad(ref_out, (x, w))
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(gx, ref_gx)
    torch.testing.assert_close(gw, ref_gw)


def test_custom_ops_pass_opcheck(device):
    x = torch.randn(5, 32, device=device)
    w = torch.randn(32, device=device)
    torch.library.opcheck(torch.ops.lstrain.rms_norm_fwd, (x, [32], w, 1e-5))
    _, rstd = torch.ops.lstrain.rms_norm_fwd(x, [32], w, 1e-5)
    torch.library.opcheck(torch.ops.lstrain.rms_norm_bwd, (torch.randn_like(x), x, w, rstd, [32], True))


def test_second_derivative_is_refused(device):
    x = torch.randn(3, 8, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="second derivatives"):
        torch.autograd.grad(rms_norm(x, 8).sum(), x, create_graph=True)


@pytest.mark.gpu
def test_llama_sized_bf16():
    rows, cols = 16384, 4096
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(cols, device="cuda") * 0.1 + 1).to(torch.bfloat16).requires_grad_()
    dy = torch.randn_like(x)
    y = rms_norm(x, cols, w)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    xr, wr = (t.detach().float().requires_grad_() for t in (x, w))
    yr = rms_norm_ref(xr, cols, wr, torch.finfo(torch.float32).eps)
    dxr, dwr = torch.autograd.grad(yr, (xr, wr), dy.float())
    torch.testing.assert_close(y.float(), yr, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(dx.float(), dxr, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(dw.float(), dwr, atol=0.5, rtol=1e-2)
    assert torch.equal(dw, torch.autograd.grad(rms_norm(x, cols, w), w, dy)[0])
