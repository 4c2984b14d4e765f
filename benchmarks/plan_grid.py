"""Calls of every op at the shapes where its launch plans change, for ``kernel_audit``.

    python -m benchmarks.kernel_audit benchmarks/plan_grid.py
    python -m benchmarks.kernel_audit --arch 80 --triton-path DIR benchmarks/plan_grid.py -k gemm

The test suite runs small shapes, so launches that only large problems get (a persistent
GEMM over more tiles than SMs, the widest rows of LayerNorm or cross-entropy) are never
compiled by it: a persistent GEMM with an fp32 D needed more shared memory than an H200
has, and only the first benchmark at 16384 x 4096 found it. These calls reach those plans
with little work for the Triton interpreter (few rows, a short K), each forward and
backward, in fp32 and fp16, and check nothing themselves: ``kernel_audit`` records their
launches and compiles them for the target GPU. Not part of the test suite (about half an
hour on two CPU cores).
"""

from __future__ import annotations

import pytest
import torch

from lstrain.ops import (
    attention_softmax,
    bias_act_dropout,
    bias_dropout_residual,
    cross_entropy,
    embedding,
    gemm,
    layer_norm,
    linear_cross_entropy,
    qkv_attention,
)
from lstrain.ops.swiglu import swiglu_act, swiglu_act_bwd, swiglu_fwd

DTYPES = [torch.float32, torch.float16]  # the interpreter's bf16 dot is wrong; 16-bit plans are alike

# M x N x K: persistent 128 x 256 tiles (M, N >= 2048), small grids of 64-row tiles, split K,
# tiles narrower than 128, a partial last column strip
GEMM_SHAPES = [(2048, 2304, 16), (1024, 1024, 4096), (512, 1024, 8192), (4096, 512, 64), (64, 64, 64), (300, 2048, 64)]
GEMM_EPILOGUES = [  # activation, c, bias, an input requiring grad (the stored pre-activation), B = w.t()
    (None, False, False, False, False),
    ("gelu", True, True, True, True),
    ("relu", False, True, True, False),
    ("silu", True, False, True, True),
    ("gelu_tanh", False, False, False, False),
]


@pytest.mark.parametrize("shape", GEMM_SHAPES)
@pytest.mark.parametrize(
    "dtype, out_dtype", [(torch.float16, None), (torch.float16, torch.float32), (torch.float32, None)]
)
@pytest.mark.parametrize("activation, c, bias, grad, transposed", GEMM_EPILOGUES)
def test_gemm(shape, dtype, out_dtype, activation, c, bias, grad, transposed):
    m, n, k = shape
    if dtype == torch.float32 and m * n * k > 2**24:
        pytest.skip("fp32 takes gemm_plan's small tiles at every size; the large K adds only interpreter time")
    a = torch.randn(m, k, dtype=dtype, requires_grad=grad)
    b = torch.randn(n, k, dtype=dtype).t() if transposed else torch.randn(k, n, dtype=dtype)
    d = gemm(
        a,
        b,
        c=torch.randn(m, n, dtype=out_dtype or dtype) if c else None,
        bias=torch.randn(n, dtype=dtype) if bias else None,
        beta=0.5 if c else 0.0,
        activation=activation,
        out_dtype=out_dtype,
    )
    if grad:
        d.sum().backward()


# tokens x D x F: whole pair blocks and a partial one, persistent (16-bit, more tiles than SMs)
@pytest.mark.parametrize("tokens, dim, units", [(2048, 16, 1068), (4096, 16, 2048), (1024, 64, 300)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("store_h", [True, False])
def test_swiglu(tokens, dim, units, dtype, store_h):
    x = torch.randn(tokens, dim, dtype=dtype)
    _, h = swiglu_fwd(x, torch.randn(dim, 2 * units, dtype=dtype), store_h=store_h)
    if store_h:
        swiglu_act_bwd(torch.randn(tokens, units, dtype=dtype), h, True)
        swiglu_act(h)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 65536), (2, 65537), (5, 8192), (7, 1), (4, 3000)])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm(dtype, shape, affine):
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    params = [torch.randn(shape[-1], dtype=dtype, requires_grad=True) if affine else None for _ in range(2)]
    layer_norm(x, shape[-1], *params).sum().backward()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k_len", [16384, 4097, 100, 7])
@pytest.mark.parametrize("causal, padding", [(True, False), (False, True)])
def test_attention_softmax(dtype, k_len, causal, padding):
    scores = torch.randn(1, 2, 2, k_len, dtype=dtype, requires_grad=True)
    key_padding_mask = torch.rand(1, k_len) < 0.1 if padding else None
    y = attention_softmax(scores, scale=0.5, causal=causal, key_padding_mask=key_padding_mask)
    y.backward(torch.randn_like(y))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [262144, 128256, 50257, 1000])
@pytest.mark.parametrize("reduction, smoothing, z_loss", [("mean", 0.1, 0.0), ("none", 0.0, 1e-4), ("sum", 0.2, 1e-4)])
def test_cross_entropy(dtype, vocab, reduction, smoothing, z_loss):
    logits = torch.randn(3, vocab, dtype=dtype, requires_grad=True)
    target = torch.tensor([0, vocab - 1, -100])
    cross_entropy(logits, target, label_smoothing=smoothing, reduction=reduction, z_loss=z_loss).sum().backward()


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_cross_entropy(dtype):
    hidden = torch.randn(9, 64, dtype=dtype, requires_grad=True)
    weight = torch.randn(70001, 64, dtype=dtype, requires_grad=True)
    linear_cross_entropy(hidden, weight, torch.randint(0, 70001, (9,)), label_smoothing=0.1).backward()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [65536, 4097, 3])
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "silu"])
def test_dropout_family(dtype, cols, activation):
    x = torch.randn(3, cols, dtype=dtype, requires_grad=True)
    bias = torch.randn(cols, dtype=dtype, requires_grad=True)
    bias_act_dropout(x, bias, activation=activation, dropout=0.1).sum().backward()
    residual = torch.randn(3, cols, dtype=dtype, requires_grad=True)
    bias_dropout_residual(x, bias, residual, dropout=0.1).sum().backward()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab, dim", [(3000, 8192), (3000, 1000), (70000, 3)])  # 70000: int32 sort keys
@pytest.mark.parametrize("deterministic", [False, True])
def test_embedding(dtype, vocab, dim, deterministic):
    weight = torch.randn(vocab, dim, dtype=dtype, requires_grad=True)
    pos_weight = torch.randn(64, dim, dtype=dtype, requires_grad=True)
    tokens = torch.randint(0, vocab, (2, 5))
    tokens[0, :3] = 7  # a row looked up three times
    y = embedding(tokens, weight, pos_weight=pos_weight, scale=2.0, dropout=0.1, deterministic=deterministic)
    y.sum().backward()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal, p", [(True, 0.1), (False, 0.0), (False, 0.1)])
def test_qkv_attention(dtype, head_dim, causal, p):
    # 256 rows: every kernel at its full tiles (they shrink for shorter sequences); one
    # head, so the interpreter's work stays small
    x = torch.randn(1, 256, 16, dtype=dtype, requires_grad=True)
    weight = (torch.randn(3 * head_dim, 16, dtype=dtype) * 0.2).requires_grad_()
    bias = torch.randn(3 * head_dim, dtype=dtype, requires_grad=True)
    qkv_attention(x, weight, bias, 1, causal=causal, dropout_p=p, seed=torch.tensor([1])).sum().backward()
