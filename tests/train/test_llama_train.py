"""``[model] name = "llama"``: a micro LLaMA trained by the loop, its checkpoints in HF's
LlamaForCausalLM layout, and the llama-1b recipe's config."""

import json

import pytest
import torch

from lstrain import _backend
from lstrain.config import load_recipe
from lstrain.models import Llama, LlamaConfig
from lstrain.train import ModelConfig, train
from tests.train.helpers import micro_run

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or _backend.interpreter_active()),
    reason="FusedAdamW on the CPU needs the Triton interpreter",
)


def _quiet(line: str) -> None:
    pass


def test_a_micro_llama_trains_and_writes_checkpoints_hugging_face_loads(tmp_path):
    run = micro_run(tmp_path, steps=4)
    fields = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 32}  # fmt: skip
    run.model = ModelConfig(name="llama", fields=fields)
    run.sample.max_new_tokens = 4
    summary = train(run, progress=False, echo=_quiet)
    losses = list(summary.losses.values())
    assert len(losses) == 4 and losses[-1] < losses[0] and isinstance(summary.sample, str)
    config = json.loads((summary.checkpoint / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 259
    ours = Llama.from_pretrained(summary.checkpoint)
    for key, value in summary.model.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value.cpu()), key
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(summary.checkpoint)
    ids = torch.randint(0, 259, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids).logits, rtol=1e-4, atol=1e-4)


def test_the_llama_1b_recipe_is_tinyllama_s_shape():
    run = load_recipe("recipes/llama-1b.toml")
    config = run.model.build(32000)
    assert config == LlamaConfig.llama_1b(vocab_size=32000)
    assert (run.training.local_batch_size, run.training.seq_len) == (4, 2048)
