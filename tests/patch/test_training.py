"""A patched model trains as the unpatched one: HF Trainer with gradient accumulation,
gradient checkpointing and torch.compile."""

from __future__ import annotations

import copy
import time

import pytest
import torch

import lstrain
from lstrain.patch import loss as patch_loss
from tests.patch.test_instance import DEVICE, TOLERANCE, VOCAB, _batch, _loss_and_grads
from tests.patch.test_llama import _model

transformers = pytest.importorskip("transformers")


class _Dataset(torch.utils.data.Dataset):
    """Eight rows of 12 tokens whose labels ignore a different number of tokens each, so
    that the mean over an accumulated batch differs from the mean of micro-batch means."""

    def __init__(self):
        generator = torch.Generator().manual_seed(2)
        self.input_ids = torch.randint(0, VOCAB, (8, 12), generator=generator)
        self.labels = self.input_ids.clone()
        for row in range(8):
            self.labels[row, : row + 1] = -100

    def __len__(self):
        return len(self.input_ids)

    def __getitem__(self, index):
        return {"input_ids": self.input_ids[index], "labels": self.labels[index]}


class _RecordingTrainer(transformers.Trainer):
    """A Trainer that keeps each micro-batch's loss as ``training_step`` returns it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.losses = []

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.losses.append(loss.detach().clone())
        return loss


def _train(model, tmp_path, optimizer=None, **options):
    """Three steps of two accumulated micro-batches under HF Trainer, with ``optimizer``
    (None: the Trainer's AdamW) and ``options`` over these TrainingArguments."""
    pytest.importorskip("accelerate")  # transformers.Trainer needs it
    arguments = dict(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=DEVICE == "cpu", seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = _RecordingTrainer(
        model=model,
        args=transformers.TrainingArguments(**(arguments | options)),
        train_dataset=_Dataset(),
        optimizers=(optimizer, None),
    )
    trainer.train()
    return trainer


def test_hf_trainer_with_gradient_accumulation_matches_unpatched(tmp_path, monkeypatch):
    seen = []
    causal = patch_loss.LOSSES["causal"]

    def recording_loss(*args, **kwargs):
        seen.append(kwargs.get("num_items_in_batch"))
        return causal(*args, **kwargs)

    monkeypatch.setitem(patch_loss.LOSSES, "causal", recording_loss)
    reference = _model("llama", layers=1)  # one layer: the Triton interpreter's time is most of this test's
    model = copy.deepcopy(reference)
    lstrain.patch(model)
    expected = _train(reference, tmp_path / "reference")
    got = _train(model, tmp_path / "patched")
    assert expected.model_accepts_loss_kwargs and got.model_accepts_loss_kwargs
    # Each micro-batch's loss went through lstrain with the accumulated batch's token count.
    assert len(seen) == len(got.losses) == 3 * 2 and all(torch.is_tensor(n) for n in seen)
    torch.testing.assert_close(torch.stack(got.losses), torch.stack(expected.losses), **TOLERANCE)
    logged = [[entry["loss"] for entry in t.state.log_history if "loss" in entry] for t in (got, expected)]
    assert len(logged[0]) == 3 and logged[0] == pytest.approx(logged[1], rel=1e-4)
    # Adam divides each gradient by its own magnitude, so a gradient entry near Adam's eps
    # moves its weight by up to lr: the weights get an absolute bound of lr / 10. (Adam does
    # not see a wrong num_items_in_batch, a constant factor: the losses above do.)
    weights = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter, weights[name], rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("flat_grads", [True, False])
def test_hf_trainer_with_lstrains_optimizer_matches_torchs(tmp_path, flat_grads):
    # A script's likely next step after patching: lstrain's FusedAdamW (with flat gradient
    # buffers, the projections' weight gradients written into them) under the Trainer's
    # clipping, schedule, accumulation and model.zero_grad(), against torch's AdamW on the
    # unpatched model. Adam's eps of 1e-2 (above these gradients' entries) makes an update
    # scale with its gradient, so clipping (to 0.5 from norms of ~1.5) shows in the losses and
    # weights, as does weight decay: skipping either fails this test.
    from lstrain.optim import FusedAdamW

    reference = _model("llama", layers=1)
    model = copy.deepcopy(reference)
    lstrain.patch(model)
    options = {"max_grad_norm": 0.5, "lr_scheduler_type": "linear", "warmup_steps": 0}
    hyper = {"lr": 1e-3, "weight_decay": 0.1, "eps": 1e-2}
    expected = _train(reference, tmp_path / "reference", torch.optim.AdamW(reference.parameters(), **hyper), **options)
    optimizer = FusedAdamW(model.parameters(), flat_grads=flat_grads, **hyper)
    got = _train(model, tmp_path / "patched", optimizer, **options)
    logged = [
        [e[key] for e in t.state.log_history if "loss" in e for key in ("loss", "grad_norm")] for t in (got, expected)
    ]
    assert len(logged[0]) == 2 * 3 and logged[0] == pytest.approx(logged[1], rel=1e-5)
    weights = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter, weights[name], **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")


def test_gradient_checkpointing_matches_unpatched():
    reference = _model("llama")
    model = copy.deepcopy(reference)
    lstrain.patch(model)
    # transformers 5.2x renamed it activation_checkpointing_enable (the old name warns)
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    model.train()
    reference.train()
    assert model.model.layers[0].gradient_checkpointing
    input_ids, labels = _batch(False)
    expected, expected_grads = _loss_and_grads(reference, input_ids, labels)
    got, grads = _loss_and_grads(model, input_ids, labels)
    torch.testing.assert_close(got.loss, expected.loss, **TOLERANCE)
    assert grads.keys() == expected_grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[key], **TOLERANCE, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3: the head norms in the attention
def test_torch_compile_of_a_patched_model_matches_eager(family):
    # aot_eager on the CPU: Inductor's C++ compile of this 2-layer model took 42 s on the
    # shared 2-core CPU, most of the patch tests' budget; on a GPU, Inductor. The patched
    # forward compiles as two graphs (the model; the loss) around one deliberate break.
    backend = "inductor" if DEVICE == "cuda" else "aot_eager"
    model = _model(family, layers=1)
    lstrain.patch(model)
    input_ids, labels = _batch(False)
    expected, expected_grads = _loss_and_grads(model, input_ids, labels)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    start = time.perf_counter()
    got, grads = _loss_and_grads(compiled, input_ids, labels)
    assert time.perf_counter() - start < 120
    assert got.logits is None
    torch.testing.assert_close(got.loss, expected.loss, **TOLERANCE)
    for key, grad in grads.items():
        name = key.removeprefix("_orig_mod.")
        torch.testing.assert_close(grad, expected_grads[name], **TOLERANCE, msg=lambda m, key=key: f"{key}: {m}")
