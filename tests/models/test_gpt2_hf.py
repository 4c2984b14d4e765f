"""GPT2 against Hugging Face transformers: a tiny random GPT2LMHeadModel saved and loaded
both ways gives the same logits, loss and gradients."""

import json

import pytest
import torch

from lstrain.models import GPT2, GPT2Config
from tests.conftest import DEVICE

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

SHAPE = {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 101, "n_positions": 64}


def _hf_model(attn_implementation="eager", **overrides):
    torch.manual_seed(0)
    config = transformers.GPT2Config(**{**SHAPE, **overrides}, attn_implementation=attn_implementation)
    return transformers.GPT2LMHeadModel(config).to(DEVICE).eval()


def _inputs():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 12), generator=generator).to(DEVICE)
    labels = ids.clone()
    labels[0, :3] = -100
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0  # right padding: HF and we differ only at the padded positions
    labels[1, -4:] = -100
    return ids, labels, mask


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_gpt2")
    _hf_model().save_pretrained(path)
    return path


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("fused", [True, False])
def test_from_pretrained_matches_hugging_face(hf_dir, fused, attn_implementation):
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir, attn_implementation=attn_implementation).to(DEVICE)
    model = GPT2.from_pretrained(hf_dir, fused=fused).to(DEVICE)
    assert not model.training and model.config.fused is fused
    ids, labels, mask = _inputs()
    expected = hf(ids, labels=labels, attention_mask=mask)
    logits = model(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(logits[keep], expected.logits[keep])
    loss = model(ids, labels=labels, attention_mask=mask).loss
    torch.testing.assert_close(loss, expected.loss)
    # gradients too: HF's Conv1D weights are [in, out], ours [out, in]
    expected.loss.backward()
    loss.backward()
    ours = dict(model.named_parameters())
    for name, p in hf.named_parameters():
        grad = ours[name].grad
        if name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            grad = grad.t()
        torch.testing.assert_close(grad, p.grad, msg=lambda m, name=name: f"grad {name}: {m}")


def test_save_pretrained_is_read_by_hugging_face(hf_dir, tmp_path):
    model = GPT2.from_pretrained(hf_dir)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gpt2"
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert "lm_head.weight" not in keys  # tied: stored once, as HF does
        assert tuple(f.get_tensor("transformer.h.0.attn.c_attn.weight").shape) == (32, 96)  # Conv1D's [in, out]
    hf, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ids, _, _ = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(hf.to(DEVICE)(ids).logits, model.to(DEVICE)(ids).logits)
    again = GPT2.from_pretrained(tmp_path)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a.cpu(), b), name


def test_an_older_checkpoint_without_the_prefix_loads(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = _hf_model()
    hf.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    old = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    for i in range(SHAPE["n_layer"]):  # the mask buffers old files carry
        old[f"h.{i}.attn.bias"] = torch.ones(1, 1, 64, 64)
        old[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(old, str(tmp_path / "model.safetensors"))
    model = GPT2.from_pretrained(tmp_path, fused=False)
    ids, _, _ = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(model.to(DEVICE)(ids).logits, hf(ids).logits)


def test_from_pretrained_errors_are_clear(tmp_path, hf_dir):
    with pytest.raises(FileNotFoundError, match="local directory with config.json and model.safetensors"):
        GPT2.from_pretrained(tmp_path / "gpt2")  # a hub name is not a directory
    config = json.loads((hf_dir / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes((hf_dir / "model.safetensors").read_bytes())
    for change, message in [
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
        ({"model_type": "bert"}, "model_type 'bert'"),
        ({"n_embd": 64, "n_head": 4}, r"transformer.wte.weight has shape \(101, 32\), expected \(101, 64\)"),
        ({"n_layer": 1}, r"unexpected \['transformer.h.1.attn.c_attn.bias'"),
        ({"n_layer": 3}, r"missing \['transformer.h.2.attn.c_attn.bias'"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            GPT2.from_pretrained(tmp_path)


def test_config_round_trips_through_hugging_face():
    config = GPT2Config(**SHAPE, n_inner=48, activation_function="gelu", fused=False)
    hf = transformers.GPT2Config(**config.to_hf_dict())
    assert GPT2Config.from_hf_dict(hf.to_dict(), fused=False) == config


@pytest.mark.gpu
def test_from_pretrained_matches_hugging_face_bf16_on_the_gpu(tmp_path):
    hf = _hf_model(attn_implementation="sdpa", n_layer=4, n_embd=512, n_head=8, vocab_size=50257, n_positions=1024)
    hf.save_pretrained(tmp_path)
    hf = hf.bfloat16()
    model = GPT2.from_pretrained(tmp_path, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, 50257, (2, 256), device="cuda")
    with torch.no_grad():
        expected = hf(ids, labels=ids)
        ours = model(ids, labels=ids).loss
        logits = model(ids).logits
    # bf16 end to end: HF and lstrain round differently; judge against HF's own bf16 vs
    # fp32 distance (the tolerance rule's spirit, with HF as PyTorch)
    with torch.no_grad():
        precise = hf.float()(ids, labels=ids)
    allowed = 2 * (expected.logits.float() - precise.logits).abs().max() + 8e-3 * precise.logits.abs().max()
    assert (logits.float() - precise.logits).abs().max() <= allowed
    # the fused loss comes back in bf16 (linear_cross_entropy returns hidden's dtype): one ulp more
    assert abs(ours.float() - precise.loss) <= 2 * abs(expected.loss.float() - precise.loss) + 2**-7 * precise.loss
