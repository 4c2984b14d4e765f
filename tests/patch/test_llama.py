"""lstrain.patch on tiny random LLaMA, Mistral, Qwen2 and Qwen3 models: the same losses, gradients and weights."""

from __future__ import annotations

import copy
import functools
import inspect
import io
import re
import sys

import pytest
import torch

import lstrain
import lstrain.ops
from lstrain import _backend
from lstrain.nn import RMSNorm
from lstrain.patch import instance
from tests.layers.test_recompute import deterministic
from tests.patch.test_instance import DEVICE, TOLERANCE, VOCAB, _batch, _gpt2, _loss_and_grads

transformers = pytest.importorskip("transformers")

EXPECTED_BACKEND = "triton" if torch.cuda.is_available() else "interpreter"
LAYERS = 2


def _config(family: str, tied: bool = False, layers: int = LAYERS):
    common = dict(
        num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=32, rms_norm_eps=1e-5,
        tie_word_embeddings=tied, attn_implementation="eager" if family == "llama" else "sdpa",
    )  # fmt: skip
    # LLaMA with eager attention; the others with transformers' default, SDPA.
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "mistral":  # a window shorter than the batch's 12 tokens: the sliding mask is used
        return transformers.MistralConfig(sliding_window=8, **common)
    if family == "qwen3":  # heads x head_dim (64) is not the width; the last layer's window is 8
        return transformers.Qwen3Config(
            head_dim=HEAD_DIMS[family], use_sliding_window=True, sliding_window=8, max_window_layers=layers - 1,
            **common,
        )  # fmt: skip
    return transformers.Qwen2Config(**common)  # Qwen2: biased q, k, v projections


CAUSAL_LM = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}  # fmt: skip
BASE = {"llama": "LlamaModel", "mistral": "MistralModel", "qwen2": "Qwen2Model", "qwen3": "Qwen3Model"}
HEAD_DIMS = {"qwen3": 16}  # the others: 32 wide / 4 heads
# RMSNorms of a model: two a layer and the final one; Qwen3's attention adds one for q's heads and one for k's
NORMS_PER_LAYER = {"qwen3": 4}


def _norm_count(family: str) -> int:
    return NORMS_PER_LAYER.get(family, 2) * LAYERS + 1


def _model(family: str = "llama", *, tied: bool = False, base: bool = False, layers: int = LAYERS):
    torch.manual_seed(0)
    model = getattr(transformers, (BASE if base else CAUSAL_LM)[family])(_config(family, tied, layers))
    with torch.no_grad():  # HF initialises RMSNorm weights to one; other weights are checked too
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                parameter.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return model.to(DEVICE)


def _rope_stand_in(calls: list):
    """HF's rotate_half rotation in the layout ``lstrain.ops.rope`` takes: q or k ``[batch,
    heads, seq, head_dim]``, cos and sin ``[batch or 1, seq, head_dim]`` (HF's rotary embedding
    gives a batch of 1 for the default position_ids), recording the shapes it is called with."""

    def rope(x, cos, sin, *, interleaved=False):
        assert not interleaved and x.dim() == 4 and cos.shape == sin.shape
        assert cos.shape[0] in (1, x.shape[0]) and cos.shape[1:] == x.shape[2:]
        calls.append(tuple(x.shape))
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)

    return rope


class _OtherCache(transformers.DynamicCache):
    """A cache that is not exactly a DynamicCache."""


# The KV cache argument's name: ``cache`` from transformers 5.2x (``past_key_values`` deprecated).
_CACHE = (
    "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters else "past_key_values"
)


def _cache_of(output):
    """The KV cache of a model output (``cache`` from transformers 5.2x, ``past_key_values`` before)."""
    cache = output.get("cache")
    return cache if cache is not None else output["past_key_values"]


FAMILIES = [("llama", False), ("llama", True), ("mistral", False), ("qwen2", False), ("qwen3", False)]
IDS = ["llama", "llama-tied", "mistral", "qwen2", "qwen3"]


