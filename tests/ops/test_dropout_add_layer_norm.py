import pytest
import torch
from hypothesis import example, given, settings

from lstrain.ops import bias_dropout_residual, dropout_add_layer_norm, dropout_add_layer_norm_ref, layer_norm_ref
from lstrain.ops.layer_norm import MAX_TILE_COLS_BWD, layer_norm_bwd_plan
from lstrain.testing import assert_all_passed
from lstrain.testing.checks import OP_CHECKS
from lstrain.testing.strategies import dropout_add_layer_norm_cases
from tests.conftest import DEVICE, EXPECTED_BACKEND

CHECK = OP_CHECKS["dropout_add_layer_norm"]
FEW = settings(max_examples=10) if DEVICE == "cpu" else settings()


def _case(shape=(3, 40), dtype=torch.float32, bias=True, dropout=0.1, training=True, seed=0, **norm):
    return {
        "shape": shape,
        "dtype": dtype,
        "bias": bias,
        "dropout": dropout,
        "training": training,
        "seed": seed,
        "weight": norm.get("weight", True),
        "norm_bias": norm.get("norm_bias", True),
        "eps": norm.get("eps", 1e-5),
        "prenorm": norm.get("prenorm", True),
    }


@FEW
@given(case=dropout_add_layer_norm_cases(DEVICE))
@example(case=_case(shape=(1, 1)))
@example(case=_case(shape=(2, 3, 1025), dtype=torch.bfloat16, dropout=0.5))
@example(case=_case(dtype=torch.float16, bias=False, training=False, weight=False, norm_bias=False))
@example(case=_case(shape=(70, 33), dropout=0.9, prenorm=False))
@example(case=_case(shape=(11, 1024), dtype=torch.bfloat16, prenorm=False))  # post-LN: normed alone
@example(case=_case(shape=(5, 768), dtype=torch.float16, dropout=0.0, eps=1e-3))
@example(case=_case(shape=(2, MAX_TILE_COLS_BWD + 1), dropout=0.5))  # wide rows: the two ops in a row
def test_matches_torch_under_the_same_mask(case):
    result = CHECK.run(case, DEVICE)
    assert set(result.backends) == {EXPECTED_BACKEND}
    assert_all_passed(result.comparisons, str(case))


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_new_residual_is_bias_dropout_residual_and_normed_its_layer_norm(device, p):
    x, residual = torch.randn(6, 40, device=device), torch.randn(6, 40, device=device) * 30
    x_bias, weight, bias = (torch.randn(40, device=device) for _ in range(3))
    seed = torch.tensor([11], dtype=torch.int64, device=device)
    normed, new_residual = dropout_add_layer_norm(x, x_bias, residual, weight, bias, dropout=p, seed=seed)
    # the same mask as bias_dropout_residual draws from the same seed
    assert torch.equal(new_residual, bias_dropout_residual(x, x_bias, residual, dropout=p, seed=seed))
    torch.testing.assert_close(normed, layer_norm_ref(new_residual, 40, weight, bias), rtol=0, atol=1e-5)


def test_gradients_of_the_outputs_used(device):
    x = torch.randn(4, 24, device=device, requires_grad=True)
    residual = torch.randn(4, 24, device=device, requires_grad=True)
    weight = torch.randn(24, device=device, requires_grad=True)
    # without dropout one tensor is the gradient of both x and residual
    dx, dresidual = torch.autograd.grad(
        dropout_add_layer_norm(x, None, residual, weight), (x, residual), (torch.randn(4, 24, device=device),) * 2
    )
    assert dx is dresidual
    # only the new residual used: it passes straight through, the norm's weight gets none
    dh = torch.randn(4, 24, device=device)
    dx, dw = torch.autograd.grad(
        dropout_add_layer_norm(x, None, residual, weight)[1], (x, weight), dh, allow_unused=True
    )
    assert torch.equal(dx, dh) and dw is None
    # only normed used (post-LN): LayerNorm's gradient, dropped with the forward's mask for x
    seed = torch.tensor([3], dtype=torch.int64, device=device)
    dy = torch.randn(4, 24, device=device)
    normed, _ = dropout_add_layer_norm(x, None, residual, weight, dropout=0.5, seed=seed)
    dx, dresidual = torch.autograd.grad(normed, (x, residual), dy)
    h = bias_dropout_residual(x, None, residual, dropout=0.5, seed=seed).detach().requires_grad_()
    (expected,) = torch.autograd.grad(layer_norm_ref(h, 24, weight), h, dy)
    torch.testing.assert_close(dresidual, expected)
    torch.testing.assert_close(dx, torch.where(dx == 0, 0.0, expected * 2))
    assert ((dx == 0).float().mean() - 0.5).abs() < 0.3


