"""y = dropout(x + bias) + residual, the tail of a Transformer sublayer, in one pass.

Forward reads x, bias and residual once and writes y; the dropout mask comes from a
Philox seed (see :mod:`lstrain.ops._lib.dropout`) and is regenerated in backward, which reads
dy once, writes dx = dy * mask / (1 - p), and sums dx over rows into dbias through
per-program fp32 partials (deterministic). The residual's gradient is dy itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from lstrain import _backend
from lstrain._backend import wait_for_producers
from lstrain.ops._lib.custom_op import kernel_op
from lstrain.ops._lib.dropout import (
    ElementwisePlan,
    apply_dropout,
    check_dropout_inputs,
    check_seed,
    column_walkers,
    dropout_keep,
    dropout_mask,
    dropout_scale,
    elementwise_plan,
    new_seed,
)
from lstrain.ops._lib.first_order import refuse_create_graph
from lstrain.ops._lib.layout import as_rows, cdiv, contiguous_or_none, grad_place, placeable
from lstrain.ops._lib.options import check_tensors
from lstrain.ops._lib.partial_sums import sum_partials

__all__ = [
    "BiasDropoutResidualFunction",
    "bias_dropout_residual",
    "bias_dropout_residual_fwd",
    "bias_dropout_residual_ref",
    "dropout_backward",
    "dropout_bwd",
]


@triton.jit
def _bias_dropout_residual_fwd_kernel(
    x_ptr,
    bias_ptr,
    residual_ptr,
    y_ptr,
    seed_ptr,
    rows,
    cols,
    x_row_stride,
    residual_row_stride,
    p,
    keep_scale,
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    col = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (row < rows)[:, None] & (col < cols)[None, :]
    v = tl.load(x_ptr + row[:, None] * x_row_stride + col[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v += tl.load(bias_ptr + col, mask=col < cols, other=0.0).to(tl.float32)[None, :]
    offsets = row[:, None] * cols + col[None, :]
    if DROPOUT:
        p = tl.cast(p, tl.float32)
        keep = dropout_keep(seed_ptr, row, tl.program_id(1) * BLOCK_COLS, cols, p, BLOCK_COLS)
        v = apply_dropout(v, keep, keep_scale)
    residual = tl.load(residual_ptr + row[:, None] * residual_row_stride + col[None, :], mask=mask, other=0.0)
    y = v + residual.to(tl.float32)
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dropout_bwd_kernel(
    dy_ptr,
    dx_ptr,
    partial_ptr,
    seed_ptr,
    rows,
    cols,
    dy_row_stride,
    p,
    keep_scale,
    DROPOUT: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """dx = dy * mask / (1 - p) (written only with dropout) and per-program column sums of dx."""
    wait_for_producers(PDL)
    col = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    group = tl.program_id(1)
    groups = tl.num_programs(1)
    p = tl.cast(p, tl.float32)
    acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
    for first in tl.range(group * BLOCK_ROWS, rows, groups * BLOCK_ROWS, num_stages=NUM_STAGES):
        row = tl.arange(0, BLOCK_ROWS).to(tl.int64) + first
        mask = (row < rows)[:, None] & (col < cols)[None, :]
        g = tl.load(dy_ptr + row[:, None] * dy_row_stride + col[None, :], mask=mask, other=0.0).to(tl.float32)
        if DROPOUT:
            offsets = row[:, None] * cols + col[None, :]
            keep = dropout_keep(seed_ptr, row, tl.program_id(0) * BLOCK_COLS, cols, p, BLOCK_COLS)
            g = apply_dropout(g, keep, keep_scale)
            tl.store(dx_ptr + offsets, g.to(dx_ptr.dtype.element_ty), mask=mask)
        if BIAS_GRAD:
            acc += g
    if BIAS_GRAD:
        tl.store(partial_ptr + group.to(tl.int64) * cols + col, tl.sum(acc, axis=0), mask=col < cols)


def dropout_bwd(
    dy: torch.Tensor,
    seed: torch.Tensor | None,
    p: float,
    dropout: bool,
    bias_grad: bool,
    bias_dtype: torch.dtype | None,
    plan: ElementwisePlan | None = None,
    into: Sequence[torch.Tensor | None] = (),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dx, dbias)`` for y = dropout(x + bias) (+ anything): dx = dy * mask / (1 - p),
    dbias = dx summed over rows (None unless ``bias_grad``; written into ``into[0]`` when
    that is given, e.g. the bias's place in a flat gradient buffer); dx is dy itself
    without dropout."""
    cols = dy.shape[-1]
    dy2d = as_rows(dy, cols)
    rows = dy2d.shape[0]
    dx = torch.empty(dy.shape, dtype=dy.dtype, device=dy.device) if dropout else dy
    if not (dropout or bias_grad):
        return dx, None
    dbias = None
    if bias_grad:
        dbias = into[0] if into and into[0] is not None else torch.empty(cols, dtype=bias_dtype, device=dy.device)
    if cols == 0:
        return dx, dbias
    plan = plan or elementwise_plan(cols)
    grid, partials = column_walkers(rows, cols, plan, dy, bias_grad)
    _dropout_bwd_kernel[grid](
        dy2d, dx, partials, seed, rows, cols, dy2d.stride(0), p, dropout_scale(p),
        DROPOUT=dropout,
        BIAS_GRAD=bias_grad,
        BLOCK_ROWS=plan.block_rows,
        BLOCK_COLS=plan.block_cols,
        NUM_STAGES=plan.num_stages,
        num_warps=plan.num_warps,
        **_backend.dependent_launch(dy2d),
    )  # fmt: skip
    if bias_grad:
        sum_partials(partials, [dbias])
    return dx, dbias


