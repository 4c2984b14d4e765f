import importlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given

import lstrain
from lstrain._backend import record_backends
from lstrain.ops import cross_entropy, linear_cross_entropy, linear_cross_entropy_ref
from lstrain.ops.linear_cross_entropy import DEFAULT_CHUNK_BYTES, _chunk_logits, _fp32_sum, _padded_weight, chunk_rows
from lstrain.testing import assert_all_passed, compare_to_reference
from lstrain.testing.checks import OP_CHECKS
from lstrain.testing.strategies import linear_cross_entropy_cases
from tests.conftest import DEVICE, EXPECTED_BACKEND

CHECK = OP_CHECKS["linear_cross_entropy"]


def _case(tokens=9, hidden=8, vocab=50, dtype=torch.float32, bias=False, rows=4, reduction="sum", **options):
    return {
        "tokens": tokens,
        "hidden": hidden,
        "vocab": vocab,
        "dtype": dtype,
        "bias": bias,
        "chunk_rows": rows,
        "label_smoothing": options.get("label_smoothing", 0.0),
        "ignored": options.get("ignored", 0.0),
        "reduction": reduction,
        "z_loss": options.get("z_loss", 0.0),
        "seed": options.get("seed", 0),
    }


@given(case=linear_cross_entropy_cases(DEVICE))
@example(case=_case())
@example(case=_case(tokens=1, vocab=1, rows=1, reduction="mean"))
@example(case=_case(dtype=torch.float16, bias=True, reduction="none", label_smoothing=0.1, ignored=0.3))
@example(case=_case(tokens=64, rows=64, reduction="mean", z_loss=1e-3, ignored=1.0))
# V = 1: q = p at the target, so its gradient is the z-loss term alone; written as q (1 + z') - p
# it lost 1e-4 of its value to cancellation (a randomised hunt drew this case)
@example(case=_case(23, 24, 1, bias=True, rows=1, reduction="none", label_smoothing=0.1, z_loss=1e-3, seed=243912182))
def test_matches_torch(case):
    result = CHECK.run(case, DEVICE)
    assert set(result.backends) == {EXPECTED_BACKEND}
    assert_all_passed(result.comparisons, str(case))


def test_chunk_rows_fit_the_budget():
    assert chunk_rows(8192, 128256, 2) == 2048  # 512 MiB of bf16 logits, a multiple of 64
    assert chunk_rows(100, 128256, 2) == 100
    assert chunk_rows(8192, 128256, 2, chunk_bytes=1) == 1
    assert chunk_rows(10, 7, 4, chunk_bytes=4 * 7 * 3) == 3
    for tokens, vocab in ((1, 1), (8192, 50257), (5, 262144)):
        rows = chunk_rows(tokens, vocab, 2)
        assert 1 <= rows <= tokens and (rows == 1 or rows * vocab * 2 <= DEFAULT_CHUNK_BYTES)


def test_16_bit_logits_that_fit_four_chunks_split_where_the_sum_stays_16_bit():
    assert chunk_rows(8192, 32000, 2, dim=2048) == 2048  # LLaMA-0.75B's head: 4 x 125 MiB, not one of 500 MiB
    assert chunk_rows(4096, 32000, 2, dim=2048) == 2048  # 250 MiB: two
    assert chunk_rows(1229, 30522, 2, dim=1024) == 1229  # BERT-large's masked rows, 72 MiB: one
    assert chunk_rows(8192, 151936, 2, dim=4096) == 1728  # more than four budgets' worth: the budget decides
    # GPT-2 medium: four chunks would make the fp32 sum (206 MB) no larger than a chunk, and
    # each chunk a pass over it: the budget's two chunks
    assert chunk_rows(8192, 50257, 2, dim=1024) == 5312
    assert chunk_rows(8192, 32000, 4, dim=2048) == chunk_rows(8192, 32000, 4)  # fp32 logits: the budget
    assert chunk_rows(8192, 32000, 2) == 8192  # no width given: no split
    hidden = torch.empty(8192, 2048, dtype=torch.bfloat16, device="meta")
    head = torch.empty(32000, 2048, dtype=torch.bfloat16, device="meta")
    assert not _fp32_sum(None, hidden, head, DEFAULT_CHUNK_BYTES)  # a 250 MiB fp32 sum > a 125 MiB chunk


