import pytest
import torch
from hypothesis import example, given

import lstrain
from lstrain.ops import attention_softmax, attention_softmax_ref
from lstrain.ops.attention_softmax import MAX_K_LEN, attention_softmax_plan
from lstrain.testing import assert_all_passed
from lstrain.testing.checks import OP_CHECKS
from lstrain.testing.strategies import attention_softmax_cases
from tests.conftest import DEVICE, EXPECTED_BACKEND

CHECK = OP_CHECKS["attention_softmax"]


def _case(shape, dtype=torch.float32, scale=1.0, causal=False, padding=None, mask_shape=None, mask_grad=False, seed=0):
    return {
        "shape": shape,
        "dtype": dtype,
        "scale": scale,
        "causal": causal,
        "padding": padding,
        "mask_shape": mask_shape,
        "mask_grad": mask_grad,
        "seed": seed,
    }


@given(case=attention_softmax_cases(DEVICE))
@example(case=_case((1, 1, 1, 1)))
@example(case=_case((2, 3, 5, 7), dtype=torch.bfloat16, scale=0.125, causal=True))
@example(case=_case((2, 1, 3, 33), dtype=torch.float16, padding=1.0))  # every key padded: zero rows
@example(case=_case((2, 2, 4, 17), padding=0.3, mask_shape=(2, 1, 4, 17), mask_grad=True))
@example(case=_case((1, 2, 3, 1000), dtype=torch.bfloat16, causal=True, mask_shape=(3, 1), mask_grad=True))
@example(case=_case((1, 1, 2, 4097), dtype=torch.bfloat16, scale=-1.5))
def test_matches_torch(case):
    result = CHECK.run(case, DEVICE)
    assert set(result.backends) == {EXPECTED_BACKEND}
    assert_all_passed(result.comparisons, str(case))


def test_causal_mask_is_top_left_aligned(device):
    scores = torch.randn(1, 1, 3, 5, device=device)
    y = attention_softmax(scores, causal=True)
    expected = torch.nn.functional.scaled_dot_product_attention(
        torch.zeros(1, 1, 3, 1, device=device), torch.zeros(1, 1, 5, 1, device=device),
        torch.eye(5, device=device)[None, None], is_causal=True,
    )  # fmt: skip
    assert torch.equal(y == 0, expected == 0)