def bias_dropout_residual_fwd(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    seed: torch.Tensor | None,
    p: float,
    dropout: bool,
) -> torch.Tensor:
    """Launch the forward kernel on validated inputs; returns y (contiguous, x's dtype)."""
    cols = x.shape[-1]
    x2d = as_rows(x, cols)
    residual2d = as_rows(residual, cols)
    rows = x2d.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows == 0 or cols == 0:
        return y
    plan = elementwise_plan(cols)
    _bias_dropout_residual_fwd_kernel[(cdiv(rows, plan.block_rows), cdiv(cols, plan.block_cols))](
        x2d, bias, residual2d, y, seed, rows, cols, x2d.stride(0), residual2d.stride(0), p, dropout_scale(p),
        HAS_BIAS=bias is not None,
        DROPOUT=dropout,
        BLOCK_ROWS=plan.block_rows,
        BLOCK_COLS=plan.block_cols,
        num_warps=plan.num_warps,
        **_backend.dependent_launch(x2d),
    )  # fmt: skip
    return y


@kernel_op("bias_dropout_residual_fwd", bias_dropout_residual_fwd)
def bias_dropout_residual_fwd_op(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    seed: torch.Tensor | None,
    p: float,
    dropout: bool,
) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def dropout_bwd_list(
    dy: torch.Tensor,
    seed: torch.Tensor | None,
    p: float,
    dropout: bool,
    bias_grad: bool,
    bias_dtype: torch.dtype | None,
) -> list[torch.Tensor]:
    """:func:`dropout_bwd` as a list [dx, (dbias)]; a custom op may not return its input,
    so without dropout dx is a copy of dy."""
    dx, dbias = dropout_bwd(dy, seed, p, dropout, bias_grad, bias_dtype)
    return [dx if dropout else dx.clone()] + ([dbias] if bias_grad else [])


@kernel_op("dropout_bwd", dropout_bwd_list)
def dropout_bwd_list_op(
    dy: torch.Tensor,
    seed: torch.Tensor | None,
    p: float,
    dropout: bool,
    bias_grad: bool,
    bias_dtype: torch.dtype | None,
) -> list[torch.Tensor]:
    grads = [torch.empty_like(dy, memory_format=torch.contiguous_format)]
    return grads + ([dy.new_empty(dy.shape[-1], dtype=bias_dtype)] if bias_grad else [])


def dropout_backward(dy, seed, p, dropout, bias_grad, bias_dtype, into=()):
    """:func:`dropout_bwd`, through the custom op under torch.compile (eager calls return
    dy itself as dx when nothing is dropped; ``into`` is None there)."""
    if not torch.compiler.is_compiling():
        return dropout_bwd(dy, seed, p, dropout, bias_grad, bias_dtype, into=into)
    grads = dropout_bwd_list_op(dy, seed, p, dropout, bias_grad, bias_dtype)
    return grads[0], grads[1] if bias_grad else None


