import importlib

import pytest
import torch
from hypothesis import example, given

import lstrain
from lstrain._backend import record_backends, shared_memory_per_program
from lstrain.ops import cross_entropy, cross_entropy_ref
from lstrain.ops.cross_entropy import (
    CrossEntropyPlan,
    cross_entropy_fwd,
    cross_entropy_plan,
    launch_layout,
    rows_aligned,
    scale_gradient_,
)
from lstrain.testing import assert_all_passed
from lstrain.testing.checks import OP_CHECKS
from lstrain.testing.strategies import cross_entropy_cases
from tests.conftest import DEVICE, EXPECTED_BACKEND

CHECK = OP_CHECKS["cross_entropy"]


def _case(
    shape, dtype=torch.float32, label_smoothing=0.0, ignored=0.0, reduction="mean", z_loss=0.0, scale=1.0, seed=0
):
    return {
        "shape": shape,
        "dtype": dtype,
        "label_smoothing": label_smoothing,
        "ignored": ignored,
        "reduction": reduction,
        "z_loss": z_loss,
        "scale": scale,
        "seed": seed,
    }


@given(case=cross_entropy_cases(DEVICE))
@example(case=_case((1, 1)))
@example(case=_case((3, 7), dtype=torch.bfloat16, label_smoothing=0.1, ignored=0.3))
@example(case=_case((2, 3, 50), dtype=torch.float16, reduction="none", z_loss=1e-4))
@example(case=_case((4, 8193), reduction="sum", label_smoothing=1.0, scale=20.0))  # two chunks per row
@example(case=_case((5, 33), ignored=1.0, reduction="sum"))  # every row ignored
def test_matches_torch(case):
    result = CHECK.run(case, DEVICE)
    assert set(result.backends) == {EXPECTED_BACKEND}
    assert_all_passed(result.comparisons, str(case))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradient_is_q_minus_p(device, reduction):
    torch.manual_seed(0)
    logits = torch.randn(6, 40, device=device, requires_grad=True)
    target = torch.randint(0, 40, (6,), device=device)
    target[2] = -100
    a = 0.2
    cross_entropy(logits, target, label_smoothing=a, reduction=reduction).backward()
    q = torch.softmax(logits.detach().double(), -1)
    p = (1 - a) * torch.nn.functional.one_hot(target.clamp(min=0), 40).double() + a / 40
    expected = (q - p) * (target != -100)[:, None]
    if reduction == "mean":
        expected /= 5
    torch.testing.assert_close(logits.grad.double(), expected, atol=1e-6, rtol=1e-5)


def test_mean_with_every_row_ignored_is_nan_like_torch(device):
    logits = torch.randn(3, 5, device=device, requires_grad=True)
    target = torch.full((3,), -100, device=device)
    loss = cross_entropy(logits, target)
    assert torch.isnan(loss) and torch.isnan(torch.nn.functional.cross_entropy(logits, target))
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_backward_scales_by_grad_output(device):
    logits = torch.randn(4, 30, device=device, requires_grad=True)
    target = torch.randint(0, 30, (4,), device=device)
    (g1,) = torch.autograd.grad(cross_entropy(logits, target), logits)
    (g3,) = torch.autograd.grad(3 * cross_entropy(logits, target), logits)
    torch.testing.assert_close(g3, 3 * g1)


def test_scale_gradient_skips_work_for_one(device):
    grad = torch.randn(1000, device=device)
    before = grad.clone()
    scale_gradient_(grad, torch.tensor(1.0, device=device))
    assert torch.equal(grad, before)
    scale_gradient_(grad, torch.tensor(-0.5, device=device))
    torch.testing.assert_close(grad, before * -0.5)


@pytest.mark.parametrize("vocab", [64, 2 * 4096 + 5])  # a tail alone; whole chunks swept backwards, then a tail
def test_inplace_backward_writes_into_the_logits(device, vocab):
    base = torch.randn(5, vocab, device=device)
    target = torch.randint(0, vocab, (5,), device=device)
    reference = torch.nn.functional.cross_entropy(base, target)
    leaf = base.clone().requires_grad_()
    (expected,) = torch.autograd.grad(cross_entropy(leaf, target), leaf)
    logits = base.clone().requires_grad_()
    hidden = logits * 1.0  # a non-leaf, as an lm head's output is
    loss = cross_entropy(hidden, target, inplace_backward=True)
    torch.testing.assert_close(loss, reference)
    (grad,) = torch.autograd.grad(loss, logits)
    torch.testing.assert_close(grad, expected)
    torch.testing.assert_close(hidden.detach(), expected)  # the logits' storage now holds the gradient


