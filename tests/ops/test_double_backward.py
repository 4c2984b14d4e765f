"""Backward semantics shared by every op. Its backward is a kernel, not differentiable
again: a backward with ``create_graph=True`` raises instead of handing back gradients
without a graph, whose second-order terms would silently be missing. A graph retained for
another backward (``retain_graph=True``) gives the same gradients every time: ops that
write gradients over what their forward saved do so only when the graph is freed."""

import pytest
import torch

from lstrain import ops
from lstrain.ops.swiglu import pack_gate_up
from tests.conftest import DEVICE


def _cases():
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype).requires_grad_()

    tokens = torch.tensor([[1, 2, 2]], device=DEVICE)
    target = torch.tensor([0, 3, 1], device=DEVICE)
    return {
        "layer_norm": lambda: (lambda x: ops.layer_norm(x, 8), randn(3, 8)),
        "attention_softmax": lambda: (lambda s: ops.attention_softmax(s, causal=True), randn(1, 2, 3, 4)),
        "cross_entropy": lambda: (lambda x: ops.cross_entropy(x, target), randn(3, 5)),
        "linear_cross_entropy": lambda: (
            lambda h: ops.linear_cross_entropy(h, torch.ones(5, 4, device=DEVICE), target),
            randn(3, 4),
        ),
        "bias_dropout_residual": lambda: (
            lambda x: ops.bias_dropout_residual(x, None, torch.ones(2, 4, device=DEVICE), dropout=0.2),
            randn(2, 4),
        ),
        "bias_act_dropout": lambda: (lambda x: ops.bias_act_dropout(x, None, activation="gelu"), randn(2, 4)),
        "embedding": lambda: (lambda w: ops.embedding(tokens, w), randn(4, 8)),
        "gemm": lambda: (
            lambda a: ops.gemm(a, torch.ones(4, 3, device=DEVICE, dtype=torch.float16), activation="silu"),
            randn(2, 4, dtype=torch.float16),
        ),
        "swiglu_mlp": lambda: (
            lambda x: ops.swiglu_mlp(
                x, pack_gate_up(torch.ones(4, 3), torch.ones(4, 3)).to(DEVICE), torch.ones(3, 4, device=DEVICE)
            ),
            randn(2, 4),
        ),
    }


@pytest.mark.parametrize("op", sorted(_cases()))
def test_second_derivative_raises(op):
    fn, x = _cases()[op]()
    with pytest.raises(RuntimeError, match=f"{op}: second derivatives are not supported"):
        torch.autograd.grad(fn(x).float().sum(), x, create_graph=True)


@pytest.mark.parametrize("op", sorted(_cases()))
def test_a_retained_graph_backpropagates_again(op):
    fn, x = _cases()[op]()
    y = fn(x).float().sum()
    (first,) = torch.autograd.grad(y, x, retain_graph=True)
    (doubled,) = torch.autograd.grad(2 * y, x, retain_graph=True)
    (last,) = torch.autograd.grad(y, x)  # frees the graph: in place where an op can
    torch.testing.assert_close(doubled, 2 * first)
    torch.testing.assert_close(last, first)
