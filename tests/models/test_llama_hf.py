"""Llama against Hugging Face transformers: a tiny random LlamaForCausalLM saved and loaded
both ways gives the same logits, loss and gradients."""

import copy
import json

import pytest
import torch

from lstrain.models import Llama, LlamaConfig
from tests.conftest import DEVICE

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

# GQA, a rope_theta other than the default (so a dropped field would show), a partial pair block
SHAPE = {
    "vocab_size": 101,
    "hidden_size": 32,
    "intermediate_size": 40,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
}
THETA = 500000.0


def _hf_model(attn_implementation="eager", **overrides):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**SHAPE, **overrides}, attn_implementation=attn_implementation)
    config.rope_parameters = {"rope_type": "default", "rope_theta": THETA}
    return transformers.LlamaForCausalLM(config).to(DEVICE).eval()


def _inputs():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 12), generator=generator).to(DEVICE)
    labels = ids.clone()
    labels[0, :3] = -100
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0  # right padding and left padding: HF and we differ only at padded positions
    labels[1, -4:] = -100
    mask[0, :2] = 0
    return ids, labels, mask


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def hf_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_llama")
    _hf_model(tie_word_embeddings=request.param).save_pretrained(path)
    return path


def _grads_by_hf_name(model):
    """Our parameters' gradients under HF's keys (q/k/v and gate/up unpacked as state_dict does)."""
    shadow = copy.deepcopy(model)  # a module tree to run the state_dict hooks on
    with torch.no_grad():
        for p, ours in zip(shadow.parameters(), model.parameters(), strict=True):
            p.copy_(ours.grad)
    return shadow.state_dict()


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("fused", [True, False])
def test_from_pretrained_matches_hugging_face(hf_dir, fused, attn_implementation):
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation=attn_implementation).to(DEVICE)
    model = Llama.from_pretrained(hf_dir, fused=fused).to(DEVICE)
    assert not model.training and model.config.fused is fused and model.config.rope_theta == THETA
    assert model.config.tie_word_embeddings is hf.config.tie_word_embeddings
    ids, labels, mask = _inputs()
    expected = hf(ids, labels=labels, attention_mask=mask)
    logits = model(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(logits[keep], expected.logits[keep])
    loss = model(ids, labels=labels, attention_mask=mask).loss
    torch.testing.assert_close(loss, expected.loss)
    expected.loss.backward()
    loss.backward()
    ours = _grads_by_hf_name(model)
    for name, p in hf.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, msg=lambda m, name=name: f"grad {name}: {m}")


@pytest.mark.parametrize("fused", [True, False])
def test_position_ids_match_hugging_face(fused):
    """Left padding with positions counted from each row's first token, as HF's generate does."""
    hf = _hf_model(tie_word_embeddings=False)
    model = Llama(LlamaConfig(**SHAPE, rope_theta=THETA, fused=fused), device=DEVICE)
    model.load_state_dict(hf.state_dict())
    ids, labels, mask = _inputs()
    mask[1] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask, position_ids=positions, labels=labels)
        out = model.eval()(ids, attention_mask=mask, position_ids=positions)
        loss = model(ids, labels=labels, attention_mask=mask, position_ids=positions).loss
        shared = model(ids, position_ids=torch.arange(12, device=DEVICE)[None] + 3).logits  # [1, seq]
    keep = mask.bool()
    torch.testing.assert_close(out.logits[keep], expected.logits[keep])
    torch.testing.assert_close(loss, expected.loss)
    torch.testing.assert_close(shared, hf(ids, position_ids=torch.arange(12, device=DEVICE)[None] + 3).logits)


def test_load_state_dict_of_a_hugging_face_model():
    hf = _hf_model(tie_word_embeddings=False)
    model = Llama(LlamaConfig(**SHAPE, rope_theta=THETA), device=DEVICE)
    model.load_state_dict(hf.state_dict())
    ids, _, _ = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids).logits, hf(ids).logits)
    hf.load_state_dict(model.state_dict())  # and back


