"""lstrain.patch on tiny random Hugging Face models: the same losses, gradients and weights."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

import lstrain
from lstrain import _backend
from lstrain.nn import LayerNorm

transformers = pytest.importorskip("transformers")

VOCAB = 101
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 throughout: the patched model's kernels and HF's torch ops differ by a few fp32 ulp
# (on a GPU, reductions in another order: a few more).
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6} if DEVICE == "cpu" else {"rtol": 1e-4, "atol": 1e-5}


def _gpt2(cls=None, **fields):
    config = transformers.GPT2Config(**{
        "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": VOCAB, "n_positions": 32,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "attn_implementation": "eager", **fields,
    })  # fmt: skip
    torch.manual_seed(0)
    return (cls or transformers.GPT2LMHeadModel)(config).to(DEVICE)


def _bert(cls=None, **fields):
    config = transformers.BertConfig(**{
        "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
        "vocab_size": VOCAB, "max_position_embeddings": 32, "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0, "attn_implementation": "eager", **fields,
    })  # fmt: skip
    torch.manual_seed(0)
    model = (cls or transformers.BertForMaskedLM)(config)
    if cls is None:  # HF initialises the decoder bias to zero; a nonzero one is checked too
        with torch.no_grad():
            model.cls.predictions.bias.normal_()
    return model.to(DEVICE)


def _batch(masked: bool):
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (2, 12), generator=generator)
    labels = input_ids.clone()
    ignored = torch.rand(labels.shape, generator=generator) < (0.7 if masked else 0.2)
    labels[ignored] = -100
    return input_ids.to(DEVICE), labels.to(DEVICE)


MODELS = {"gpt2": (_gpt2, False, 5), "bert": (_bert, True, 6)}  # builder, masked labels, LayerNorms


def _loss_and_grads(model, input_ids, labels, **kwargs):
    model.zero_grad(set_to_none=True)
    output = model(input_ids=input_ids, labels=labels, **kwargs)
    output.loss.backward()
    return output, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", MODELS)
def test_patched_loss_and_gradients_match_hf(name):
    build, masked, layer_norms = MODELS[name]
    reference = build()
    model = copy.deepcopy(reference)
    report = lstrain.patch(model)
    swapped_norms = [s for s in report.swapped if s.new_type == "lstrain.nn.layer_norm.LayerNorm"]
    assert len(swapped_norms) == layer_norms and report.left_alone == []
    input_ids, labels = _batch(masked)

    expected, expected_grads = _loss_and_grads(reference, input_ids, labels)
    with _backend.record_backends() as ran:
        got, grads = _loss_and_grads(model, input_ids, labels)
    assert {op for op, _ in ran} == {"layer_norm", "linear_cross_entropy"}
    assert {backend for _, backend in ran} == {"interpreter" if not torch.cuda.is_available() else "triton"}
    assert got.logits is None, "the patched loss must not build logits"
    torch.testing.assert_close(got.loss, expected.loss, **TOLERANCE)
    assert grads.keys() == expected_grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[key], **TOLERANCE, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("name", MODELS)
def test_num_items_in_batch_matches_hf(name):
    build, masked, _ = MODELS[name]
    reference = build()
    model = copy.deepcopy(reference)
    lstrain.patch(model)
    input_ids, labels = _batch(masked)
    # As under gradient accumulation: the kept tokens of all micro-batches, more than this one's.
    num_items = torch.tensor(int((labels != -100).sum()) + 7, device=DEVICE)
    expected = reference(input_ids=input_ids, labels=labels, num_items_in_batch=num_items).loss
    got = model(input_ids=input_ids, labels=labels, num_items_in_batch=num_items).loss
    torch.testing.assert_close(got, expected, **TOLERANCE)
    mean = reference(input_ids=input_ids, labels=labels).loss
    if name == "gpt2":  # GPT-2's loss is the sum over num_items_in_batch; BertForMaskedLM ignores it
        assert not torch.allclose(expected, mean)
    else:
        torch.testing.assert_close(expected, mean)


@pytest.mark.parametrize("name", MODELS)
def test_state_dict_is_unchanged(name):
    model = MODELS[name][0]()
    before = model.state_dict()
    parameters = dict(model.named_parameters())
    lstrain.patch(model)
    after = model.state_dict()
    assert list(after) == list(before)
    for key, tensor in after.items():
        assert tensor.data_ptr() == before[key].data_ptr() and torch.equal(tensor, before[key]), key
    assert all(p is parameters[n] for n, p in model.named_parameters()), "Parameters must be reused, not copied"


def test_patching_twice_is_a_no_op():
    model = _gpt2()
    report = lstrain.patch(model)
    modules = dict(model.named_modules())
    forward = model.forward
    assert lstrain.patch(model) is report
    assert dict(model.named_modules()) == modules and model.forward is forward
    with pytest.raises(ValueError, match="already patched"):
        lstrain.patch(model, layer_norm=False)


@pytest.mark.parametrize("name", MODELS)
def test_unpatch_restores_modules_and_outputs(name):
    build, masked, _ = MODELS[name]
    model = build()
    types_before = {path: type(module) for path, module in model.named_modules()}
    input_ids, labels = _batch(masked)
    with torch.no_grad():
        before = model(input_ids=input_ids, labels=labels)
    lstrain.patch(model)
    assert any(isinstance(m, LayerNorm) for m in model.modules())
    assert lstrain.unpatch(model) and not lstrain.unpatch(model)
    assert {path: type(module) for path, module in model.named_modules()} == types_before
    assert "forward" not in model.__dict__
    with torch.no_grad():
        after = model(input_ids=input_ids, labels=labels)
    assert torch.equal(after.loss, before.loss) and torch.equal(after.logits, before.logits)


def test_logits_on_request_and_tuple_output():
    reference = _gpt2()
    model = copy.deepcopy(reference)
    lstrain.patch(model)
    input_ids, labels = _batch(False)
    with torch.no_grad():
        expected = reference(input_ids=input_ids, labels=labels)
        asked = model(input_ids=input_ids, labels=labels, return_logits=True)
        as_tuple = model(input_ids, labels=labels, return_dict=False)
        without_labels = model(input_ids)
    torch.testing.assert_close(asked.logits, expected.logits, **TOLERANCE)
    torch.testing.assert_close(without_labels.logits, expected.logits, **TOLERANCE)
    # to_tuple drops the missing logits: (loss, cache)
    torch.testing.assert_close(as_tuple[0], expected.loss, **TOLERANCE)
    assert all(item is not None for item in as_tuple)


@pytest.mark.parametrize(("build", "cls"), [(_gpt2, "GPT2Model"), (_bert, "BertModel")])
def test_base_models_patch_layer_norms(build, cls):
    reference = build(getattr(transformers, cls))
    model = copy.deepcopy(reference)
    report = lstrain.patch(model)
    assert report.swapped and all(s.new_type.endswith(("LayerNorm", ".GELU")) for s in report.swapped)
    assert [item.path for item in report.left_alone] == [""]
    input_ids, _ = _batch(False)
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids).last_hidden_state, reference(input_ids).last_hidden_state, **TOLERANCE
        )


def test_gpt2s_composite_gelu_becomes_torchs_tanh_gelu():
    """GPT-2's ``gelu_new`` (transformers' NewGELUActivation: seven elementwise ops) becomes
    torch's one-kernel tanh GELU, the same function; unpatch and activation=False keep it."""
    model = _gpt2()
    originals = [m for m in model.modules() if type(m).__name__ == "NewGELUActivation"]
    assert len(originals) == 2
    report = lstrain.patch(model)
    swapped = [s for s in report.swapped if s.old_type == "transformers.activations.NewGELUActivation"]
    assert [s.path for s in swapped] == [f"transformer.h.{i}.mlp.act" for i in range(2)]
    assert all(s.new_type == "torch.nn.modules.activation.GELU" for s in swapped)
    act = model.transformer.h[0].mlp.act
    assert isinstance(act, torch.nn.GELU) and act.approximate == "tanh"
    x = torch.randn(3, 64, device=DEVICE, dtype=torch.float64)
    torch.testing.assert_close(act(x), originals[0](x), rtol=1e-12, atol=1e-12)
    lstrain.unpatch(model)
    assert [m for m in model.modules() if type(m).__name__ == "NewGELUActivation"] == originals
    report = lstrain.patch(model, activation=False)
    assert [item.path for item in report.left_alone if item.reason == "activation=False"] == [
        f"transformer.h.{i}.mlp.act" for i in range(2)
    ]


