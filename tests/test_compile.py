"""Whole-model torch.compile of lstrain's fused GPT-2: no graph break, compiled = eager, no
recompilation across steps.

On the CPU Inductor's C++ backend compiles everything around lstrain's custom ops, which run
their Triton kernels in the interpreter; on a GPU Inductor compiles for CUDA.
"""

import torch

from lstrain._backend import record_backends
from lstrain.layers import TransformerLayer
from lstrain.models import GPT2, GPT2Config
from lstrain.optim import FusedAdamW
from lstrain.testing import assert_all_passed, check_module
from tests.conftest import DEVICE, EXPECTED_BACKEND

SMALL = {"vocab_size": 100, "n_positions": 32, "n_embd": 64, "n_layer": 2, "n_head": 4}
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
FUSED_OPS = {"embedding", "layer_norm", "bias_act_dropout", "dropout_add_layer_norm", "linear_cross_entropy"}


class _Loss(torch.nn.Module):
    """A GPT-2's loss as a function of input_ids alone (for check_module), optionally compiled."""

    def __init__(self, model: GPT2, labels: torch.Tensor, attention_mask: torch.Tensor, backend: str | None = None):
        super().__init__()
        self.model, self.labels, self.attention_mask = model, labels, attention_mask
        self.loss = self._loss if backend is None else torch.compile(self._loss, fullgraph=True, backend=backend)

    def _loss(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, labels=self.labels, attention_mask=self.attention_mask).loss

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.loss(input_ids)


def _twins(**overrides) -> tuple[GPT2, GPT2]:
    """A fused GPT-2 and its plain-torch twin with the same weights."""
    config = GPT2Config(**{**SMALL, **NO_DROPOUT, **overrides})
    torch.manual_seed(0)
    fused = GPT2(config, device=DEVICE)
    plain = GPT2(GPT2Config(**{**vars(config), "fused": False}), device=DEVICE)
    plain.load_state_dict(fused.state_dict())
    return fused, plain


def _batch(batch: int = 2, seq: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, SMALL["vocab_size"], (batch, seq), device=DEVICE)
    labels = ids.clone()
    labels[0, :3] = -100
    mask = torch.ones_like(ids)
    mask[-1, -5:] = 0  # right padding: exercises the SDPA mask path
    labels[-1, -5:] = -100
    return ids, labels, mask


def test_whole_model_traces_to_one_graph():
    fused, _ = _twins()
    ids, labels, mask = _batch()

    def loss(input_ids):
        return fused(input_ids, labels=labels, attention_mask=mask).loss

    explanation = torch._dynamo.explain(loss)(ids)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_compiled_loss_and_every_gradient_match_eager_by_the_tolerance_rule():
    # Inductor on both devices: its CPU backend compiles a 2-layer model in about 10 s.
    fused, plain = _twins()
    ids, labels, mask = _batch()
    torch._dynamo.reset()
    compiled_loss = _Loss(fused, labels, mask, backend="inductor")
    with record_backends() as ran:
        compiled = check_module(
            compiled_loss,
            _Loss(plain, labels, mask),
            ids,
            generator=torch.Generator().manual_seed(0),
        )
    assert {op for op, _ in ran} >= FUSED_OPS
    assert {backend for _, backend in ran} == {EXPECTED_BACKEND}
    assert len(compiled) == 1 + len(list(fused.parameters()))  # the loss and every parameter
    assert_all_passed(compiled, "compiled fused GPT-2 vs the fp64 plain twin")
    # kernel_op declared each op's Inductor fallback (no implicit fallback, whose log line
    # formats every argument's IR)
    from torch._inductor.lowering import lowerings

    names = (
        "layer_norm_fwd",
        "dropout_add_layer_norm_fwd",
        "dropout_add_layer_norm_bwd",
        "embedding_fwd",
        "embedding_bwd",
    )
    for name in names:
        assert getattr(torch.ops.lstrain, name).default in lowerings, name
    # and next to the eager fused model: the same kernels, only the glue around them compiled.
    # Parameters go in as plain tensors, as check_module passed them, so that the graph is reused.
    params = {name: p.detach().requires_grad_() for name, p in compiled_loss.named_parameters()}
    with record_backends(), torch._dynamo.config.patch(error_on_recompile=True):
        loss = torch.func.functional_call(compiled_loss, params, (ids,))
    eager_loss = torch.func.functional_call(_Loss(fused, labels, mask), params, (ids,))
    tensors = list(params.values())
    torch.testing.assert_close(loss, eager_loss)
    torch.testing.assert_close(torch.autograd.grad(loss, tensors), torch.autograd.grad(eager_loss, tensors))


class _BiasedStack(torch.nn.Module):
    """Transformer layers over a learned additive attention bias (the attention_softmax path)."""

    def __init__(self, fused: bool, backend: str | None = None, layers: int = 2, dim: int = 64, heads: int = 4):
        super().__init__()
        seq = 16
        self.layers = torch.nn.ModuleList(
            TransformerLayer(dim, heads, norm_first=True, causal=True, fused=fused, device=DEVICE)
            for _ in range(layers)
        )
        self.attn_bias = torch.nn.Parameter(0.1 * torch.randn(heads, seq, seq, device=DEVICE))
        # compiled inside, so that the parameter names stay those of the plain twin
        self.run = self._run if backend is None else torch.compile(self._run, fullgraph=True, backend=backend)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, attn_bias=self.attn_bias)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)


def test_compiled_attention_bias_path_matches_by_the_tolerance_rule():
    torch.manual_seed(0)
    fused = _BiasedStack(fused=True, backend="inductor")
    x = torch.randn(2, 16, 64, device=DEVICE)
    torch._dynamo.reset()
    with record_backends() as ran:
        comparisons = check_module(fused, _BiasedStack(fused=False), x, generator=torch.Generator().manual_seed(0))
    assert {op for op, _ in ran} >= {"attention_softmax", "layer_norm", "bias_act_dropout", "bias_dropout_residual"}
    assert len(comparisons) == 2 + len(list(fused.parameters()))  # output, input and every parameter
    assert_all_passed(comparisons, "compiled fused layers with attn_bias vs the fp64 plain twin")


def test_training_steps_do_not_recompile():
    # dropout on: each step draws a fresh seed inside the graph; a new seed, new data and a
    # new lr must reuse the first step's graph (error_on_recompile turns a recompile into an error)
    fused, _ = _twins(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    optimizer = FusedAdamW(fused.parameters(), lr=1e-3)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def loss_of(input_ids, labels, attention_mask):
        return fused(input_ids, labels=labels, attention_mask=attention_mask).loss

    losses = []
    for i in range(3):
        torch.manual_seed(i)
        optimizer.param_groups[0]["lr"] = 1e-3 * (i + 1)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            loss = loss_of(*_batch())
        loss.backward()  # through the compiled backward graph
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert all(torch.isfinite(loss) for loss in losses)
