"""``[model] name = "bert"``: a micro BERT trained by the loop (MLM, fixed masked positions),
its HF checkpoints, exact resume, the data-position check on resume, and bad input."""

import dataclasses
import json

import pytest
import torch

from lstrain import _backend
from lstrain.models import GPT2, BertForMaskedLM, GPT2Config
from lstrain.train import checkpoint as ckpt
from lstrain.train import train
from tests.train.helpers import micro_bert_run

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or _backend.interpreter_active()),
    reason="FusedAdamW on the CPU needs the Triton interpreter",
)

STEPS = 6


def _quiet(line: str) -> None:
    pass


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """An uninterrupted micro BERT run: 6 steps, a checkpoint every 2 (all kept)."""
    folder = tmp_path_factory.mktemp("bert")
    return folder, train(micro_bert_run(folder, steps=STEPS), progress=False, echo=_quiet)


def test_a_micro_bert_trains_and_writes_checkpoints_hugging_face_loads(whole):
    folder, summary = whole
    losses = list(summary.losses.values())
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.2  # measured: 5.53 -> 5.02
    assert summary.eval_loss is not None and summary.sample is None  # BERT generates no sample
    assert summary.tokens == STEPS * 4 * 32 and summary.tflops > 0
    assert [p.name for p in ckpt.list_checkpoints(folder / "checkpoints")] == [
        "step-00000002",
        "step-00000004",
        "step-00000006",
    ]
    last = summary.checkpoint
    config = json.loads((last / "config.json").read_text())
    assert config["model_type"] == "bert" and config["architectures"] == ["BertForMaskedLM"]
    assert config["vocab_size"] == 259 and config["pad_token_id"] == 1  # the byte tokenizer's pad id
    ours = BertForMaskedLM.from_pretrained(last)
    for key, value in summary.model.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value.cpu()), key
    state = ckpt.load_trainer_state(last)
    assert state["data"] == {"sequences_per_step": 4, "seq_len": 32}
    transformers = pytest.importorskip("transformers")
    hf, info = transformers.BertForMaskedLM.from_pretrained(last, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ids = torch.randint(3, 259, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids).logits, rtol=1e-4, atol=1e-4)
    records = [json.loads(line) for line in (folder / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["run"]["model"]["name"] == "bert"


def test_a_resumed_bert_run_continues_bit_for_bit(whole, tmp_path):
    folder, uninterrupted = whole
    start = folder / "checkpoints" / "step-00000002"
    resumed = train(micro_bert_run(tmp_path, steps=STEPS), resume=start, progress=False, echo=_quiet)
    assert sorted(resumed.losses) == list(range(3, STEPS + 1))
    assert resumed.losses == {s: uninterrupted.losses[s] for s in resumed.losses}  # bit for bit
    assert resumed.eval_loss == uninterrupted.eval_loss
    for (key, a), b in zip(resumed.model.state_dict().items(), uninterrupted.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), key


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"local_batch_size": 2},
            r"sequences_per_step 4 and seq_len 32 \(this run: 2 and 32; sequences_per_step = local_batch_size x",
        ),
        ({"seq_len": 16}, r"sequences_per_step 4 and seq_len 32 \(this run: 4 and 16;"),
        ({"local_batch_size": 2, "gradient_accumulation_steps": 2}, None),  # 4 sequences a step still: exact
    ],
)
def test_resume_refuses_another_batch_or_seq_len_unless_allowed(whole, tmp_path, change, message):
    folder, _ = whole
    start = folder / "checkpoints" / "step-00000004"
    run = micro_bert_run(tmp_path, steps=5, **change)
    if message is None:
        summary = train(run, resume=start, progress=False, echo=_quiet)
        assert list(summary.losses) == [5]
        return
    with pytest.raises(ValueError, match=f"was trained with {message}.*--allow-batch-change"):
        train(run, resume=start, progress=False, echo=_quiet)
    assert not (tmp_path / "metrics").exists()
    lines = []
    summary = train(run, resume=start, progress=False, echo=lines.append, allow_batch_change=True)
    assert list(summary.losses) == [5] and any("--allow-batch-change" in line for line in lines)


def test_an_old_trainer_state_is_checked_from_its_recipe(whole):
    folder, _ = whole
    state = ckpt.load_trainer_state(folder / "checkpoints" / "step-00000002")
    del state["data"]  # written before the trainer state held the data position
    assert ckpt.data_mismatch(state, {"sequences_per_step": 4, "seq_len": 32}) is None
    assert "this run: 8 and 32" in ckpt.data_mismatch(state, {"sequences_per_step": 8, "seq_len": 32})