@pytest.mark.parametrize(("family", "tied"), FAMILIES, ids=IDS)
def test_patched_loss_and_gradients_match_hf(family, tied):
    reference = _model(family, tied=tied)
    model = copy.deepcopy(reference)
    report = lstrain.patch(model)
    norms = [s.path for s in report.swapped if s.new_type == "lstrain.nn.rms_norm.RMSNorm"]
    assert len(norms) == _norm_count(family) and "model.norm" in norms
    assert [s.path for s in report.swapped if s.new_type == "lstrain.ops.linear_cross_entropy"] == ["lm_head"]
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    input_ids, labels = _batch(False)

    expected, expected_grads = _loss_and_grads(reference, input_ids, labels)
    with _backend.record_backends() as ran:
        got, grads = _loss_and_grads(model, input_ids, labels)
    assert [s.path for s in report.swapped if "silu_mul_linear" in s.new_type] == [
        f"model.layers.{i}.mlp" for i in range(LAYERS)
    ]
    ops = [op for op, _ in ran]
    assert {"rms_norm", "linear_cross_entropy", "silu_mul_linear", "linear"} <= set(ops)
    # q / k / v and gate / up of every layer share an input
    assert ops.count("shared_input_linear") == 2 * LAYERS
    assert {backend for _, backend in ran} == {EXPECTED_BACKEND}
    assert got.logits is None, "the patched loss must not build logits"
    torch.testing.assert_close(got.loss, expected.loss, **TOLERANCE)
    assert grads.keys() == expected_grads.keys() and len(grads) == len(list(reference.parameters()))
    for key, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[key], **TOLERANCE, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize(("family", "tied"), [("llama", True), ("mistral", False), ("qwen2", False), ("qwen3", False)])
def test_rope_routes_each_attention_through_the_op(monkeypatch, family, tied):
    # A stand-in with lstrain.ops.rope's signature records the calls the routing makes.
    calls = []
    monkeypatch.setattr(lstrain.ops, "rope", _rope_stand_in(calls), raising=False)
    reference = _model(family, tied=tied)
    model = copy.deepcopy(reference)
    report = lstrain.patch(model)
    attentions = [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
    assert [s.path for s in report.swapped if s.new_type == "lstrain.ops.rope"] == attentions
    assert report.left_alone == []
    input_ids, labels = _batch(False)
    expected, expected_grads = _loss_and_grads(reference, input_ids, labels)
    got, grads = _loss_and_grads(model, input_ids, labels)
    head_dim = HEAD_DIMS.get(family, 8)
    assert calls == [(2, 4, 12, head_dim), (2, 2, 12, head_dim)] * LAYERS  # q and k (2 kv heads) of each layer
    torch.testing.assert_close(got.loss, expected.loss, **TOLERANCE)
    for key, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[key], **TOLERANCE, msg=lambda m, key=key: f"{key}: {m}")
    # A DynamicCache (what a forward builds by default) is updated on the op's path: a prompt,
    # then one more token reading the cache, as generation does.
    calls.clear()
    with torch.no_grad():
        steps = [m(input_ids, use_cache=True) for m in (model, reference)]
        assert len(calls) == 2 * LAYERS
        next_ids = input_ids[:, :1]
        steps += [m(next_ids, **{_CACHE: _cache_of(out)}) for m, out in zip((model, reference), steps, strict=True)]
        assert len(calls) == 4 * LAYERS
        for got_step, expected_step in (steps[0:2], steps[2:4]):
            torch.testing.assert_close(got_step.logits, expected_step.logits, **TOLERANCE)
        # Another cache type (static, quantized, ...) runs the attention's own forward.
        calls.clear()
        other = [m(input_ids, **{_CACHE: _OtherCache()}) for m in (model, reference)]
        assert calls == []
        torch.testing.assert_close(other[0].logits, other[1].logits, **TOLERANCE)
    assert lstrain.unpatch(model)
    assert all("forward" not in model.get_submodule(path).__dict__ for path in attentions)


def test_rope_op_matches_hf_rotary():
    reference = _model("llama")
    model = copy.deepcopy(reference)
    report = lstrain.patch(model)
    assert sum(s.new_type == "lstrain.ops.rope" for s in report.swapped) == LAYERS
    input_ids, labels = _batch(False)
    expected, expected_grads = _loss_and_grads(reference, input_ids, labels)
    with _backend.record_backends() as ran:
        got, grads = _loss_and_grads(model, input_ids, labels)
    assert "rope" in {op for op, _ in ran} and {backend for _, backend in ran} == {EXPECTED_BACKEND}
    torch.testing.assert_close(got.loss, expected.loss, **TOLERANCE)
    for key, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[key], **TOLERANCE, msg=lambda m, key=key: f"{key}: {m}")