def test_a_retained_graph_with_the_gradient_in_the_logits_storage(device):
    base = torch.randn(2, 8, device=device)
    target = torch.tensor([1, 2], device=device)
    leaf = base.clone().requires_grad_()
    (expected,) = torch.autograd.grad(cross_entropy(leaf, target), leaf)
    logits = base.clone().requires_grad_()
    loss = cross_entropy(logits * 1.0, target, inplace_backward=True)
    loss.backward(retain_graph=True)
    (3.0 * loss).backward()
    torch.testing.assert_close(logits.grad, 4.0 * expected)


def test_inplace_backward_bumps_the_version_of_the_logits(device):
    """An earlier consumer that saved the logits must not backpropagate through the
    gradient written over them: autograd raises, as for any in-place op."""
    leaf = torch.randn(4, 16, device=device, requires_grad=True)
    target = torch.randint(0, 16, (4,), device=device)
    hidden = leaf * 1.0
    penalty = hidden.square().sum()  # saves hidden for its backward
    before = hidden._version
    loss = cross_entropy(hidden, target, inplace_backward=True)
    assert hidden._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + penalty).backward()


def test_inplace_backward_refuses_a_leaf_that_requires_grad(device):
    leaf = torch.randn(4, 16, device=device, requires_grad=True)
    before = leaf.detach().clone()
    target = torch.randint(0, 16, (4,), device=device)
    with pytest.raises(RuntimeError, match="inplace_backward=True.*leaf"):
        cross_entropy(leaf, target, inplace_backward=True)
    assert torch.equal(leaf.detach(), before)
    with pytest.raises(RuntimeError, match="inplace_backward=True.*leaf"):
        lstrain.nn.CrossEntropyLoss(inplace_backward=True)(leaf, target)


def test_bad_targets_give_nan_rows_when_unchecked(device):
    logits = torch.randn(3, 10, device=device, requires_grad=True)
    target = torch.tensor([1, 10, -100], device=device)
    loss = cross_entropy(logits, target, reduction="none", check_targets=False)
    assert not torch.isnan(loss[0]) and torch.isnan(loss[1]) and loss[2] == 0
    loss.sum().backward()
    assert torch.isnan(logits.grad[1]).all() and not torch.isnan(logits.grad[0]).any()


def test_strided_logits_and_targets(device):
    logits = torch.randn(6, 40, device=device)[::2]  # row stride 80
    target = torch.randint(0, 40, (6,), device=device)[::2]  # stride 2
    for reduction in ("mean", "none"):
        xs = logits.detach().requires_grad_()  # keeps the row stride
        x = logits.clone().requires_grad_()
        loss = cross_entropy(xs, target, reduction=reduction)
        expected = torch.nn.functional.cross_entropy(x, target, reduction=reduction)
        torch.testing.assert_close(loss, expected)
        grad_out = torch.ones_like(loss)
        (g,) = torch.autograd.grad(loss, xs, grad_out)
        (ge,) = torch.autograd.grad(expected, x, grad_out)
        torch.testing.assert_close(g, ge)


def test_minus_inf_logits_are_masked_classes(device):
    """-inf logits (masked vocabulary entries) take no probability and no gradient, also
    where a whole chunk or a lane's first logits are -inf."""
    vocab = 5000  # one whole 4096-wide chunk and a partial one
    logits = torch.randn(3, vocab, device=device)
    logits[0, :4096] = -float("inf")  # every lane empty through the first chunk
    logits[1, ::3] = -float("inf")
    logits[2, 4096:] = -float("inf")  # the partial chunk is all -inf
    target = torch.tensor([4500, 1, 7], device=device)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, target, reduction="none")
    expected_x = logits.clone().requires_grad_()
    expected = torch.nn.functional.cross_entropy(expected_x, target, reduction="none")
    torch.testing.assert_close(loss, expected)
    (g,) = torch.autograd.grad(loss.sum(), x)
    (ge,) = torch.autograd.grad(expected.sum(), expected_x)
    torch.testing.assert_close(g, ge)
    assert (g[logits == -float("inf")] == 0).all()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("inplace", [False, True])
