"""lstrain._grad_slots: weight gradients written straight into flat gradient buffers."""

import copy

import pytest
import torch

from lstrain import _grad_slots
from lstrain.ops import linear
from lstrain.optim import FlatParameters, FusedAdamW
from lstrain.optim.flat import _same_memory
from tests.conftest import DEVICE


def _flat(*params):
    flat = FlatParameters([list(params)])
    for p in params:
        p.grad = None
    return flat, flat.buffers[0]


def _in_buffer(p, buffer):
    view = buffer.grad_views[next(i for i, q in enumerate(buffer.params) if q is p)]
    return p.grad is not None and _same_memory(p.grad, view)


def test_a_weight_gradient_is_written_into_its_place():
    weight = torch.nn.Parameter(torch.randn(5, 4, device=DEVICE))
    held = torch.nn.Parameter(torch.randn(4, 3, device=DEVICE))  # used as held.t(): the other layout
    flat, buffer = _flat(weight, held)
    x = torch.randn(6, 4, device=DEVICE)
    expected = torch.autograd.grad((x @ weight.t()).square().sum(), weight)[0]
    linear(x, weight).square().sum().backward()
    assert _in_buffer(weight, buffer)
    torch.testing.assert_close(weight.grad, expected)
    y = torch.randn(2, 4, device=DEVICE)
    expected = torch.autograd.grad((y @ held).sum(), held)[0]
    linear(y, held.t()).sum().backward()
    assert _in_buffer(held, buffer) and weight.grad is not None
    torch.testing.assert_close(held.grad, expected)


def test_saved_tensor_hooks_keep_a_saved_weight_its_place_and_an_alias_gets_none():
    """Under saved-tensor hooks backward gets a new tensor object for a saved weight: it is
    found by its gradient edge; a detached alias over the same memory is another leaf."""
    weight = torch.nn.Parameter(torch.randn(5, 4, device=DEVICE))
    held = torch.nn.Parameter(torch.randn(4, 3, device=DEVICE))
    flat, buffer = _flat(weight, held)
    x = torch.randn(6, 4, device=DEVICE)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        loss = linear(x, weight).square().sum() + linear(x, held.t()).sum()
    loss.backward()
    assert _in_buffer(weight, buffer) and _in_buffer(held, buffer)
    weight.grad = held.grad = None
    flat.reopen_grad_slots()
    alias = weight.detach().requires_grad_()
    linear(x, alias).square().sum().backward()
    assert alias.grad is not None and not any(_same_memory(alias.grad, view) for view in buffer.grad_views)


def test_autograd_grad_gets_its_own_tensors_not_places():
    # its caller keeps the gradients: a place would be written over by the next backward
    weight = torch.nn.Parameter(torch.randn(5, 4, device=DEVICE))
    flat, buffer = _flat(weight)
    x = torch.randn(6, 4, device=DEVICE)
    (grad,) = torch.autograd.grad(linear(x, weight).square().sum(), weight)
    assert not _same_memory(grad, buffer.grad_views[0]) and weight.grad is None
    kept = grad.clone()
    linear(torch.randn(6, 4, device=DEVICE), weight).square().sum().backward()
    assert _in_buffer(weight, buffer) and torch.equal(grad, kept)


def test_a_tied_weight_gets_both_contributions():
    weight = torch.nn.Parameter(torch.randn(5, 4, device=DEVICE))
    flat, buffer = _flat(weight)
    x, z = torch.randn(6, 4, device=DEVICE), torch.randn(3, 5, device=DEVICE)
    reference = weight.detach().clone().requires_grad_()
    (linear(x, reference).square().sum() + linear(z, reference.t()).sum()).backward()
    (linear(x, weight).square().sum() + linear(z, weight.t()).sum()).backward()
    torch.testing.assert_close(weight.grad, reference.grad)


def test_a_second_backward_accumulates():
    weight = torch.nn.Parameter(torch.randn(5, 4, device=DEVICE))
    flat, buffer = _flat(weight)
    x = torch.randn(6, 4, device=DEVICE)
    for _ in range(2):
        linear(x, weight).sum().backward()
    torch.testing.assert_close(weight.grad, 2 * torch.autograd.grad((x @ weight.t()).sum(), weight)[0])
    assert _in_buffer(weight, buffer)


