"""Two gloo processes on the CPU train as one process over the same global batch."""

import functools
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from lstrain import _backend
from lstrain.data import build_data
from lstrain.train import checkpoint as ckpt
from lstrain.train import train
from tests.train.helpers import micro_bert_run, micro_run

pytestmark = pytest.mark.skipif(
    not _backend.interpreter_active(), reason="FusedAdamW on the CPU needs the Triton interpreter: a CPU-only run"
)

STEPS = 3
# "bert-drawn": HF's masking, a count per row drawn, so the ranks' token counts differ
RUNS = {
    "gpt2": micro_run,
    "bert": micro_bert_run,
    "bert-drawn": functools.partial(micro_bert_run, max_predictions=None),
    "gpt2-zero": micro_run,
}


def _quiet(line: str) -> None:
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, folder: str, family: str) -> None:
    # what torchrun sets; train() joins the group from it (gloo on the CPU)
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1"}
    )
    os.environ["MASTER_PORT"] = str(port)
    run = RUNS[family](folder, steps=STEPS, dropout=0.0, local_batch_size=1)
    if family.endswith("-zero"):
        run.optimizer.name = "zero_adamw"
    summary = train(run, progress=False, echo=_quiet)
    state = {k: v.clone() for k, v in summary.model.state_dict().items()}
    torch.save({"state": state, "losses": summary.losses}, os.path.join(folder, f"rank{rank}.pt"))


@pytest.mark.parametrize("family", list(RUNS))
def test_two_ranks_agree_with_one_process_over_the_global_batch(tmp_path, family):
    make = RUNS[family]
    ddp, single = tmp_path / "ddp", tmp_path / "single"
    for folder in (ddp, single):  # the tokenized corpus cached before the ranks start
        run = make(folder, steps=STEPS)
        build_data(run.data, seq_len=run.training.seq_len, seed=run.training.seed, mlm=run.model.family.mlm)
    mp.spawn(_rank, args=(2, _free_port(), str(ddp), family), nprocs=2, join=True)
    ranks = [torch.load(ddp / f"rank{r}.pt") for r in range(2)]
    alone = train(make(single, steps=STEPS, dropout=0.0, local_batch_size=2), progress=False, echo=_quiet)

    for key, a in ranks[0]["state"].items():
        assert torch.equal(a, ranks[1]["state"][key]), key  # the ranks hold identical weights
        # fp32, not bit for bit: the ranks' means are summed in another order, and Adam turns a
        # near-zero gradient's rounding (attention's key bias: ~0 by symmetry) into up to ~1e-6
        torch.testing.assert_close(a, alone.model.state_dict()[key], rtol=1e-4, atol=1e-5, msg=key)
    assert ranks[0]["losses"] == ranks[1]["losses"]  # logged as the mean over ranks
    for step, loss in alone.losses.items():
        assert ranks[0]["losses"][step] == pytest.approx(loss, rel=1e-5)
    # rank 0 alone writes: every interval (2) and the last step, no temporary directory left
    assert sorted(p.name for p in (ddp / "checkpoints").iterdir()) == ["step-00000002", "step-00000003"]
    if family.endswith("-zero"):  # the shards gathered into torch's AdamW layout, as one process saves it
        saved = ckpt.load_trainer_state(ddp / "checkpoints" / "step-00000003")["optimizer"]
        expected = alone.checkpoint and ckpt.load_trainer_state(alone.checkpoint)["optimizer"]
        assert saved["state"].keys() == expected["state"].keys()
        for index, entry in saved["state"].items():
            torch.testing.assert_close(entry["exp_avg"], expected["state"][index]["exp_avg"], rtol=1e-4, atol=1e-6)
