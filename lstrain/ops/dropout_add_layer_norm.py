"""The end of a Transformer sublayer and the next LayerNorm in one pass each way.

``new_residual = residual + dropout(x + x_bias)`` and ``normed = layer_norm(new_residual)``:
GPT-2's ``x = x + attn(ln_1(x)); ... ln_2(x)`` and BERT's ``ln_1(x + attn(x))`` between
two GEMMs. Separately they are :func:`lstrain.ops.bias_dropout_residual` then
:func:`lstrain.ops.layer_norm`, and in backward LayerNorm's dx, the add of the stream's own
gradient that autograd inserts, and the dropout's backward: three kernels and eight passes
over [rows, cols] become one kernel and five (and the small sums of the parameters'
partials).

Forward reads x, the residual and the biases once, writes the new residual (rounded once
to its dtype, and normalised as rounded, as the unfused pair computes it) and the
normalised output, and keeps LayerNorm's fp32 row statistics. Backward reads the new
residual, the gradient of ``normed`` and (pre-LN) the gradient of ``new_residual``, and
writes their sum through LayerNorm (the gradient of ``residual``) and, with dropout, that
sum dropped with the forward's mask (the gradient of ``x``), regenerated from the seed;
dweight, dbias and dx_bias go through fp32 per-program partials (deterministic). The
dropout mask is :func:`lstrain.ops.dropout_mask`'s, as bias_dropout_residual draws it.

Rows wider than LayerNorm's single-tile backward (``MAX_TILE_COLS_BWD``) run the two ops
in a row instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from lstrain import _backend
from lstrain._backend import wait_for_producers
from lstrain.ops._lib.custom_op import kernel_op
from lstrain.ops._lib.dropout import (
    apply_dropout,
    check_seed,
    dropout_keep,
    dropout_mask,
    dropout_scale,
    new_seed,
)
from lstrain.ops._lib.first_order import refuse_create_graph
from lstrain.ops._lib.layout import as_rows, cdiv, contiguous_or_none, grad_place, placeable
from lstrain.ops._lib.options import check_tensors, float_option
from lstrain.ops._lib.partial_sums import sum_partials
from lstrain.ops.bias_dropout_residual import bias_dropout_residual, bias_dropout_residual_ref, dropout_backward
from lstrain.ops.layer_norm import (
    MAX_TILE_COLS_BWD,
    layer_norm,
    layer_norm_bwd_plan,
    layer_norm_fwd_plan,
    layer_norm_ref,
    normalized_grad,
    row_statistics,
)

__all__ = [
    "DropoutAddLayerNormFunction",
    "dropout_add_layer_norm",
    "dropout_add_layer_norm_bwd",
    "dropout_add_layer_norm_fwd",
    "dropout_add_layer_norm_ref",
]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _dropout_add_layer_norm_fwd_kernel(
    x_ptr,
    x_bias_ptr,
    residual_ptr,
    weight_ptr,
    bias_ptr,
    normed_ptr,
    new_residual_ptr,
    stats_ptr,
    seed_ptr,
    rows,
    cols,
    x_row_stride,
    residual_row_stride,
    inv_cols,
    eps,
    p,
    keep_scale,
    HAS_X_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = row < rows
    col = tl.arange(0, BLOCK_COLS)
    col_ok = col < cols
    mask = row_ok[:, None] & col_ok[None, :]
    v = tl.load(x_ptr + row[:, None] * x_row_stride + col[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_X_BIAS:
        v += tl.load(x_bias_ptr + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if DROPOUT:
        p = tl.cast(p, tl.float32)
        v = apply_dropout(v, dropout_keep(seed_ptr, row, 0, cols, p, BLOCK_COLS), keep_scale)
    residual = tl.load(residual_ptr + row[:, None] * residual_row_stride + col[None, :], mask=mask, other=0.0)
    h = (v + residual.to(tl.float32)).to(new_residual_ptr.dtype.element_ty)
    offsets = row[:, None] * cols + col[None, :]
    tl.store(new_residual_ptr + offsets, h, mask=mask)
    # LayerNorm of the stored (rounded) sum, as lstrain.ops.layer_norm computes it
    eps = tl.cast(eps, tl.float32)
    inv_cols = tl.cast(inv_cols, tl.float32)
    centred, mean, drift, rstd = row_statistics(h.to(tl.float32), mask, inv_cols, eps)
    y = (centred - drift[:, None]) * rstd[:, None]
    if HAS_WEIGHT:
        y *= tl.load(weight_ptr + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(normed_ptr + offsets, y.to(normed_ptr.dtype.element_ty), mask=mask)
    tl.store(stats_ptr + row, mean, mask=row_ok)
    tl.store(stats_ptr + rows + row, rstd, mask=row_ok)
    tl.store(stats_ptr + rows + rows + row, drift, mask=row_ok)


@triton.jit
def _dropout_add_layer_norm_bwd_kernel(
    new_residual_ptr,
    dnormed_ptr,
    dnew_residual_ptr,
    weight_ptr,
    stats_ptr,
    seed_ptr,
    dresidual_ptr,
    dx_ptr,
    partial_ptr,
    rows,
    cols,
    dnormed_row_stride,
    dnew_residual_row_stride,
    inv_cols,
    p,
    keep_scale,
    HAS_DNEW_RESIDUAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    X_BIAS_GRAD: tl.constexpr,
    BIAS_SLOT: tl.constexpr,
    X_BIAS_SLOT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """dresidual = LayerNorm's dx + dnew_residual; dx = dresidual * mask / (1 - p); per-program
    column sums of dnormed * x_hat, dnormed and dx into their partials rows."""
    wait_for_producers(PDL)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    inv_cols = tl.cast(inv_cols, tl.float32)
    p = tl.cast(p, tl.float32)
    col = tl.arange(0, BLOCK_COLS)
    col_ok = col < cols
    if HAS_WEIGHT:
        weight = tl.load(weight_ptr + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    weight_acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
    bias_acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
    x_bias_acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
    # Pipelining the loop keeps the next rows' loads in flight during this row's math.
    for first in tl.range(pid * BLOCK_ROWS, rows, programs * BLOCK_ROWS, num_stages=NUM_STAGES):
        row = tl.arange(0, BLOCK_ROWS).to(tl.int64) + first
        row_ok = row < rows
        mask = row_ok[:, None] & col_ok[None, :]
        offsets = row[:, None] * cols + col[None, :]
        h = tl.load(new_residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dnormed_ptr + row[:, None] * dnormed_row_stride + col[None, :], mask=mask, other=0.0)
        dy = dy.to(tl.float32)
        mean = tl.load(stats_ptr + row, mask=row_ok, other=0.0)
        rstd = tl.load(stats_ptr + rows + row, mask=row_ok, other=0.0)
        drift = tl.load(stats_ptr + rows + rows + row, mask=row_ok, other=0.0)
        x_hat = tl.where(mask, ((h - mean[:, None]) - drift[:, None]) * rstd[:, None], 0.0)
        g = normalized_grad(x_hat, dy * weight if HAS_WEIGHT else dy, rstd, inv_cols)
        if HAS_DNEW_RESIDUAL:
            dnew = tl.load(
                dnew_residual_ptr + row[:, None] * dnew_residual_row_stride + col[None, :], mask=mask, other=0.0
            )
            g += dnew.to(tl.float32)
        tl.store(dresidual_ptr + offsets, g.to(dresidual_ptr.dtype.element_ty), mask=mask)
        if DROPOUT:
            g = apply_dropout(g, dropout_keep(seed_ptr, row, 0, cols, p, BLOCK_COLS), keep_scale)
            tl.store(dx_ptr + offsets, g.to(dx_ptr.dtype.element_ty), mask=mask)
        if WEIGHT_GRAD:
            weight_acc += dy * x_hat
        if BIAS_GRAD:
            bias_acc += dy
        if X_BIAS_GRAD:
            x_bias_acc += g
    if WEIGHT_GRAD:
        tl.store(partial_ptr + pid.to(tl.int64) * cols + col, tl.sum(weight_acc, axis=0), mask=col_ok)
    if BIAS_GRAD:
        tl.store(
            partial_ptr + (BIAS_SLOT * programs + pid).to(tl.int64) * cols + col, tl.sum(bias_acc, axis=0), mask=col_ok
        )
    if X_BIAS_GRAD:
        slot = (X_BIAS_SLOT * programs + pid).to(tl.int64)
        tl.store(partial_ptr + slot * cols + col, tl.sum(x_bias_acc, axis=0), mask=col_ok)


def dropout_add_layer_norm_fwd(
    x: torch.Tensor,
    x_bias: torch.Tensor | None,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    seed: torch.Tensor | None,
    eps: float,
    p: float,
    dropout: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on validated inputs (rows of at most ``MAX_TILE_COLS_BWD``).

    Returns:
        ``(normed, new_residual, stats)``: the first two shaped and typed like ``x``
        (contiguous); stats fp32 [3, rows]: mean, rstd and the mean's rounding error.
    """
    cols = x.shape[-1]
    x2d = as_rows(x, cols)
    residual2d = as_rows(residual, cols)
    rows = x2d.shape[0]
    normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    stats = torch.empty((3, rows), dtype=torch.float32, device=x.device)
    if rows == 0 or cols == 0:
        return normed, new_residual, stats.zero_()  # rows of no width: statistics nothing reads, defined
    plan = layer_norm_fwd_plan(max(8, cols))  # dropout_keep takes at least 8 columns
    _dropout_add_layer_norm_fwd_kernel[(cdiv(rows, plan.block_rows),)](
        x2d, x_bias, residual2d, weight, bias, normed, new_residual, stats, seed,
        rows, cols, x2d.stride(0), residual2d.stride(0), 1.0 / cols, eps, p, dropout_scale(p),
        HAS_X_BIAS=x_bias is not None,
        DROPOUT=dropout,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        BLOCK_ROWS=plan.block_rows,
        BLOCK_COLS=plan.block_cols,
        num_warps=plan.num_warps,
        **_backend.dependent_launch(x2d),
    )  # fmt: skip
    return normed, new_residual, stats