def test_options_leave_modules_alone():
    model = _bert()
    report = lstrain.patch(model, layer_norm=False, cross_entropy=False)
    assert report.swapped == [] and "forward" not in model.__dict__
    assert {item.reason for item in report.left_alone} == {"layer_norm=False", "cross_entropy=False"}


def test_the_reports_summary_folds_layers_and_names_reasons():
    model = _gpt2()
    model.transformer.h[0].ln_2.register_forward_hook(lambda *args: None)
    lines = str(lstrain.patch(model, cross_entropy=False)).splitlines()
    assert lines == [
        "lstrain.patch (GPT-2): 6 changes, 2 left alone",
        "  swapped     transformer.h.*.ln_1 (x2): torch.nn.LayerNorm -> lstrain.nn.LayerNorm",
        "  swapped     transformer.h.1.ln_2: torch.nn.LayerNorm -> lstrain.nn.LayerNorm",
        "  swapped     transformer.ln_f: torch.nn.LayerNorm -> lstrain.nn.LayerNorm",
        "  swapped     transformer.h.*.mlp.act (x2): NewGELUActivation -> torch.nn.GELU",
        "  left alone  transformer.h.0.ln_2: has hooks, which a new module would lose",
        "  left alone  lm_head: cross_entropy=False",
    ]


