"""Residual add fused with RMSNorm: h = x + residual, y = rms_norm(h) * weight, both returned.

The pre-norm decoder layer's ``residual = residual + x; x = norm(residual)``, in one pass
over the rows each way. The kernels are RMSNorm's (:mod:`lstrain.ops.rms_norm`), switched
by a flag: forward also reads the residual and stores the sum, rounded once to x's dtype
and normalised as rounded (as the unfused pair computes it); backward adds the incoming
gradient of the sum to dx in the same pass, and that one tensor is the gradient of both
x and residual (no copy). dweight goes through RMSNorm's fp32 per-program partials, so it
is deterministic without atomics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lstrain import _backend
from lstrain.ops._lib.custom_op import kernel_op
from lstrain.ops._lib.first_order import refuse_create_graph
from lstrain.ops._lib.layout import contiguous_or_none, grad_place
from lstrain.ops._lib.options import check_tensors
from lstrain.ops.layer_norm import LayerNormPlan
from lstrain.ops.rms_norm import rms_norm_arguments, rms_norm_bwd, rms_norm_fwd, rms_norm_ref

__all__ = [
    "AddRMSNormFunction",
    "add_rms_norm",
    "add_rms_norm_bwd",
    "add_rms_norm_fwd",
    "add_rms_norm_ref",
]


def add_rms_norm_fwd(
    x: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None,
    eps: float,
    plan: LayerNormPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on validated inputs.

    Args:
        x, residual, normalized_shape, weight: as for :func:`add_rms_norm` (weight contiguous).
        eps: the resolved eps (a Python float).
        plan: launch settings (default: RMSNorm's forward plan of the row width).

    Returns:
        ``(normed, new_residual, rstd)``: the first two shaped and typed like ``x``
        (contiguous); rstd fp32 [rows].
    """
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    normed, rstd = rms_norm_fwd(x, normalized_shape, weight, eps, plan, residual=residual, new_residual=new_residual)
    return normed, new_residual, rstd


def add_rms_norm_bwd(
    dnormed: torch.Tensor,
    dnew_residual: torch.Tensor | None,
    new_residual: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    normalized_shape: Sequence[int],
    weight_grad: bool,
    plan: LayerNormPlan | None = None,
    into: Sequence[torch.Tensor | None] = (),
) -> list[torch.Tensor]:
    """Launch the backward kernels.

    Args:
        dnormed: the upstream gradient of ``normed``.
        dnew_residual: the upstream gradient of ``new_residual`` (None: not used).
        new_residual, rstd: what :func:`add_rms_norm_fwd` returned.
        weight, normalized_shape: as given to :func:`add_rms_norm_fwd`.
        weight_grad: whether to compute dweight.
        plan: launch settings (default: RMSNorm's backward plan for the shape and device).
        into: ``into[0]``, when given, is where to write dweight (the weight's place in a
            flat gradient buffer).

    Returns:
        ``[d new_residual in total]`` (the gradient of both x and residual), followed by
        dweight (in ``weight``'s dtype) if ``weight_grad``.
    """
    return rms_norm_bwd(
        dnormed, new_residual, weight, rstd, normalized_shape, weight_grad, plan, sum_grad=dnew_residual, into=into
    )


@kernel_op("add_rms_norm_fwd", add_rms_norm_fwd)
def add_rms_norm_fwd_op(
    x: torch.Tensor, residual: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = math.prod(x.shape[: x.dim() - len(normalized_shape)])
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        torch.empty_like(x, memory_format=torch.contiguous_format),
        x.new_empty((rows,), dtype=torch.float32),
    )


@kernel_op("add_rms_norm_bwd", add_rms_norm_bwd)
def add_rms_norm_bwd_op(
    dnormed: torch.Tensor,
    dnew_residual: torch.Tensor | None,
    new_residual: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    normalized_shape: list[int],
    weight_grad: bool,
) -> list[torch.Tensor]:
    grads = [torch.empty_like(new_residual, memory_format=torch.contiguous_format)]
    if weight_grad:
        grads.append(new_residual.new_empty(normalized_shape, dtype=weight.dtype))
    return grads