def dropout_add_layer_norm_bwd(
    dnormed: torch.Tensor,
    dnew_residual: torch.Tensor | None,
    new_residual: torch.Tensor,
    weight: torch.Tensor | None,
    stats: torch.Tensor,
    seed: torch.Tensor | None,
    p: float,
    dropout: bool,
    weight_grad: bool,
    bias_grad: bool,
    x_bias_grad: bool,
    bias_dtype: torch.dtype | None,
    x_bias_dtype: torch.dtype | None,
    into: Sequence[torch.Tensor | None] = (),
) -> list[torch.Tensor]:
    """Launch the backward kernels.

    Args:
        dnormed: the upstream gradient of ``normed``.
        dnew_residual: the upstream gradient of ``new_residual`` (None: not used).
        new_residual, stats: what :func:`dropout_add_layer_norm_fwd` returned.
        weight, seed, p, dropout: as given to it.
        weight_grad, bias_grad, x_bias_grad: which parameter gradients to compute.
        bias_dtype, x_bias_dtype: their dtypes.
        into: where to write dweight, dbias and dx_bias (in that order; None or missing: a
            new tensor), e.g. their places in flat gradient buffers.

    Returns:
        ``[dresidual]`` (the gradient of ``residual``, and of ``x`` without dropout), then
        dx if ``dropout``, then dweight, dbias, dx_bias as asked.
    """
    cols = new_residual.shape[-1]
    dnormed2d = as_rows(dnormed, cols)
    dnew2d = None if dnew_residual is None else as_rows(dnew_residual, cols)
    rows = dnormed2d.shape[0]
    like = {"dtype": new_residual.dtype, "device": new_residual.device}
    grads = [torch.empty(new_residual.shape, **like)]
    if dropout:
        grads.append(torch.empty(new_residual.shape, **like))
    weight_dtype = None if weight is None else weight.dtype
    wanted = ((weight_grad, weight_dtype), (bias_grad, bias_dtype), (x_bias_grad, x_bias_dtype))
    places = (*into, None, None, None)[:3]
    params = [
        torch.empty(cols, dtype=dtype, device=new_residual.device) if place is None else place
        for (want, dtype), place in zip(wanted, places, strict=True)
        if want
    ]
    if cols == 0:
        return grads + params
    device = _backend.device_index(new_residual)
    # tiles at least 8 wide: dropout_keep's minimum; the pipeline holds dnew_residual too
    row_inputs = 2 + (dnew_residual is not None)
    plan = layer_norm_bwd_plan(
        max(8, cols), new_residual.element_size(), _backend.shared_memory_per_program(device), row_inputs
    )
    programs = max(1, min(cdiv(rows, plan.block_rows), _backend.multiprocessor_count(device) * plan.programs_per_sm))
    partials = torch.empty((len(params), programs, cols), dtype=torch.float32, device=new_residual.device)
    _dropout_add_layer_norm_bwd_kernel[(programs,)](
        new_residual, dnormed2d, dnew2d, weight, stats, seed, grads[0], grads[-1], partials,
        rows, cols, dnormed2d.stride(0), 0 if dnew2d is None else dnew2d.stride(0), 1.0 / cols, p, dropout_scale(p),
        HAS_DNEW_RESIDUAL=dnew_residual is not None,
        DROPOUT=dropout,
        HAS_WEIGHT=weight is not None,
        WEIGHT_GRAD=weight_grad,
        BIAS_GRAD=bias_grad,
        X_BIAS_GRAD=x_bias_grad,
        BIAS_SLOT=int(weight_grad),
        X_BIAS_SLOT=int(weight_grad) + int(bias_grad),
        BLOCK_ROWS=plan.block_rows,
        BLOCK_COLS=plan.block_cols,
        NUM_STAGES=plan.num_stages,
        num_warps=plan.num_warps,
        # As LayerNorm's backward: without contraction, dy * w - c2 is exactly 0 where x
        # equals its row mean; an FMA would leave the product's rounding error there.
        enable_fp_fusion=False,
        **_backend.dependent_launch(new_residual),
    )  # fmt: skip
    if params:
        sum_partials(partials, params)
    return grads + params