@pytest.mark.parametrize("how", ["module.compile()", "torch.compile(module)"])
def test_a_module_compiled_on_its_own_is_left_alone(how):
    # module.compile() lives on the instance, and torch.compile(module)'s wrapper runs the module
    # it was given: a new module in its place would run uncompiled, or not at all
    reference = _gpt2()
    model = copy.deepcopy(reference)
    ln_1 = model.transformer.h[1].ln_1
    if how == "module.compile()":
        ln_1.compile(backend="eager")
        path, reason = "transformer.h.1.ln_1", "was compiled with module.compile(), which a new module would lose"
    else:
        model.transformer.h[1].ln_1 = torch.compile(ln_1, backend="eager")
        path, reason = (
            "transformer.h.1.ln_1._orig_mod",
            "is wrapped by torch.compile(module), which would go on running it",
        )
    report = lstrain.patch(model)
    assert model.get_submodule(path) is ln_1
    assert {item.path: item.reason for item in report.left_alone} == {path: reason}
    assert path not in [s.path for s in report.swapped]
    input_ids, labels = _batch(False)
    got, grads = _loss_and_grads(model, input_ids, labels)
    grads = {key.replace("._orig_mod", ""): grad for key, grad in grads.items()}
    expected, expected_grads = _loss_and_grads(reference, input_ids, labels)
    torch.testing.assert_close(got.loss, expected.loss, **TOLERANCE)
    assert grads.keys() == expected_grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[key], **TOLERANCE, msg=lambda m, key=key: f"{key}: {m}")


def test_unsupported_model_names_the_supported_ones():
    model = _gpt2(transformers.GPT2ForSequenceClassification)
    with pytest.raises(TypeError, match="GPT2ForSequenceClassification.*supported: GPT2LMHeadModel, GPT2Model"):
        lstrain.patch(model)
    with pytest.raises(TypeError, match="BertForMaskedLM"):
        lstrain.patch(torch.nn.Linear(2, 2))
    assert "_lstrain_patch" not in model.__dict__


def test_importing_lstrain_loads_no_patch_code():
    code = "import sys, lstrain; assert 'lstrain.patch' not in sys.modules and 'lstrain.ops' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_package_is_callable_however_imported():
    import lstrain.patch as package

    model = _gpt2(transformers.GPT2Model)
    assert lstrain.patch is package and package(model) is package.patch(model)
    assert lstrain.unpatch(model)


def test_a_head_that_is_not_a_plain_linear_runs_its_own_forward():
    model = _gpt2()
    reference = copy.deepcopy(model)
    lstrain.patch(model)
    input_ids, labels = _batch(False)
    for m in (model, reference):  # a hook on the logits, as an adapter or a logit soft-cap would add
        m.lm_head.register_forward_hook(lambda module, args, logits: torch.tanh(logits))
    loss = model(input_ids=input_ids, labels=labels).loss
    torch.testing.assert_close(loss, reference(input_ids=input_ids, labels=labels).loss, **TOLERANCE)


def test_unpatch_keeps_parameters_a_load_with_assign_put_in():
    model = _gpt2()
    lstrain.patch(model)
    state = {key: value.clone() + 1 for key, value in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    lstrain.unpatch(model)
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_an_evaluation_under_no_grad_gets_logits_and_the_same_loss():
    model = _gpt2()
    reference = copy.deepcopy(model)
    lstrain.patch(model)
    input_ids, labels = _batch(False)
    with torch.no_grad():
        got, expected = (m(input_ids=input_ids, labels=labels) for m in (model, reference))
    torch.testing.assert_close(got.logits, expected.logits, **TOLERANCE)
    torch.testing.assert_close(got.loss, expected.loss, **TOLERANCE)