def test_ignored_rows_are_not_read(device, reduction, inplace):
    """An ignored row costs only its gradient's zeros: NaN logits there reach neither the
    loss nor the gradient (torch's gradient would be NaN), on either side of a chunk."""
    torch.manual_seed(0)
    logits = torch.randn(4, 5000, device=device)
    logits[1] = float("nan")
    logits[3, 4090:4100] = float("nan")
    target = torch.tensor([7, -100, 4999, -100], device=device)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x if not inplace else x * 1, target, reduction=reduction, inplace_backward=inplace)
    clean = logits.clone()
    clean[[1, 3]] = 0.0
    expected_x = clean.clone().requires_grad_()
    expected = torch.nn.functional.cross_entropy(expected_x, target, reduction=reduction)
    torch.testing.assert_close(loss, expected)
    (g,) = torch.autograd.grad(loss.sum(), x)
    (ge,) = torch.autograd.grad(expected.sum(), expected_x)
    torch.testing.assert_close(g, ge)
    assert (g[[1, 3]] == 0).all()


def test_nan_in_gives_nan_out(device):
    logits = torch.randn(2, 16, device=device)
    logits[1, 3] = float("nan")
    loss = cross_entropy(logits, torch.tensor([0, 1], device=device), reduction="none")
    assert not torch.isnan(loss[0]) and torch.isnan(loss[1])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(logits=torch.randn(2, 3, 4, 5)), "logits must be 2-D"),
        (dict(logits=torch.randint(0, 3, (2, 5))), "logits has dtype"),
        (dict(target=torch.tensor([0, 1, 2])), "target has shape"),
        (dict(target=torch.tensor([0.0, 1.0])), "target must be int64"),
        (dict(target=torch.tensor([0, 1], dtype=torch.uint8)), "got torch.uint8; convert with target.long\\(\\)"),
        (dict(target=torch.tensor([0, 5])), "target 5 at \\(1,\\) is outside \\[0, 5\\)"),
        (dict(target=torch.tensor([-3, 0])), "target -3"),
        (dict(label_smoothing=1.5), "label_smoothing must be in \\[0, 1\\], got 1.5"),
        (dict(reduction="avg"), "reduction must be one of"),
        (dict(z_loss=-1.0), "z_loss"),
        (dict(target=torch.tensor([0, 1], device="meta")), "target is on meta"),
    ],
)
def test_bad_input_names_the_argument(device, kwargs, match):
    logits = kwargs.pop("logits", torch.randn(2, 5)).to(device)
    target = kwargs.pop("target", torch.tensor([0, 1]))
    target = target if target.device.type == "meta" else target.to(device)
    with pytest.raises(ValueError, match=match):
        cross_entropy(logits, target, check_targets=True, **kwargs)


def test_launch_plan():
    assert cross_entropy_plan(50257) == CrossEntropyPlan(8192, 8)
    assert cross_entropy_plan(128256) == CrossEntropyPlan(32768, 32)
    assert cross_entropy_plan(50257, element_size=4) == CrossEntropyPlan(16384, 32)
    assert cross_entropy_plan(20000, element_size=4) == CrossEntropyPlan(4096, 8)
    for work in ("loss_and_gradient", "loss", "gradient"):  # unaligned rows: no 16-byte accesses
        assert cross_entropy_plan(50257, work=work, aligned=False) == CrossEntropyPlan(2048, 8)
    assert cross_entropy_plan(8192) == CrossEntropyPlan(4096, 4)
    assert cross_entropy_plan(50257, work="loss") == CrossEntropyPlan(4096, 4)
    assert cross_entropy_plan(50257, work="gradient") == CrossEntropyPlan(2048, 8)
    assert cross_entropy_plan(100).block == 128
    for vocab in (1, 2, 1000, 32000, 262144):
        for work in ("loss_and_gradient", "loss", "gradient"):
            plan = cross_entropy_plan(vocab, work=work)
            assert 1 <= plan.num_warps <= 32 and plan.block <= max(128, 2 * vocab)
    with pytest.raises(ValueError, match="work"):
        cross_entropy_plan(1000, work="both")