@kernel_op("dropout_add_layer_norm_fwd", dropout_add_layer_norm_fwd)
def dropout_add_layer_norm_fwd_op(
    x: torch.Tensor,
    x_bias: torch.Tensor | None,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    seed: torch.Tensor | None,
    eps: float,
    p: float,
    dropout: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = math.prod(x.shape[:-1])
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        torch.empty_like(x, memory_format=torch.contiguous_format),
        x.new_empty((3, rows), dtype=torch.float32),
    )


@kernel_op("dropout_add_layer_norm_bwd", dropout_add_layer_norm_bwd)
def dropout_add_layer_norm_bwd_op(
    dnormed: torch.Tensor,
    dnew_residual: torch.Tensor | None,
    new_residual: torch.Tensor,
    weight: torch.Tensor | None,
    stats: torch.Tensor,
    seed: torch.Tensor | None,
    p: float,
    dropout: bool,
    weight_grad: bool,
    bias_grad: bool,
    x_bias_grad: bool,
    bias_dtype: torch.dtype | None,
    x_bias_dtype: torch.dtype | None,
) -> list[torch.Tensor]:
    grads = [torch.empty_like(new_residual, memory_format=torch.contiguous_format)]
    if dropout:
        grads.append(torch.empty_like(new_residual, memory_format=torch.contiguous_format))
    cols = new_residual.shape[-1]
    if weight_grad:
        grads.append(new_residual.new_empty(cols, dtype=weight.dtype))
    if bias_grad:
        grads.append(new_residual.new_empty(cols, dtype=bias_dtype))
    if x_bias_grad:
        grads.append(new_residual.new_empty(cols, dtype=x_bias_dtype))
    return grads


