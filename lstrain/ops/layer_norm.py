"""LayerNorm over the trailing dims: y = (x - mean) / sqrt(var + eps) * weight + bias.

Forward: one program normalises a tile of rows held in registers (rows longer than
``MAX_TILE_COLS_FWD`` are streamed in chunks, three passes over the row, the re-reads
served by L2). Mean and rstd are kept in fp32 for backward, as one [3, rows] tensor with
the mean's rounding error: x - mean is exact near the mean, so the row sum of it is
cols times that error ("residual"), and subtracting it keeps x - mean accurate where the
row's spread is small against its mean, which rstd then amplifies (with an fp32 mean alone
a 3-column row of 0.72 +- 0.007 lost 3 ulp of y and 9x torch's error in dx).

Backward: a persistent grid; each program walks a fixed set of rows, writes dx, and
accumulates dweight/dbias in fp32 registers (or in its own fp32 row of a partials buffer
for chunked rows). A second small kernel sums the per-program partials in a fixed order,
so the parameter gradients are deterministic without atomics.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lstrain import _backend
from lstrain._backend import wait_for_producers
from lstrain.ops._lib.custom_op import kernel_op
from lstrain.ops._lib.first_order import refuse_create_graph
from lstrain.ops._lib.layout import as_rows, cdiv, contiguous_or_none, grad_place, placeable
from lstrain.ops._lib.options import check_tensors, float_option
from lstrain.ops._lib.partial_sums import sum_partials

__all__ = [
    "LayerNormFunction",
    "LayerNormPlan",
    "layer_norm",
    "layer_norm_bwd",
    "layer_norm_bwd_plan",
    "layer_norm_fwd",
    "layer_norm_fwd_plan",
    "layer_norm_ref",
    "normalized_grad",
    "row_statistics",
]

# Longest row (power of two) kept whole in registers; longer rows are chunked.
MAX_TILE_COLS_FWD = 16384
MAX_TILE_COLS_BWD = 8192
CHUNK_COLS = 4096
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def row_statistics(x, mask, inv_cols, eps):
    """``(centred, mean, drift, rstd)`` of fp32 rows ``x`` held whole ([rows, cols], ``mask``
    False outside them): ``centred`` is x - mean, zero outside the rows; ``drift`` the fp32
    mean's rounding error (the row mean of ``centred``), which normalising subtracts too."""
    mean = tl.sum(x, axis=1) * inv_cols
    centred = tl.where(mask, x - mean[:, None], 0.0)
    drift = tl.sum(centred, axis=1) * inv_cols
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) * inv_cols - drift * drift + eps)
    return centred, mean, drift, rstd


@triton.jit
def normalized_grad(x_hat, w_dy, rstd, inv_cols):
    """The gradient of rows normalised to ``x_hat`` (zero outside the rows), given the
    gradient of the normalised values ``w_dy`` (dy times the weight): the LayerNorm dx."""
    c1 = tl.sum(x_hat * w_dy, axis=1) * inv_cols
    c2 = tl.sum(w_dy, axis=1) * inv_cols
    return (w_dy - (x_hat * c1[:, None] + c2[:, None])) * rstd[:, None]


