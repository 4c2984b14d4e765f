"""BertForMaskedLM against Hugging Face transformers: a tiny random HF BertForMaskedLM saved
and loaded both ways gives the same logits, loss and gradients."""

import json

import pytest
import torch

from lstrain.models import BertConfig, BertForMaskedLM
from lstrain.models.bert import HF_LAYER_NAMES
from tests.conftest import DEVICE

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

SHAPE = {
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "intermediate_size": 48,
    "vocab_size": 101,
    "max_position_embeddings": 64,
    "type_vocab_size": 2,
}


def _hf_model(attn_implementation="eager", **overrides):
    torch.manual_seed(0)
    config = transformers.BertConfig(**{**SHAPE, **overrides}, attn_implementation=attn_implementation)
    model = transformers.BertForMaskedLM(config)
    with torch.no_grad():  # HF's init leaves the pad row and the biases zero; make them count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.to(DEVICE).eval()


def _inputs(vocab=SHAPE["vocab_size"], size=(2, 12)):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, size, generator=generator)
    labels = torch.where(torch.rand(size, generator=generator) < 0.3, ids, -100)
    labels[0, 2] = ids[0, 2]
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0  # right padding, with pad tokens (id 0)
    ids[1, -4:] = 0
    labels[1, -4:] = -100
    types = torch.zeros_like(ids)
    types[:, size[1] // 2 :] = 1  # a second segment
    return ids.to(DEVICE), labels.to(DEVICE), mask.to(DEVICE), types.to(DEVICE)


def _hf_grad(name, ours):
    """Our gradient for HF parameter ``name`` (c_attn's rows split back into q, k, v)."""
    for module, hf_names in HF_LAYER_NAMES.items():
        for index, hf_name in enumerate(hf_names):
            if f".{hf_name}." in name:
                layer = name.split(".")[3]
                grad = ours[f"bert.encoder.layer.{layer}.{module}.{name.rsplit('.', 1)[1]}"].grad
                return grad.chunk(len(hf_names))[index]
    return ours[name].grad


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_bert")
    _hf_model().save_pretrained(path)
    return path


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("fused", [True, False])
def test_from_pretrained_matches_hugging_face(hf_dir, fused, attn_implementation):
    hf = transformers.BertForMaskedLM.from_pretrained(hf_dir, attn_implementation=attn_implementation).to(DEVICE)
    model = BertForMaskedLM.from_pretrained(hf_dir, fused=fused).to(DEVICE)
    assert not model.training and model.config.fused is fused
    ids, labels, mask, types = _inputs()
    expected = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels)
    # every position, padded ones too: bidirectional attention masks keys, not queries
    torch.testing.assert_close(model(ids, mask, types).logits, expected.logits)
    loss = model(ids, mask, types, labels=labels).loss
    torch.testing.assert_close(loss, expected.loss)
    expected.loss.backward()
    loss.backward()
    ours = dict(model.named_parameters())
    for name, p in hf.named_parameters():  # the tied decoder is not listed twice
        torch.testing.assert_close(_hf_grad(name, ours), p.grad, msg=lambda m, name=name: f"grad {name}: {m}")


def test_save_pretrained_is_read_by_hugging_face(hf_dir, tmp_path):
    model = BertForMaskedLM.from_pretrained(hf_dir)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "bert"
    from safetensors import safe_open

    with (
        safe_open(str(tmp_path / "model.safetensors"), "pt") as f,
        safe_open(str(hf_dir / "model.safetensors"), "pt") as g,
    ):
        assert set(f.keys()) == set(g.keys())  # HF's own keys, the tied decoder stored once
        for key in g.keys():
            assert torch.equal(f.get_tensor(key), g.get_tensor(key)), key
    hf, info = transformers.BertForMaskedLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ids, _, mask, types = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(hf.to(DEVICE)(ids, mask, types).logits, model.to(DEVICE)(ids, mask, types).logits)
    again = BertForMaskedLM.from_pretrained(tmp_path)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a.cpu(), b), name