def test_save_pretrained_is_read_by_hugging_face(hf_dir, tmp_path):
    model = Llama.from_pretrained(hf_dir)
    model.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "llama" and written["rope_theta"] == THETA
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert ("lm_head.weight" in keys) is not model.config.tie_word_embeddings  # tied: stored once, as HF does
    assert "model.layers.0.self_attn.k_proj.weight" in keys and "model.layers.1.mlp.up_proj.weight" in keys
    hf, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert hf.config.rope_parameters["rope_theta"] == THETA
    ids, _, _ = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(hf.to(DEVICE)(ids).logits, model.to(DEVICE)(ids).logits)
    again = Llama.from_pretrained(tmp_path)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a.cpu(), b), name


def test_tiny_llama_config_is_the_llama_1b_preset():
    # TinyLlama-1.1B's config.json as published (transformers 4.31's spelling)
    tiny_llama = {
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 5632,
        "max_position_embeddings": 2048,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 22,
        "num_key_value_heads": 4,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "4.31.0.dev0",
        "use_cache": True,
        "vocab_size": 32000,
    }
    assert LlamaConfig.from_hf_dict(tiny_llama) == LlamaConfig.llama_1b()


def test_transformers_4_config_spelling_loads():
    hf = {**SHAPE, "model_type": "llama", "rope_theta": 1234.0, "rope_scaling": None, "torch_dtype": "bfloat16"}
    config = LlamaConfig.from_hf_dict(hf, fused=False)
    assert (config.rope_theta, config.rope_scaling, config.fused, config.head_dim) == (1234.0, None, False, 8)


def test_from_pretrained_errors_are_clear(tmp_path, hf_dir):
    with pytest.raises(FileNotFoundError, match="local directory with config.json and model.safetensors"):
        Llama.from_pretrained(tmp_path / "TinyLlama")  # a hub name is not a directory
    config = json.loads((hf_dir / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes((hf_dir / "model.safetensors").read_bytes())
    for change, message in [
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "only plain RoPE"),
        ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, "LlamaConfig: rope_scaling"),
        ({"pretraining_tp": 2}, "pretraining_tp=2"),
        ({"mlp_bias": True}, "LlamaConfig: mlp_bias"),
        ({"model_type": "mistral"}, "model_type 'mistral'"),
        (
            {"num_key_value_heads": 4},
            r"model.layers.0.self_attn.k_proj.weight has shape \(16, 32\), expected \(32, 32\)",
        ),
        ({"num_hidden_layers": 1}, r"unexpected \['model.layers.1.input_layernorm.weight'"),
        ({"num_hidden_layers": 3}, r"missing \['model.layers.2.input_layernorm.weight'"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            Llama.from_pretrained(tmp_path)


def test_a_tied_config_refuses_a_different_head(tmp_path):
    hf = _hf_model(tie_word_embeddings=False)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        Llama.from_pretrained(tmp_path)


def test_config_round_trips_through_hugging_face():
    config = LlamaConfig(**SHAPE, rope_theta=THETA, head_dim=16, attention_bias=True, tie_word_embeddings=True)
    hf = transformers.LlamaConfig(**config.to_hf_dict())
    assert LlamaConfig.from_hf_dict(hf.to_dict()) == config


@pytest.mark.gpu
def test_from_pretrained_matches_hugging_face_bf16_on_the_gpu(tmp_path):
    shape = {"num_hidden_layers": 4, "hidden_size": 512, "intermediate_size": 1408, "num_attention_heads": 8}
    hf = _hf_model(attn_implementation="sdpa", vocab_size=32000, max_position_embeddings=1024, **shape)
    hf.save_pretrained(tmp_path)
    hf = hf.bfloat16()
    model = Llama.from_pretrained(tmp_path, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, 32000, (2, 256), device="cuda")
    with torch.no_grad():
        expected = hf(ids, labels=ids)
        ours = model(ids, labels=ids).loss
        logits = model(ids).logits
        precise = hf.float()(ids, labels=ids)
    # bf16 end to end: judge against HF's own bf16 vs fp32 distance (the tolerance rule's spirit)
    allowed = 2 * (expected.logits.float() - precise.logits).abs().max() + 8e-3 * precise.logits.abs().max()
    assert (logits.float() - precise.logits).abs().max() <= allowed
    assert abs(ours.float() - precise.loss) <= 2 * abs(expected.loss.float() - precise.loss) + 2**-7 * precise.loss
