"""``F.linear`` whose weight gradient lands where a flat-buffer optimizer keeps it.

torch's backward of ``F.linear`` computes the weight gradient into a new tensor, which
autograd then adds into the parameter's ``.grad`` (a flat-buffer view, zeroed each step) or
an optimizer copies into its buffer. This op's backward computes it with
``matmul_like``, which writes into the parameter's place in the flat gradient buffer when
its ``.grad`` is None (:mod:`lstrain._grad_slots`), so the buffer receives it with no add,
fill or copy: on GPT-2 medium that is 292 adds over 355M gradient elements and a fill
per step. The GEMMs are cuBLAS's in both directions, as torch's; only where the weight
gradient goes differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lstrain import _backend
from lstrain.ops._lib.autocast import autocast_inputs
from lstrain.ops._lib.first_order import differentiated, refuse_create_graph
from lstrain.ops._lib.layout import as_rows, matmul_like
from lstrain.ops._lib.linear_checks import check_projection
from lstrain.ops._lib.options import check_tensors

__all__ = ["LinearFunction", "linear", "linear_ref"]


class LinearFunction(torch.autograd.Function):
    """Autograd for :func:`linear`; saves the input and the weight, as torch's does."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        refuse_create_graph("linear")
        x, weight = ctx.saved_tensors
        need_x, need_weight, need_bias = ctx.needs_input_grad
        dy2d = as_rows(dy, dy.shape[-1])
        dx = (dy2d @ weight).view(x.shape) if need_x else None
        dweight = matmul_like(dy2d.t(), as_rows(x, x.shape[-1]), weight) if need_weight else None
        dbias = dy2d.sum(0) if need_bias and ctx.has_bias else None
        return dx, dweight, dbias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, whose backward writes the weight gradient straight into
    a flat gradient buffer where it can (see the module's docstring). Under
    ``torch.autocast`` the inputs are first cast to its dtype, as ``F.linear``'s would be.

    Args:
        x: ``[*, in]``.
        weight: ``[out, in]`` (torch's Linear layout), x's dtype and device.
        bias: ``[out]`` or None.

    Returns:
        ``[*, out]`` in x's dtype.

    Raises:
        ValueError: x, weight or bias no tensor (named), x a scalar, or a weight / bias
            whose shape, dtype or device does not fit (named).
    """
    check_tensors("linear", {"x": x, "weight": weight}, {"bias": bias})
    x, weight, bias = autocast_inputs(x, weight, bias)
    if x.dim() == 0:
        raise ValueError("linear: x must have at least one dim, got a scalar")
    check_projection("linear", "x", x, weight, bias)
    backend = _backend.backend_for(x)
    _backend.note("linear", backend)
    if backend == "reference" or not differentiated(x, weight, bias):
        return F.linear(x, weight, bias)
    return LinearFunction.apply(x, weight, bias)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch: ``F.linear`` (autograd's backward).

    Args:
        x, weight, bias: as for :func:`linear`.

    Returns:
        ``F.linear(x, weight, bias)``.
    """
    return F.linear(x, weight, bias)