class DropoutAddLayerNormFunction(torch.autograd.Function):
    """Autograd for :func:`dropout_add_layer_norm`; saves the new residual, the norm's weight,
    the fp32 statistics and the seed."""

    @staticmethod
    def forward(ctx, x, x_bias, residual, weight, bias, seed, eps, p, dropout):
        normed, new_residual, stats = dropout_add_layer_norm_fwd_op(
            x, x_bias, residual, weight, bias, seed, eps, p, dropout
        )
        # bias and x_bias only as the parameters their gradients may be written into
        ctx.save_for_backward(new_residual, weight, stats, seed, placeable(bias), placeable(x_bias))
        ctx.p, ctx.dropout = p, dropout
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.x_bias_dtype = None if x_bias is None else x_bias.dtype
        # An unused output's gradient stays None instead of a tensor of zeros to read.
        ctx.set_materialize_grads(False)
        return normed, new_residual

    @staticmethod
    def backward(ctx, dnormed, dnew_residual):
        refuse_create_graph("dropout_add_layer_norm")
        new_residual, weight, stats, seed, bias, x_bias = ctx.saved_tensors
        x_grad, x_bias_grad, residual_grad, weight_grad, bias_grad = ctx.needs_input_grad[:5]
        if dnormed is None:  # only new_residual was used: LayerNorm contributes nothing
            return _bias_dropout_residual_grads(ctx, dnew_residual, seed, x_bias)
        into = (
            grad_place(weight) if weight_grad else None,
            grad_place(bias) if bias_grad else None,
            grad_place(x_bias) if x_bias_grad else None,
        )
        grads = dropout_add_layer_norm_bwd_op(
            dnormed, dnew_residual, new_residual, weight, stats, seed, ctx.p, ctx.dropout,
            weight_grad, bias_grad, x_bias_grad, ctx.bias_dtype, ctx.x_bias_dtype, into=into,
        )  # fmt: skip
        dresidual = grads[0]
        dx = grads[1] if ctx.dropout else dresidual  # without dropout one tensor serves both
        params = iter(grads[1 + ctx.dropout :])
        dweight = next(params) if weight_grad else None
        dbias = next(params) if bias_grad else None
        dx_bias = next(params) if x_bias_grad else None
        return (
            dx if x_grad else None,
            dx_bias,
            dresidual if residual_grad else None,
            dweight,
            dbias,
            None,
            None,
            None,
            None,
        )


