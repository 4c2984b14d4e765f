"""Under torch.autocast the matrix-product ops run in autocast's dtype, as torch.matmul
does, and gradients reach fp32 parameters (fp16 autocast on the CPU: the interpreter's
bf16 dot is wrong; the GPU runs the same code with its own autocast)."""

import pytest
import torch

from lstrain import nn as lnn
from lstrain import ops
from tests.conftest import DEVICE

AUTOCAST_DTYPE = torch.float16


def _autocast():
    return torch.autocast(DEVICE, dtype=AUTOCAST_DTYPE)


def test_gemm_runs_in_the_autocast_dtype():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(8, 16, generator=gen).to(DEVICE)
    b = torch.randn(16, 4, generator=gen).to(DEVICE).requires_grad_()
    with _autocast():
        d = ops.gemm(a, b, activation="gelu")
    assert d.dtype == AUTOCAST_DTYPE
    torch.testing.assert_close(d, ops.gemm(a.to(AUTOCAST_DTYPE), b.detach().to(AUTOCAST_DTYPE), activation="gelu"))
    d.float().sum().backward()
    assert b.grad.dtype == torch.float32


def test_swiglu_module_with_fp32_parameters():
    torch.manual_seed(0)
    mlp = lnn.SwiGLUMLP(16, 24).to(DEVICE)
    x = torch.randn(5, 16, device=DEVICE)
    with _autocast():
        y = mlp(x)
    assert y.dtype == AUTOCAST_DTYPE
    expected = ops.swiglu_mlp(
        x.to(AUTOCAST_DTYPE), mlp.gate_up_weight.to(AUTOCAST_DTYPE), mlp.down_weight.to(AUTOCAST_DTYPE)
    )
    torch.testing.assert_close(y, expected)
    y.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in mlp.parameters())


def test_linear_module_with_fp32_parameters():
    """As torch.nn.Linear under autocast: output in autocast's dtype (the fp32 bias joins the
    fp32 accumulator), fp32 gradients for the fp32 weight and bias."""
    torch.manual_seed(0)
    linear = lnn.Linear(16, 12, activation="gelu").to(DEVICE)
    x = torch.randn(2, 5, 16, device=DEVICE)
    with _autocast():
        y = linear(x)
    assert y.dtype == AUTOCAST_DTYPE and y.shape == (2, 5, 12)
    expected = ops.gemm(
        x.reshape(10, 16).to(AUTOCAST_DTYPE), linear.weight.t().to(AUTOCAST_DTYPE), bias=linear.bias, activation="gelu"
    )
    torch.testing.assert_close(y, expected.reshape(2, 5, 12))
    y.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in linear.parameters())


@pytest.mark.parametrize("bias", [False, True])
def test_linear_cross_entropy_with_fp32_weight(bias):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 8, generator=gen).to(DEVICE)
    weight = torch.randn(11, 8, generator=gen).to(DEVICE).requires_grad_()
    b = torch.randn(11, generator=gen).to(DEVICE).requires_grad_() if bias else None
    target = torch.randint(0, 11, (6,), generator=gen).to(DEVICE)
    with _autocast():
        loss = ops.linear_cross_entropy(hidden, weight, target, b)
    expected = ops.linear_cross_entropy(
        hidden.to(AUTOCAST_DTYPE), weight.detach().to(AUTOCAST_DTYPE), target,
        None if b is None else b.detach().to(AUTOCAST_DTYPE), out_dtype=torch.float32,
    )  # fmt: skip
    torch.testing.assert_close(loss, expected)  # in float32, as torch's loss under autocast
    loss.float().backward()
    assert weight.grad.dtype == torch.float32


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_losses_are_float32_under_autocast_as_torchs(reduction):
    """torch's autocast runs its losses in float32; the fused losses give the fp32 value
    their kernels reduced, not one rounded to 16 bits."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 11, generator=gen).to(DEVICE, AUTOCAST_DTYPE).requires_grad_()
    target = torch.randint(0, 11, (6,), generator=gen).to(DEVICE)
    with _autocast():
        expected = torch.nn.functional.cross_entropy(logits, target, reduction=reduction)
        loss = ops.cross_entropy(logits, target, reduction=reduction)
        module = lnn.CrossEntropyLoss(reduction=reduction)(logits, target)
    assert loss.dtype == module.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(loss, ops.cross_entropy(logits, target, reduction=reduction, out_dtype=torch.float32))
    (grad,) = torch.autograd.grad(loss.sum(), logits)
    assert grad.dtype == AUTOCAST_DTYPE
    assert ops.cross_entropy(logits, target, reduction=reduction).dtype == AUTOCAST_DTYPE  # outside autocast
    with pytest.raises(ValueError, match="cross_entropy: out_dtype must be None or a floating dtype"):
        ops.cross_entropy(logits, target, out_dtype=torch.int32)


def test_float64_is_not_cast():
    """torch's autocast leaves float64 alone (``F.linear`` of two float64 tensors stays
    float64 inside it); so do the ops."""
    x, w = torch.randn(3, 4, device=DEVICE, dtype=torch.float64), torch.randn(5, 4, device=DEVICE, dtype=torch.float64)
    with _autocast():
        assert torch.nn.functional.linear(x, w).dtype == torch.float64
        assert ops.linear(x, w).dtype == torch.float64
        assert ops.shared_input_linear(x, [w, w])[1].dtype == torch.float64


def test_outside_autocast_nothing_is_cast():
    a = torch.randn(4, 4, device=DEVICE)
    assert ops.gemm(a, a).dtype == torch.float32


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda a, b: ops.gemm(a, b), "gemm: b is on cpu but a is on meta"),
        (lambda a, b: lnn.Linear(16, 4)(a), "gemm: bias is on cpu but a is on meta"),
        (lambda a, b: ops.swiglu_mlp(a, b, torch.randn(2, 16)), "swiglu_mlp: w_gate_up is on cpu but x is on meta"),
        (
            lambda a, b: ops.linear_cross_entropy(a, b.t(), torch.zeros(8, dtype=torch.long)),
            "linear_cross_entropy: weight is on cpu but hidden is on meta",
        ),
    ],
)
def test_a_first_input_on_a_device_autocast_does_not_know_is_a_device_error(call, match):
    """A meta tensor first (autocast has no meta dispatch key) gets the op's device error,
    not torch's 'unknown device type for autocast'."""
    with pytest.raises(ValueError, match=match):
        call(torch.randn(8, 16, device="meta"), torch.randn(16, 4))