def test_resident_plans():
    """Rows held in shared memory where the Gluon kernel runs, the row fits and the work is
    the forward with its gradient; the two-sweep kernel everywhere else."""
    h200, a100 = 232448, 166912
    assert cross_entropy_plan(50257, shared_memory=h200) == CrossEntropyPlan(4096, 8, resident=13)
    assert cross_entropy_plan(32000, shared_memory=h200) == CrossEntropyPlan(4096, 8, resident=8)
    assert cross_entropy_plan(65536, shared_memory=h200) == CrossEntropyPlan(8192, 16, resident=8)
    assert cross_entropy_plan(128256, shared_memory=h200) == CrossEntropyPlan(8192, 16, resident=14, held=16384)
    assert cross_entropy_plan(50257, 4, shared_memory=h200) == CrossEntropyPlan(4096, 16, resident=13)
    assert cross_entropy_plan(50257, shared_memory=a100) == CrossEntropyPlan(8192, 16, resident=7)
    assert cross_entropy_plan(32000, shared_memory=a100) == CrossEntropyPlan(4096, 8, resident=8)
    assert cross_entropy_plan(8192, shared_memory=h200) == CrossEntropyPlan(4096, 8, resident=2)
    for vocab, element_size, shared_memory in ((151936, 2, h200), (128256, 2, a100), (4096, 2, h200), (2048, 4, h200)):
        assert cross_entropy_plan(vocab, element_size, shared_memory=shared_memory).resident == 0
    for work in ("loss", "gradient"):
        assert cross_entropy_plan(50257, work=work, shared_memory=h200).resident == 0
    assert cross_entropy_plan(50257, aligned=False, shared_memory=h200).resident == 0
    assert cross_entropy_plan(50257, shared_memory=0).resident == 0
    for vocab in range(4097, 140000, 997):  # the row always fits what the plan holds
        plan = cross_entropy_plan(vocab, shared_memory=h200)
        if plan.resident:
            assert plan.resident * plan.block + plan.held >= vocab
            assert plan.resident * plan.block * 2 <= h200 - 2048


