"""Two processes on the CPU (gloo): the flat gradients are reduced and both ranks step alike."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lstrain import _backend
from lstrain.optim import FusedAdamW

pytestmark = pytest.mark.skipif(
    not _backend.interpreter_active(), reason="CPU processes (gloo) need the Triton interpreter: a CPU-only run"
)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _worker(rank: int, world: int, init_file: str, out_dir: str, use_ddp: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model = _model()
    optimizer = FusedAdamW(model.parameters(), lr=1e-2)  # flat buffers before DDP sees the parameters
    reductions = []
    if use_ddp:
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1000)

        def counting_hook(state, bucket):
            reductions.append(bucket.buffer().numel())
            work = dist.all_reduce(bucket.buffer().div_(world), async_op=True)
            return work.get_future().then(lambda f: f.value()[0])

        model.register_comm_hook(None, counting_hook)
    torch.manual_seed(100 + rank)  # each rank its own data
    for _ in range(4):
        x = torch.randn(8, 6)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        if not use_ddp:
            optimizer.flat.all_reduce_grads()
            reductions.append(len(optimizer.flat.buffers))
        optimizer.step()
    params = [p.detach().clone() for p in model.parameters()]
    torch.save({"params": params, "reductions": reductions}, os.path.join(out_dir, f"rank{rank}.pt"))
    # DDP's reducer and the hook's futures go before the group: left to the interpreter's
    # exit, gloo's threads could still hold them and abort the process (3 of 30 runs did)
    del model, optimizer
    dist.barrier()
    dist.destroy_process_group()


def _run(tmp_path, use_ddp):
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path), use_ddp), nprocs=2, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


def test_ddp_reduces_once_per_step_and_ranks_agree(tmp_path):
    ranks = _run(tmp_path, use_ddp=True)
    for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(a, b)
    assert len(ranks[0]["reductions"]) == 4  # one bucket, one all-reduce per step
    assert not torch.equal(ranks[0]["params"][0], _model()[0].weight.detach())  # it trained


def test_flat_all_reduce_without_ddp(tmp_path):
    ranks = _run(tmp_path, use_ddp=False)
    for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(a, b)
    assert ranks[0]["reductions"] == [1, 1, 1, 1]  # fp32 only: one flat buffer, one all-reduce