class BiasDropoutResidualFunction(torch.autograd.Function):
    """Autograd for :func:`bias_dropout_residual`; saves the seed (and the bias, whose
    gradient's place it looks up, no values)."""

    @staticmethod
    def forward(ctx, x, bias, residual, seed, p, dropout):
        y = bias_dropout_residual_fwd_op(x, bias, residual, seed, p, dropout)
        ctx.save_for_backward(seed, placeable(bias))  # bias: the parameter its gradient may be written into
        ctx.p, ctx.dropout = p, dropout
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        refuse_create_graph("bias_dropout_residual")
        seed, bias = ctx.saved_tensors
        bias_grad = ctx.needs_input_grad[1]
        into = (grad_place(bias) if bias_grad else None,)
        dx, dbias = dropout_backward(dy, seed, ctx.p, ctx.dropout, bias_grad, ctx.bias_dtype, into)
        dresidual = dy if ctx.needs_input_grad[2] else None
        return (dx if ctx.needs_input_grad[0] else None), dbias, dresidual, None, None, None


def bias_dropout_residual(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    *,
    dropout: float = 0.0,
    training: bool = True,
    seed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dropout(x + bias) + residual`` in one kernel each way.

    Args:
        x: ``[*, H]``, float32/float16/bfloat16 (e.g. an attention or MLP output before
            its bias); only the last dim needs to be contiguous.
        bias: optional ``[H]``.
        residual: shaped like ``x`` (the sublayer's input).
        dropout: drop probability in [0, 1); kept elements are scaled by 1 / (1 - p).
        training: dropout is the identity when False.
        seed: a 1-element int64 tensor on x's device fixing the mask (see
            :func:`lstrain.ops.dropout_mask`: the same mask on every backend); drawn from
            torch's generator when None.

    Returns:
        y shaped like ``x`` in x's dtype (contiguous); fp32 arithmetic, one rounding.

    Raises:
        ValueError: a tensor argument that is no tensor (named), wrong dtype, device or
            shape of ``bias`` / ``residual``, ``dropout`` outside [0, 1), or a ``seed`` that
            is not a 1-element int64 tensor on x's device.
    """
    check_tensors("bias_dropout_residual", {"x": x, "residual": residual}, {"bias": bias})
    dropout = check_dropout_inputs("bias_dropout_residual", x, bias, dropout)
    if residual.shape != x.shape or residual.device != x.device:
        raise ValueError(
            f"bias_dropout_residual: residual must match x: got {tuple(residual.shape)} on {residual.device}, "
            f"x is {tuple(x.shape)} on {x.device}"
        )
    if residual.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"bias_dropout_residual: residual has dtype {residual.dtype}; expected a float stream")
    check_seed("bias_dropout_residual", seed, x.device)
    active = training and dropout > 0
    backend = _backend.backend_for(x)
    _backend.note("bias_dropout_residual", backend)
    if active and seed is None:
        seed = new_seed(x.device)
    if backend == "reference":  # the kernels' mask, drawn by plain PyTorch: a seed means one mask everywhere
        mask = dropout_mask(seed, x.shape, dropout) if active else None
        return bias_dropout_residual_ref(x, bias, residual, dropout=dropout if active else 0.0, mask=mask)
    bias = contiguous_or_none(bias)
    return BiasDropoutResidualFunction.apply(x, bias, residual, seed if active else None, dropout, active)


def bias_dropout_residual_ref(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    *,
    dropout: float = 0.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch in fp32.

    Args:
        x, bias, residual, dropout: as for :func:`bias_dropout_residual`.
        mask: bool, x's shape: which elements are kept, e.g.
            :func:`lstrain.ops.dropout_mask` of the seed an lstrain call used;
            None lets torch's generator draw one.

    Returns:
        ``dropout(x + bias) + residual`` in x's dtype.
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    v = x.to(compute) if bias is None else x.to(compute) + bias.to(compute)
    if dropout > 0:
        keep = mask if mask is not None else torch.rand(v.shape, device=v.device) >= dropout
        v = v * keep / (1 - dropout)
    return (v + residual.to(compute)).to(x.dtype)
