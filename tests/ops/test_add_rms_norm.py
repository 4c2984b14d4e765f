import pytest
import torch
from hypothesis import example, given, settings

import lstrain
from lstrain import _backend
from lstrain.ops import add_rms_norm, add_rms_norm_ref, rms_norm_ref
from lstrain.ops.layer_norm import MAX_TILE_COLS_BWD, MAX_TILE_COLS_FWD
from lstrain.ops.rms_norm import rms_norm_bwd_plan
from lstrain.testing import assert_all_passed
from lstrain.testing.checks import OP_CHECKS
from lstrain.testing.strategies import rms_norm_cases
from tests.conftest import DEVICE, EXPECTED_BACKEND

CHECK = OP_CHECKS["add_rms_norm"]
# The @example cases carry the edges; few drawn ones keep the interpreter run short.
FEW = settings(max_examples=8) if DEVICE == "cpu" else settings()


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


@FEW
@given(case=rms_norm_cases(DEVICE))
@example(case=_case((1, 1)))
@example(case=_case((1, 7), dtype=torch.bfloat16))
@example(case=_case((3, 1025), dtype=torch.float16, weight=False))
@example(case=_case((2, 3, 2, 40), normalized_shape=(2, 40), eps=1e-5))
@example(case=_case((2, MAX_TILE_COLS_FWD + 3), dtype=torch.float16))  # chunked forward and backward
@example(case=_case((3, MAX_TILE_COLS_BWD + 1), weight=False))  # single-tile forward, chunked backward
@example(case=_case((5, 64), scale=1e-3, dtype=torch.float16))  # eps dominates the mean square
def test_matches_torch(case):
    result = CHECK.run(case, DEVICE)
    assert set(result.backends) == {EXPECTED_BACKEND}
    assert_all_passed(result.comparisons, str(case))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_new_residual_is_the_rounded_sum_and_normed_is_its_norm(device, dtype):
    x = torch.randn(6, 40, device=device, dtype=dtype)
    residual = torch.randn(6, 40, device=device, dtype=dtype) * 30
    weight = torch.randn(40, device=device, dtype=dtype)
    normed, new_residual = add_rms_norm(x, residual, 40, weight)
    assert torch.equal(new_residual, x + residual)
    # normalised as rounded: the same as RMSNorm of the stored sum
    torch.testing.assert_close(normed, rms_norm_ref(x + residual, 40, weight), rtol=0, atol=1e-6 * 30)


def test_one_gradient_for_both_inputs_and_unused_outputs(device):
    x = torch.randn(4, 24, device=device, requires_grad=True)
    residual = torch.randn(4, 24, device=device, requires_grad=True)
    weight = torch.randn(24, device=device, requires_grad=True)
    normed, new_residual = add_rms_norm(x, residual, 24, weight)
    dx, dresidual = torch.autograd.grad((normed, new_residual), (x, residual), (torch.randn_like(normed),) * 2)
    assert dx is dresidual  # passed to both, not copied
    # only the new residual used: its gradient passes through, weight gets none
    dh = torch.randn(4, 24, device=device)
    dx, dw = torch.autograd.grad(add_rms_norm(x, residual, 24, weight)[1], (x, weight), dh, allow_unused=True)
    assert torch.equal(dx, dh) and dw is None
    # only normed used: the gradient of RMSNorm alone
    dy = torch.randn(4, 24, device=device)
    (dx,) = torch.autograd.grad(add_rms_norm(x, residual, 24, weight)[0], x, dy)
    h = (x + residual).detach().requires_grad_()
    (expected,) = torch.autograd.grad(rms_norm_ref(h, 24, weight), h, dy)
    torch.testing.assert_close(dx, expected)