def test_num_items_in_batch_matches_hf():
    reference = _model("llama")
    model = copy.deepcopy(reference)
    lstrain.patch(model)
    input_ids, labels = _batch(False)
    num_items = torch.tensor(int((labels != -100).sum()) + 7, device=DEVICE)
    expected = reference(input_ids=input_ids, labels=labels, num_items_in_batch=num_items).loss
    got = model(input_ids=input_ids, labels=labels, num_items_in_batch=num_items).loss
    torch.testing.assert_close(got, expected, **TOLERANCE)
    assert not torch.allclose(expected, reference(input_ids=input_ids, labels=labels).loss)


@pytest.mark.parametrize(("family", "tied"), FAMILIES, ids=IDS)
def test_state_dict_is_unchanged(family, tied):
    model = _model(family, tied=tied)
    before = model.state_dict()
    parameters = dict(model.named_parameters())
    lstrain.patch(model)
    after = model.state_dict()
    assert list(after) == list(before)
    for key, tensor in after.items():
        assert tensor.data_ptr() == before[key].data_ptr() and torch.equal(tensor, before[key]), key
    assert all(p is parameters[n] for n, p in model.named_parameters()), "Parameters must be reused, not copied"


def test_rms_norm_keeps_eps_and_mode():
    model = _model("llama")
    model.eval()
    lstrain.patch(model)
    norm = model.model.norm
    assert type(norm) is RMSNorm and norm.eps == 1e-5 and not norm.training
    assert norm.weight is model.state_dict(keep_vars=True)["model.norm.weight"]


def test_patching_twice_is_a_no_op():
    model = _model("llama")
    report = lstrain.patch(model)
    modules = dict(model.named_modules())
    forwards = {path: module.__dict__.get("forward") for path, module in modules.items()}
    assert lstrain.patch(model) is report
    assert dict(model.named_modules()) == modules
    assert {path: module.__dict__.get("forward") for path, module in modules.items()} == forwards
    with pytest.raises(ValueError, match="already patched"):
        lstrain.patch(model, rms_norm=False)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_unpatch_restores_modules_and_outputs(family, monkeypatch):
    monkeypatch.setattr(lstrain.ops, "rope", _rope_stand_in([]), raising=False)
    model = _model(family)
    types_before = {path: type(module) for path, module in model.named_modules()}
    input_ids, labels = _batch(False)
    with torch.no_grad():
        before = model(input_ids=input_ids, labels=labels)
    lstrain.patch(model)
    assert any(isinstance(m, RMSNorm) for m in model.modules())
    assert lstrain.unpatch(model) and not lstrain.unpatch(model)
    assert {path: type(module) for path, module in model.named_modules()} == types_before
    assert all("forward" not in module.__dict__ for module in model.modules())
    with torch.no_grad():
        after = model(input_ids=input_ids, labels=labels)
    assert torch.equal(after.loss, before.loss) and torch.equal(after.logits, before.logits)


def test_unpatch_restores_a_forward_the_instance_had():
    model = _model("llama")
    layer = model.model.layers[0]
    own = layer.forward  # e.g. what accelerate's hooks set on an instance
    layer.forward = own
    model.forward = model.forward
    own_model_forward = model.__dict__["forward"]
    lstrain.patch(model)
    assert layer.__dict__["_lstrain_wrapped_forward"].forward is own  # the layer's norm outputs are made again
    lstrain.unpatch(model)
    assert layer.__dict__["forward"] is own and model.__dict__["forward"] is own_model_forward