def test_an_old_pretraining_checkpoint_loads(tmp_path):
    # bert-base-uncased's file: BertForPreTraining (pooler, next-sentence head), LayerNorm
    # gamma / beta, the position-id buffer, and the decoder stored apart from the word table
    from safetensors.torch import load_file, save_file

    hf = _hf_model()
    hf.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    old = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
           for k, v in tensors.items()}  # fmt: skip
    old["bert.embeddings.position_ids"] = torch.arange(64)[None]
    old["bert.pooler.dense.weight"], old["bert.pooler.dense.bias"] = torch.zeros(32, 32), torch.zeros(32)
    old["cls.seq_relationship.weight"], old["cls.seq_relationship.bias"] = torch.zeros(2, 32), torch.zeros(2)
    old["cls.predictions.decoder.weight"] = tensors["bert.embeddings.word_embeddings.weight"].clone()
    save_file(old, str(tmp_path / "model.safetensors"))
    model = BertForMaskedLM.from_pretrained(tmp_path, fused=False)
    ids, _, mask, types = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(model.to(DEVICE)(ids, mask, types).logits, hf(ids, mask, types).logits)


def test_from_pretrained_errors_are_clear(tmp_path, hf_dir):
    from safetensors.torch import load_file, save_file

    with pytest.raises(FileNotFoundError, match="local directory with config.json and model.safetensors"):
        BertForMaskedLM.from_pretrained(tmp_path / "bert-base-uncased")  # a hub name is not a directory
    config = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for change, message in [
        ({"position_embedding_type": "relative_key"}, "position_embedding_type='relative_key'"),
        ({"is_decoder": True}, "is_decoder=True"),
        ({"model_type": "roberta"}, "model_type 'roberta'"),
        ({"hidden_act": "gelu_fast"}, "BertConfig: hidden_act"),
        (
            {"hidden_size": 64},
            r"bert.embeddings.word_embeddings.weight has shape \(101, 32\), expected \(101, 64\)",
        ),
        ({"num_hidden_layers": 1}, r"unexpected \['bert.encoder.layer.1.attention.output.LayerNorm.bias'"),
        ({"num_hidden_layers": 3}, r"missing \['bert.encoder.layer.2.attention.output.LayerNorm.bias'"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            BertForMaskedLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    for change, message in [
        ({"bert.encoder.layer.0.attention.self.key.weight": None}, r"missing \['bert.encoder.layer.0.attention.self"),
        ({"cls.predictions.decoder.weight": torch.zeros(101, 32)}, "decoder.weight differs from bert.embeddings"),
    ]:
        edited = {k: v for k, v in {**tensors, **change}.items() if v is not None}
        save_file(edited, str(tmp_path / "model.safetensors"))
        with pytest.raises(ValueError, match=message):
            BertForMaskedLM.from_pretrained(tmp_path)


def test_config_round_trips_through_hugging_face():
    config = BertConfig(**SHAPE, hidden_act="gelu_new", pad_token_id=3, layer_norm_eps=1e-6, fused=False)
    hf = transformers.BertConfig(**config.to_hf_dict())
    assert BertConfig.from_hf_dict(hf.to_dict(), fused=False) == config


@pytest.mark.gpu
def test_from_pretrained_matches_hugging_face_bf16_on_the_gpu(tmp_path):
    shape = {"num_hidden_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "intermediate_size": 2048}
    hf = _hf_model(attn_implementation="sdpa", **shape, vocab_size=30522, max_position_embeddings=512)
    hf.save_pretrained(tmp_path)
    hf = hf.bfloat16()
    model = BertForMaskedLM.from_pretrained(tmp_path, dtype=torch.bfloat16, device="cuda")
    ids, labels, mask, types = _inputs(vocab=30522, size=(4, 256))
    with torch.no_grad():
        expected = hf(ids, mask, types, labels=labels)
        ours = model(ids, mask, types, labels=labels).loss
        logits = model(ids, mask, types).logits
        precise = hf.float()(ids, mask, types, labels=labels)
    # bf16 end to end: HF and lstrain round differently; judge against HF's own bf16 vs
    # fp32 distance (the tolerance rule's spirit, with HF as PyTorch)
    allowed = 2 * (expected.logits.float() - precise.logits).abs().max() + 8e-3 * precise.logits.abs().max()
    assert (logits.float() - precise.logits).abs().max() <= allowed
    # the fused loss comes back in bf16 (linear_cross_entropy returns hidden's dtype): one ulp more
    assert abs(ours.float() - precise.loss) <= 2 * abs(expected.loss.float() - precise.loss) + 2**-7 * precise.loss
