"""lstrain.patch's SDPA mask skip: no mask tensor for unpadded causal / bidirectional attention
also while transformers counts itself as tracing (CUDA-graph capture, torch.compile)."""

from __future__ import annotations

import copy

import pytest
import torch

import lstrain
from lstrain.patch.attention import SKIP_SDPA, register_skip_sdpa
from tests.patch.test_instance import VOCAB
from tests.patch.test_instance import _bert as bert_model
from tests.patch.test_instance import _gpt2 as gpt2_model

transformers = pytest.importorskip("transformers")
masking = pytest.importorskip("transformers.masking_utils")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6} if DEVICE == "cpu" else {"rtol": 1e-4, "atol": 1e-5}


def _gpt2():
    return gpt2_model(attn_implementation="sdpa", use_cache=False)


def _bert():
    return bert_model(attn_implementation="sdpa")


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(DEVICE)


MODELS = {"gpt2": _gpt2, "bert": _bert, "llama": _llama}


def _sdpa_masks(monkeypatch) -> list:
    """Record the attn_mask of every SDPA call."""
    masks = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, attn_mask=None, **kwargs):
        masks.append(attn_mask)
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return masks


def _mask_arguments(**overrides) -> dict:
    arguments = {
        "batch_size": 2, "q_length": 6, "kv_length": 6, "q_offset": 0, "kv_offset": 0,
        "mask_function": masking.causal_mask_function, "attention_mask": None, "allow_is_causal_skip": True,
        "dtype": torch.float32, "device": "cpu",
    }  # fmt: skip
    return arguments | overrides


def _transformers_tracing(monkeypatch) -> None:
    """Make transformers' mask code believe it is tracing, as under CUDA-graph capture."""
    monkeypatch.setattr(masking, "is_tracing", lambda *args, **kwargs: True)


def test_mask_function_skips_while_tracing(monkeypatch):
    register_skip_sdpa()
    _transformers_tracing(monkeypatch)
    mask = masking.ALL_MASK_ATTENTION_FUNCTIONS[SKIP_SDPA]
    assert mask(**_mask_arguments()) is None
    assert mask(**_mask_arguments(q_length=1, kv_length=7)) is None
    bidirectional = _mask_arguments(
        mask_function=masking.bidirectional_mask_function, allow_is_causal_skip=False, allow_is_bidirectional_skip=True
    )
    assert mask(**bidirectional) is None


@pytest.mark.parametrize(
    "overrides",
    [
        {"attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6], dtype=torch.bool)},  # padding
        {"local_size": 4},  # a sliding window shorter than the keys
        {"q_length": 3, "kv_length": 6, "q_offset": 3},  # queries after a cache
        {"allow_is_causal_skip": False},  # transformers' own reasons (packed sequences, extra masks)
    ],
    ids=["padding", "sliding-window", "offset-queries", "no-skip-allowed"],
)
def test_mask_function_builds_transformers_mask_otherwise(overrides):
    register_skip_sdpa()
    arguments = _mask_arguments(**overrides)
    expected = masking.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](**arguments)
    assert expected is not None
    assert torch.equal(masking.ALL_MASK_ATTENTION_FUNCTIONS[SKIP_SDPA](**arguments), expected)


@pytest.mark.parametrize("name", MODELS)
def test_patched_model_attends_without_a_mask_while_tracing(name, monkeypatch):
    reference = MODELS[name]()
    model = copy.deepcopy(reference)
    report = lstrain.patch(model)
    assert model.config._attn_implementation == SKIP_SDPA
    assert ("config", "attention 'sdpa'", f"attention {SKIP_SDPA!r}") in [
        (s.path, s.old_type, s.new_type) for s in report.swapped
    ]
    input_ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    masks = _sdpa_masks(monkeypatch)
    _transformers_tracing(monkeypatch)
    with torch.no_grad():
        loss = model(input_ids=input_ids, labels=input_ids).loss
    assert len(masks) == 2 and all(mask is None for mask in masks)
    monkeypatch.undo()
    with torch.no_grad():
        expected = reference(input_ids=input_ids, labels=input_ids).loss
    torch.testing.assert_close(loss, expected, **TOLERANCE)


@pytest.mark.parametrize("name", MODELS)
def test_patched_model_keeps_padding_masks(name):
    reference = MODELS[name]()
    model = copy.deepcopy(reference)
    lstrain.patch(model)
    input_ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, 8:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    with torch.no_grad():
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        expected = reference(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    torch.testing.assert_close(loss, expected, **TOLERANCE)


def test_given_position_ids_keep_transformers_packed_sequence_check(monkeypatch):
    reference = _llama()
    model = copy.deepcopy(reference)
    lstrain.patch(model)
    input_ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    packed = torch.cat([torch.arange(5), torch.arange(7)]).expand(2, -1).to(DEVICE)  # two sequences a row
    masks = _sdpa_masks(monkeypatch)
    _transformers_tracing(monkeypatch)
    with torch.no_grad():
        loss = model(input_ids=input_ids, position_ids=packed, labels=input_ids).loss
    assert len(masks) == 2 and all(mask is not None for mask in masks)
    monkeypatch.undo()
    with torch.no_grad():
        expected = reference(input_ids=input_ids, position_ids=packed, labels=input_ids).loss
    torch.testing.assert_close(loss, expected, **TOLERANCE)


def test_unpatch_restores_the_attention_implementation():
    model = _gpt2()
    lstrain.patch(model)
    assert model.config._attn_implementation == SKIP_SDPA
    assert lstrain.unpatch(model)
    assert model.config._attn_implementation == "sdpa" and "forward" not in model.transformer.__dict__


def test_models_on_other_attention_are_not_candidates():
    model = _gpt2()
    model.config._attn_implementation = "eager"
    report = lstrain.patch(model)
    assert model.config._attn_implementation == "eager"
    assert "config" not in [s.path for s in report.swapped] + [a.path for a in report.left_alone]