def test_offloaded_modules_are_not_replaced():
    # accelerate's offload hooks keep a module's weights on the meta device and bring them to
    # the execution device in its own forward (set on the instance): a swapped norm would
    # lose that. Routed attention and MLPs keep working: their projections, offloaded too,
    # run their own forwards. The patched model runs and matches the reference.
    accelerate = pytest.importorskip("accelerate")
    reference = _model("llama")
    model = copy.deepcopy(reference)
    accelerate.cpu_offload(model, execution_device=torch.device(DEVICE))
    report = lstrain.patch(model)
    reasons = {item.path: item.reason for item in report.left_alone}
    norms = [f"model.layers.{i}.{n}" for i in range(LAYERS) for n in ("input_layernorm", "post_attention_layernorm")]
    for path in [*norms, "model.norm"]:
        assert reasons[path].startswith("is offloaded (its weights are on the meta device)"), path
    attentions = [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
    assert [s.path for s in report.swapped if s.new_type == "lstrain.ops.rope"] == attentions
    input_ids, labels = _batch(False)
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=input_ids, labels=labels).loss, reference(input_ids=input_ids, labels=labels).loss,
            **TOLERANCE,
        )  # fmt: skip


def test_a_model_offloaded_after_patching_runs_and_refuses_unpatch():
    """Patched, then offloaded: each swapped norm runs inside its offload hook, which takes
    the weight away again after forward; the norm outputs made again in backward use the
    weight the forward used. Offloaded weights get no gradients (accelerate trains none), so
    the input's gradient is compared. Unpatching would drop the hooks: it raises instead and
    leaves the model patched and running."""
    accelerate = pytest.importorskip("accelerate")
    reference = _model("llama")
    model = copy.deepcopy(reference)
    report = lstrain.patch(model)
    assert any(s.new_type == "made again in backward" for s in report.swapped)
    accelerate.cpu_offload(model, execution_device=torch.device(DEVICE))
    input_ids, labels = _batch(False)
    losses, grads = [], []
    for each in (reference, model, model):
        embeds = reference.model.embed_tokens(input_ids).detach().requires_grad_()
        loss = each(inputs_embeds=embeds, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(embeds.grad)
        if len(losses) == 2:
            with pytest.raises(RuntimeError, match=r"unpatch: model\.layers\.0\.input_layernorm is offloaded"):
                lstrain.unpatch(model)
    for loss, grad in zip(losses[1:], grads[1:], strict=True):
        torch.testing.assert_close(loss, losses[0], **TOLERANCE)
        torch.testing.assert_close(grad, grads[0], **TOLERANCE)


def _change_after_patching(model, change: str) -> str:
    """Give the patched ``model`` something unpatch would undo; returns the path it names."""
    layer = model.model.layers[1]
    norm = layer.input_layernorm  # swapped in, with the patch's forward (its output is made again)
    final = model.model.norm  # swapped in, no forward of the patch's
    if change == "hook":
        norm.register_forward_hook(lambda module, args, output: None)
    elif change == "state_dict hook":
        final.register_state_dict_post_hook(lambda module, state_dict, prefix, local_metadata: None)
    elif change == "bound forward":
        final.forward = final.forward
    elif change == "partial forward":  # as accelerate's add_hook_to_module sets
        final.forward = functools.partial(type(final).forward, final)
    elif change == "compile":
        final.compile(backend="eager")
    elif change == "parametrization":
        torch.nn.utils.parametrize.register_parametrization(final, "weight", torch.nn.Identity())
    elif change == "replaced":
        layer.input_layernorm = torch.nn.Identity()
    else:  # "layer forward": wraps the patch's forward of the layer
        layer.forward = lambda *args, own=layer.forward, **kwargs: own(*args, **kwargs)
    return {"hook": "model.layers.1.input_layernorm", "replaced": "model.layers.1.input_layernorm"}.get(
        change, "model.layers.1" if change == "layer forward" else "model.norm"
    )


CHANGES = [
    "hook", "state_dict hook", "bound forward", "partial forward", "compile", "parametrization", "replaced",
    "layer forward",
]  # fmt: skip


@pytest.mark.parametrize("change", CHANGES)
def test_unpatch_refuses_to_undo_what_was_added_after_patching(change):
    model = _model("llama")
    lstrain.patch(model)
    path = _change_after_patching(model, change)
    with pytest.raises(RuntimeError, match=rf"unpatch: {re.escape(path)} (has|was|is) .* since it was patched"):
        lstrain.unpatch(model)
    assert "_lstrain_patch" in model.__dict__ and isinstance(model.model.layers[0].input_layernorm, RMSNorm)


def test_unpatch_of_a_compiled_model_unpatches_it_and_keeps_the_attention_set_since():
    model = _model("llama")
    lstrain.patch(model)
    compiled = torch.compile(model, backend="eager")
    model.config._attn_implementation = "eager"  # chosen after patching: unpatch keeps it
    assert lstrain.unpatch(compiled)
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"
    assert model.config._attn_implementation == "eager"
    assert not lstrain.unpatch(model)


@pytest.mark.parametrize(("build", "tied"), [("llama", False), ("gpt2", False), ("llama", True)])
def test_save_pretrained_from_pretrained_round_trip(tmp_path, build, tied):
    reference = _gpt2() if build == "gpt2" else _model("llama", tied=tied)
    reference.save_pretrained(tmp_path / "reference")
    model = copy.deepcopy(reference)
    lstrain.patch(model)
    model.save_pretrained(tmp_path / "patched")
    reference_files = sorted(p.name for p in (tmp_path / "reference").iterdir())
    assert sorted(p.name for p in (tmp_path / "patched").iterdir()) == reference_files
    loaded = type(reference).from_pretrained(tmp_path / "patched").to(DEVICE)
    assert list(loaded.state_dict()) == list(reference.state_dict())
    for key, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, reference.state_dict()[key]), key
    lstrain.patch(loaded)
    input_ids, labels = _batch(False)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=input_ids, labels=labels).loss, reference(input_ids=input_ids, labels=labels).loss,
            **TOLERANCE,
        )  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_base_models_patch_rms_norms(family):
    reference = _model(family, base=True)
    model = copy.deepcopy(reference)
    report = lstrain.patch(model)
    assert sum(s.new_type == "lstrain.nn.rms_norm.RMSNorm" for s in report.swapped) == _norm_count(family)
    assert "" in [item.path for item in report.left_alone]
    input_ids, _ = _batch(False)
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids).last_hidden_state, reference(input_ids).last_hidden_state, **TOLERANCE
        )


