"""The step's pieces that the CUDA-graph capture relies on, checked eagerly on the CPU."""

import dataclasses

import pytest
import torch

from lstrain import _backend
from lstrain.data import build_data
from lstrain.models import GPT2
from lstrain.train.capture import rewind, snapshot
from lstrain.train.families import FAMILIES
from lstrain.train.loop import _optimizer_label, _Stepper, _to_device, _World
from tests.train.helpers import micro_run

pytestmark = pytest.mark.skipif(
    not _backend.interpreter_active(), reason="FusedAdamW on the CPU needs the Triton interpreter: a CPU-only run"
)

GPT2_TOKENS = FAMILIES["gpt2"].loss_tokens


def _stepper(run):
    torch.manual_seed(0)
    model = GPT2(run.model.build(259)).train()
    return _Stepper(run, model, _World(0, 1, torch.device("cpu"), False), 2, GPT2_TOKENS)


def test_warm_up_steps_are_undone_before_the_capture(tmp_path):
    """The captured step warms up with real steps and then restores everything: the first
    step after that restore is the first step of a fresh run."""
    run = micro_run(tmp_path, steps=4)
    data = build_data(run.data, seq_len=32, seed=0)
    batches = [_to_device(data.train.batch(m, 2), torch.device("cpu")) for m in range(2)]
    fresh, warmed = _stepper(run), _stepper(run)
    saved = snapshot((warmed.model, warmed.optimizer))
    for _ in range(3):
        warmed.eager(batches)
    rewind((warmed.model, warmed.optimizer), saved)
    torch.manual_seed(7)
    expected = fresh.eager(batches)
    torch.manual_seed(7)
    got = warmed.eager(batches)
    assert torch.equal(expected, got)
    for (key, a), b in zip(fresh.model.state_dict().items(), warmed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), key
    assert fresh.optimizer.state_dict()["state"].keys() == warmed.optimizer.state_dict()["state"].keys()


def test_the_optimizer_section_can_drop_master_weights(tmp_path, monkeypatch):
    run = micro_run(tmp_path, steps=2, mixed_precision="bf16")
    run.optimizer = dataclasses.replace(run.optimizer, master_weights=False, state_dtype="bfloat16")
    torch.manual_seed(0)
    model = GPT2(run.model.build(259)).to(torch.bfloat16).train()
    stepper = _Stepper(run, model, _World(0, 1, torch.device("cpu"), False), 1, GPT2_TOKENS)
    assert stepper.optimizer.master_weights is False and stepper.optimizer.state_dtype == torch.bfloat16
    assert _optimizer_label(stepper) == "FusedAdamW (no master weights, bfloat16 moments, rounded stochastically)"
    data = build_data(run.data, seq_len=32, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    assert torch.isfinite(stepper.eager([_to_device(data.train.batch(0, 2), torch.device("cpu"))]))
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in stepper.optimizer.state.values())
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    # where torch's AdamW would stand in (no CUDA, no interpreter), it would round to nearest: refused
    monkeypatch.setattr(_backend, "interpreter_active", lambda: False)
    with pytest.raises(ValueError, match="round stochastically in lstrain's FusedAdamW"):
        _Stepper(run, GPT2(run.model.build(259)), _World(0, 1, torch.device("cpu"), False), 1, GPT2_TOKENS)


def test_a_micro_batch_without_loss_tokens_weighs_nothing(tmp_path):
    """Its mean loss is NaN (0 / 0): the step is the other micro-batches' alone, not NaN."""
    run = micro_run(tmp_path, steps=2, dropout=0.0)
    data = build_data(run.data, seq_len=32, seed=0)
    batch = _to_device(data.train.batch(0, 2), torch.device("cpu"))
    ignored = {**batch, "labels": torch.full_like(batch["labels"], -100)}
    torch.manual_seed(0)
    alone = _Stepper(run, GPT2(run.model.build(259)).train(), _World(0, 1, torch.device("cpu"), False), 1, GPT2_TOKENS)
    paired = _stepper(run)
    expected = alone.eager([batch])
    got = paired.eager([batch, ignored])
    assert torch.isfinite(got) and got == pytest.approx(float(expected), rel=1e-6)
    for (key, a), b in zip(alone.model.state_dict().items(), paired.model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=key)
