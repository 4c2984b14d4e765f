import pytest
import torch
from hypothesis import example, given

import lstrain
from lstrain import _backend
from lstrain.ops import layer_norm, layer_norm_ref
from lstrain.ops.layer_norm import (
    MAX_TILE_COLS_BWD,
    MAX_TILE_COLS_FWD,
    layer_norm_bwd_plan,
    layer_norm_fwd_plan,
)
from lstrain.testing import assert_all_passed, check_module
from lstrain.testing.checks import OP_CHECKS
from lstrain.testing.strategies import layer_norm_cases
from tests.conftest import DEVICE, EXPECTED_BACKEND

CHECK = OP_CHECKS["layer_norm"]


def _case(shape, normalized_shape=None, dtype=torch.float32, weight=True, bias=True, eps=1e-5, mean=0.0, seed=0):
    return {
        "shape": shape,
        "normalized_shape": normalized_shape or shape[-1:],
        "dtype": dtype,
        "weight": weight,
        "bias": bias,
        "eps": eps,
        "mean": mean,
        "seed": seed,
    }


@given(case=layer_norm_cases(DEVICE))
@example(case=_case((1, 1)))
@example(case=_case((1, 7), dtype=torch.bfloat16))
@example(case=_case((3, 1025), dtype=torch.float16, weight=False))
@example(case=_case((2, 3, 2, 40), normalized_shape=(2, 40), bias=False))
@example(case=_case((2, MAX_TILE_COLS_FWD + 3), dtype=torch.bfloat16, mean=3.0))  # chunked forward and backward
@example(case=_case((3, MAX_TILE_COLS_BWD + 1), weight=False))  # single-tile forward, chunked backward
@example(case=_case((5, 64), weight=False, bias=False, mean=3.0))
@example(case=_case((3, 3, 1564, 3), weight=False, bias=False, seed=2))  # a row's spread << its mean
def test_matches_torch(case):
    result = CHECK.run(case, DEVICE)
    assert set(result.backends) == {EXPECTED_BACKEND}
    assert_all_passed(result.comparisons, str(case))


def test_a_wrong_kernel_fails_the_check():
    """The check can fail: the reference with a different eps stands in for a bug."""
    from lstrain.testing import check_function

    x = torch.randn(4, 32, device=DEVICE) * 0.01
    comparisons = check_function(
        lambda x: layer_norm_ref(x, 32, eps=1e-3), lambda x: layer_norm_ref(x, 32, eps=1e-5), {"x": x}
    )
    assert not comparisons[0].passed and not comparisons[1].passed


def test_zero_rows(device):
    x = torch.randn(0, 3, 16, device=device, requires_grad=True)
    w = torch.randn(16, device=device, requires_grad=True)
    b = torch.randn(16, device=device, requires_grad=True)
    y = layer_norm(x, 16, w, b)
    assert y.shape == (0, 3, 16)
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(w.grad, torch.zeros(16, device=device))
    assert torch.equal(b.grad, torch.zeros(16, device=device))


def test_zero_width(device):
    x = torch.randn(3, 0, device=device, requires_grad=True)
    weight = torch.randn(0, device=device, requires_grad=True)
    bias = torch.randn(0, device=device, requires_grad=True)
    y = layer_norm(x, 0, weight, bias)
    y.sum().backward()
    assert y.shape == (3, 0) and x.grad.shape == (3, 0) and weight.grad.shape == (0,) and bias.grad.shape == (0,)


def test_fp32_weight_with_bf16_input(device):
    x = torch.randn(6, 96, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(96, device=device, requires_grad=True)
    b = torch.randn(96, device=device, requires_grad=True)
    y = layer_norm(x, 96, w, b)
    assert y.dtype == torch.bfloat16
    y.backward(torch.ones_like(y))
    assert w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    xr = x.detach().double().requires_grad_()
    wr, br = (t.detach().double().requires_grad_() for t in (w, b))
    torch.nn.functional.layer_norm(xr, (96,), wr, br).backward(torch.ones_like(xr))
    torch.testing.assert_close(w.grad.double(), wr.grad, rtol=1e-2, atol=5e-2)
    torch.testing.assert_close(b.grad.double(), br.grad)


def test_strided_input(device):
    base = torch.randn(8, 2, 48, device=device)
    x = base[:, 1, :]  # row stride 96, last dim contiguous: no copy needed
    torch.testing.assert_close(layer_norm(x, 48), layer_norm_ref(x, 48))
    xt = torch.randn(48, 8, device=device).t()  # last dim strided: copied
    torch.testing.assert_close(layer_norm(xt, 48), layer_norm_ref(xt, 48))


def test_strided_weight_and_bias(device):
    """Parameters that are views with a stride (every other element of a buffer) are read
    by value, not as flat arrays, and their gradients reach the buffer's elements."""
    x = torch.randn(5, 6, device=device)
    buffers = [torch.randn(12, device=device, requires_grad=True) for _ in range(2)]
    y = layer_norm(x, 6, buffers[0][::2], buffers[1][::2])
    ref = [t.detach().double().requires_grad_() for t in buffers]
    expected = torch.nn.functional.layer_norm(x.double(), (6,), ref[0][::2], ref[1][::2])
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, buffers, dy)
    expected_grads = torch.autograd.grad(expected, ref, dy.double())
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g.double(), e, rtol=1e-5, atol=1e-5)
        assert not g[1::2].any()