def test_zero_rows_and_zero_width(device):
    x = torch.randn(0, 3, 16, device=device, requires_grad=True)
    residual = torch.randn(0, 3, 16, device=device, requires_grad=True)
    w = torch.randn(16, device=device, requires_grad=True)
    normed, new_residual = dropout_add_layer_norm(x, None, residual, w, dropout=0.1)
    (normed.sum() + new_residual.sum()).backward()
    assert normed.shape == new_residual.shape == x.grad.shape == residual.grad.shape == (0, 3, 16)
    assert torch.equal(w.grad, torch.zeros(16, device=device))
    x = torch.randn(3, 0, device=device, requires_grad=True)
    normed, new_residual = dropout_add_layer_norm(x, None, torch.randn(3, 0, device=device))
    normed.sum().backward()
    assert x.grad.shape == new_residual.shape == (3, 0)


def test_strided_inputs(device):
    base = torch.randn(8, 2, 48, device=device)
    x = base[:, 1, :]  # row stride 96, last dim contiguous: no copy needed
    residual = torch.randn(48, 8, device=device).t()  # last dim strided: copied
    x_bias = torch.randn(96, device=device)[::2]
    got = dropout_add_layer_norm(x, x_bias, residual)
    expected = dropout_add_layer_norm_ref(x, x_bias, residual)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)


def test_nan_in_gives_nan_out_even_where_dropped(device):
    x = torch.randn(3, 40, device=device)
    x[1, 5] = float("nan")
    seed = torch.tensor([0], dtype=torch.int64, device=device)
    for p in (0.0, 0.99):
        normed, new_residual = dropout_add_layer_norm(x, None, torch.randn(3, 40, device=device), dropout=p, seed=seed)
        assert torch.isnan(normed[1]).all() and torch.isnan(new_residual[1, 5])
        assert not torch.isnan(normed[0::2]).any() and torch.isnan(new_residual).sum() == 1


def test_gradients_are_deterministic(device):
    x = torch.randn(300, 200, device=device, requires_grad=True)
    residual = torch.randn(300, 200, device=device)
    params = [torch.randn(200, device=device, requires_grad=True) for _ in range(3)]
    seed = torch.tensor([5], dtype=torch.int64, device=device)
    dy = torch.randn(2, 300, 200, device=device)
    grads = [
        torch.autograd.grad(
            dropout_add_layer_norm(x, params[0], residual, params[1], params[2], dropout=0.2, seed=seed),
            (x, *params),
            tuple(dy),
        )
        for _ in range(3)
    ]
    for other in grads[1:]:
        for g0, g1 in zip(grads[0], other, strict=True):
            assert torch.equal(g0, g1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dtype=torch.int32), "x has dtype"),
        (dict(residual_shape=(4, 8)), "residual has shape"),
        (dict(residual_dtype=torch.float16), "residual has dtype"),
        (dict(x_bias_shape=(8,)), "x_bias has shape"),
        (dict(weight_shape=(8,)), "weight has shape"),
        (dict(bias_shape=(4, 16)), "bias has shape"),
        (dict(eps=-1.0), "eps"),
        (dict(dropout=1.0), "dropout"),
        (dict(seed=3), "seed must be a 1-element int64 tensor"),
    ],
)
def test_bad_input_names_the_argument(device, kwargs, match):
    x = torch.randn(4, 16, device=device).to(kwargs.get("dtype", torch.float32))
    residual = torch.randn(kwargs.get("residual_shape", (4, 16)), device=device)
    residual = residual.to(kwargs.get("residual_dtype", x.dtype))
    x_bias = torch.randn(kwargs.get("x_bias_shape", (16,)), device=device)
    weight = torch.ones(kwargs.get("weight_shape", (16,)), device=device)
    bias = torch.zeros(kwargs.get("bias_shape", (16,)), device=device)
    options = {k: kwargs[k] for k in ("eps", "dropout", "seed") if k in kwargs}
    with pytest.raises(ValueError, match=match):
        dropout_add_layer_norm(x, x_bias, residual, weight, bias, **options)