def test_zero_rows_and_zero_width(device):
    x = torch.randn(0, 3, 16, device=device, requires_grad=True)
    residual = torch.randn(0, 3, 16, device=device, requires_grad=True)
    w = torch.randn(16, device=device, requires_grad=True)
    normed, new_residual = add_rms_norm(x, residual, 16, w)
    (normed.sum() + new_residual.sum()).backward()
    assert normed.shape == new_residual.shape == x.grad.shape == residual.grad.shape == (0, 3, 16)
    assert torch.equal(w.grad, torch.zeros(16, device=device))
    x = torch.randn(3, 0, device=device, requires_grad=True)
    normed, new_residual = add_rms_norm(x, torch.randn(3, 0, device=device), 0)
    normed.sum().backward()
    assert x.grad.shape == new_residual.shape == (3, 0)


def test_strided_inputs(device):
    base = torch.randn(8, 2, 48, device=device)
    x = base[:, 1, :]  # row stride 96, last dim contiguous: no copy needed
    residual = torch.randn(48, 8, device=device).t()  # last dim strided: copied
    for got, expected in zip(add_rms_norm(x, residual, 48), add_rms_norm_ref(x, residual, 48), strict=True):
        torch.testing.assert_close(got, expected)
    buffer = torch.randn(12, device=device, requires_grad=True)
    (grad,) = torch.autograd.grad(add_rms_norm(x[:, :6], x[:, 6:12], 6, buffer[::2])[0].sum(), buffer)
    assert not grad[1::2].any() and grad[::2].any()


def test_nan_in_gives_nan_out(device):
    x = torch.randn(3, 40, device=device)
    residual = torch.randn(3, 40, device=device)
    residual[1, 5] = float("nan")
    normed, new_residual = add_rms_norm(x, residual, 40, torch.randn(40, device=device))
    assert torch.isnan(normed[1]).all() and torch.isnan(new_residual[1, 5])
    assert not torch.isnan(normed[0::2]).any() and torch.isnan(new_residual).sum() == 1


def test_weight_gradient_is_deterministic(device):
    x = torch.randn(300, 200, device=device, requires_grad=True)
    residual = torch.randn(300, 200, device=device)
    w = torch.randn(200, device=device, requires_grad=True)
    dy = torch.randn(2, 300, 200, device=device)
    grads = [torch.autograd.grad(add_rms_norm(x, residual, 200, w), (x, w), tuple(dy)) for _ in range(3)]
    for other in grads[1:]:
        for g0, g1 in zip(grads[0], other, strict=True):
            assert torch.equal(g0, g1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(normalized_shape=(32,)), "add_rms_norm: x has shape"),
        (dict(weight_shape=(8,)), "weight has shape"),
        (dict(dtype=torch.int32), "x has dtype"),
        (dict(eps=-1.0), "eps"),
        (dict(residual_shape=(4, 8, 2)), "residual has shape"),
        (dict(residual_dtype=torch.float16), "residual has dtype"),
        (dict(residual_device="meta"), "residual has device meta"),
    ],
)
def test_bad_input_names_the_argument(device, kwargs, match):
    x = torch.randn(4, 16, device=device).to(kwargs.get("dtype", torch.float32))
    residual = torch.randn(kwargs.get("residual_shape", (4, 16)), device=kwargs.get("residual_device", device))
    residual = residual.to(kwargs.get("residual_dtype", x.dtype))
    weight = torch.ones(kwargs.get("weight_shape", (16,)), device=device)
    with pytest.raises(ValueError, match=match):
        add_rms_norm(x, residual, kwargs.get("normalized_shape", (16,)), weight, kwargs.get("eps"))


def test_a_residual_that_is_not_a_tensor_is_named():
    with pytest.raises(ValueError, match="add_rms_norm: residual must be a tensor, got list"):
        add_rms_norm(torch.randn(4, 16), [0.0] * 16, 16)


def test_backward_plan_counts_the_incoming_residual_gradient():
    a100 = 163 * 1024  # 8192 fp32 columns: two row tensors fit 3 stages there, three only 2
    assert rms_norm_bwd_plan(8192, 4, a100).num_stages == 3
    assert rms_norm_bwd_plan(8192, 4, a100, row_inputs=3).num_stages == 2