def _bias_dropout_residual_grads(ctx, dnew_residual, seed, x_bias):
    """The backward of ``residual + dropout(x + x_bias)`` alone, for when ``normed`` is unused."""
    x_bias_grad = ctx.needs_input_grad[1]
    into = (grad_place(x_bias) if x_bias_grad else None,)
    dx, dx_bias = dropout_backward(dnew_residual, seed, ctx.p, ctx.dropout, x_bias_grad, ctx.x_bias_dtype, into)
    return dx, dx_bias, dnew_residual, None, None, None, None, None, None


def _check_tensor(name: str, t: torch.Tensor | None, x: torch.Tensor, shape: tuple[int, ...], same_dtype: bool):
    if t is None:
        return
    if tuple(t.shape) != shape:
        raise ValueError(f"dropout_add_layer_norm: {name} has shape {tuple(t.shape)}, expected {shape}")
    if t.device != x.device:
        raise ValueError(f"dropout_add_layer_norm: {name} is on {t.device} but x is on {x.device}")
    if same_dtype and t.dtype != x.dtype:
        raise ValueError(f"dropout_add_layer_norm: {name} has dtype {t.dtype}, but x has dtype {x.dtype}")
    if t.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"dropout_add_layer_norm: {name} has dtype {t.dtype}; expected float32, float16 or bfloat16")