class AddRMSNormFunction(torch.autograd.Function):
    """Autograd for :func:`add_rms_norm`; saves the new residual, weight and the fp32 rstd."""

    @staticmethod
    def forward(ctx, x, residual, normalized_shape, weight, eps):
        normed, new_residual, rstd = add_rms_norm_fwd_op(x, residual, normalized_shape, weight, eps)
        ctx.save_for_backward(new_residual, weight, rstd)
        ctx.normalized_shape = normalized_shape
        # An unused output's gradient stays None instead of a tensor of zeros to read.
        ctx.set_materialize_grads(False)
        return normed, new_residual

    @staticmethod
    def backward(ctx, dnormed, dnew_residual):
        refuse_create_graph("add_rms_norm")
        new_residual, weight, rstd = ctx.saved_tensors
        weight_grad = ctx.needs_input_grad[3]
        if dnormed is None:  # only new_residual was used: its gradient passes straight through
            return dnew_residual, dnew_residual, None, None, None
        into = (grad_place(weight) if weight_grad else None,)
        grads = add_rms_norm_bwd_op(
            dnormed, dnew_residual, new_residual, weight, rstd, ctx.normalized_shape, weight_grad, into=into
        )
        # One tensor is the gradient of both inputs: x + residual passes it to each unchanged.
        return grads[0], grads[0], None, grads[1] if weight_grad else None, None


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add ``residual`` to ``x`` and RMS-normalise the sum over the trailing ``normalized_shape`` dims.

    ``new_residual = x + residual`` (added in fp32, rounded once to x's dtype) and
    ``normed = rms_norm(new_residual, normalized_shape, weight, eps)``, the same values as
    the two torch ops in a row (:func:`add_rms_norm_ref`), in one kernel each way.
    Statistics and arithmetic are fp32, with one rounding at each store.

    Args:
        x: input of shape ``[*, *normalized_shape]``, float32, float16 or bfloat16 (e.g. the
            attention or MLP output). Only the last dim needs to be contiguous.
        residual: the residual stream, same shape, dtype and device as ``x`` (any strides
            with a contiguous last dim).
        normalized_shape: the trailing dims to normalise over (an int or a sequence).
        weight: optional scale of shape ``normalized_shape``; may have a different float
            dtype from ``x``.
        eps: added to the mean square before the square root; None takes torch's default
            (fp32's machine epsilon, as :func:`lstrain.ops.rms_norm`).

    Returns:
        ``(normed, new_residual)``, both shaped and typed like ``x`` (contiguous). The
        gradient reaching x and residual is one tensor, passed to both.

    Raises:
        ValueError: as :func:`lstrain.ops.rms_norm` raises for ``x``, ``normalized_shape``,
            ``weight`` and ``eps``; ``residual`` is not a tensor or differs from ``x`` in
            shape, dtype or device.
    """
    check_tensors("add_rms_norm", {"x": x, "residual": residual}, {"weight": weight})
    shape, eps = rms_norm_arguments("add_rms_norm", x, normalized_shape, weight, eps)
    for what, ours, theirs in (
        ("shape", tuple(residual.shape), tuple(x.shape)),
        ("dtype", residual.dtype, x.dtype),
        ("device", residual.device, x.device),
    ):
        if ours != theirs:
            raise ValueError(f"add_rms_norm: residual has {what} {ours}, but x has {what} {theirs}")
    backend = _backend.backend_for(x)
    _backend.note("add_rms_norm", backend)
    if backend == "reference":
        return add_rms_norm_ref(x, residual, shape, weight, eps)
    return AddRMSNormFunction.apply(x, residual, list(shape), contiguous_or_none(weight), eps)


def add_rms_norm_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add then RMSNorm in plain PyTorch (``x + residual`` in their dtype,
    then :func:`lstrain.ops.rms_norm_ref`).

    Args:
        x, residual, normalized_shape, weight, eps: as for :func:`add_rms_norm` (eps None:
            torch's default for ``x.dtype``; x and residual may also be fp64).

    Returns:
        ``(normed, new_residual)``, shaped and typed like ``x``.
    """
    new_residual = x + residual
    return rms_norm_ref(new_residual, normalized_shape, weight, eps), new_residual