def test_options_leave_rms_norms_and_attention_alone():
    model = _model("qwen2")
    options = {"rms_norm": False, "rope": False, "activation": False, "cross_entropy": False, "sdpa_mask_skip": False}
    report = lstrain.patch(model, **options)
    assert report.swapped == [] and all("forward" not in m.__dict__ for m in model.modules())
    assert model.config._attn_implementation == "sdpa"
    assert {item.reason for item in report.left_alone} == {f"{option}=False" for option in options}


def test_unsupported_llama_class_names_the_supported_ones():
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(_config("llama"))
    with pytest.raises(TypeError, match="LlamaForSequenceClassification.*LlamaForCausalLM, LlamaModel"):
        lstrain.patch(model)


def test_unsupported_transformers_major_version_is_refused(monkeypatch):
    for version in ("5.17.0", "5.24.0", "5.0.0.dev0"):
        assert instance.check_transformers_version(version) == version
    for version in ("4.46.3", "6.0.0", "nightly"):
        with pytest.raises(RuntimeError, match=f"supports transformers 5.x.*not the installed {version}"):
            instance.check_transformers_version(version)
    # sys.modules' own: transformers' lazy module may have been replaced since this file imported it
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.1")
    model = _model("llama")
    with pytest.raises(RuntimeError, match="4.57.1"):
        lstrain.patch(model)
    assert "_lstrain_patch" not in model.__dict__ and not any(isinstance(m, RMSNorm) for m in model.modules())


def test_attention_with_another_forward_is_left_alone(monkeypatch):
    monkeypatch.setattr(lstrain.ops, "rope", _rope_stand_in([]), raising=False)
    model = _model("llama")
    attention = model.model.layers[1].self_attn
    own = attention.forward

    def forward(hidden_states, attention_mask=None, **kwargs):  # not transformers 5.x's argument order
        return own(hidden_states, attention_mask=attention_mask, **kwargs)

    attention.forward = forward
    report = lstrain.patch(model)
    assert [item.path for item in report.left_alone] == ["model.layers.1.self_attn"]
    assert "its forward takes (hidden_states, attention_mask, kwargs)" in report.left_alone[0].reason
    assert attention.forward is forward


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swapped_rms_norm_meets_the_tolerance_rule_against_hf_in_low_precision(dtype):
    # HF rounds x * rstd to the input dtype before the weight multiply, lstrain rounds once:
    # the kernel's error against fp64 must be within 2x HF's own low-precision error.
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from lstrain.testing.compare import assert_all_passed, check_function

    hf_norm = LlamaRMSNorm(96, eps=1e-5).to(DEVICE)
    model_norm = instance._shared_rms_norm(hf_norm)

    def ours(x, weight):
        return torch.func.functional_call(model_norm, {"weight": weight}, (x,))

    def hf(x, weight):
        return torch.func.functional_call(hf_norm, {"weight": weight}, (x,))

    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 7, 96, generator=generator) * 3 + 1).to(DEVICE, dtype)
    weight = (torch.randn(96, generator=generator) * 0.5 + 1).to(DEVICE, dtype)
    with _backend.record_backends() as ran:
        comparisons = check_function(ours, hf, {"x": x, "weight": weight}, generator=generator)
    assert {op for op, _ in ran} == {"rms_norm"} and {b for _, b in ran} == {EXPECTED_BACKEND}
    assert_all_passed(comparisons, f"lstrain RMSNorm vs HF LlamaRMSNorm in {dtype}")