def test_the_labels_only_loss_and_the_fused_model_train_too(tmp_path):
    """HF-style masking (no fixed positions) through the labels path, and lstrain's kernels
    (in the interpreter) on the fixed positions: the fused run takes the plain run's losses."""
    labels_only = train(micro_bert_run(tmp_path / "labels", steps=2, max_predictions=None), progress=False, echo=_quiet)
    assert all(0 < v < 10 for v in labels_only.losses.values())
    plain = train(micro_bert_run(tmp_path / "plain", steps=2, dropout=0.0), progress=False, echo=_quiet)
    fused = train(micro_bert_run(tmp_path / "fused", steps=2, dropout=0.0, fused=True), progress=False, echo=_quiet)
    for step, loss in plain.losses.items():
        assert fused.losses[step] == pytest.approx(loss, rel=1e-4)


def _gpt2_checkpoint(folder):
    model = GPT2(GPT2Config(vocab_size=259, n_positions=32, n_embd=16, n_layer=1, n_head=2, fused=False))
    return ckpt.save_checkpoint(folder, 3, model, {"step": 3}, keep=2)


@pytest.mark.parametrize(
    "case", ["seq_len", "sample", "cuda_graphs without fixed positions", "predictions", "gpt2 checkpoint", "gpt2 data"]
)
def test_bad_bert_input_is_refused_before_any_step(tmp_path, case):
    run = micro_bert_run(tmp_path)
    kwargs = {}
    expected = {
        "seq_len": (ValueError, "seq_len 64 exceeds the model's max_position_embeddings 32"),
        "sample": (ValueError, r"\[sample\]: BERT does not generate text"),
        "cuda_graphs without fixed positions": (ValueError, "cuda_graphs with BERT needs .data. max_predictions_per"),
        "predictions": (ValueError, "max_predictions_per_seq: 40 exceeds seq_len 32"),
        "gpt2 checkpoint": (ValueError, "holds another model: .*model_type: checkpoint 'gpt2', recipe 'bert'"),
        "gpt2 data": (ValueError, "bert trains on masked-LM data, but the data given is not"),
    }[case]
    if case == "seq_len":
        run.training.seq_len = 64
    elif case == "sample":
        run.sample.max_new_tokens = 8
    elif case == "cuda_graphs without fixed positions":
        run.data.max_predictions_per_seq = None
        run.training.cuda_graphs = True
    elif case == "predictions":
        run.data.max_predictions_per_seq = 40
    elif case == "gpt2 checkpoint":
        _gpt2_checkpoint(tmp_path / "checkpoints")
        kwargs["resume"] = True
    else:
        from lstrain.data import build_data

        causal = dataclasses.replace(run.data, max_predictions_per_seq=None)  # a GPT-2 recipe's data section
        kwargs["data"] = build_data(causal, seq_len=32, mlm=False)
    before = sorted(p.name for p in (tmp_path / "checkpoints").glob("*"))
    with pytest.raises(expected[0], match=expected[1]):
        train(run, progress=False, echo=_quiet, **kwargs)
    assert not (tmp_path / "metrics").exists()  # nothing written
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*")) == before


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_captured_bert_steps_are_the_eager_steps_on_the_gpu(tmp_path, precision):
    """lstrain's kernels on the GPU: the captured BERT step (fixed masked positions, no
    host sync) takes the eager step's losses, with eval and checkpoints in between."""

    def run(name, **options):
        config = micro_bert_run(tmp_path / name, steps=8, dropout=0.0, fused=True, mixed_precision=precision, **options)
        return train(config, progress=False, echo=_quiet)

    eager, captured = run("eager"), run("captured", cuda_graphs=True)
    losses = list(eager.losses.values())
    assert losses[-1] < losses[0]
    for step, loss in eager.losses.items():
        assert captured.losses[step] == pytest.approx(loss, rel=2e-2 if precision != "fp32" else 1e-4)


def test_gradient_accumulation_weighs_every_masked_token_alike(tmp_path):
    """Micro-batches mask different numbers of tokens: the accumulated step is the mean over
    all of the step's masked tokens, as the whole batch's is (not a mean of the
    micro-batches' means, which weighs a token of a sparsely masked micro-batch more)."""
    kwargs = {"steps": 2, "dropout": 0.0, "max_predictions": None}  # HF's masking: a count per row drawn
    whole = train(micro_bert_run(tmp_path / "whole", local_batch_size=4, **kwargs), progress=False, echo=_quiet)
    run = micro_bert_run(tmp_path / "accumulated", local_batch_size=1, global_batch_size=4, **kwargs)
    assert run.training.accumulation(world_size=1) == 4
    accumulated = train(run, progress=False, echo=_quiet)
    for step, loss in whole.losses.items():
        assert accumulated.losses[step] == pytest.approx(loss, rel=1e-5)
    for (key, a), b in zip(whole.model.state_dict().items(), accumulated.model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=key)