@pytest.mark.gpu
@pytest.mark.parametrize(
    "vocab, dtype",
    [(20011, torch.bfloat16), (50257, torch.float16), (70001, torch.bfloat16), (128256, torch.bfloat16),
     (50257, torch.float32)],
)  # fmt: skip
def test_rows_held_in_shared_memory_match_the_two_sweep_kernel(vocab, dtype):
    """The Gluon kernel (two rows per SM, one, and one with logits held in registers) against
    the two-sweep kernel on the same rows: fp32 statistics that differ only in the order of
    their sums, gradients within an ulp (fp32: 1e-5); in place the same bits as into a new
    buffer."""
    plan = cross_entropy_plan(vocab, dtype.itemsize, shared_memory=shared_memory_per_program(0))
    assert plan.resident and (plan.held > 0) == (vocab == 128256)
    gen = torch.Generator(device="cuda").manual_seed(vocab)
    logits = 4 * torch.randn(7, vocab, device="cuda", generator=gen).to(dtype)
    logits[1, 5] = float("-inf")
    target = torch.tensor([0, vocab - 1, -100, 17, vocab // 2, 3, vocab - 2], device="cuda")
    two_sweep = cross_entropy_plan(vocab, dtype.itemsize)
    for smoothing, z_loss, scale in ((0.1, 0.0, "mean"), (0.0, 1e-3, "sum"), (1.0, 0.0, "mean")):
        count = (target != -100).sum().to(torch.int32)
        grad = torch.empty_like(logits)
        loss, stats = cross_entropy_fwd(logits, target, smoothing, -100, z_loss, scale, grad, count)  # resident
        grad_ref = torch.empty_like(logits)
        options = (smoothing, -100, z_loss, scale)
        loss_ref, stats_ref = cross_entropy_fwd(logits, target, *options, grad_ref, count, two_sweep)
        torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(stats, stats_ref, rtol=1e-5, atol=0)
        # fp32 keeps the sums' rounding (a few 1e-7, relative; 1e-8 absolute where the target
        # column's q - 1 + a (1 - 1 / V) cancels), 16-bit types round it away but for an ulp
        rtol = max(torch.finfo(dtype).eps, 1e-5)
        torch.testing.assert_close(grad.float(), grad_ref.float(), rtol=rtol, atol=1e-7)
        assert (grad[2] == 0).all()
        in_place = logits.clone()
        cross_entropy_fwd(in_place, target, *options, in_place, count)
        assert torch.equal(in_place, grad)


def test_alignment_hint_only_where_it_holds():
    plan = CrossEntropyPlan(2048, 8)
    storage = torch.zeros(8 * 5000, dtype=torch.bfloat16)
    logits = storage[: 4 * 4999].view(4, 4999)
    assert rows_aligned(logits, None)
    assert launch_layout(logits, plan, True) == {"ALIGNED": True, "LANES": 256, "RUN": 8}
    assert launch_layout(logits.float(), plan, True)["RUN"] == 4
    assert not rows_aligned(storage[3 : 3 + 4 * 4999].view(4, 4999), None)
    # a gradient whose rows are shifted against the logits' by other than whole runs
    assert rows_aligned(logits, torch.empty_like(logits))
    assert not rows_aligned(storage.view(8, 5000)[:4, :4999], torch.empty(4, 4999, dtype=torch.bfloat16))


@pytest.mark.parametrize("vocab", [4999, 20011, 70001])  # each launch plan's chunk width
@pytest.mark.parametrize("offset", [0, 3])  # rows start 16-byte aligned or not at all
def test_odd_rows_longer_than_a_chunk(device, vocab, offset):
    """Odd V (each row starts at a different alignment, so the loose head and tail vary)
    over whole chunks, a partial chunk and loose ends; with ``offset`` the logits do not
    start on a 16-byte boundary at all."""
    gen = torch.Generator(device=device).manual_seed(0)
    storage = torch.randn(5 * vocab + offset, device=device, generator=gen).to(torch.float16)
    logits = storage[offset:].view(5, vocab).requires_grad_()
    target = torch.tensor([0, vocab - 1, 2048, -100, 17], device=device)
    for reduction in ("mean", "none"):
        with record_backends() as ran:
            loss = cross_entropy(logits, target, label_smoothing=0.1, reduction=reduction)
        assert ran == [("cross_entropy", EXPECTED_BACKEND)]
        expected = cross_entropy_ref(logits.double(), target, label_smoothing=0.1, reduction=reduction)
        torch.testing.assert_close(loss.double(), expected, rtol=2e-3, atol=2e-3)
        dy = torch.rand(loss.shape, device=device, generator=gen, dtype=loss.dtype)
        (grad,) = torch.autograd.grad(loss, logits, dy)
        (grad_ref,) = torch.autograd.grad(expected, logits, dy.double())
        torch.testing.assert_close(grad.double(), grad_ref.double(), rtol=2e-3, atol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(5, 7), (2, 7, 7), (2, 7, 3, 7), (7,)])  # C == d: a layout mix-up shows
def test_module_is_a_drop_in(device, shape, reduction):
    """torch.nn.CrossEntropyLoss's layouts: [N, C], [N, C, d1, ...] (classes in dim 1) and [C]."""
    options = {"ignore_index": 0, "label_smoothing": 0.1, "reduction": reduction}
    torch.manual_seed(0)
    base = torch.randn(shape, device=device)
    target_shape = () if len(shape) == 1 else (shape[0], *shape[2:])
    target = torch.randint(0, 7, target_shape, device=device)
    ours_in, theirs_in = base.clone().requires_grad_(), base.clone().requires_grad_()
    with record_backends() as ran:
        loss = lstrain.nn.CrossEntropyLoss(**options)(ours_in, target)
    expected = torch.nn.CrossEntropyLoss(**options)(theirs_in, target)
    assert {backend for _, backend in ran} == {EXPECTED_BACKEND}
    torch.testing.assert_close(loss, expected)
    grad_out = torch.rand_like(expected)
    loss.backward(grad_out)
    expected.backward(grad_out)
    torch.testing.assert_close(ours_in.grad, theirs_in.grad)


def test_module_refuses_what_torch_refuses(device):
    with pytest.raises(ValueError, match="class weights"):
        lstrain.nn.CrossEntropyLoss(weight=torch.ones(3))
    criterion = lstrain.nn.CrossEntropyLoss()
    with pytest.raises(ValueError, match=r"target has shape \(2, 3\).*must be \(2, 5\)"):
        criterion(torch.randn(2, 3, 5, device=device), torch.zeros(2, 3, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="input must have a class dim"):
        criterion(torch.tensor(1.0, device=device), torch.tensor(0, device=device))


@pytest.mark.parametrize("shape", [(4, 0), (4, 0, 3)])
def test_module_with_no_classes_gets_the_ops_error(device, shape):
    """C = 0 is the op's clear error, not a reshape(-1, 0) failure (torch refuses it too)."""
    target = torch.zeros((shape[0], *shape[2:]), dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="no classes"):
        lstrain.nn.CrossEntropyLoss()(torch.randn(shape, device=device), target)


def test_torch_compile_fullgraph(device):
    w = torch.randn(16, 50, device=device, requires_grad=True)

    def f(h, target):
        return cross_entropy(h @ w, target, label_smoothing=0.1, z_loss=1e-3)

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    h = torch.randn(8, 16, device=device)
    target = torch.randint(0, 50, (8,), device=device)
    out = compiled(h, target)
    (grad,) = torch.autograd.grad(out, w)
    ref_out = f(h, target)
    (ref_grad,) = torch.autograd.grad(ref_out, w)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(grad, ref_grad)


def test_custom_ops_pass_opcheck(device):
    logits = torch.randn(4, 20, device=device)
    target = torch.tensor([1, -100, 3, 19], device=device)
    valid_rows = (target != -100).sum()
    torch.library.opcheck(torch.ops.lstrain.cross_entropy_fwd, (logits, target, 0.1, -100, 1e-3, "mean", valid_rows))
    _, stats, _ = torch.ops.lstrain.cross_entropy_fwd(logits, target, 0.1, -100, 1e-3, None, None)
    grad_out = torch.randn(4, device=device)
    torch.library.opcheck(torch.ops.lstrain.cross_entropy_bwd, (grad_out, logits, target, stats, 0.1, -100, 1e-3))


@pytest.mark.gpu
def test_cuda_graph_capture():
    logits = torch.randn(64, 1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 1000, (64,), device="cuda")
    for _ in range(2):
        (expected,) = torch.autograd.grad(cross_entropy(logits, target, label_smoothing=0.1), logits)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (grad,) = torch.autograd.grad(cross_entropy(logits, target, label_smoothing=0.1), logits)
    graph.replay()
    assert torch.equal(grad, expected)


@pytest.mark.gpu
@pytest.mark.large_memory  # tens of GB: one at a time under pytest -n
def test_offsets_beyond_int32():
    vocab = 65536
    rows = 2**31 // vocab + 4  # more than 2**31 logits
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, vocab, (rows,), device="cuda")
    loss = cross_entropy(logits, target, reduction="sum")
    (grad,) = torch.autograd.grad(loss, logits)
    tail = slice(rows - 4, rows)
    x = logits[tail].detach().float()
    torch.testing.assert_close(
        cross_entropy(logits[tail].detach(), target[tail], reduction="none").float(),
        torch.nn.functional.cross_entropy(x, target[tail], reduction="none"),
        atol=2e-2,
        rtol=1e-2,
    )
    expected = torch.softmax(x, -1) - torch.nn.functional.one_hot(target[tail], vocab)
    torch.testing.assert_close(grad[tail].float(), expected, atol=1e-3, rtol=2e-2)


def test_no_gradient_under_no_grad(device, monkeypatch):
    """Under torch.no_grad the forward writes no gradient, not even in place, for logits that
    require grad."""
    module = importlib.import_module("lstrain.ops.cross_entropy")
    scales = []
    loss_and_gradient = module.loss_and_gradient
    monkeypatch.setattr(module, "loss_and_gradient", lambda *args: scales.append(args[3]) or loss_and_gradient(*args))
    logits = torch.randn(6, 11, device=device, requires_grad=True)
    before = logits.detach().clone()
    target = torch.randint(0, 11, (6,), device=device)
    with torch.no_grad():
        loss = cross_entropy(logits, target, inplace_backward=True)
    assert scales == [None] and torch.equal(logits.detach(), before)
    torch.testing.assert_close(loss, cross_entropy_ref(logits.detach(), target))