def test_deepcopy_of_a_patched_model_runs_its_own_modules():
    # As TRL's reference models and EMA copies are made: the copy's forwards must not call
    # into the original's modules.
    model = _model("llama")
    lstrain.patch(model)
    duplicate = copy.deepcopy(model)
    attention = duplicate.model.layers[0].self_attn
    assert duplicate.forward.__self__ is duplicate and attention.forward.__self__ is attention
    input_ids, labels = _batch(False)
    with torch.no_grad():
        expected = model(input_ids=input_ids, labels=labels).loss
        torch.testing.assert_close(duplicate(input_ids=input_ids, labels=labels).loss, expected, rtol=0, atol=0)
        duplicate.lm_head.weight.zero_()
        torch.testing.assert_close(
            duplicate(input_ids=input_ids, labels=labels).loss, torch.tensor(VOCAB).log().to(DEVICE)
        )
        torch.testing.assert_close(model(input_ids=input_ids, labels=labels).loss, expected, rtol=0, atol=0)
    assert lstrain.unpatch(duplicate) and "_lstrain_patch" in model.__dict__
    assert all("forward" not in m.__dict__ for m in duplicate.modules())


def test_a_patched_model_refuses_to_be_pickled():
    # pickle stores a bound forward by its name, and the loaded model would get the class's:
    # silently unpatched while its state said patched
    model = _model("llama")
    lstrain.patch(model)
    for patched in (model, model.model, model.model.layers[0]):  # a patched submodule saved alone too
        with pytest.raises(TypeError, match=r"cannot be pickled \(torch.save\(model\).*save_pretrained"):
            torch.save(patched, io.BytesIO())
    lstrain.unpatch(model)
    torch.save(model, io.BytesIO())


def test_an_mlp_without_silu_is_left_alone():
    torch.manual_seed(0)
    config = _config("llama")
    config.hidden_act = "gelu"
    model = transformers.LlamaForCausalLM(config).to(DEVICE)
    report = lstrain.patch(model)
    reasons = {item.path: item.reason for item in report.left_alone}
    assert all(f"model.layers.{i}.mlp" in reasons for i in range(LAYERS))
    assert "act_fn is" in reasons["model.layers.0.mlp"] and "not SiLU" in reasons["model.layers.0.mlp"]
    assert "forward" not in model.model.layers[0].mlp.__dict__


@pytest.mark.parametrize("when", ["before", "after"])
def test_projections_with_hooks_run_their_own_forwards(when):
    """A hooked projection (hooked before or after patching: a LoRA adapter or a probe)
    runs its own forward, the hook included, and the rest of the layer stays routed."""
    reference = _model("llama")
    model = copy.deepcopy(reference)
    layer = model.model.layers[0]
    hooked = (layer.mlp.down_proj, layer.mlp.up_proj, layer.self_attn.k_proj, layer.self_attn.o_proj)
    calls = []

    def hook_all():
        for module in hooked:
            module.register_forward_hook(lambda module, *args: calls.append(module))

    if when == "before":
        hook_all()
    lstrain.patch(model)
    if when == "after":
        hook_all()
    input_ids, labels = _batch(False)
    expected, expected_grads = _loss_and_grads(reference, input_ids, labels)
    with _backend.record_backends() as ran:
        got, grads = _loss_and_grads(model, input_ids, labels)
    assert set(calls) == set(hooked), "every hook ran"
    ops = [op for op, _ in ran]
    # layer 1 routed as ever; layer 0's hooked projections through their modules
    assert ops.count("shared_input_linear") == 2 * LAYERS - 2
    assert ops.count("silu_mul_linear") == LAYERS - 1 and ops.count("silu_mul") == 1
    torch.testing.assert_close(got.loss, expected.loss, **TOLERANCE)
    for key, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[key], **TOLERANCE, msg=lambda m, key=key: f"{key}: {m}")