@triton.jit
def _layer_norm_fwd_kernel(
    x_ptr,
    y_ptr,
    weight_ptr,
    bias_ptr,
    stats_ptr,
    rows,
    cols,
    x_row_stride,
    y_row_stride,
    inv_cols,
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    SINGLE_TILE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = row < rows
    col = tl.arange(0, BLOCK_COLS)
    x_rows = x_ptr + row[:, None] * x_row_stride
    y_rows = y_ptr + row[:, None] * y_row_stride
    eps = tl.cast(eps, tl.float32)
    inv_cols = tl.cast(inv_cols, tl.float32)
    if SINGLE_TILE:
        mask = row_ok[:, None] & (col < cols)[None, :]
        x = tl.load(x_rows + col[None, :], mask=mask, other=0.0).to(tl.float32)
        centred, mean, residual, rstd = row_statistics(x, mask, inv_cols, eps)
        y = (centred - residual[:, None]) * rstd[:, None]
        if HAS_WEIGHT:
            y *= tl.load(weight_ptr + col, mask=col < cols, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            y += tl.load(bias_ptr + col, mask=col < cols, other=0.0).to(tl.float32)[None, :]
        tl.store(y_rows + col[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        # Two-pass statistics (mean, then squared deviations) stay exact for rows with
        # a large mean, where sum / sum-of-squares would cancel.
        total = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
        for start in range(0, cols, BLOCK_COLS):
            mask = row_ok[:, None] & (start + col < cols)[None, :]
            total += tl.load(x_rows + start + col[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(total, axis=1) * inv_cols
        total = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
        squares = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
        for start in range(0, cols, BLOCK_COLS):
            mask = row_ok[:, None] & (start + col < cols)[None, :]
            x = tl.load(x_rows + start + col[None, :], mask=mask, other=0.0).to(tl.float32)
            centred = tl.where(mask, x - mean[:, None], 0.0)
            total += centred
            squares += centred * centred
        residual = tl.sum(total, axis=1) * inv_cols
        rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=1) * inv_cols - residual * residual + eps)
        for start in range(0, cols, BLOCK_COLS):
            col_ok = start + col < cols
            mask = row_ok[:, None] & col_ok[None, :]
            x = tl.load(x_rows + start + col[None, :], mask=mask, other=0.0).to(tl.float32)
            y = ((x - mean[:, None]) - residual[:, None]) * rstd[:, None]
            if HAS_WEIGHT:
                y *= tl.load(weight_ptr + start + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if HAS_BIAS:
                y += tl.load(bias_ptr + start + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_rows + start + col[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(stats_ptr + row, mean, mask=row_ok)
    tl.store(stats_ptr + rows + row, rstd, mask=row_ok)
    tl.store(stats_ptr + rows + rows + row, residual, mask=row_ok)


@triton.jit
def _layer_norm_bwd_kernel(
    x_ptr,
    dy_ptr,
    dx_ptr,
    weight_ptr,
    stats_ptr,
    partial_ptr,
    rows,
    cols,
    x_row_stride,
    dy_row_stride,
    dx_row_stride,
    inv_cols,
    HAS_WEIGHT: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    SINGLE_TILE: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_producers(PDL)
    pid = tl.program_id(0)
    inv_cols = tl.cast(inv_cols, tl.float32)
    programs = tl.num_programs(0)
    col = tl.arange(0, BLOCK_COLS)
    # Partials layout: [weight grad?, bias grad?] x [programs, cols], fp32.
    weight_partial = partial_ptr + pid.to(tl.int64) * cols
    bias_partial = partial_ptr + ((pid + programs) if WEIGHT_GRAD else pid).to(tl.int64) * cols
    if SINGLE_TILE:
        col_ok = col < cols
        if HAS_WEIGHT:
            weight = tl.load(weight_ptr + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        weight_acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
        bias_acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
        # Pipelining the loop keeps the next rows' loads in flight during this row's math.
        for first in tl.range(pid * BLOCK_ROWS, rows, programs * BLOCK_ROWS, num_stages=NUM_STAGES):
            row = tl.arange(0, BLOCK_ROWS).to(tl.int64) + first
            row_ok = row < rows
            mask = row_ok[:, None] & col_ok[None, :]
            x = tl.load(x_ptr + row[:, None] * x_row_stride + col[None, :], mask=mask, other=0.0)
            dy = tl.load(dy_ptr + row[:, None] * dy_row_stride + col[None, :], mask=mask, other=0.0)
            x = x.to(tl.float32)
            dy = dy.to(tl.float32)
            mean = tl.load(stats_ptr + row, mask=row_ok, other=0.0)
            rstd = tl.load(stats_ptr + rows + row, mask=row_ok, other=0.0)
            residual = tl.load(stats_ptr + rows + rows + row, mask=row_ok, other=0.0)
            x_hat = tl.where(mask, ((x - mean[:, None]) - residual[:, None]) * rstd[:, None], 0.0)
            dx = normalized_grad(x_hat, dy * weight if HAS_WEIGHT else dy, rstd, inv_cols)
            tl.store(dx_ptr + row[:, None] * dx_row_stride + col[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if WEIGHT_GRAD:
                weight_acc += dy * x_hat
            if BIAS_GRAD:
                bias_acc += dy
        if WEIGHT_GRAD:
            tl.store(weight_partial + col, tl.sum(weight_acc, axis=0), mask=col_ok)
        if BIAS_GRAD:
            tl.store(bias_partial + col, tl.sum(bias_acc, axis=0), mask=col_ok)
    else:
        # Chunked rows: each program owns its partials row, so read-add-write there is
        # race free and the summation order fixed. The launcher zeroes the partials.
        for row_index in range(pid, rows, programs):
            row = tl.cast(row_index, tl.int64)
            x_row = x_ptr + row * x_row_stride
            dy_row = dy_ptr + row * dy_row_stride
            mean = tl.load(stats_ptr + row)
            rstd = tl.load(stats_ptr + rows + row)
            residual = tl.load(stats_ptr + rows + rows + row)
            c1_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
            c2_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
            for start in range(0, cols, BLOCK_COLS):
                col_ok = start + col < cols
                x = tl.load(x_row + start + col, mask=col_ok, other=0.0).to(tl.float32)
                dy = tl.load(dy_row + start + col, mask=col_ok, other=0.0).to(tl.float32)
                x_hat = tl.where(col_ok, ((x - mean) - residual) * rstd, 0.0)
                if HAS_WEIGHT:
                    dy *= tl.load(weight_ptr + start + col, mask=col_ok, other=0.0).to(tl.float32)
                c1_acc += x_hat * dy
                c2_acc += dy
            c1 = tl.sum(c1_acc, axis=0) * inv_cols
            c2 = tl.sum(c2_acc, axis=0) * inv_cols
            for start in range(0, cols, BLOCK_COLS):
                col_ok = start + col < cols
                x = tl.load(x_row + start + col, mask=col_ok, other=0.0).to(tl.float32)
                dy = tl.load(dy_row + start + col, mask=col_ok, other=0.0).to(tl.float32)
                x_hat = tl.where(col_ok, ((x - mean) - residual) * rstd, 0.0)
                w_dy = dy
                if HAS_WEIGHT:
                    w_dy = dy * tl.load(weight_ptr + start + col, mask=col_ok, other=0.0).to(tl.float32)
                dx = (w_dy - (x_hat * c1 + c2)) * rstd
                tl.store(dx_ptr + row * dx_row_stride + start + col, dx.to(dx_ptr.dtype.element_ty), mask=col_ok)
                if WEIGHT_GRAD:
                    acc = tl.load(weight_partial + start + col, mask=col_ok, other=0.0)
                    tl.store(weight_partial + start + col, acc + dy * x_hat, mask=col_ok)
                if BIAS_GRAD:
                    acc = tl.load(bias_partial + start + col, mask=col_ok, other=0.0)
                    tl.store(bias_partial + start + col, acc + dy, mask=col_ok)


@dataclass(frozen=True)
class LayerNormPlan:
    """Launch settings of a LayerNorm kernel.

    ``single_tile`` keeps a whole row in registers (``block_cols`` >= cols); otherwise
    rows are streamed in chunks of ``block_cols`` and ``block_rows`` is 1.
    ``programs_per_sm`` sizes the persistent backward grid and ``num_stages`` pipelines
    its row loop (both unused by forward).
    """

    block_rows: int
    block_cols: int
    num_warps: int
    single_tile: bool
    programs_per_sm: int = 1
    num_stages: int = 1


@functools.cache
def layer_norm_fwd_plan(cols: int) -> LayerNormPlan:
    """Forward launch settings for rows of ``cols`` elements (a pure function).

    4 warps holding 16-64 values per thread beat wider programs (the fastest measured);
    short rows go several to a program.
    """
    block_cols = triton.next_power_of_2(cols)
    if block_cols > MAX_TILE_COLS_FWD:
        return LayerNormPlan(1, CHUNK_COLS, 4, single_tile=False)
    if block_cols <= 1024:
        return LayerNormPlan(min(128, 2048 // block_cols), block_cols, 4, single_tile=True)
    block_rows = max(1, 8192 // block_cols)
    return LayerNormPlan(block_rows, block_cols, max(4, block_rows * block_cols // 2048), single_tile=True)


@functools.cache
def layer_norm_bwd_plan(
    cols: int, element_size: int = 4, shared_memory: int = _backend.HOPPER_SHARED_MEMORY, row_inputs: int = 2
) -> LayerNormPlan:
    """Backward launch settings for rows of ``cols`` elements of ``element_size`` bytes on a
    device with ``shared_memory`` bytes per program, the pipeline holding ``row_inputs`` row
    tensors a tile (x and dy; dropout_add_layer_norm's gradient of the new residual too): a
    pure function.

    A persistent grid whose row loop is software-pipelined 3 deep (measured faster than
    no pipelining); few programs per SM keep the
    per-program fp32 partials of dweight/dbias small. The pipeline holds x, dy and the
    three row statistics of two tiles ahead in shared memory: 160 KiB for 4096 x 1 fp32
    tiles (Triton 3.6, sm_86), over the 99 KiB of sm_86 / sm_89 parts, where such narrow
    rows get a shallower pipeline.
    """
    block_cols = triton.next_power_of_2(cols)
    if block_cols > MAX_TILE_COLS_BWD:
        return LayerNormPlan(1, CHUNK_COLS, 8, single_tile=False, programs_per_sm=2)
    warps = 4 if block_cols <= 2048 else 8
    programs_per_sm = 2 if block_cols <= 4096 else 1
    block_rows = max(1, 4096 // block_cols)
    tile_bytes = block_rows * (row_inputs * block_cols * element_size + 3 * 4)
    stages = 3
    while stages > 1 and (stages - 1) * tile_bytes > shared_memory:
        stages -= 1
    return LayerNormPlan(block_rows, block_cols, warps, True, programs_per_sm, num_stages=stages)


def layer_norm_fwd(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    plan: LayerNormPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on validated inputs.

    Returns:
        ``(y, stats)``: y shaped and typed like ``x``; stats fp32 [3, rows]: mean, rstd, and the mean's residual.
    """
    cols = math.prod(normalized_shape)
    x2d = as_rows(x, cols)
    rows = x2d.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    stats = torch.empty((3, rows), dtype=torch.float32, device=x.device)
    if rows == 0 or cols == 0:
        return y, stats
    plan = plan or layer_norm_fwd_plan(cols)
    _layer_norm_fwd_kernel[(cdiv(rows, plan.block_rows),)](
        x2d, y, weight, bias, stats,
        rows, cols, x2d.stride(0), cols, 1.0 / cols, eps,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        BLOCK_ROWS=plan.block_rows,
        BLOCK_COLS=plan.block_cols,
        SINGLE_TILE=plan.single_tile,
        num_warps=plan.num_warps,
        **_backend.dependent_launch(x2d),
    )  # fmt: skip
    return y, stats


def layer_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    stats: torch.Tensor,
    normalized_shape: Sequence[int],
    weight_grad: bool,
    bias_grad: bool,
    bias_dtype: torch.dtype | None = None,
    plan: LayerNormPlan | None = None,
    into: Sequence[torch.Tensor | None] = (),
) -> list[torch.Tensor]:
    """Launch the backward kernels.

    Returns:
        ``[dx]`` followed by dweight if ``weight_grad`` and dbias if ``bias_grad``; the
        parameter gradients are in the parameters' dtypes (``bias_dtype`` for dbias,
        default ``x.dtype``), written into ``into``'s (dweight, dbias) where given (their
        places in flat gradient buffers).
    """
    cols = math.prod(normalized_shape)
    x2d = as_rows(x, cols)
    dy2d = as_rows(dy, cols)
    rows = x2d.shape[0]
    grads = [torch.empty(x.shape, dtype=x.dtype, device=x.device)]
    weight_place, bias_place = (*into, None, None)[:2]
    if weight_grad:
        grads.append(
            torch.empty(normalized_shape, dtype=weight.dtype, device=x.device) if weight_place is None else weight_place
        )
    if bias_grad:
        dtype = bias_dtype or x.dtype
        grads.append(torch.empty(normalized_shape, dtype=dtype, device=x.device) if bias_place is None else bias_place)
    if cols == 0:
        return grads
    device = _backend.device_index(x)
    plan = plan or layer_norm_bwd_plan(cols, x.element_size(), _backend.shared_memory_per_program(device))
    sms = _backend.multiprocessor_count(device)
    programs = max(1, min(cdiv(rows, plan.block_rows), sms * plan.programs_per_sm))
    outputs = len(grads) - 1  # dweight and / or dbias
    alloc = torch.empty if plan.single_tile else torch.zeros
    partials = alloc((outputs, programs, cols), dtype=torch.float32, device=x.device)
    _layer_norm_bwd_kernel[(programs,)](
        x2d, dy2d, grads[0], weight, stats, partials,
        rows, cols, x2d.stride(0), dy2d.stride(0), cols, 1.0 / cols,
        HAS_WEIGHT=weight is not None,
        WEIGHT_GRAD=weight_grad,
        BIAS_GRAD=bias_grad,
        BLOCK_ROWS=plan.block_rows,
        BLOCK_COLS=plan.block_cols,
        SINGLE_TILE=plan.single_tile,
        NUM_STAGES=plan.num_stages,
        num_warps=plan.num_warps,
        # Without contraction, dy * w - c2 is exactly 0 where x equals its row mean
        # (e.g. a single column); an FMA would leave the product's rounding error there.
        enable_fp_fusion=False,
        **_backend.dependent_launch(x2d),
    )  # fmt: skip
    if outputs:
        sum_partials(partials, grads[1:])
    return grads


@kernel_op("layer_norm_fwd", layer_norm_fwd)
def layer_norm_fwd_op(
    x: torch.Tensor,
    normalized_shape: list[int],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.numel() // math.prod(normalized_shape)
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty((3, rows), dtype=torch.float32)


@kernel_op("layer_norm_bwd", layer_norm_bwd)
def layer_norm_bwd_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    stats: torch.Tensor,
    normalized_shape: list[int],
    weight_grad: bool,
    bias_grad: bool,
    bias_dtype: torch.dtype | None,
) -> list[torch.Tensor]:
    grads = [torch.empty_like(x, memory_format=torch.contiguous_format)]
    if weight_grad:
        grads.append(x.new_empty(normalized_shape, dtype=weight.dtype))
    if bias_grad:
        grads.append(x.new_empty(normalized_shape, dtype=bias_dtype or x.dtype))
    return grads


class LayerNormFunction(torch.autograd.Function):
    """Autograd for :func:`layer_norm`; saves x, weight and the fp32 statistics (and the
    bias, whose gradient's place it looks up)."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, bias, eps):
        y, stats = layer_norm_fwd_op(x, normalized_shape, weight, bias, eps)
        ctx.save_for_backward(x, weight, stats, placeable(bias))  # bias: the parameter its gradient may be written into
        ctx.normalized_shape = normalized_shape
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        refuse_create_graph("layer_norm")
        x, weight, stats, bias = ctx.saved_tensors
        weight_grad, bias_grad = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        into = (grad_place(weight) if weight_grad else None, grad_place(bias) if bias_grad else None)
        grads = layer_norm_bwd_op(
            dy, x, weight, stats, ctx.normalized_shape, weight_grad, bias_grad, ctx.bias_dtype, into=into
        )
        dweight = grads[1] if weight_grad else None
        dbias = grads[-1] if bias_grad else None
        return grads[0], None, dweight, dbias, None


def _check_param(name: str, param: torch.Tensor | None, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    if param is None:
        return
    if tuple(param.shape) != shape:
        raise ValueError(f"layer_norm: {name} has shape {tuple(param.shape)}, expected normalized_shape {shape}")
    if param.device != x.device:
        raise ValueError(f"layer_norm: {name} is on {param.device} but x is on {x.device}")
    if param.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"layer_norm: {name} has dtype {param.dtype}; expected float32, float16 or bfloat16")


def layer_norm(
    x: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Layer normalisation over the trailing ``normalized_shape`` dims of ``x``.

    Same semantics as :func:`torch.nn.functional.layer_norm`; the statistics and all
    arithmetic are fp32 whatever the input dtype, with one rounding at the store.

    Args:
        x: input of shape ``[*, *normalized_shape]``, float32, float16 or bfloat16; any
            leading shape (0 rows included). Only the last dim needs to be contiguous.
        normalized_shape: the trailing dims to normalise over (an int or a sequence).
        weight: optional scale of shape ``normalized_shape``; may have a different float
            dtype from ``x`` (e.g. fp32 weights with bf16 activations).
        bias: optional shift of shape ``normalized_shape``.
        eps: added to the variance before the square root.

    Returns:
        The normalised tensor, same shape and dtype as ``x`` (contiguous).

    Raises:
        ValueError: ``x`` or a parameter is no tensor (named), ``x`` does not end in
            ``normalized_shape``, a parameter has the wrong shape, dtype or device, or
            ``eps`` is negative or not finite (numbers may be Python or numpy scalars or 0-d
            CPU tensors).
    """
    check_tensors("layer_norm", {"x": x}, {"weight": weight, "bias": bias})
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or tuple(x.shape[x.dim() - len(shape) :]) != shape or x.dim() < len(shape):
        raise ValueError(f"layer_norm: x has shape {tuple(x.shape)}, which does not end in normalized_shape {shape}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"layer_norm: x has dtype {x.dtype}; expected float32, float16 or bfloat16")
    _check_param("weight", weight, x, shape)
    _check_param("bias", bias, x, shape)
    eps = float_option("layer_norm", "eps", eps, 0)
    backend = _backend.backend_for(x)
    _backend.note("layer_norm", backend)
    if backend == "reference":
        return layer_norm_ref(x, shape, weight, bias, eps)
    return LayerNormFunction.apply(x, list(shape), contiguous_or_none(weight), contiguous_or_none(bias), eps)


def layer_norm_ref(
    x: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """PyTorch's own LayerNorm, with the parameters cast to ``x.dtype`` as it requires.

    Args:
        x, normalized_shape, weight, bias, eps: as for :func:`layer_norm`.

    Returns:
        The normalised tensor, shaped and typed like ``x``.
    """
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    weight = None if weight is None else weight.to(x.dtype)
    bias = None if bias is None else bias.to(x.dtype)
    return torch.nn.functional.layer_norm(x, shape, weight, bias, eps)