def test_same_as_logits_then_cross_entropy(device):
    torch.manual_seed(0)
    hidden = torch.randn(20, 16, device=device, requires_grad=True)
    weight = torch.randn(70, 16, device=device, requires_grad=True)
    target = torch.randint(0, 70, (20,), device=device)
    options = dict(label_smoothing=0.1, z_loss=1e-3)
    loss = linear_cross_entropy(hidden, weight, target, chunk_bytes=6 * 70 * 4, **options)
    grads = torch.autograd.grad(loss, (hidden, weight))
    expected = cross_entropy(hidden @ weight.t(), target, **options)
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    torch.testing.assert_close(loss, expected)
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_weight_gradient_summed_in_either_precision(device, dtype):
    torch.manual_seed(0)
    hidden = torch.randn(24, 16, device=device, dtype=dtype)
    weight = torch.randn(40, 16, device=device, dtype=dtype, requires_grad=True)
    target = torch.randint(0, 40, (24,), device=device)
    chunk = 6 * 40 * hidden.element_size()  # 4 chunks: every one after the first adds to the sum
    with record_backends() as ran:
        grads = [
            torch.autograd.grad(
                linear_cross_entropy(hidden, weight, target, reduction="sum", chunk_bytes=chunk, fp32_weight_grad=fp32),
                weight,
            )[0]
            for fp32 in (False, True)
        ]
    assert ran == [("linear_cross_entropy", EXPECTED_BACKEND)] * 2
    torch_grads = []
    for w in (weight.double(), weight):  # fp64 reference, then torch in the test's precision
        loss = F.cross_entropy(hidden.to(w.dtype) @ w.t(), target, reduction="sum")
        torch_grads.append(torch.autograd.grad(loss, weight)[0])
    comparisons = [
        compare_to_reference(f"grad weight, fp32 sum {fp32}", grad, *torch_grads)
        for grad, fp32 in zip(grads, (False, True), strict=True)
    ]
    assert_all_passed(comparisons)
    assert all(grad.dtype == dtype for grad in grads)
    if dtype == torch.float32:
        torch.testing.assert_close(grads[0], grads[1])


