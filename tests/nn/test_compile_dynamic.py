"""lstrain.nn modules under ``torch.compile(fullgraph=True, dynamic=True)``, where Dynamo
passes their float options (eps, dropout, label smoothing, scale) as symbolic floats:
one graph over several sizes, each call equal to eager."""

import pytest
import torch

import lstrain.nn as lnn
from lstrain.layers import DecoderLayer, TransformerLayer
from tests.conftest import DEVICE

D = 32
MODULES = {
    "LayerNorm": (lambda: lnn.LayerNorm(D, eps=1e-6), lambda n: (torch.randn(n, D),)),
    "RMSNorm": (lambda: lnn.RMSNorm(D, eps=1e-6), lambda n: (torch.randn(n, D),)),
    "CrossEntropyLoss": (
        lambda: lnn.CrossEntropyLoss(label_smoothing=0.1),
        lambda n: (torch.randn(n, D), torch.randint(0, D, (n,))),
    ),
    "BiasDropoutResidual": (lambda: lnn.BiasDropoutResidual(D, 0.0), lambda n: (torch.randn(n, D), torch.randn(n, D))),
    "AttentionSoftmax": (lambda: lnn.AttentionSoftmax(0.5, causal=True), lambda n: (torch.randn(1, 2, n, n),)),
    "TransformerLayer": (lambda: TransformerLayer(D, 2).eval(), lambda n: (torch.randn(2, n, D),)),
    "DecoderLayer": (  # LLaMA's: GQA, RoPE on the packed projection, SwiGLU
        lambda: DecoderLayer(D, 2, 1, D // 2, 2 * D).eval(),
        lambda n: (torch.randn(1, n, D), torch.randn(n, D // 2), torch.randn(n, D // 2)),
    ),
}


@pytest.mark.parametrize("name", MODULES)
def test_float_options_trace_as_symbols(name):
    make, inputs = MODULES[name]
    torch.manual_seed(0)
    module = make().to(DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, dynamic=True, backend="aot_eager")
    for n in (3, 5, 7):
        args = [a.to(DEVICE) for a in inputs(n)]
        torch.testing.assert_close(compiled(*args), module(*args), rtol=1e-5, atol=1e-6)