def test_a_place_is_taken_once_until_reopened():
    weight = torch.nn.Parameter(torch.randn(5, 4, device=DEVICE))
    flat, buffer = _flat(weight)
    x = torch.randn(6, 4, device=DEVICE)
    linear(x, weight).sum().backward()
    first = weight.grad.clone()
    weight.grad = None
    linear(x, weight).sum().backward()  # not reopened: a new tensor, the buffer's gradient untouched
    assert not _in_buffer(weight, buffer)
    torch.testing.assert_close(weight.grad, first)
    weight.grad = None
    flat.reopen_grad_slots()
    linear(x, weight).sum().backward()
    assert _in_buffer(weight, buffer)


def _in_a_backward(params, check):
    """Run ``check()`` inside a backward that accumulates into ``params``' ``.grad`` (where
    the ops call ``take``)."""

    class _Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            return sum(x.sum() for x in inputs)

        @staticmethod
        def backward(ctx, grad):
            check()
            return tuple(torch.zeros_like(p) for p in params)

    _Probe.apply(*params).backward()


def test_no_place_with_grad_mode_on_or_a_dead_buffer():
    weight = torch.nn.Parameter(torch.randn(5, 4, device=DEVICE))
    other = torch.nn.Parameter(torch.randn(5, 4, device=DEVICE))
    flat, buffer = _flat(weight)
    _grad_slots.Places().register(other, torch.zeros(20, device=DEVICE), 0)  # the buffer dies here

    def check():
        with torch.enable_grad():
            assert _grad_slots.take(weight, weight.dtype) is None
        assert _grad_slots.take(weight, torch.float64) is None
        assert _grad_slots.take(other, other.dtype) is None
        assert _grad_slots.take(weight, weight.dtype) is not None

    _in_a_backward([weight, other], check)


def test_set_to_none_steps_as_in_place_and_copies_nothing_for_lstrain_weights():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to(DEVICE)
    twin = copy.deepcopy(model)
    runs = []
    for net, set_to_none in ((model, True), (twin, False)):
        optimizer = FusedAdamW(net.parameters(), lr=1e-2)
        for step in range(3):
            x = torch.randn(10, 8, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(step))
            optimizer.zero_grad(set_to_none=set_to_none)
            h = torch.nn.functional.gelu(linear(x, net[0].weight, net[0].bias))
            linear(h, net[2].weight, net[2].bias).square().mean().backward()
            buffer = optimizer.flat.buffers[0]
            runs.append([_in_buffer(p, buffer) for p in (net[0].weight, net[2].weight)])
            optimizer.step()
    assert runs[:3] == [[True, True]] * 3  # set_to_none: the weights' gradients were written in place
    for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs)


def _tiny_model(family):
    from lstrain.models import GPT2, BertConfig, BertForMaskedLM, GPT2Config, Llama, LlamaConfig

    if family == "gpt2":
        return GPT2(GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.1,
                               embd_pdrop=0.1, attn_pdrop=0.0))  # fmt: skip
    if family == "bert":
        return BertForMaskedLM(BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                          intermediate_size=64, max_position_embeddings=32))  # fmt: skip
    return Llama(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))  # fmt: skip


# What a backward of lstrain's models still leaves for the optimizer to copy into the flat
# buffer: an untied LM head's weight gradient (made in forward, where a zero_grad before
# backward could clear a place in the buffer), BERT's tied word table (autograd adds the
# decoder's gradient to the embedding's), its position and token-type tables (summed by
# plain torch ops) and its MLM head's biases. GPT-2's tied table gets both gradients in
# the embedding's backward (``return_table``).
COPIED = {
    "gpt2": set(),
    "bert": {
        "bert.embeddings.word_embeddings.weight",
        "bert.embeddings.position_embeddings.weight",
        "bert.embeddings.token_type_embeddings.weight",
        "cls.predictions.bias",
        "cls.predictions.transform.dense.bias",
    },
    "llama": {"lm_head.weight"},
}


@pytest.mark.parametrize("family", sorted(COPIED))
def test_lstrain_models_write_their_gradients_in_place(family):
    torch.manual_seed(0)
    model = _tiny_model(family).to(DEVICE).train()
    optimizer = FusedAdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(1, 96, (2, 16), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1))
    state = torch.get_rng_state() if DEVICE == "cpu" else torch.cuda.get_rng_state()  # the same dropout masks twice
    optimizer.zero_grad()
    model(ids, labels=ids).loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    (torch.set_rng_state if DEVICE == "cpu" else torch.cuda.set_rng_state)(state)
    optimizer.zero_grad(set_to_none=True)
    model(ids, labels=ids).loss.backward()
    buffer = optimizer.flat.buffers[0]
    copied = {name for name, p in model.named_parameters() if not _in_buffer(p, buffer)}
    assert copied == COPIED[family]
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-6)
