"""ZeroAdamW (ZeRO-1) with 2 and 4 gloo processes on the CPU.

One spawn per world size runs every scenario; the tests read what the ranks saved. The
reference is one FusedAdamW process over the same global batch, each rank's gradient
divided by the world size and the ranks' sum taken in rank order: with 2 ranks that is
the reduce-scatter's sum bit for bit; with 4, gloo adds the four in another order, so the
weights agree to rounding (a tolerance) while the ranks agree bit for bit. The clip norm
is bit-identical to one process's: the ranks all-gather the per-block partial sums and sum
the same vector.
"""

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lstrain import _backend
from lstrain.optim import FusedAdamW, LossScaler, ZeroAdamW
from lstrain.optim.flat import BLOCK

pytestmark = pytest.mark.skipif(
    not _backend.interpreter_active(), reason="CPU processes (gloo) need the Triton interpreter: a CPU-only run"
)

STEPS, RESUME_AT = 4, 2


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    # 7 parameters of 1 to 3 blocks: 11 blocks, so that shards cut through parameters
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 300), torch.nn.Tanh(), torch.nn.Linear(300, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2)
    )
    return model.to(dtype)


def _groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    return [{"params": decay}, {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


KWARGS = {"lr": 1e-2, "weight_decay": 0.1, "max_grad_norm": 0.5}


def batch(step, rank, dtype=torch.float32):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, generator=generator).to(dtype)


def _loss(model, step, rank, dtype=torch.float32):
    return model(batch(step, rank, dtype)).square().mean()


def _steps(model, optimizer, rank, steps):
    for step in steps:
        optimizer.zero_grad()
        _loss(model, step, rank).backward()
        optimizer.step()


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _train(rank, world, out, results, reference_path):
    model = _model()
    optimizer = ZeroAdamW(_groups(model), **KWARGS)
    results["numels"] = [b.data.numel() for b in optimizer.flat.buffers]
    results["state_numel"] = optimizer.state_numel()
    _steps(model, optimizer, rank, range(RESUME_AT))
    at_resume = _params(model)
    torch.save(optimizer.state_dict(), out / f"shard{rank}.pt")
    gathered = optimizer.state_dict(gathered=True)
    results["gathered"] = gathered
    _steps(model, optimizer, rank, range(RESUME_AT, STEPS))
    results["params"] = _params(model)
    optimizer.zero_grad()
    _loss(model, STEPS, rank).backward()
    results["clip_norm"] = optimizer.grad_norm()  # of the averaged gradients: a collective

    def resumed(state):
        fresh = _model()
        with torch.no_grad():
            for p, saved in zip(fresh.parameters(), at_resume, strict=True):
                p.copy_(saved)
        again = ZeroAdamW(_groups(fresh), **KWARGS)
        again.load_state_dict(state)
        _steps(fresh, again, rank, range(RESUME_AT, STEPS))
        return _params(fresh), again

    results["resumed"], again = resumed(torch.load(out / f"shard{rank}.pt"))
    # torch's layout (gathered by rank 0, every rank loads the file) restores the same
    torch.save(gathered, out / "gathered.pt") if rank == 0 else None
    dist.barrier()
    results["resumed_gathered"], _ = resumed(torch.load(out / "gathered.pt"))
    # one process's FusedAdamW state, resharded over this world size
    results["resharded"], _ = resumed(torch.load(reference_path))
    errors = {}
    wrong = torch.load(out / f"shard{rank}.pt")
    wrong["zero"]["world_size"] += 1
    try:
        again.load_state_dict(wrong)
    except ValueError as error:
        errors["world"] = str(error)
    try:
        again.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    except RuntimeError as error:
        errors["add_group"] = str(error)
    try:
        ZeroAdamW([torch.nn.Parameter(torch.zeros(3, device="meta"))])
    except ValueError as error:
        errors["meta"] = str(error)
    results["errors"] = errors


def _scaled(rank, results):
    """fp16 (fp32 master shards) with the loss scaler: an inf on rank 0 alone skips the step everywhere."""
    model = _model(torch.float16)
    if rank > 0:
        with torch.no_grad():
            model[4].weight.add_(1.0)  # in another rank's shard: all start from rank 0's weights and masters
    optimizer = ZeroAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    results["fp16_state_numel"] = optimizer.state_numel()
    results["fp16_numels"] = [b.data.numel() for b in optimizer.flat.buffers]
    scaler = LossScaler(init_scale=2.0**10, device="cpu")
    snapshots, scales = [], []
    for step in range(3):
        optimizer.zero_grad(set_to_none=step == 2)
        loss = _loss(model, step, rank, torch.float16)
        if step == 1 and rank == 0:
            loss = loss * math.inf
        scaler.scale(loss).backward()
        if step == 2 and rank == 0:
            model[0].bias.grad = None  # no gradient here (in rank 0's shard), one on the others
        scaler.step(optimizer)
        scaler.update()
        snapshots.append(_params(model))
        scales.append(scaler.get_scale().item())
    results["scaled_snapshots"], results["scales"] = snapshots, scales
    results["scaled_steps"] = [optimizer.state[p]["step"].clone() for p in model.parameters()]


ROUNDED = {"lr": 1e-2, "weight_decay": 0.1, "master_weights": False, "state_dtype": torch.bfloat16}


def _rounded_steps(optimizer, model, rank):
    """Three steps of a bf16 model on the same batch on every rank (the mean gradient is then
    each rank's own, exactly), for a stochastically rounded optimizer."""
    for step in range(3):
        optimizer.zero_grad()
        _loss(model, step, 0, torch.bfloat16).backward()
        optimizer.step()
    return _params(model), [optimizer.state[p] for p in model.parameters()]


def _rounded(rank, results):
    """bf16 weights and moments rounded stochastically, no master shards."""
    model = _model(torch.bfloat16)
    optimizer = ZeroAdamW(model.parameters(), **ROUNDED)
    results["rounded_state_numel"] = optimizer.state_numel()
    results["rounded_params"], _ = _rounded_steps(optimizer, model, rank)


def _worker(rank, world, init_file, out_dir, reference_path):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    out = Path(out_dir)
    results = {}
    _train(rank, world, out, results, reference_path)
    _scaled(rank, results)
    _rounded(rank, results)
    torch.save(results, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _reference(world):
    """One FusedAdamW process over the global batch; its state at RESUME_AT; its weights after each step."""
    model = _model()
    optimizer = FusedAdamW(_groups(model), **KWARGS)
    grad = optimizer.flat.buffers[0].grad
    weights, state = [], None
    for step in range(STEPS):
        if step == RESUME_AT:
            state = copy.deepcopy(optimizer.state_dict())  # its moments are live views
        total = torch.zeros_like(grad)
        for rank in range(world):
            optimizer.zero_grad()
            _loss(model, step, rank).backward()
            total += grad / world
        grad.copy_(total)
        optimizer.step()
        weights.append(_params(model))
    return weights, state


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def run(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"zero{world}")
    weights, state = _reference(world)
    torch.save(state, out / "reference_state.pt")
    mp.spawn(_worker, args=(world, str(out / "init"), str(out), str(out / "reference_state.pt")), nprocs=world)
    return world, [torch.load(out / f"rank{r}.pt") for r in range(world)], weights, state


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _close(got, want, world):
    for x, y in zip(got, want, strict=True):
        if world == 2:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_ranks_agree_and_equal_one_process(run):
    world, ranks, weights, _ = run
    assert all(_same(ranks[0]["params"], r["params"]) for r in ranks[1:])
    _close(ranks[0]["params"], weights[-1], world)
    assert not _same(weights[-1], _params(_model()))


def test_state_per_rank_is_one_over_world(run):
    world, ranks, _, _ = run
    padded = sum(ranks[0]["numels"])
    assert padded % (world * BLOCK) == 0
    assert all(r["state_numel"] == 2 * padded // world for r in ranks)  # fp32: the two moments
    assert all(r["fp16_state_numel"] == 3 * padded // world for r in ranks)  # fp16: master too
    single = FusedAdamW(_model().parameters())
    total = sum(t.numel() for ts in single._buffers.values() for t in ts)
    assert 2 * padded - total < world * BLOCK * 2  # only the padding to equal shards on top of 1/world each


def test_save_resume_bit_for_bit(run):
    world, ranks, _, _ = run
    for rank in ranks:
        assert _same(rank["resumed"], rank["params"])
        assert _same(rank["resumed_gathered"], rank["params"])


def test_gathered_state_is_torch_layout(run):
    world, ranks, _, reference = run
    gathered = ranks[0]["gathered"]
    assert all(r["gathered"] is None for r in ranks[1:])
    assert gathered["state"].keys() == reference["state"].keys()
    for number, entry in reference["state"].items():
        assert entry.keys() == gathered["state"][number].keys()
        _close([gathered["state"][number][k] for k in entry], list(entry.values()), world)
    model = _model()
    torch.optim.AdamW(_groups(model), **{k: v for k, v in KWARGS.items() if k != "max_grad_norm"}).load_state_dict(
        gathered
    )


def test_resharded_from_one_process(run):
    world, ranks, weights, _ = run
    for rank in ranks:
        _close(rank["resharded"], weights[-1], world)


def test_clip_and_loss_scaler_skip_agree_across_ranks(run):
    world, ranks, _, _ = run
    assert all(torch.equal(ranks[0]["clip_norm"], r["clip_norm"]) for r in ranks[1:])
    assert all(r["scales"] == [2.0**10, 2.0**9, 2.0**9] for r in ranks)
    for r in ranks[1:]:
        assert all(_same(a, b) for a, b in zip(ranks[0]["scaled_snapshots"], r["scaled_snapshots"], strict=True))
    before, skipped, after = ranks[0]["scaled_snapshots"]
    for got, start in zip(before, _params(_model(torch.float16)), strict=True):  # from rank 0's weights
        torch.testing.assert_close(got, start, rtol=0, atol=0.05)
    assert _same(before, skipped)
    assert not _same(skipped, after)
    # the last step had no gradient for one parameter on rank 0: it stepped everywhere all the same
    assert all(_same(r["scaled_steps"], [torch.tensor(2.0)] * 6) for r in ranks)


def test_clear_errors(run):
    world, ranks, _, _ = run
    errors = ranks[0]["errors"]
    assert f"world size {world + 1}" in errors["world"] and "gathered=True" in errors["world"]
    assert "fixed" in errors["add_group"]
    assert "meta" in errors["meta"] and "gloo" in errors["meta"]


def test_needs_an_initialized_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        ZeroAdamW(_model().parameters())


def test_stochastic_rounding_matches_one_process(run):
    """The random counters are the whole buffer's: a shard rounds as one process does."""
    world, ranks, _, _ = run
    model = _model(torch.bfloat16)
    single = FusedAdamW(model.parameters(), **ROUNDED)
    want, _ = _rounded_steps(single, model, 0)
    padded = sum(ranks[0]["numels"])  # one buffer, as the fp32 model's
    for r in ranks:
        assert _same(r["rounded_params"], want)
        assert r["rounded_state_numel"] == 2 * padded // world  # the two bf16 moments, no master
