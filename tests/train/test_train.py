"""A micro run end to end, its checkpoints, and the bad input refused before any step."""

import json
import os
import time
from pathlib import Path

import pytest
import torch

from lstrain import _backend
from lstrain.models import GPT2, GPT2Config
from lstrain.train import RunConfig, train
from lstrain.train import checkpoint as ckpt
from tests.conftest import DEVICE
from tests.train.helpers import micro_run

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or _backend.interpreter_active()),
    reason="FusedAdamW on the CPU needs the Triton interpreter",
)


def _quiet(line: str) -> None:
    pass


def test_a_micro_run_writes_metrics_checkpoints_and_the_loss_curve(tmp_path):
    run = micro_run(tmp_path, steps=2, fused=True)  # lstrain's kernels, in the interpreter
    run.sample.max_new_tokens = 4
    summary = train(run, progress=False, echo=_quiet)

    assert summary.steps == 2 and summary.tokens == 2 * 2 * 32
    assert set(summary.losses) == {1, 2} and all(0 < v < 10 for v in summary.losses.values())
    assert summary.eval_loss is not None and isinstance(summary.sample, str)
    assert summary.tflops > 0 and (summary.mfu is None) == (DEVICE == "cpu")  # MFU against a GPU's datasheet peak
    records = [json.loads(line) for line in (tmp_path / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["step"] == 0 and records[0]["run"]["training"]["steps"] == 2
    logged = [r for r in records if "loss" in r]
    assert [r["step"] for r in logged] == [1, 2]
    assert {"step", "loss", "lr", "tokens_per_s", "memory_mib"} <= set(logged[0])
    assert logged[0]["lr"] == pytest.approx(3e-3 / 2)  # one warmup step: lr / (warmup + 1)
    assert [r["step"] for r in records if "eval_loss" in r] == [2]
    assert records[-1]["summary"]["steps"] == 2
    assert (tmp_path / "metrics" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    (saved,) = ckpt.list_checkpoints(tmp_path / "checkpoints")
    assert saved.name == "step-00000002" and summary.checkpoint == saved
    loaded = GPT2.from_pretrained(saved)  # HF's files: config.json + model.safetensors
    for key, value in summary.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value.cpu()), key
    state = ckpt.load_trainer_state(saved)
    assert state["step"] == 2 and state["data_step"] == 2
    assert {"optimizer", "scaler", "scheduler", "rng", "run"} <= set(state)


def _other_model_checkpoint(folder):
    model = GPT2(GPT2Config(vocab_size=259, n_positions=32, n_embd=16, n_layer=1, n_head=2, fused=False))
    return ckpt.save_checkpoint(folder, 3, model, {"step": 3}, keep=2)


@pytest.mark.parametrize(
    "case",
    [
        "missing data",
        "no data",
        "short corpus",
        "seq_len",
        "global batch",
        "cuda_graphs",
        "bf16 on the CPU",
        "over checkpoints",
        "other model",
    ],
)
def test_bad_input_is_refused_before_any_step(tmp_path, case):
    run: RunConfig = micro_run(tmp_path)
    resume = None
    expected = {
        "missing data": (FileNotFoundError, "does not exist"),
        "no data": (ValueError, r"train: no data: pass data= or set RunConfig.data"),
        "short corpus": (ValueError, "shorter than one sequence"),
        "seq_len": (ValueError, "seq_len 64 exceeds the model's n_positions 32"),
        "global batch": (ValueError, "global_batch_size 5 does not divide across 1 rank"),
        "cuda_graphs": (ValueError, "cuda_graphs needs CUDA"),
        "bf16 on the CPU": (ValueError, 'mixed_precision = "bf16" needs CUDA; on the CPU use "fp32"'),
        "over checkpoints": (ValueError, "already holds checkpoints; pass --resume"),
        "other model": (ValueError, "holds another model: n_embd: checkpoint 16, recipe 32"),
    }[case]
    if case == "missing data":
        run.data.source = str(tmp_path / "nowhere.txt")
    elif case == "no data":
        run.data = None
    elif case == "short corpus":
        (tmp_path / "short.txt").write_text("too short")
        run.data.source = str(tmp_path / "short.txt")
    elif case == "seq_len":
        run.training.seq_len = 64
    elif case == "global batch":
        run.training.global_batch_size = 5
    elif case == "cuda_graphs":
        run.training.device, run.training.cuda_graphs = "cpu", True
    elif case == "bf16 on the CPU":
        run.training.device, run.training.mixed_precision = "cpu", "bf16"
    elif case == "over checkpoints":
        _other_model_checkpoint(tmp_path / "checkpoints")
    else:
        _other_model_checkpoint(tmp_path / "checkpoints")
        resume = True
    before = (
        sorted(p.name for p in (tmp_path / "checkpoints").glob("*")) if case.endswith(("checkpoints", "model")) else []
    )
    with pytest.raises(expected[0], match=expected[1]):
        train(run, resume=resume, progress=False, echo=_quiet)
    assert not (tmp_path / "metrics").exists()  # nothing written
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*")) == before


def test_a_failed_checkpoint_write_leaves_the_previous_one(tmp_path, monkeypatch):
    model = GPT2(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, fused=False))
    first = ckpt.save_checkpoint(tmp_path, 1, model, {"step": 1}, keep=2)
    files = {p.name: p.read_bytes() for p in first.iterdir()}

    def failing_save(obj, path):
        raise OSError("disk full")

    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    monkeypatch.setattr(ckpt.torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(tmp_path, 2, model, {"step": 2}, keep=2)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]  # no step-2, no temporary directory
    assert {p.name: p.read_bytes() for p in first.iterdir()} == files
    assert ckpt.find_checkpoint(tmp_path) == first


def test_a_run_killed_while_replacing_a_checkpoint_gets_it_back(tmp_path, monkeypatch):
    """Saving a step again moves the old directory aside, then renames the new one in: a
    kill between the two renames must not cost the checkpoint at the next start."""
    model = GPT2(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, fused=False))
    first = ckpt.save_checkpoint(tmp_path, 1, model, {"step": 1}, keep=1)
    files = {p.name: p.read_bytes() for p in first.iterdir()}
    rename = os.rename

    def killed_after_moving_aside(src, dst):
        if Path(src).name.startswith(".tmp-step-"):
            raise KeyboardInterrupt  # the kill, between the two renames
        rename(src, dst)

    monkeypatch.setattr(ckpt.os, "rename", killed_after_moving_aside)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(tmp_path, 1, model, {"step": 1}, keep=1)
    monkeypatch.undo()
    assert not first.exists()
    ckpt.remove_partial_writes(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]
    assert {p.name: p.read_bytes() for p in first.iterdir()} == files


