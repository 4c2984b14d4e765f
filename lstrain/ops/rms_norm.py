"""RMSNorm over the trailing dims: y = x / sqrt(mean(x^2) + eps) * weight.

Forward: one program normalises a tile of rows held in registers (rows longer than
``MAX_TILE_COLS_FWD`` are streamed in chunks, two passes over the row, the re-read served
by L2). rstd is kept in fp32 for backward, one value per row. There is no mean to
subtract, so no cancellation to guard against: the sum of squares is accurate in fp32.

Backward: a persistent grid; each program walks a fixed set of rows, writes dx, and
accumulates dweight in fp32 registers (or in its own fp32 row of a partials buffer for
chunked rows). :func:`~lstrain.ops._lib.partial_sums.sum_partials` adds the per-program
partials in a fixed order, so dweight is deterministic without atomics.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from lstrain import _backend
from lstrain._backend import wait_for_producers
from lstrain.ops._lib.custom_op import kernel_op
from lstrain.ops._lib.first_order import refuse_create_graph
from lstrain.ops._lib.layout import as_rows, cdiv, contiguous_or_none, grad_place
from lstrain.ops._lib.options import check_tensors, float_option
from lstrain.ops._lib.partial_sums import sum_partials
from lstrain.ops.layer_norm import CHUNK_COLS, MAX_TILE_COLS_BWD, LayerNormPlan, layer_norm_fwd_plan

__all__ = [
    "RMSNormFunction",
    "default_eps",
    "rms_norm",
    "rms_norm_arguments",
    "rms_norm_bwd",
    "rms_norm_bwd_plan",
    "rms_norm_fwd",
    "rms_norm_fwd_plan",
    "rms_norm_ref",
]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _load_input(x_rows, residual_ptr, row, residual_row_stride, col, mask, HAS_RESIDUAL: tl.constexpr):
    """The row tile RMSNorm normalises, in the input dtype: x, or x + residual added in
    fp32 and rounded once to x's dtype (the new residual stream, as stored)."""
    x = tl.load(x_rows + col, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row[:, None] * residual_row_stride + col, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr,
    residual_ptr,
    sum_ptr,
    y_ptr,
    weight_ptr,
    rstd_ptr,
    rows,
    cols,
    x_row_stride,
    residual_row_stride,
    y_row_stride,
    inv_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
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
        x = _load_input(x_rows, residual_ptr, row, residual_row_stride, col[None, :], mask, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            # The sum has the same row stride as y (both contiguous).
            tl.store(sum_ptr + row[:, None] * y_row_stride + col[None, :], x, mask=mask)
        x = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) * inv_cols + eps)
        y = x * rstd[:, None]
        if HAS_WEIGHT:
            y *= tl.load(weight_ptr + col, mask=col < cols, other=0.0).to(tl.float32)[None, :]
        tl.store(y_rows + col[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        squares = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
        for start in range(0, cols, BLOCK_COLS):
            mask = row_ok[:, None] & (start + col < cols)[None, :]
            x = _load_input(x_rows, residual_ptr, row, residual_row_stride, start + col[None, :], mask, HAS_RESIDUAL)
            if HAS_RESIDUAL:
                tl.store(sum_ptr + row[:, None] * y_row_stride + start + col[None, :], x, mask=mask)
            x = x.to(tl.float32)
            squares += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=1) * inv_cols + eps)
        for start in range(0, cols, BLOCK_COLS):
            col_ok = start + col < cols
            mask = row_ok[:, None] & col_ok[None, :]
            # The sum is recomputed rather than re-read: a load of what this program just
            # stored would need a barrier between the threads that stored and load it.
            x = _load_input(
                x_rows, residual_ptr, row, residual_row_stride, start + col[None, :], mask, HAS_RESIDUAL
            ).to(tl.float32)
            y = x * rstd[:, None]
            if HAS_WEIGHT:
                y *= tl.load(weight_ptr + start + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_rows + start + col[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd, mask=row_ok)


@triton.jit
def _rms_norm_bwd_kernel(
    x_ptr,
    dy_ptr,
    sum_grad_ptr,
    dx_ptr,
    weight_ptr,
    rstd_ptr,
    partial_ptr,
    rows,
    cols,
    x_row_stride,
    dy_row_stride,
    sum_grad_row_stride,
    dx_row_stride,
    inv_cols,
    HAS_SUM_GRAD: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr,
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
    # Partials layout: [programs, cols] fp32, this program's row.
    weight_partial = partial_ptr + pid.to(tl.int64) * cols
    if SINGLE_TILE:
        col_ok = col < cols
        if HAS_WEIGHT:
            weight = tl.load(weight_ptr + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        weight_acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
        # Pipelining the loop keeps the next rows' loads in flight during this row's math.
        for first in tl.range(pid * BLOCK_ROWS, rows, programs * BLOCK_ROWS, num_stages=NUM_STAGES):
            row = tl.arange(0, BLOCK_ROWS).to(tl.int64) + first
            row_ok = row < rows
            mask = row_ok[:, None] & col_ok[None, :]
            x = tl.load(x_ptr + row[:, None] * x_row_stride + col[None, :], mask=mask, other=0.0)
            dy = tl.load(dy_ptr + row[:, None] * dy_row_stride + col[None, :], mask=mask, other=0.0)
            x = x.to(tl.float32)
            dy = dy.to(tl.float32)
            rstd = tl.load(rstd_ptr + row, mask=row_ok, other=0.0)
            x_hat = x * rstd[:, None]
            w_dy = dy * weight if HAS_WEIGHT else dy
            c1 = tl.sum(x_hat * w_dy, axis=1) * inv_cols
            dx = (w_dy - x_hat * c1[:, None]) * rstd[:, None]
            if HAS_SUM_GRAD:
                dx += tl.load(
                    sum_grad_ptr + row[:, None] * sum_grad_row_stride + col[None, :], mask=mask, other=0.0
                ).to(tl.float32)
            tl.store(dx_ptr + row[:, None] * dx_row_stride + col[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if WEIGHT_GRAD:
                weight_acc += dy * x_hat
        if WEIGHT_GRAD:
            tl.store(weight_partial + col, tl.sum(weight_acc, axis=0), mask=col_ok)
    else:
        # Chunked rows: each program owns its partials row, so read-add-write there is
        # race free and the summation order fixed. The launcher zeroes the partials.
        for row_index in range(pid, rows, programs):
            row = tl.cast(row_index, tl.int64)
            x_row = x_ptr + row * x_row_stride
            dy_row = dy_ptr + row * dy_row_stride
            rstd = tl.load(rstd_ptr + row)
            c1_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
            for start in range(0, cols, BLOCK_COLS):
                col_ok = start + col < cols
                x = tl.load(x_row + start + col, mask=col_ok, other=0.0).to(tl.float32)
                dy = tl.load(dy_row + start + col, mask=col_ok, other=0.0).to(tl.float32)
                if HAS_WEIGHT:
                    dy *= tl.load(weight_ptr + start + col, mask=col_ok, other=0.0).to(tl.float32)
                c1_acc += x * rstd * dy
            c1 = tl.sum(c1_acc, axis=0) * inv_cols
            for start in range(0, cols, BLOCK_COLS):
                col_ok = start + col < cols
                x = tl.load(x_row + start + col, mask=col_ok, other=0.0).to(tl.float32)
                dy = tl.load(dy_row + start + col, mask=col_ok, other=0.0).to(tl.float32)
                x_hat = x * rstd
                w_dy = dy
                if HAS_WEIGHT:
                    w_dy = dy * tl.load(weight_ptr + start + col, mask=col_ok, other=0.0).to(tl.float32)
                dx = (w_dy - x_hat * c1) * rstd
                if HAS_SUM_GRAD:
                    sum_grad_row = sum_grad_ptr + row * sum_grad_row_stride
                    dx += tl.load(sum_grad_row + start + col, mask=col_ok, other=0.0).to(tl.float32)
                tl.store(dx_ptr + row * dx_row_stride + start + col, dx.to(dx_ptr.dtype.element_ty), mask=col_ok)
                if WEIGHT_GRAD:
                    acc = tl.load(weight_partial + start + col, mask=col_ok, other=0.0)
                    tl.store(weight_partial + start + col, acc + dy * x_hat, mask=col_ok)


# RMSNorm moves LayerNorm's bytes per row with one reduction fewer: its forward runs on
# LayerNorm's launch ladder (4 warps holding 16-64 values per thread, short rows several
# to a program, rows over MAX_TILE_COLS_FWD chunked).
rms_norm_fwd_plan = layer_norm_fwd_plan


@functools.cache
def rms_norm_bwd_plan(
    cols: int, element_size: int = 4, shared_memory: int = _backend.HOPPER_SHARED_MEMORY, row_inputs: int = 2
) -> LayerNormPlan:
    """Backward launch settings for rows of ``cols`` elements of ``element_size`` bytes on a
    device with ``shared_memory`` bytes per program (a pure function).

    LayerNorm's backward ladder: a persistent grid, its row loop pipelined up to 3 deep,
    few programs per SM to keep the fp32 dweight partials small. The pipeline holds the
    ``row_inputs`` row tensors (x and dy; add_rms_norm's incoming gradient of the sum
    too) and rstd of the tiles ahead in shared memory; where that does not fit the device,
    the pipeline gets shallower.
    """
    block_cols = triton.next_power_of_2(cols)
    if block_cols > MAX_TILE_COLS_BWD:
        return LayerNormPlan(1, CHUNK_COLS, 8, single_tile=False, programs_per_sm=2)
    warps = 4 if block_cols <= 2048 else 8
    programs_per_sm = 2 if block_cols <= 4096 else 1
    block_rows = max(1, 4096 // block_cols)
    tile_bytes = block_rows * (row_inputs * block_cols * element_size + 4)
    stages = 3
    while stages > 1 and (stages - 1) * tile_bytes > shared_memory:
        stages -= 1
    return LayerNormPlan(block_rows, block_cols, warps, True, programs_per_sm, num_stages=stages)


def rms_norm_fwd(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None,
    eps: float,
    plan: LayerNormPlan | None = None,
    *,
    residual: torch.Tensor | None = None,
    new_residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on validated inputs.

    Args:
        x, normalized_shape, weight: as for :func:`rms_norm` (weight contiguous).
        eps: the resolved eps (a Python float).
        plan: launch settings (default: :func:`rms_norm_fwd_plan` of the row width).
        residual: added to ``x`` before the norm (:func:`~lstrain.ops.add_rms_norm`): shaped
            and typed like ``x``; the kernel normalises the sum rounded to ``x``'s dtype.
        new_residual: with ``residual``, the contiguous buffer shaped like ``x`` that the
            rounded sum is written to.

    Returns:
        ``(y, rstd)``: y shaped and typed like ``x`` (contiguous); rstd fp32 [rows].
    """
    cols = math.prod(normalized_shape)
    x2d = as_rows(x, cols)
    residual2d = None if residual is None else as_rows(residual, cols)
    # Counted from the leading dims, as the fake kernel does, so that zero-width rows agree.
    rows = math.prod(x.shape[: x.dim() - len(normalized_shape)])
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty((rows,), dtype=torch.float32, device=x.device)
    if rows == 0 or cols == 0:
        return y, rstd
    plan = plan or rms_norm_fwd_plan(cols)
    _rms_norm_fwd_kernel[(cdiv(rows, plan.block_rows),)](
        x2d, residual2d, new_residual, y, weight, rstd,
        rows, cols, x2d.stride(0), 0 if residual2d is None else residual2d.stride(0), cols, 1.0 / cols, eps,
        HAS_RESIDUAL=residual is not None,
        HAS_WEIGHT=weight is not None,
        BLOCK_ROWS=plan.block_rows,
        BLOCK_COLS=plan.block_cols,
        SINGLE_TILE=plan.single_tile,
        num_warps=plan.num_warps,
        **_backend.dependent_launch(x2d),
    )  # fmt: skip
    return y, rstd


def rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    normalized_shape: Sequence[int],
    weight_grad: bool,
    plan: LayerNormPlan | None = None,
    *,
    sum_grad: torch.Tensor | None = None,
    into: Sequence[torch.Tensor | None] = (),
) -> list[torch.Tensor]:
    """Launch the backward kernels.

    Args:
        dy: the upstream gradient, shaped like ``x``.
        x, weight, normalized_shape: as given to :func:`rms_norm_fwd` (for
            :func:`~lstrain.ops.add_rms_norm`, ``x`` is the new residual it normalised).
        rstd: the fp32 [rows] statistics :func:`rms_norm_fwd` returned.
        weight_grad: whether to compute dweight.
        plan: launch settings (default: :func:`rms_norm_bwd_plan` for the shape and device).
        sum_grad: a gradient shaped like ``x`` added to dx in the same pass
            (add_rms_norm's incoming gradient of the new residual).
        into: ``into[0]``, when given, is where to write dweight (the weight's place in a
            flat gradient buffer).

    Returns:
        ``[dx]``, followed by dweight (in ``weight``'s dtype) if ``weight_grad``.
    """
    cols = math.prod(normalized_shape)
    x2d = as_rows(x, cols)
    dy2d = as_rows(dy, cols)
    sum_grad2d = None if sum_grad is None else as_rows(sum_grad, cols)
    rows = x2d.shape[0]
    grads = [torch.empty(x.shape, dtype=x.dtype, device=x.device)]
    if weight_grad:
        place = into[0] if into else None
        grads.append(torch.empty(normalized_shape, dtype=weight.dtype, device=x.device) if place is None else place)
    if cols == 0:
        return grads
    device = _backend.device_index(x)
    if plan is None:
        row_inputs = 2 if sum_grad is None else 3
        shared_memory = _backend.shared_memory_per_program(device)
        plan = rms_norm_bwd_plan(cols, x.element_size(), shared_memory, row_inputs)
    sms = _backend.multiprocessor_count(device)
    programs = max(1, min(cdiv(rows, plan.block_rows), sms * plan.programs_per_sm))
    alloc = torch.empty if plan.single_tile else torch.zeros
    partials = alloc((int(weight_grad), programs, cols), dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(programs,)](
        x2d, dy2d, sum_grad2d, grads[0], weight, rstd, partials,
        rows, cols, x2d.stride(0), dy2d.stride(0), 0 if sum_grad2d is None else sum_grad2d.stride(0), cols, 1.0 / cols,
        HAS_SUM_GRAD=sum_grad is not None,
        HAS_WEIGHT=weight is not None,
        WEIGHT_GRAD=weight_grad,
        BLOCK_ROWS=plan.block_rows,
        BLOCK_COLS=plan.block_cols,
        SINGLE_TILE=plan.single_tile,
        NUM_STAGES=plan.num_stages,
        num_warps=plan.num_warps,
        **_backend.dependent_launch(x2d),
    )  # fmt: skip
    if weight_grad:
        sum_partials(partials, grads[1:])
    return grads


@kernel_op("rms_norm_fwd", rms_norm_fwd)
def rms_norm_fwd_op(
    x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = math.prod(x.shape[: x.dim() - len(normalized_shape)])
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty((rows,), dtype=torch.float32)


@kernel_op("rms_norm_bwd", rms_norm_bwd)
def rms_norm_bwd_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    normalized_shape: list[int],
    weight_grad: bool,
) -> list[torch.Tensor]:
    grads = [torch.empty_like(x, memory_format=torch.contiguous_format)]
    if weight_grad:
        grads.append(x.new_empty(normalized_shape, dtype=weight.dtype))
    return grads


class RMSNormFunction(torch.autograd.Function):
    """Autograd for :func:`rms_norm`; saves x, weight and the fp32 rstd."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, eps):
        y, rstd = rms_norm_fwd_op(x, normalized_shape, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.normalized_shape = normalized_shape
        return y

    @staticmethod
    def backward(ctx, dy):
        refuse_create_graph("rms_norm")
        x, weight, rstd = ctx.saved_tensors
        weight_grad = ctx.needs_input_grad[2]
        into = (grad_place(weight) if weight_grad else None,)
        grads = rms_norm_bwd_op(dy, x, weight, rstd, ctx.normalized_shape, weight_grad, into=into)
        return grads[0], None, grads[1] if weight_grad else None, None


def default_eps(dtype: torch.dtype) -> float:
    """The eps :func:`torch.nn.functional.rms_norm` uses when given None.

    Its documentation says ``torch.finfo(x.dtype).eps``, but it computes in the dtype's
    math type and takes that type's eps: fp32's for fp16 and bf16 (checked against torch
    2.13, whose bf16 and fp16 outputs match fp32 eps, not bf16's 2**-7).

    Args:
        dtype: the input's dtype.

    Returns:
        ``torch.finfo`` eps of ``dtype`` promoted to at least fp32.
    """
    return torch.finfo(torch.promote_types(dtype, torch.float32)).eps


def rms_norm_arguments(
    op: str,
    x: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None,
    eps: object,
    names: tuple[str, str] = ("x", "weight"),
) -> tuple[tuple[int, ...], float]:
    """Validate RMSNorm's arguments (shared by :func:`rms_norm` and
    :func:`~lstrain.ops.add_rms_norm`).

    Args:
        op: the calling op's name, for the messages.
        x, normalized_shape, weight, eps: as for :func:`rms_norm`.
        names: what the op calls x and weight, for the messages.

    Returns:
        ``(shape, eps)``: normalized_shape as a tuple, eps as a Python float (torch's
        default for ``x.dtype`` where None).

    Raises:
        ValueError: as listed for :func:`rms_norm`, prefixed with ``op``.
    """
    x_name, w_name = names
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape) :]) != shape:
        raise ValueError(f"{op}: {x_name} has shape {tuple(x.shape)}, which does not end in normalized_shape {shape}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{op}: {x_name} has dtype {x.dtype}; expected float32, float16 or bfloat16")
    if weight is not None:
        if tuple(weight.shape) != shape:
            raise ValueError(f"{op}: {w_name} has shape {tuple(weight.shape)}, expected normalized_shape {shape}")
        if weight.device != x.device:
            raise ValueError(f"{op}: {w_name} is on {weight.device} but {x_name} is on {x.device}")
        if weight.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{op}: {w_name} has dtype {weight.dtype}; expected float32, float16 or bfloat16")
    return shape, default_eps(x.dtype) if eps is None else float_option(op, "eps", eps, 0)


def rms_norm(
    x: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    """Root-mean-square normalisation over the trailing ``normalized_shape`` dims of ``x``.

    Same semantics as :func:`torch.nn.functional.rms_norm`; the statistics and all
    arithmetic are fp32 whatever the input dtype, with one rounding at the store.

    Args:
        x: input of shape ``[*, *normalized_shape]``, float32, float16 or bfloat16; any
            leading shape (0 rows included). Only the last dim needs to be contiguous.
        normalized_shape: the trailing dims to normalise over (an int or a sequence).
        weight: optional scale of shape ``normalized_shape``; may have a different float
            dtype from ``x`` (e.g. fp32 weights with bf16 activations).
        eps: added to the mean square before the square root; None takes torch's
            default (:func:`default_eps`: fp32's machine epsilon for all three dtypes).

    Returns:
        The normalised tensor, same shape and dtype as ``x`` (contiguous).

    Raises:
        ValueError: ``x`` or ``weight`` is no tensor (named), ``x`` does not end in
            ``normalized_shape`` or has an unsupported dtype, ``weight`` has the wrong
            shape, dtype or device, or ``eps`` is negative or not finite (it may be a Python
            or numpy scalar or a 0-d CPU tensor).
    """
    check_tensors("rms_norm", {"x": x}, {"weight": weight})
    shape, eps = rms_norm_arguments("rms_norm", x, normalized_shape, weight, eps)
    backend = _backend.backend_for(x)
    _backend.note("rms_norm", backend)
    if backend == "reference":
        return rms_norm_ref(x, shape, weight, eps)
    return RMSNormFunction.apply(x, list(shape), contiguous_or_none(weight), eps)


def rms_norm_ref(
    x: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    """RMSNorm in plain PyTorch, computed in fp32 (fp64 for fp64 input) as torch's own is,
    with one rounding to ``x.dtype`` at the end.

    Args:
        x, normalized_shape, weight, eps: as for :func:`rms_norm` (eps None: torch's
            default for ``x.dtype``; x may also be fp64).

    Returns:
        The normalised tensor, shaped and typed like ``x``.
    """
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    compute = torch.promote_types(x.dtype, torch.float32)
    eps = default_eps(x.dtype) if eps is None else eps
    dims = tuple(range(-len(shape), 0))
    upcast = x.to(compute)
    y = upcast * torch.rsqrt(upcast.square().mean(dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(compute)
    return y.to(x.dtype)
