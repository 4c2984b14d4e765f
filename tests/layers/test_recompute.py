"""lstrain.layers.RecomputedNorms and the decoder layer's recomputed norm outputs."""

import contextlib
import gc
import weakref

import pytest
import torch

from lstrain.layers import RecomputedNorms
from lstrain.layers import recompute as recompute_module
from lstrain.models import Llama, LlamaConfig
from lstrain.ops import rms_norm
from tests.conftest import DEVICE

TINY = LlamaConfig(
    vocab_size=37, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=16,
)  # fmt: skip


@contextlib.contextmanager
def deterministic():
    """Run-to-run identical bits on any device: torch's deterministic algorithms (lstrain's
    embedding backward then sorts instead of adding atomically) and SDPA's math backend
    (the GPU's fused attention backwards may sum in another order on each run)."""
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def test_a_registered_output_is_saved_as_a_recipe_and_made_again_in_backward():
    h = torch.randn(6, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(16, device=DEVICE, requires_grad=True)
    proj = torch.randn(16, 8, device=DEVICE, requires_grad=True)
    calls = []

    def make():
        calls.append(1)
        return rms_norm(h.detach(), (16,), w.detach())

    def step(recompute):
        with RecomputedNorms(enabled=recompute) as norms:
            normed = norms.register(rms_norm(h, (16,), w), make)
            return (normed.view(2, 3, 16) @ proj).square().sum()  # a view of it is saved

    grads = {}
    for recompute in (False, True):
        loss = step(recompute)
        grads[recompute] = torch.autograd.grad(loss, (h, w, proj))
    assert len(calls) == 1  # only the recomputing step made it again, once
    for kept, made in zip(grads[False], grads[True], strict=True):
        assert torch.equal(kept, made)


CASTS = [
    "autocast", "autocast F.linear", "to", "cast changed in place", "cast of another tensor", ".data replaced",
    "complex view of a cast",
]  # fmt: skip


@pytest.mark.parametrize("cast", CASTS)
def test_a_dtype_cast_of_a_registered_output_is_made_again_as_the_cast(cast):
    """fp32 weights under autocast: the projection saves autocast's bf16 copy of the fp32 norm
    output (F.linear a [tokens, D] view of it), which is made again as the output cast again
    (the same bits); a cast changed in place, the cast of a tensor that is not registered, or
    of an output whose memory was replaced through ``.data``, is saved as it is."""
    device_type = torch.device(DEVICE).type
    h = torch.randn(2, 3, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(16, device=DEVICE, requires_grad=True)
    proj = torch.randn(16, 8, device=DEVICE, requires_grad=True)
    made = []

    def make():
        made.append(1)
        return rms_norm(h.detach(), (16,), w.detach())

    def loss(recompute):
        with RecomputedNorms(enabled=recompute) as norms:
            normed = norms.register(rms_norm(h, (16,), w), make)
            if cast == "autocast":
                with torch.autocast(device_type, dtype=torch.bfloat16):
                    return (normed @ proj).float().square().sum()
            if cast == "autocast F.linear":
                with torch.autocast(device_type, dtype=torch.bfloat16):
                    return torch.nn.functional.linear(normed, proj.t()).float().square().sum()
            if cast == ".data replaced":
                normed.data = normed.data * 2
            if cast == "complex view of a cast":  # a view of the whole cast, in another dtype
                pairs = torch.view_as_complex(normed.double().view(2, 3, 8, 2))
                return (pairs * pairs).abs().sum() + proj.sum()
            low = (normed * 1 if cast == "cast of another tensor" else normed).to(torch.bfloat16)
            if cast == "cast changed in place":
                low.mul_(3)
            return (low @ proj.to(torch.bfloat16)).float().square().sum()

    kept = torch.autograd.grad(loss(False), (h, w, proj))
    remade = torch.autograd.grad(loss(True), (h, w, proj))
    assert len(made) == (1 if cast in ("autocast", "autocast F.linear", "to") else 0)
    for a, b in zip(kept, remade, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("changed", ["a saved input", "the saved norm output", "a saved cast of it"])
def test_a_saved_tensor_changed_in_place_fails_backward_as_without_the_context(changed):
    """Autograd skips its in-place check for tensors that saved-tensor hooks pack; the
    context keeps it, for what it saves as it is and for what it makes again."""
    h = torch.randn(6, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(16, device=DEVICE, requires_grad=True)
    proj = torch.randn(16, 8, device=DEVICE, requires_grad=True)
    for recompute in (False, True):
        with RecomputedNorms(enabled=recompute) as norms:
            normed = norms.register(rms_norm(h, (16,), w), lambda: rms_norm(h.detach(), (16,), w.detach()))
            low = normed.to(torch.bfloat16)
            loss = (normed @ proj).sum() + (low @ proj.to(torch.bfloat16)).float().sum() + (h * proj[:, 0]).sum()
        target = {"a saved input": proj, "the saved norm output": normed, "a saved cast of it": low}[changed]
        with torch.no_grad():
            target.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_a_graph_dropped_without_backward_is_freed():
    # exp saves its own output: held as it is, that output and its node would keep each other alive
    h = torch.randn(6, 16, device=DEVICE, requires_grad=True)
    with RecomputedNorms():
        y = h.exp()
        loss = y.sum()
    alive = weakref.ref(y)
    del y, loss
    gc.collect()
    assert alive() is None


def test_a_context_inside_another_repacks_its_own_outputs():
    h = torch.randn(6, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(16, device=DEVICE, requires_grad=True)
    proj = torch.randn(16, 8, device=DEVICE, requires_grad=True)
    made = []
    with RecomputedNorms() as outer:
        outer_normed = outer.register(rms_norm(h, (16,), w), lambda: made.append("outer") or rms_norm(h, (16,), w))
        with RecomputedNorms() as inner:
            assert inner._hooks is not None
            normed = inner.register(rms_norm(h, (16,), w), lambda: made.append("inner") or rms_norm(h, (16,), w))
            loss = (normed @ proj).sum() + (outer_normed @ proj).sum()
    loss.backward()
    assert sorted(made) == ["inner", "outer"]


def test_nothing_is_repacked_without_grad_or_when_disabled():
    x = torch.randn(4, 8, device=DEVICE)
    with torch.no_grad(), RecomputedNorms() as norms:
        assert norms.register(x, lambda: x) is x and not norms._makers
    with RecomputedNorms(enabled=False) as norms:
        assert norms.register(x, lambda: x) is x and not norms._makers


@pytest.mark.parametrize(("padding", "autocast"), [(False, False), (True, False), (False, True)])
def test_llama_with_recomputed_norms_gives_the_same_bits_and_keeps_less(monkeypatch, padding, autocast):
    """Both norm outputs of every layer are saved as recipes (the hooks' own bookkeeping:
    saved_tensors_hooks do not nest, so an outer counter would see nothing inside), and the
    loss and every gradient keep their bits; fp32 weights under autocast too, where the
    projections save bf16 casts of the outputs."""
    made = []
    init = recompute_module._Recipe.__init__

    def counting_init(self, make, *rest):
        made.append(make)
        init(self, make, *rest)

    monkeypatch.setattr(recompute_module._Recipe, "__init__", counting_init)
    torch.manual_seed(0)
    model = Llama(TINY, device=DEVICE)
    ids = torch.randint(0, TINY.vocab_size, (2, 12), device=DEVICE)
    mask = torch.ones_like(ids)
    if padding:
        mask[-1, -4:] = 0
    results = {}
    for recompute in (False, True):
        for layer in model.model.layers:
            layer.recompute_norms = recompute
        made.clear()
        with deterministic(), torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(ids, labels=ids, attention_mask=mask).loss
            results[recompute] = (loss.detach(), torch.autograd.grad(loss, list(model.parameters())))
        assert len({id(make) for make in made}) == (2 * TINY.num_hidden_layers if recompute else 0)
    (loss_kept, grads_kept), (loss_made, grads_made) = results[False], results[True]
    assert torch.equal(loss_kept, loss_made)
    for a, b in zip(grads_kept, grads_made, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_llama_keeps_two_norm_outputs_a_layer_fewer_on_the_gpu(dtype):
    """bf16 weights, or fp32 weights under bf16 autocast (the projections' bf16 casts of the
    norm outputs are what is no longer kept)."""
    config = LlamaConfig(**{**vars(TINY), "hidden_size": 256, "num_attention_heads": 4, "head_dim": None})
    torch.manual_seed(0)
    model = Llama(config, device="cuda", dtype=dtype)
    ids = torch.randint(0, config.vocab_size, (4, 16), device="cuda")
    model(ids, labels=ids).loss.backward()  # a first step's one-time allocations are not counted
    model.zero_grad(set_to_none=True)
    held = {}
    for recompute in (False, True):
        for layer in model.model.layers:
            layer.recompute_norms = recompute
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.float32):
            loss = model(ids, labels=ids).loss
        held[recompute] = torch.cuda.memory_allocated() - before
        loss.backward()
        del loss  # else the next pass's `before` holds this loss and its `held` does not hold its own
        model.zero_grad(set_to_none=True)
    stream = ids.numel() * config.hidden_size * 2  # one bf16 [tokens, D] norm output
    assert held[False] - held[True] == 2 * config.num_hidden_layers * stream


def test_other_saved_tensor_hooks_own_what_is_saved_inside_them():
    """Inside activation checkpointing (its own saved-tensor hooks) nothing is repacked, and
    the gradients are checkpointing's."""
    h = torch.randn(6, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(16, device=DEVICE, requires_grad=True)

    def block(h):
        with RecomputedNorms() as norms:
            assert norms._hooks is None
            normed = norms.register(rms_norm(h, (16,), w), lambda: rms_norm(h.detach(), (16,), w.detach()))
            return (normed @ normed.t()).sum()

    loss = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
    grads = torch.autograd.grad(loss, (h, w))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        expected = torch.autograd.grad(block(h), (h, w))
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_an_output_changed_in_place_or_an_unusual_tensor_is_saved_as_it_is():
    """Only a plain, non-empty, unchanged registered output is repacked: one scaled in place
    after registering keeps its own gradient, and sparse, empty or int tensors saved in the
    context pass through untouched."""
    h = torch.randn(6, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(16, device=DEVICE, requires_grad=True)
    proj = torch.randn(16, 8, device=DEVICE, requires_grad=True)

    def loss(recompute):
        with RecomputedNorms(enabled=recompute) as norms:
            normed = norms.register(rms_norm(h, (16,), w), lambda: rms_norm(h.detach(), (16,), w.detach()))
            normed.mul_(3)
            return (normed @ proj).square().sum()

    for kept, made in zip(
        torch.autograd.grad(loss(False), (h, w, proj)), torch.autograd.grad(loss(True), (h, w, proj)), strict=True
    ):
        torch.testing.assert_close(made, kept)
    empty = torch.empty(0, 4, device=DEVICE, requires_grad=True)
    with RecomputedNorms() as norms:
        norms.register(torch.empty(0, 4, device=DEVICE), lambda: torch.empty(0, 4, device=DEVICE))
        sparse = torch.eye(4, device=DEVICE).to_sparse()
        dense = torch.randn(4, 3, device=DEVICE, requires_grad=True)
        out = torch.sparse.mm(sparse, dense).sum() + (empty * 2).sum()
    out.backward()
    torch.testing.assert_close(dense.grad, torch.ones(4, 3, device=DEVICE))


def test_a_norm_of_another_class_runs_as_its_module_in_the_fused_layer():
    """A decoder layer whose norms are swapped for LayerNorms (bias included) computes what
    the unfused layer computes: no RMSNorm kernel stands in for them, forward or backward."""
    from lstrain.layers import DecoderLayer, rotary_cos_sin

    torch.manual_seed(0)
    dim = 32
    cos, sin = rotary_cos_sin(torch.arange(6, device=DEVICE), 8, 1e4, torch.float32)
    layers = {fused: DecoderLayer(dim, 4, 2, 8, 48, fused=fused, device=DEVICE) for fused in (True, False)}
    layers[False].load_state_dict(layers[True].state_dict())
    for layer in layers.values():
        torch.manual_seed(1)  # the same random weights and biases in both layers
        layer.input_layernorm = torch.nn.LayerNorm(dim, device=DEVICE)
        layer.post_attention_layernorm = torch.nn.LayerNorm(dim, device=DEVICE)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            torch.nn.init.normal_(norm.weight)
            torch.nn.init.normal_(norm.bias)
    x, stream = (torch.randn(2, 6, dim, device=DEVICE, requires_grad=True) for _ in range(2))
    results = {}
    for fused, layer in layers.items():
        out, residual = layer(x, cos, sin, residual=stream)
        grads = torch.autograd.grad((out.square().sum() + residual.sum()), (x, stream))
        results[fused] = (out, residual, *grads)
    for a, b in zip(results[True], results[False], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