def test_fully_masked_rows_are_zero_with_zero_gradient(device):
    scores = torch.randn(2, 2, 3, 8, device=device, requires_grad=True)
    padding = torch.zeros(2, 8, dtype=torch.bool, device=device)
    padding[1] = True
    mask = torch.zeros(1, 1, 3, 8, device=device)
    mask[..., 0, :] = float("-inf")
    y = attention_softmax(scores, key_padding_mask=padding, mask=mask)
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    assert torch.equal(y[:, :, 0], torch.zeros_like(y[:, :, 0]))
    torch.testing.assert_close(y[0, :, 1:].sum(-1), torch.ones(2, 2, device=device))
    y.backward(torch.randn_like(y))
    assert torch.isfinite(scores.grad).all()
    assert torch.equal(scores.grad[1], torch.zeros_like(scores.grad[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_ignores_what_lies_past_the_diagonal(device, dtype):
    """Loads run to the end of the 16 bytes that hold the diagonal: NaN and inf there (in
    scores or in dy) must not reach the outputs or the gradient."""
    scores = torch.randn(1, 2, 16, 16, device=device).to(dtype)
    future = torch.ones(16, 16, dtype=torch.bool, device=device).triu(1)
    poisoned = scores.masked_fill(future, float("nan")).requires_grad_()
    clean = scores.masked_fill(future, 0.0).requires_grad_()
    dy = torch.randn(1, 2, 16, 16, device=device).to(dtype)
    y = attention_softmax(poisoned, causal=True)
    y.backward(dy.masked_fill(future, float("inf")))
    y_clean = attention_softmax(clean, causal=True)
    y_clean.backward(dy)
    assert torch.equal(y, y_clean)
    assert torch.equal(poisoned.grad, clean.grad)
    assert torch.isfinite(poisoned.grad).all()


def test_no_keys(device):
    scores = torch.randn(2, 1, 3, 0, device=device, requires_grad=True)
    y = attention_softmax(scores, causal=True)
    y.sum().backward()
    assert y.shape == scores.shape and scores.grad.shape == scores.shape


def test_nan_in_gives_nan_out(device):
    scores = torch.randn(1, 1, 2, 16, device=device)
    scores[0, 0, 1, 3] = float("nan")
    y = attention_softmax(scores)
    assert torch.isnan(y[0, 0, 1]).all() and not torch.isnan(y[0, 0, 0]).any()


def test_strided_scores(device):
    base = torch.randn(2, 6, 5, 40, device=device)
    scores = base[:, ::2]  # strided heads, contiguous keys
    torch.testing.assert_close(attention_softmax(scores, scale=0.5), attention_softmax_ref(scores, scale=0.5))
    transposed = torch.randn(2, 3, 40, 5, device=device).transpose(-1, -2)
    torch.testing.assert_close(
        attention_softmax(transposed, causal=True), attention_softmax_ref(transposed, causal=True)
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(scores=torch.randn(3, 4, 5)), "scores must be 4-D"),
        (dict(scores=torch.randint(0, 3, (1, 1, 2, 2))), "scores has dtype"),
        (dict(key_padding_mask=torch.zeros(2, 7, dtype=torch.bool)), "key_padding_mask has shape"),
        (dict(key_padding_mask=torch.zeros(2, 8)), "key_padding_mask must be bool"),
        (dict(mask=torch.zeros(3, 1, 1, 8)), "does not broadcast"),
        (dict(mask=torch.zeros(1, 8, dtype=torch.bool)), "additive float mask"),
        (dict(mask=torch.zeros(1, 8, device="meta")), "mask is on meta"),
        (dict(scale=float("inf")), "scale must be a finite"),
        (dict(scores=torch.randn(1, 1, 1, MAX_K_LEN + 1)), "k_len"),
    ],
)
def test_bad_input_names_the_argument(device, kwargs, match):
    scores = kwargs.pop("scores", torch.randn(2, 3, 4, 8))
    kwargs = {
        k: v.to(device) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v for k, v in kwargs.items()
    }
    with pytest.raises(ValueError, match=match):
        attention_softmax(scores.to(device), **kwargs)


def test_launch_plan_by_row_length():
    short = attention_softmax_plan(20)
    assert short.block_cols == 32 and short.block_rows >= 32  # many short rows per program
    long = attention_softmax_plan(1024)
    assert long.block_cols == 1024 and long.block_rows == 1
    widest = attention_softmax_plan(MAX_K_LEN)
    assert widest.block_rows == 1 and widest.num_warps == 16
    assert attention_softmax_plan(1024, backward=True).num_warps < long.num_warps
    for k_len in (1, 2, 31, 32, 33, 100, 4096, 16384):
        for backward in (False, True):
            plan = attention_softmax_plan(k_len, backward)
            assert plan.block_cols >= k_len and 1 <= plan.num_warps <= 16


def test_module(device):
    module = lstrain.nn.AttentionSoftmax(scale=0.25, causal=True)
    scores = torch.randn(1, 2, 4, 4, device=device)
    torch.testing.assert_close(module(scores), attention_softmax_ref(scores, scale=0.25, causal=True))
    assert "causal=True" in repr(module)
    with pytest.raises(ValueError, match="AttentionSoftmax: causal must be a bool, got int 1"):
        lstrain.nn.AttentionSoftmax(causal=1)


def test_torch_compile_fullgraph(device):
    def f(q, k, padding):
        scores = q @ k.transpose(-1, -2)
        return attention_softmax(scores, scale=0.5, key_padding_mask=padding, causal=True).sum()

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    q = torch.randn(2, 2, 6, 8, device=device, requires_grad=True)
    k = torch.randn(2, 2, 6, 8, device=device, requires_grad=True)
    padding = torch.rand(2, 6, device=device) < 0.3
    out = compiled(q, k, padding)
    grads = torch.autograd.grad(out, (q, k))
    ref_out = f(q, k, padding)
    ref_grads = torch.autograd.grad(ref_out, (q, k))
    torch.testing.assert_close(out, ref_out)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r)


def test_custom_ops_pass_opcheck(device):
    scores = torch.randn(2, 2, 3, 10, device=device)
    padding = torch.rand(2, 10, device=device) < 0.3
    mask = torch.randn(1, 2, 1, 10, device=device)
    torch.library.opcheck(torch.ops.lstrain.attention_softmax_fwd, (scores, padding, mask, 0.5, True))
    y = torch.ops.lstrain.attention_softmax_fwd(scores, padding, mask, 0.5, True)
    torch.library.opcheck(torch.ops.lstrain.attention_softmax_bwd, (torch.randn_like(y), y, 0.5, True, None))


@pytest.mark.gpu
def test_cuda_graph_capture():
    scores = torch.randn(2, 4, 128, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(scores)
    for _ in range(2):
        (expected,) = torch.autograd.grad(attention_softmax(scores, scale=0.1, causal=True), scores, dy)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (grad,) = torch.autograd.grad(attention_softmax(scores, scale=0.1, causal=True), scores, dy)
    graph.replay()
    assert torch.equal(grad, expected)


@pytest.mark.gpu
@pytest.mark.large_memory  # tens of GB: one at a time under pytest -n
def test_offsets_beyond_int32():
    shape = (2, 16, 2**31 // (32 * 1024) + 4, 1024)  # more than 2**31 elements
    scores = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = attention_softmax(scores, scale=0.125, causal=True)
    tail = (slice(1, 2), slice(15, 16), slice(shape[2] - 8, shape[2]))  # the last rows
    q_index = torch.arange(shape[2] - 8, shape[2], device="cuda")[:, None]
    future = torch.arange(1024, device="cuda") > q_index
    z = (scores[tail].detach().float() * 0.125).masked_fill(future, float("-inf"))
    torch.testing.assert_close(y[tail].float(), torch.softmax(z, -1), atol=4e-3, rtol=1e-2)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, scores, dy)
    yt = y[tail].float()
    dt = dy[tail].float()
    dx_expected = 0.125 * yt * (dt - (yt * dt).sum(-1, keepdim=True))
    torch.testing.assert_close(dx[tail].float(), dx_expected, atol=2e-2, rtol=2e-2)