def test_resume_finds_a_checkpoint_a_killed_re_save_moved_aside(tmp_path):
    first = train(micro_run(tmp_path, steps=2), progress=False, echo=_quiet)
    aside = tmp_path / "checkpoints" / ".tmp-old-step-00000002-4242"
    os.rename(first.checkpoint, aside)  # as a kill between save_checkpoint's two renames leaves it
    resumed = train(micro_run(tmp_path, steps=3), resume=True, progress=False, echo=_quiet)
    assert list(resumed.losses) == [3] and not aside.exists()


def test_only_the_latest_k_checkpoints_are_kept(tmp_path):
    model = GPT2(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, fused=False))
    for step in (1, 2, 3, 10):
        ckpt.save_checkpoint(tmp_path, step, model, {"step": step}, keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000003", "step-00000010"]
    assert ckpt.find_checkpoint(tmp_path).name == "step-00000010"
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        ckpt.find_checkpoint(tmp_path / "empty")


def test_compile_trains_like_eager(tmp_path):
    eager = train(micro_run(tmp_path / "eager", steps=2, dropout=0.0), progress=False, echo=_quiet)
    run = micro_run(tmp_path / "compiled", steps=2, dropout=0.0, compile=True)
    compiled = train(run, progress=False, echo=_quiet)
    for step, loss in eager.losses.items():
        assert compiled.losses[step] == pytest.approx(loss, rel=1e-4)


def test_gradient_accumulation_matches_the_whole_batch(tmp_path):
    whole = train(micro_run(tmp_path / "whole", steps=2, dropout=0.0, local_batch_size=2), progress=False, echo=_quiet)
    run = micro_run(tmp_path / "accumulated", steps=2, dropout=0.0, local_batch_size=1, global_batch_size=2)
    assert run.training.accumulation(world_size=1) == 2  # global_batch_size fixes the accumulation
    accumulated = train(run, progress=False, echo=_quiet)
    for (key, a), b in zip(whole.model.state_dict().items(), accumulated.model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=key)  # Adam amplifies rounding near 0
    for step, loss in whole.losses.items():
        assert accumulated.losses[step] == pytest.approx(loss, rel=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("mode", ["cuda_graphs", "compile"])
def test_fused_gpu_runs_train_like_eager(tmp_path, mode, precision):
    """lstrain's kernels on the GPU: the captured and the compiled step take the eager
    step's losses (fp16 through the loss scaler), with eval and checkpoints in between."""

    def run(name, **options):
        config = micro_run(tmp_path / name, steps=6, dropout=0.0, fused=True, mixed_precision=precision, **options)
        return train(config, progress=False, echo=_quiet)

    eager, other = run("eager"), run(mode, **{mode: True})
    losses = list(eager.losses.values())
    assert losses[-1] < losses[0]
    for step, loss in eager.losses.items():
        assert other.losses[step] == pytest.approx(loss, rel=2e-2 if precision != "fp32" else 1e-4)


def test_cuda_graphs_with_several_ranks_is_refused_before_any_step(tmp_path):
    """DataParallel's bucket collectives are not captured: the check runs before any step
    (and before any process group or GPU is touched)."""
    from lstrain.train.families import FAMILIES
    from lstrain.train.loop import _check_run, _World

    run = micro_run(tmp_path, cuda_graphs=True)
    world = _World(rank=0, size=2, device=torch.device("cuda"), initialized_here=False)
    data = type("Data", (), {"mlm": False, "train": None})()
    with pytest.raises(ValueError, match="cuda_graphs with more than one rank is not supported yet"):
        _check_run(run, world, FAMILIES["gpt2"], run.model.build(259), data)


def test_zero_adamw_in_one_process_is_refused_before_any_step(tmp_path):
    run = micro_run(tmp_path)
    run.optimizer.name = "zero_adamw"
    with pytest.raises(ValueError, match='"zero_adamw" shards over the ranks of a torchrun job'):
        train(run, progress=False, echo=_quiet)
    assert not (tmp_path / "metrics").exists()


def test_a_loss_gone_non_finite_between_logs_stops_the_run_before_a_checkpoint(tmp_path):
    """Logged every 100 steps, saved every 2: the loss checked on the device every step
    stops the run at the first save after it went NaN or inf, with nothing saved."""
    run = micro_run(tmp_path, steps=4)
    run.optimizer.lr = 1e36  # the first update blows the weights up
    run.metrics.log_freq = 100
    with pytest.raises(FloatingPointError, match=r"not finite at step 2 \(found before evaluating or saving step 2\)"):
        train(run, progress=False, echo=_quiet)
    assert ckpt.list_checkpoints(tmp_path / "checkpoints") == []


def test_resuming_at_or_past_the_last_step_is_refused(tmp_path):
    train(micro_run(tmp_path, steps=2), progress=False, echo=_quiet)
    with pytest.raises(ValueError, match="is at step 2, and training.steps is 2: nothing is left to run"):
        train(micro_run(tmp_path, steps=2), resume=True, progress=False, echo=_quiet)
    lines = []  # raised as the message says: the schedule is stretched to the new total, and said so
    train(micro_run(tmp_path, steps=3), resume=True, progress=False, echo=lines.append)
    assert any("the checkpoint's run was to take 2 steps, this one 3" in line for line in lines)


def test_evaluation_and_checkpoints_are_not_timed_as_training(tmp_path, monkeypatch):
    """A slow evaluation (its loss plot made to take four seconds) leaves the next logged
    interval's tokens/s at the steps' own rate."""
    from lstrain.train import loop

    plot = loop.plot_losses
    monkeypatch.setattr(loop, "plot_losses", lambda *args: time.sleep(4.0) or plot(*args))
    run = micro_run(tmp_path, steps=4)
    run.eval.freq = 2
    train(run, progress=False, echo=_quiet)
    records = [json.loads(line) for line in (tmp_path / "metrics" / "metrics.jsonl").read_text().splitlines()]
    rates = {r["step"]: r["tokens_per_s"] for r in records if "tokens_per_s" in r}
    # step 3's interval follows step 2's evaluation; step 2's holds the first steps' warm-up
    assert rates[3] > 0.4 * rates[4], rates


def test_resume_keeps_the_recipes_optimizer_hyperparameters(tmp_path, monkeypatch):
    """lr follows the recipe every step; betas, eps and weight decay must too, not come back
    from the checkpoint's optimizer state (the no-decay group keeps its 0)."""
    from lstrain.train import loop

    train(micro_run(tmp_path, steps=2), progress=False, echo=_quiet)
    groups = []
    load = loop._Stepper.load_state_dict

    def recording_load(self, state):
        load(self, state)
        groups.extend({k: g[k] for k in ("betas", "eps", "weight_decay")} for g in self.optimizer.param_groups)

    monkeypatch.setattr(loop._Stepper, "load_state_dict", recording_load)
    run = micro_run(tmp_path, steps=3)
    run.optimizer.betas, run.optimizer.eps, run.optimizer.weight_decay = (0.5, 0.6), 1e-3, 0.0
    train(run, resume=True, progress=False, echo=_quiet)
    assert groups == [{"betas": (0.5, 0.6), "eps": 1e-3, "weight_decay": 0.0}] * 2


def test_resuming_behind_later_checkpoints_is_refused(tmp_path):
    """Branching from step 2 while step 4 is in the folder would leave step 4 'latest' and
    let keep_latest_k delete step 2."""
    train(micro_run(tmp_path, steps=4), progress=False, echo=_quiet)
    step2 = tmp_path / "checkpoints" / "step-00000002"
    with pytest.raises(ValueError, match=r"checkpoints after step-00000002 \(step-00000004\)"):
        train(micro_run(tmp_path, steps=6), resume=step2, progress=False, echo=_quiet)
    assert [c.name for c in ckpt.list_checkpoints(tmp_path / "checkpoints")] == ["step-00000002", "step-00000004"]


def test_resume_refuses_another_seed_or_tokenizer(tmp_path):
    """Another seed draws another data order; another tokenizer (a BPE trained on other
    text: the same vocabulary size, other merges) gives the ids other meanings."""
    train(micro_run(tmp_path, steps=2), progress=False, echo=_quiet)
    with pytest.raises(ValueError, match=r"was trained with training.seed 0 \(this run: 5"):
        train(micro_run(tmp_path, steps=3, seed=5), resume=True, progress=False, echo=_quiet)
    (saved,) = ckpt.list_checkpoints(tmp_path / "checkpoints")
    state = torch.load(saved / ckpt.TRAINER_FILE, weights_only=False)
    assert len(state["tokenizer"]) == 64  # a sha256 of the tokenizer
    state["tokenizer"] = "0" * 64
    torch.save(state, saved / ckpt.TRAINER_FILE)
    with pytest.raises(ValueError, match="was trained with another tokenizer"):
        train(micro_run(tmp_path, steps=3), resume=True, progress=False, echo=_quiet)


def test_resume_refuses_other_data_splits(tmp_path):
    """Another val_fraction reorders the training data and trains on what was validation."""
    train(micro_run(tmp_path, steps=2), progress=False, echo=_quiet)
    run = micro_run(tmp_path, steps=3)
    run.data.val_fraction = 0.5
    with pytest.raises(ValueError, match=r"was trained with other data: train_tokens \d+ \(this run: \d+\)"):
        train(run, resume=True, progress=False, echo=_quiet)
    train(micro_run(tmp_path, steps=3), resume=True, progress=False, echo=_quiet)  # the same data resumes


@pytest.mark.parametrize(
    ("name", "peak"),
    [("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.5), ("NVIDIA H100 NVL", 835.5), ("NVIDIA H200", 989.4)],
)
def test_mfu_uses_the_devices_own_peak(monkeypatch, name, peak):
    from lstrain.train import loop

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert loop._mfu(peak / 2, torch.device("cuda"), 1) == pytest.approx(0.5)


def test_a_warmup_longer_than_the_run_is_said(tmp_path):
    run = micro_run(tmp_path, steps=2)
    run.lr_scheduler.warmup_steps = 5
    lines = []
    train(run, progress=False, echo=lines.append)
    assert any("warmup_steps 5 >= [training] steps 2: the learning rate rises" in line for line in lines)