def test_weight_gradient_sum_chosen_by_memory_and_chunk_count():
    hidden = torch.empty(8192, 4096, dtype=torch.bfloat16, device="meta")
    head = torch.empty(128256, 4096, dtype=torch.bfloat16, device="meta")
    assert not _fp32_sum(None, hidden, head, DEFAULT_CHUNK_BYTES)  # 4 chunks; an fp32 sum would be 2 GB
    assert _fp32_sum(None, hidden, head, DEFAULT_CHUNK_BYTES // 2)  # 8 chunks
    narrow = torch.empty(8192, 64, dtype=torch.bfloat16, device="meta")
    assert _fp32_sum(None, narrow, head[:1000, :64], 8 << 20)  # 2 chunks, 256 KB of fp32
    assert not _fp32_sum(None, hidden, head[:1000], DEFAULT_CHUNK_BYTES)  # one chunk: one GEMM, one rounding
    assert _fp32_sum(True, hidden, head, DEFAULT_CHUNK_BYTES) and not _fp32_sum(False, hidden, head[:10], 1 << 30)
    assert not _fp32_sum(None, hidden.float(), head.float(), 1)


def test_backward_scales_by_grad_output_also_through_a_retained_graph(device):
    hidden = torch.randn(6, 8, device=device, requires_grad=True)
    weight = torch.randn(11, 8, device=device, requires_grad=True)
    bias = torch.randn(11, device=device, requires_grad=True)
    target = torch.randint(0, 11, (6,), device=device)
    g1 = torch.autograd.grad(linear_cross_entropy(hidden, weight, target, bias), (hidden, weight, bias))
    loss = linear_cross_entropy(hidden, weight, target, bias)
    g2 = torch.autograd.grad(2.5 * loss, (hidden, weight, bias), retain_graph=True)
    g3 = torch.autograd.grad(loss, (hidden, weight, bias))
    for one, scaled, again in zip(g1, g2, g3, strict=True):
        torch.testing.assert_close(scaled, 2.5 * one)
        torch.testing.assert_close(again, one)


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_no_tokens_give_zero_parameter_gradients(device, reduction):
    """With no tokens no chunk runs: the weight and bias gradients are zeros, not the
    uninitialised buffer the first chunk would have overwritten."""
    hidden = torch.randn(0, 8, device=device, requires_grad=True)
    weight = torch.randn(11, 8, device=device, requires_grad=True)
    bias = torch.randn(11, device=device, requires_grad=True)
    target = torch.zeros(0, dtype=torch.long, device=device)
    loss = linear_cross_entropy(hidden, weight, target, bias, reduction=reduction)
    loss.sum().backward()
    assert hidden.grad.shape == (0, 8)
    assert torch.equal(weight.grad, torch.zeros_like(weight))
    assert torch.equal(bias.grad, torch.zeros_like(bias))


def test_no_gradient_needed(device):
    hidden = torch.randn(5, 8, device=device)
    weight = torch.randn(9, 8, device=device)
    target = torch.randint(0, 9, (5,), device=device)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, target)
    torch.testing.assert_close(loss, linear_cross_entropy_ref(hidden, weight, target))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(hidden=torch.randn(2, 3, 8)), "hidden must be 2-D"),
        (dict(weight=torch.randn(10, 7)), "weight must be \\[V, D\\] with D = 8"),
        (dict(weight=torch.randn(10, 8).double()), "share a float dtype"),
        (dict(bias=torch.randn(9)), "bias must be \\[V\\]"),
        (dict(target=torch.tensor([0, 1, 2])), "target has shape"),
        (
            dict(target=torch.tensor([0, 10, 1, 2])),
            "^linear_cross_entropy: target 10 at \\(1,\\) is outside \\[0, 10\\)",
        ),
        (dict(target=torch.tensor([0.0, 1.0, 2.0, 3.0])), "^linear_cross_entropy: target must be int64 or int32"),
        (dict(label_smoothing=-0.1), "^linear_cross_entropy: label_smoothing"),
        (dict(reduction="max"), "^linear_cross_entropy: reduction"),
        (dict(chunk_bytes=0), "chunk_bytes must be a positive int, got 0"),
        (dict(chunk_bytes=-4096), "chunk_bytes must be a positive int, got -4096"),
        (dict(chunk_bytes=4096.0), "chunk_bytes must be a positive int, got 4096.0"),
        (dict(chunk_bytes=True), "chunk_bytes must be a positive int, got True"),
        (dict(weight=torch.randn(10, 8, device="meta")), "weight is on meta"),
    ],
)
def test_bad_input_names_the_argument(device, kwargs, match):
    hidden = kwargs.pop("hidden", torch.randn(4, 8))
    weight = kwargs.pop("weight", torch.randn(10, 8))
    target = kwargs.pop("target", torch.tensor([0, 1, 2, 3]))
    bias = kwargs.pop("bias", None)
    move = lambda t: t if t is None or t.device.type == "meta" else t.to(device)  # noqa: E731
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(move(hidden), move(weight), move(target), move(bias), check_targets=True, **kwargs)


def test_module(device):
    criterion = lstrain.nn.LinearCrossEntropyLoss(ignore_index=0, reduction="none", chunk_bytes=4 * 13 * 4)
    hidden = torch.randn(2, 5, 8, device=device)
    weight = torch.randn(13, 8, device=device)
    target = torch.randint(0, 13, (2, 5), device=device)
    loss = criterion(hidden, weight, target)
    assert loss.shape == (2, 5)
    torch.testing.assert_close(
        loss,
        linear_cross_entropy_ref(hidden.view(10, 8), weight, target.view(10), ignore_index=0, reduction="none").view(
            2, 5
        ),
    )
    assert "chunk_bytes=208" in repr(criterion) and "fp32_weight_grad=None" in repr(criterion)


def test_torch_compile_fullgraph(device):
    weight = torch.randn(30, 16, device=device, requires_grad=True)

    def f(hidden, target):
        return linear_cross_entropy(torch.tanh(hidden), weight, target, chunk_bytes=5 * 30 * 4)

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    hidden = torch.randn(12, 16, device=device)
    target = torch.randint(0, 30, (12,), device=device)
    out = compiled(hidden, target)
    (grad,) = torch.autograd.grad(out, weight)
    ref_out = f(hidden, target)
    (ref_grad,) = torch.autograd.grad(ref_out, weight)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(grad, ref_grad)


