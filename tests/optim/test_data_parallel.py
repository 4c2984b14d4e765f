"""DataParallel over the flat buffers with 2 and 4 gloo processes on the CPU.

One spawn per world size runs every scenario; the tests read what the ranks saved. The
reference is one process stepping over the same global batch: the ranks' micro-batches
accumulated rank by rank, each rank's gradient divided by the world size, the ranks' sum in
rank order. With 2 ranks that is the all-reduce's sum bit for bit (a + b = b + a, and the
divisions by 2 are exact); with 4, gloo's ring adds the four in another order for each
chunk, so the weights agree to rounding (a tolerance), while the ranks agree bit for bit.
"""

import contextlib
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lstrain import _backend
from lstrain.optim import DataParallel, FlatParameters, FusedAdamW, LossScaler, ZeroAdamW

pytestmark = pytest.mark.skipif(
    not _backend.interpreter_active(), reason="CPU processes (gloo) need the Triton interpreter: a CPU-only run"
)

STEPS, ACCUMULATION = 3, 2
BUCKET_MIB = 2 * 1024 * 4 / 2**20  # two fp32 parameters (a block of 1024 elements each) per bucket


class Net(torch.nn.Module):
    """``unused`` never gets a gradient; ``side`` only on rank 1 (``side=True``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.unused = torch.nn.Linear(3, 3)
        self.a = torch.nn.Linear(6, 16)
        self.b = torch.nn.Linear(16, 2)
        self.side = torch.nn.Linear(6, 2)

    def forward(self, x, side):
        y = self.b(torch.tanh(self.a(x)))
        if side:
            y = y + self.side(x)
        return y.square().mean()


def batch(step, rank, micro, dtype=torch.float32):
    generator = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(4, 6, generator=generator).to(dtype)


def _optimizer(model):
    return FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=0.05)


def _train(rank, world, results):
    model = Net()
    optimizer = _optimizer(model)
    ddp = DataParallel(optimizer, bucket_mib=BUCKET_MIB)
    results["buckets"] = ddp.num_buckets
    results["overlapped"] = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=step == 1)  # step 1: new .grad tensors, copied in by the hooks
        for micro in range(ACCUMULATION):
            with ddp.no_sync() if micro < ACCUMULATION - 1 else contextlib.nullcontext():
                (model(batch(step, rank, micro), side=rank == 1) / ACCUMULATION).backward()
        results["overlapped"].append(ddp.overlapped)
        if step == 0:
            ddp.finish()  # explicit; later steps leave it to optimizer.step()
        optimizer.step()
    results["params"] = [p.detach().clone() for p in model.parameters()]
    results["grads_attached"] = all(p.grad is not None for p in model.parameters())


def _scaled(rank, results):
    """fp16 with the loss scaler: an inf on rank 0 alone makes every rank skip the step."""
    model = Net().half()
    if rank > 0:
        with torch.no_grad():
            model.a.weight.add_(1.0)  # DataParallel starts every rank from rank 0's weights (and masters)
    optimizer = FusedAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    ddp = DataParallel(optimizer, bucket_mib=BUCKET_MIB)  # finish() runs in scaler.step's optimizer.step()
    results["scaled_buckets"] = ddp.num_buckets
    scaler = LossScaler(init_scale=2.0**10, device="cpu")
    snapshots, scales = [], []
    for step in range(3):
        optimizer.zero_grad()
        loss = model(batch(step, rank, 0, torch.float16), side=rank == 1)
        if step == 1 and rank == 0:
            loss = loss * math.inf
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        snapshots.append([p.detach().clone() for p in model.parameters()])
        scales.append(scaler.get_scale().item())
    results["scaled_snapshots"], results["scales"] = snapshots, scales


def _plain(rank, results):
    """Another optimizer over the flat buffers (the training loop's CPU path): finish() by hand."""
    model = Net()
    flat = FlatParameters([list(model.parameters())])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = DataParallel(flat, bucket_mib=BUCKET_MIB)
    for step in range(2):
        flat.zero_grad()
        model(batch(step, rank, 0), side=rank == 1).backward()
        ddp.finish()
        optimizer.step()
    results["plain"] = [p.detach().clone() for p in model.parameters()]


def _errors(rank, world, results):
    model = Net()
    optimizer = _optimizer(model)
    ddp = DataParallel(optimizer)
    errors = {}
    try:
        model(batch(0, 0, 0), side=True).backward()
        model(batch(0, 0, 1), side=True).backward()  # a second backward outside no_sync
    except RuntimeError as error:
        errors["twice"] = str(error)
    ddp.remove()
    for key, build in {
        "bucket": lambda: DataParallel(FlatParameters([list(Net().parameters())]), bucket_mib=0),
        "zero": lambda: DataParallel(ZeroAdamW(Net().parameters())),
        "meta": lambda: DataParallel(FlatParameters([[torch.nn.Parameter(torch.zeros(3, device="meta"))]])),
        "target": lambda: DataParallel(model),
    }.items():
        try:
            build()
        except (TypeError, ValueError) as error:
            errors[key] = f"{type(error).__name__}: {error}"
    results["errors"] = errors


def _worker(rank, world, init_file, out_dir, full):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    _train(rank, world, results)
    if full:
        _scaled(rank, results)
        _plain(rank, results)
        _errors(rank, world, results)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def run(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"dp{world}")
    mp.spawn(_worker, args=(world, str(out / "init"), str(out), world == 2), nprocs=world, join=True)
    return world, [torch.load(out / f"rank{r}.pt") for r in range(world)]


def _reference(world):
    """One process over the global batch (see the module docstring)."""
    model = Net()
    optimizer = _optimizer(model)
    grad = optimizer.flat.buffers[0].grad
    for step in range(STEPS):
        total = torch.zeros_like(grad)
        for rank in range(world):
            optimizer.zero_grad()
            for micro in range(ACCUMULATION):
                (model(batch(step, rank, micro), side=rank == 1) / ACCUMULATION).backward()
            total += grad / world
        grad.copy_(total)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def test_ranks_agree_and_equal_one_process(run):
    world, ranks = run
    for other in ranks[1:]:
        for a, b in zip(ranks[0]["params"], other["params"], strict=True):
            assert torch.equal(a, b)
    reference = _reference(world)
    for got, want in zip(ranks[0]["params"], reference, strict=True):
        if world == 2:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.equal(reference[1], Net().a.weight.detach())  # it trained
    assert all(r["grads_attached"] for r in ranks)


def test_buckets_overlap_backward_and_unused_parameters_complete(run):
    world, ranks = run
    assert ranks[0]["buckets"] == 4
    # rank 1 uses side, b and a: their three buckets go out during backward; `unused`'s in
    # finish(). Rank 0 leaves side's bucket (the first) incomplete: finish() sends all four.
    assert ranks[1]["overlapped"] == [3] * STEPS
    assert ranks[0]["overlapped"] == [0] * STEPS
    for rank in ranks[2:]:
        assert rank["overlapped"] == [0] * STEPS


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_loss_scaler_skip_and_clip_agree_across_ranks(run):
    world, ranks = run
    if world != 2:
        pytest.skip("run with 2 processes")
    first, second = ranks
    assert first["scales"] == second["scales"] == [2.0**10, 2.0**9, 2.0**9]
    for a, b in zip(first["scaled_snapshots"], second["scaled_snapshots"], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    before, skipped, after = first["scaled_snapshots"]
    for got, start in zip(before, Net().half().parameters(), strict=True):  # from rank 0's weights
        torch.testing.assert_close(got, start.detach(), rtol=0, atol=0.05)
    assert all(torch.equal(x, y) for x, y in zip(before, skipped, strict=True))  # the inf step changed nothing
    assert not torch.equal(skipped[2], after[2])  # a.weight trained on


def test_flat_parameters_with_another_optimizer(run):
    world, ranks = run
    if world != 2:
        pytest.skip("run with 2 processes")
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        optimizer.zero_grad()
        for rank in range(world):
            (model(batch(step, rank, 0), side=rank == 1) / world).backward()
        optimizer.step()
    assert _same(ranks[0]["plain"], ranks[1]["plain"])
    for got, want in zip(ranks[0]["plain"], model.parameters(), strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-7)  # torch accumulates in another order


def test_clear_errors(run):
    world, ranks = run
    if world != 2:
        pytest.skip("run with 2 processes")
    errors = ranks[0]["errors"]
    assert "second gradient" in errors["twice"] and "no_sync" in errors["twice"]
    assert errors["bucket"].startswith("ValueError") and "bucket_mib" in errors["bucket"]
    assert errors["zero"].startswith("TypeError") and "ZeroAdamW" in errors["zero"]
    assert errors["meta"].startswith("ValueError") and "meta" in errors["meta"] and "gloo" in errors["meta"]
    assert errors["target"].startswith("TypeError") and "Net" in errors["target"]


def test_needs_an_initialized_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        DataParallel(_optimizer(Net()))
