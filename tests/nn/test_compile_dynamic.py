"""lstrain.nn modules under ``torch.compile(fullgraph=True, dynamic=True)``, where Dynamo
passes their float options (eps, dropout, label smoothing, scale) as symbolic floats:
one graph over several sizes, each call equal to eager."""

import numpy as np
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


def test_numpy_head_counts_and_flags_become_python_values():
    """Configs read from numpy (or a JSON loader that yields numpy scalars) trace like Python values."""
    torch.manual_seed(0)
    layer = TransformerLayer(D, np.int64(2), causal=np.bool_(True)).eval().to(DEVICE)
    assert type(layer.attn.heads) is int and type(layer.attn.causal) is bool
    x = torch.randn(2, 5, D, device=DEVICE)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-6)
    rotary = DecoderLayer(D, np.int64(2), np.int64(1), np.int64(D // 2), 2 * D).self_attn
    assert (type(rotary.heads), type(rotary.kv_heads), type(rotary.head_dim)) == (int, int, int)


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
