"""--resume continues exactly: a run killed with SIGKILL and resumed gives the same losses,
bit for bit, as an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lstrain import _backend
from lstrain.data import build_data
from lstrain.train import checkpoint as ckpt
from lstrain.train import train
from tests.train.helpers import micro_run

pytestmark = pytest.mark.skipif(
    not _backend.interpreter_active(), reason="FusedAdamW on the CPU needs the Triton interpreter: a CPU-only run"
)

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
# the child trains the micro recipe (dropout on: the resumed run must draw the same masks)
CHILD = (
    "import sys; from pathlib import Path; from lstrain.train import train; "
    "from tests.train.helpers import micro_run; "
    f"train(micro_run(Path(sys.argv[1]), steps={STEPS}), progress=False)"
)


def _quiet(line: str) -> None:
    pass


def test_a_killed_run_resumes_bit_for_bit(tmp_path):
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    for folder in (killed, whole):  # the tokenized corpus cached before the child starts
        run = micro_run(folder, steps=STEPS)
        build_data(run.data, seq_len=run.training.seq_len, seed=run.training.seed)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(killed)], cwd=ROOT, env=dict(os.environ))
    deadline = time.monotonic() + 120
    try:
        while not ckpt.list_checkpoints(killed / "checkpoints") and time.monotonic() < deadline:
            assert child.poll() is None, "the child ended before its first checkpoint"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)  # mid-training: 8 steps, a checkpoint every 2
    finally:
        child.kill()
        child.wait()
    saved = ckpt.list_checkpoints(killed / "checkpoints")
    assert saved, "no checkpoint within the deadline"
    resumed_from = ckpt.load_trainer_state(saved[-1])["step"]
    assert resumed_from < STEPS, "the child finished before it was killed"

    resumed = train(micro_run(killed, steps=STEPS), resume=True, progress=False, echo=_quiet)
    uninterrupted = train(micro_run(whole, steps=STEPS), progress=False, echo=_quiet)

    assert sorted(resumed.losses) == list(range(resumed_from + 1, STEPS + 1))
    assert resumed.losses == {s: uninterrupted.losses[s] for s in resumed.losses}  # bit for bit
    assert resumed.eval_loss == uninterrupted.eval_loss
    for (key, a), b in zip(resumed.model.state_dict().items(), uninterrupted.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), key
    # the metrics log reads as one run: each step once
    records = [json.loads(line) for line in (killed / "metrics" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, STEPS + 1))