def test_a_residual_that_is_not_a_tensor_is_named():
    with pytest.raises(ValueError, match="dropout_add_layer_norm: residual must be a tensor, got list"):
        dropout_add_layer_norm(torch.randn(4, 16), None, [0.0] * 16)


def test_backward_plan_counts_the_incoming_residual_gradient():
    # the op takes LayerNorm's backward plan for three row tensors, at least 8 columns wide
    plan = layer_norm_bwd_plan(1024, 2, row_inputs=3)
    assert (plan.block_rows, plan.block_cols, plan.num_warps, plan.num_stages) == (4, 1024, 4, 3)
    small = 80 * 1024  # three fp32 rows of 8192 columns (96 KiB) fit no second stage there, two do
    assert layer_norm_bwd_plan(8192, 4, small, row_inputs=3).num_stages == 1
    assert layer_norm_bwd_plan(8192, 4, small).num_stages == 2


def test_torch_compile_fullgraph(device):
    weight = torch.randn(32, device=device, requires_grad=True)
    x_bias = torch.randn(32, device=device, requires_grad=True)
    seed = torch.tensor([1], dtype=torch.int64, device=device)

    def f(x, residual):
        normed, new_residual = dropout_add_layer_norm(x, x_bias, residual, weight, dropout=0.1, seed=seed)
        return (normed * new_residual).sum()

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    x, residual = torch.randn(4, 32, device=device), torch.randn(4, 32, device=device)
    out = compiled(x, residual)
    grads = torch.autograd.grad(out, (weight, x_bias))
    ref_out = f(x, residual)
    ref_grads = torch.autograd.grad(ref_out, (weight, x_bias))
    torch.testing.assert_close(out, ref_out)
    for got, expected in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, expected)


def test_custom_ops_pass_opcheck(device):
    x, residual = torch.randn(5, 24, device=device), torch.randn(5, 24, device=device)
    w, b = torch.randn(24, device=device), torch.randn(24, device=device)
    seed = torch.tensor([2], dtype=torch.int64, device=device)
    fwd = torch.ops.lstrain.dropout_add_layer_norm_fwd
    torch.library.opcheck(fwd, (x, b, residual, w, b, seed, 1e-5, 0.1, True))
    normed, new_residual, stats = fwd(x, b, residual, w, b, seed, 1e-5, 0.1, True)
    bwd = torch.ops.lstrain.dropout_add_layer_norm_bwd
    args = (x, residual, new_residual, w, stats, seed, 0.1, True, True, True, True, torch.float32, torch.float32)
    torch.library.opcheck(bwd, args)
    torch.library.opcheck(
        bwd, (x, None, new_residual, None, stats, None, 0.0, False, False, True, False, x.dtype, None)
    )
    empty = torch.randn(3, 0, device=device)  # zero-width rows: the fake's stats count the rows too
    torch.library.opcheck(fwd, (empty, None, empty, None, None, None, 1e-5, 0.0, False))