@pytest.mark.gpu
def test_memory_stays_near_one_chunk():
    tokens, dim, vocab = 4096, 1024, 65536
    hidden = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(vocab, dim, device="cuda", dtype=torch.bfloat16) * dim**-0.5
    target = torch.randint(0, vocab, (tokens,), device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = linear_cross_entropy(hidden, weight, target, chunk_bytes=64 * 2**20)
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    logits_bytes = tokens * vocab * 2  # 512 MiB that eager would hold (plus its fp32 copies)
    assert extra < 64 * 2**20 * 2 + 2 * tokens * dim * 2 + 2**20, extra
    assert extra < logits_bytes / 3


def test_no_gradients_under_no_grad(device, monkeypatch):
    """An evaluation under torch.no_grad computes no gradient in forward, though the weight
    (a parameter) requires grad; the loss is the same."""
    module = importlib.import_module("lstrain.ops.linear_cross_entropy")
    built = []
    chunk_gradients = module._ChunkGradients
    monkeypatch.setattr(module, "_ChunkGradients", lambda *args: built.append(args[2]) or chunk_gradients(*args))
    hidden = torch.randn(12, 16, device=device)
    weight = torch.randn(40, 16, device=device, requires_grad=True)
    target = torch.randint(0, 40, (12,), device=device)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, target)
    assert not built
    torch.testing.assert_close(loss, linear_cross_entropy(hidden, weight, target).detach())
    assert built  # with grad enabled the forward does fold the weight's gradient in


def test_module_refuses_a_target_not_shaped_like_hidden(device):
    """A [seq, batch] target with [batch, seq, D] hidden has as many tokens; flattening both
    would pair the wrong ones, where torch's loss refuses the mismatch."""
    criterion = lstrain.nn.LinearCrossEntropyLoss()
    weight = torch.randn(11, 8, device=device)
    with pytest.raises(ValueError, match=r"target has shape \(3, 2\), expected hidden's leading shape \(2, 3\)"):
        criterion(torch.randn(2, 3, 8, device=device), weight, torch.zeros(3, 2, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="hidden is 0-d"):
        criterion(torch.tensor(1.0, device=device), weight, torch.tensor(0, device=device))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_module_with_zero_width_hidden(device, reduction):
    """D = 0: every logit is 0 (log V per token, as torch's loss of zero logits), not a
    reshape(-1, 0) failure."""
    target = torch.randint(0, 11, (2, 3), device=device)
    loss = lstrain.nn.LinearCrossEntropyLoss(reduction=reduction)(
        torch.randn(2, 3, 0, device=device), torch.randn(11, 0, device=device), target
    )
    expected = F.cross_entropy(torch.zeros(2, 11, 3, device=device), target, reduction=reduction)
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize("vocab", [50, 64, 130])
def test_chunk_logits_rows_are_padded_to_an_aligned_stride(device, vocab):
    """An odd vocabulary gets logits whose row stride is a multiple of 64 elements (cuBLAS's
    unaligned kernels are several times slower); the values are the plain product's."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 16, generator=gen).to(device)
    weight = torch.randn(vocab, 16, generator=gen).to(device)
    bias = torch.randn(vocab, generator=gen).to(device)
    product, logits = _chunk_logits(hidden, _padded_weight(weight), vocab, bias)
    padded = -(-vocab // 64) * 64
    assert logits.shape == (5, vocab) and logits.stride() == (padded, 1)
    assert product.shape == (5, padded) and logits.data_ptr() == product.data_ptr()
    torch.testing.assert_close(logits, hidden @ weight.t() + bias)
    # the extra columns are exact zeros: the hidden gradient's GEMM reads them as its K
    assert torch.equal(product[:, vocab:], torch.zeros(5, padded - vocab, device=device))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_out_dtype_keeps_the_fp32_loss_that_the_default_rounds(reduction):
    # fp16 on the CPU: the interpreter's bf16 tl.dot is wrong (the rounding is the point here)
    dtype = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(24, 16, generator=generator).to(DEVICE, dtype)
    weight = torch.randn(40, 16, generator=generator).to(DEVICE, dtype)
    target = torch.randint(0, 40, (24,), generator=generator).to(DEVICE)
    kwargs = {"reduction": reduction}
    fp32 = linear_cross_entropy(hidden, weight, target, out_dtype=torch.float32, **kwargs)
    assert fp32.dtype == torch.float32
    assert torch.equal(fp32.to(dtype), linear_cross_entropy(hidden, weight, target, **kwargs))
    logits = (hidden.double() @ weight.double().T).to(dtype)  # the chunk's logits are 16-bit
    exact = F.cross_entropy(logits.double(), target, reduction=reduction)
    assert (fp32.double() - exact).abs().max() < 1e-4 * exact.abs().max()
    with pytest.raises(ValueError, match="out_dtype must be None or a floating dtype"):
        linear_cross_entropy(hidden, weight, target, out_dtype=torch.int64)