def test_a_projection_with_a_forward_of_its_own_runs_it():
    """A projection given an instance forward after patching (accelerate's offload and
    device-map hooks wrap the forward so) runs that forward, not the op on its weight."""
    model = _model("llama")
    lstrain.patch(model)
    k_proj = model.model.layers[0].self_attn.k_proj
    calls = []

    def wrapped(x, own=k_proj.forward):
        calls.append(x.shape)
        return own(x)

    k_proj.forward = wrapped
    input_ids, labels = _batch(False)
    with _backend.record_backends() as ran:
        _loss_and_grads(model, input_ids, labels)
    assert len(calls) == 1
    assert [op for op, _ in ran].count("shared_input_linear") == 2 * LAYERS - 1


@pytest.mark.parametrize(
    ("family", "autocast"), [("llama", False), ("qwen2", False), ("qwen3", False), ("llama", True)]
)
def test_recomputed_norm_outputs_keep_every_bit(monkeypatch, family, autocast):
    """The layers' norm outputs are saved as recipes (two a layer: the attention's and the
    MLP's projections read them), made again in backward; the loss and every gradient are
    the bits of the patch that keeps them. The final norm is not a candidate, nor are
    Qwen3's q / k head norms (the rotation saves none of their outputs). fp32 weights under
    autocast: the projections' bf16 casts of the outputs are the recipes."""
    from lstrain.layers import recompute

    made = []
    init = recompute._Recipe.__init__
    monkeypatch.setattr(
        recompute._Recipe, "__init__", lambda self, make, *rest: made.append(make) or init(self, make, *rest)
    )
    kept, recomputed = copy.deepcopy(_model(family)), _model(family)
    lstrain.patch(kept, recompute_norms=False)
    report = lstrain.patch(recomputed)
    paths = [s.path for s in report.swapped if s.new_type == "made again in backward"]
    assert paths == [
        f"model.layers.{i}.{n}" for i in range(LAYERS) for n in ("input_layernorm", "post_attention_layernorm")
    ]
    input_ids, labels = _batch(False)
    with deterministic(), torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16, enabled=autocast):
        expected, expected_grads = _loss_and_grads(kept, input_ids, labels)
        assert not made
        got, grads = _loss_and_grads(recomputed, input_ids, labels)
    assert len({id(make) for make in made}) == 2 * LAYERS
    assert torch.equal(got.loss, expected.loss)
    for key, grad in grads.items():
        assert torch.equal(grad, expected_grads[key]), key
    assert lstrain.unpatch(recomputed) and "forward" not in recomputed.model.layers[0].__dict__


@pytest.mark.parametrize("inner_first", [False, True])
def test_a_model_and_its_base_model_are_not_patched_both(inner_first):
    model = _model("llama")
    first, second = (model.model, model) if inner_first else (model, model.model)
    lstrain.patch(first)
    with pytest.raises(ValueError, match="already patched as part of another model"):
        lstrain.patch(second)
    assert lstrain.unpatch(first)


def test_a_static_cache_decode_without_a_mask_matches_hf():
    # transformers keeps the mask of a compileable cache's one-token step (its empty slots);
    # the patch's implied-positions rule must not skip it
    reference = _model("qwen2")  # SDPA attention
    model = copy.deepcopy(reference)
    lstrain.patch(model)
    input_ids, _ = _batch(False)
    outputs = []
    with torch.no_grad():
        for m in (model, reference):
            cache = transformers.StaticCache(config=m.config, max_cache_len=24)
            m(input_ids, **{_CACHE: cache}, use_cache=True)
            outputs.append(m(input_ids[:, :1], **{_CACHE: cache}, use_cache=True).logits)
    torch.testing.assert_close(outputs[0], outputs[1], **TOLERANCE)