def dropout_add_layer_norm(
    x: torch.Tensor,
    x_bias: torch.Tensor | None,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    eps: float = 1e-5,
    dropout: float = 0.0,
    training: bool = True,
    seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sublayer's residual add and the LayerNorm after it, in one kernel each way.

    ``new_residual = residual + dropout(x + x_bias)`` (fp32 arithmetic, rounded once to x's
    dtype) and ``normed = layer_norm(new_residual, weight, bias, eps)`` over the last dim:
    the values of :func:`lstrain.ops.bias_dropout_residual` then :func:`lstrain.ops.layer_norm`
    with the same seed, and in backward the gradients of both outputs meet inside the
    kernel (pre-LN models use both; post-LN ones only ``normed``).

    Args:
        x: ``[*, cols]``, float32/float16/bfloat16: a sublayer's projection before its bias;
            only the last dim needs to be contiguous.
        x_bias: optional ``[cols]``: the projection's bias, float32/float16/bfloat16.
        residual: the residual stream, same shape, dtype and device as ``x``.
        weight, bias: optional ``[cols]`` LayerNorm scale and shift, float32/float16/bfloat16
            (not necessarily x's dtype).
        eps: LayerNorm's epsilon, >= 0.
        dropout: drop probability of ``x + x_bias`` in [0, 1); kept elements are scaled by
            1 / (1 - p).
        training: dropout is the identity when False.
        seed: a 1-element int64 tensor on x's device fixing the mask (see
            :func:`lstrain.ops.dropout_mask`); drawn from torch's generator when None.

    Returns:
        ``(normed, new_residual)``, both shaped and typed like ``x`` (contiguous).

    Raises:
        ValueError: a tensor argument that is no tensor (named); ``x`` a scalar or not
            float32/float16/bfloat16; ``residual`` not shaped, typed or placed like ``x``; a
            bias or weight not ``[cols]``, on another device or of another dtype than those
            three; ``eps`` negative or not finite; ``dropout`` outside [0, 1); a ``seed``
            that is not a 1-element int64 tensor on x's device.
    """
    check_tensors(
        "dropout_add_layer_norm", {"x": x, "residual": residual}, {"x_bias": x_bias, "weight": weight, "bias": bias}
    )
    if x.dim() < 1:
        raise ValueError("dropout_add_layer_norm: x must have at least one dim, got a scalar")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"dropout_add_layer_norm: x has dtype {x.dtype}; expected float32, float16 or bfloat16")
    cols = x.shape[-1]
    _check_tensor("residual", residual, x, tuple(x.shape), same_dtype=True)
    _check_tensor("x_bias", x_bias, x, (cols,), same_dtype=False)
    _check_tensor("weight", weight, x, (cols,), same_dtype=False)
    _check_tensor("bias", bias, x, (cols,), same_dtype=False)
    eps = float_option("dropout_add_layer_norm", "eps", eps, 0)
    p = float_option("dropout_add_layer_norm", "dropout", dropout, 0, 1, high_open=True)
    check_seed("dropout_add_layer_norm", seed, x.device)
    active = training and p > 0
    if active and seed is None:
        seed = new_seed(x.device)
    backend = _backend.backend_for(x)
    _backend.note("dropout_add_layer_norm", backend)
    if backend == "reference":  # the kernels' mask, drawn by plain PyTorch
        mask = dropout_mask(seed, x.shape, p) if active else None
        return dropout_add_layer_norm_ref(
            x, x_bias, residual, weight, bias, eps=eps, dropout=p if active else 0.0, mask=mask
        )
    if cols > MAX_TILE_COLS_BWD:  # rows LayerNorm's backward streams in chunks: the two ops
        new_residual = bias_dropout_residual(x, x_bias, residual, dropout=p, training=training, seed=seed)
        return layer_norm(new_residual, cols, weight, bias, eps), new_residual
    return DropoutAddLayerNormFunction.apply(
        x, contiguous_or_none(x_bias), residual, contiguous_or_none(weight), contiguous_or_none(bias),
        seed if active else None, eps, p, active,
    )  # fmt: skip


def dropout_add_layer_norm_ref(
    x: torch.Tensor,
    x_bias: torch.Tensor | None,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    eps: float = 1e-5,
    dropout: float = 0.0,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`lstrain.ops.bias_dropout_residual_ref` then :func:`lstrain.ops.layer_norm_ref`.

    Args:
        x, x_bias, residual, weight, bias, eps, dropout: as for :func:`dropout_add_layer_norm`.
        mask: bool, x's shape: which elements are kept (e.g. :func:`lstrain.ops.dropout_mask`
            of the seed an lstrain call used); None lets torch's generator draw one.

    Returns:
        ``(normed, new_residual)``, shaped and typed like ``x``.
    """
    new_residual = bias_dropout_residual_ref(x, x_bias, residual, dropout=dropout, mask=mask)
    return layer_norm_ref(new_residual, x.shape[-1], weight, bias, eps), new_residual