def test_module(device):
    ours = lstrain.nn.AddRMSNorm((3, 16), eps=1e-6, device=device)
    assert isinstance(ours, torch.nn.RMSNorm)
    assert ours.state_dict().keys() == torch.nn.RMSNorm((3, 16)).state_dict().keys() == {"weight"}
    with torch.no_grad():
        ours.weight.normal_()
    x = torch.randn(5, 3, 16, device=device)
    residual = torch.randn(5, 3, 16, device=device)
    with _backend.record_backends() as ran:
        normed, new_residual = ours(x, residual)
    assert ran == [("add_rms_norm", EXPECTED_BACKEND)]
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(normed, torch.nn.functional.rms_norm(x + residual, (3, 16), ours.weight, 1e-6))
    no_weight = lstrain.nn.AddRMSNorm(8, elementwise_affine=False)
    assert no_weight.weight is None and no_weight(torch.randn(2, 8), torch.randn(2, 8))[0].shape == (2, 8)


def test_torch_compile_fullgraph(device):
    w = torch.randn(64, device=device, requires_grad=True)

    def f(x, residual):
        normed, new_residual = add_rms_norm(x * 2, residual, 64, w)
        return (normed * new_residual).sum()

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    x = torch.randn(4, 64, device=device, requires_grad=True)
    residual = torch.randn(4, 64, device=device, requires_grad=True)
    out = compiled(x, residual)
    grads = torch.autograd.grad(out, (x, residual, w))
    ref_out = f(x, residual)
    ref_grads = torch.autograd.grad(ref_out, (x, residual, w))
    torch.testing.assert_close(out, ref_out)
    for got, expected in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, expected)


def test_custom_ops_pass_opcheck(device):
    x = torch.randn(5, 32, device=device)
    residual = torch.randn(5, 32, device=device)
    w = torch.randn(32, device=device)
    torch.library.opcheck(torch.ops.lstrain.add_rms_norm_fwd, (x, residual, [32], w, 1e-5))
    _, new_residual, rstd = torch.ops.lstrain.add_rms_norm_fwd(x, residual, [32], w, 1e-5)
    dy = torch.randn_like(x)
    torch.library.opcheck(torch.ops.lstrain.add_rms_norm_bwd, (dy, dy.clone(), new_residual, w, rstd, [32], True))
    torch.library.opcheck(torch.ops.lstrain.add_rms_norm_bwd, (dy, None, new_residual, None, rstd, [32], False))


def test_second_derivative_is_refused(device):
    x = torch.randn(3, 8, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="second derivatives"):
        torch.autograd.grad(add_rms_norm(x, x.detach(), 8)[0].sum(), x, create_graph=True)


@pytest.mark.gpu
def test_llama_sized_bf16():
    rows, cols = 16384, 4096
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    residual = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(cols, device="cuda") * 0.1 + 1).to(torch.bfloat16).requires_grad_()
    dy, dh = torch.randn(2, rows, cols, device="cuda", dtype=torch.bfloat16)
    normed, new_residual = add_rms_norm(x, residual, cols, w)
    dx, dr, dw = torch.autograd.grad((normed, new_residual), (x, residual, w), (dy, dh))
    assert torch.equal(new_residual, x + residual) and dx is dr
    hr = (x + residual).detach().float().requires_grad_()
    wr = w.detach().float().requires_grad_()
    yr = rms_norm_ref(hr, cols, wr, torch.finfo(torch.float32).eps)
    dhr, dwr = torch.autograd.grad(yr, (hr, wr), dy.float())
    torch.testing.assert_close(normed.float(), yr, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(dx.float(), dhr + dh.float(), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(dw.float(), dwr, atol=0.5, rtol=1e-2)
    assert torch.equal(dw, torch.autograd.grad(add_rms_norm(x, residual, cols, w), w, (dy, dh))[0])