def test_nan_in_gives_nan_out(device):
    x = torch.randn(3, 40, device=device)
    x[1, 5] = float("nan")
    y = layer_norm(x, 40)
    assert torch.isnan(y[1]).all()
    assert not torch.isnan(y[0]).any() and not torch.isnan(y[2]).any()


def test_parameter_gradients_are_deterministic(device):
    x = torch.randn(300, 200, device=device, requires_grad=True)
    w = torch.randn(200, device=device, requires_grad=True)
    b = torch.randn(200, device=device, requires_grad=True)
    dy = torch.randn(300, 200, device=device)
    grads = [torch.autograd.grad(layer_norm(x, 200, w, b), (x, w, b), dy) for _ in range(3)]
    for other in grads[1:]:
        for g0, g1 in zip(grads[0], other, strict=True):
            assert torch.equal(g0, g1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(normalized_shape=(32,)), "normalized_shape"),
        (dict(weight_shape=(8,)), "weight has shape"),
        (dict(bias_shape=(2, 8)), "bias has shape"),
        (dict(dtype=torch.int32), "x has dtype"),
        (dict(eps=-1.0), "eps"),
        (dict(weight_device="meta"), "weight is on meta"),
    ],
)
def test_bad_input_names_the_argument(device, kwargs, match):
    x = torch.randn(4, 16, device=device).to(kwargs.get("dtype", torch.float32))
    weight = torch.ones(kwargs.get("weight_shape", (16,)), device=kwargs.get("weight_device", device))
    bias = torch.zeros(kwargs.get("bias_shape", (16,)), device=device)
    with pytest.raises(ValueError, match=match):
        layer_norm(x, kwargs.get("normalized_shape", (16,)), weight, bias, kwargs.get("eps", 1e-5))


def test_launch_plans():
    plan = layer_norm_fwd_plan(1024)
    assert plan.single_tile and plan.block_cols == 1024 and plan.block_rows * 1024 <= 4096
    assert layer_norm_fwd_plan(7).block_cols == 8 and layer_norm_fwd_plan(7).block_rows > 1
    assert layer_norm_fwd_plan(MAX_TILE_COLS_FWD).single_tile
    long_row = layer_norm_fwd_plan(MAX_TILE_COLS_FWD + 1)
    assert not long_row.single_tile and long_row.block_rows == 1
    assert layer_norm_bwd_plan(MAX_TILE_COLS_BWD).single_tile
    assert not layer_norm_bwd_plan(MAX_TILE_COLS_BWD + 1).single_tile
    for cols in (1, 3, 64, 1000, 4096, 8192, 65536):
        for plan in (layer_norm_fwd_plan(cols), layer_norm_bwd_plan(cols)):
            assert 1 <= plan.num_warps <= 16
            assert plan.block_rows * plan.block_cols <= 16384


def test_module_is_a_drop_in(device):
    ours = lstrain.nn.LayerNorm(48, eps=1e-6, device=device)
    theirs = torch.nn.LayerNorm(48, eps=1e-6, device=device)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.bias.normal_()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(5, 3, 48, device=device)
    with _backend.record_backends() as ran:
        assert_all_passed(check_module(ours, theirs, x))
    assert ran and {b for _, b in ran} == {EXPECTED_BACKEND}
    assert lstrain.nn.LayerNorm(8, elementwise_affine=False)(torch.randn(2, 8)).shape == (2, 8)
    no_bias = lstrain.nn.LayerNorm(8, bias=False, device=device)
    assert no_bias.bias is None and no_bias(torch.randn(2, 8, device=device)).shape == (2, 8)


def test_torch_compile_fullgraph(device):
    w = torch.randn(64, device=device, requires_grad=True)

    def f(x):
        return layer_norm(x * 2, 64, w).sum()

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    x = torch.randn(4, 64, device=device, requires_grad=True)
    out = compiled(x)
    (gx,) = torch.autograd.grad(out, x)
    ref_out = f(x)
    (ref_gx,) = torch.autograd.grad(ref_out, x)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(gx, ref_gx)


def test_custom_ops_pass_opcheck(device):
    x = torch.randn(5, 32, device=device)
    w = torch.randn(32, device=device)
    b = torch.randn(32, device=device)
    torch.library.opcheck(torch.ops.lstrain.layer_norm_fwd, (x, [32], w, b, 1e-5))
    _, stats = torch.ops.lstrain.layer_norm_fwd(x, [32], w, b, 1e-5)
    torch.library.opcheck(torch.ops.lstrain.layer_norm_bwd, (torch.randn_like(x), x, w, stats, [32], True, True, None))


@pytest.mark.gpu
def test_cuda_graph_capture():
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    for _ in range(2):  # compile the kernels before capture
        expected = torch.autograd.grad(layer_norm(x, 512, w, b), (x, w, b), dy)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = torch.autograd.grad(layer_norm(x, 512, w, b), (x, w, b), dy)
    graph.replay()
    for got, want in zip(grads, expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.large_memory  # tens of GB: one at a time under pytest -n
def test_offsets_beyond_int32():
    cols = 4096
    rows = 2**31 // cols + 8  # x has more than 2**31 elements
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = layer_norm(x, cols)
    tail = slice(rows - 16, rows)
    torch.testing.assert_close(y[tail], layer_norm_ref(x[tail].detach(), cols))
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    xt = x[tail].detach().requires_grad_()
    (dxt,) = torch.autograd.grad(layer_norm_ref(xt, cols), xt, dy[tail])
    torch.testing.assert_close(dx[tail], dxt, atol=2e-2, rtol=2e-2)
