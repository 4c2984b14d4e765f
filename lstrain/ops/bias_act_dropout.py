"""y = dropout(act(x + bias)), the middle of an MLP, in one pass each way.

act is one of gelu (erf), gelu_tanh, relu, silu. Forward reads x and bias once and
writes y; backward reads x, bias and dy once, regenerates the dropout mask from its
seed, writes dx = dy * mask / (1 - p) * act'(x + bias) and sums dx over rows into dbias
through per-program fp32 partials (deterministic).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from lstrain import _backend
from lstrain._backend import wait_for_producers
from lstrain.ops._lib.activations import ACTIVATIONS, activation_ref, apply_activation
from lstrain.ops._lib.custom_op import kernel_op
from lstrain.ops._lib.dropout import (
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
from lstrain.ops._lib.layout import as_rows, cdiv, contiguous_or_none, grad_place
from lstrain.ops._lib.options import check_tensors
from lstrain.ops._lib.partial_sums import sum_partials

__all__ = [
    "ACTIVATIONS",
    "BiasActDropoutFunction",
    "bias_act_dropout",
    "bias_act_dropout_bwd",
    "bias_act_dropout_fwd",
    "bias_act_dropout_ref",
]


@triton.jit
def _bias_act_dropout_fwd_kernel(
    x_ptr,
    bias_ptr,
    y_ptr,
    seed_ptr,
    rows,
    cols,
    x_row_stride,
    p,
    keep_scale,
    ACT: tl.constexpr,
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
    z = tl.load(x_ptr + row[:, None] * x_row_stride + col[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(bias_ptr + col, mask=col < cols, other=0.0).to(tl.float32)[None, :]
    y, _ = apply_activation(z, ACT)
    offsets = row[:, None] * cols + col[None, :]
    if DROPOUT:
        p = tl.cast(p, tl.float32)
        keep = dropout_keep(seed_ptr, row, tl.program_id(1) * BLOCK_COLS, cols, p, BLOCK_COLS)
        y = apply_dropout(y, keep, keep_scale)
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_tile(
    x_ptr, dy_ptr, dx_ptr, seed_ptr, bias, first, rows, col, cols, x_row_stride, dy_row_stride, p, keep_scale, scale,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr, ROW_MASK: tl.constexpr,
):  # fmt: skip
    """dx of rows ``first + arange(BLOCK_ROWS)``, stored; returns it unscaled, zero outside x."""
    row = tl.arange(0, BLOCK_ROWS).to(tl.int64) + first
    mask = (col < cols)[None, :]
    if ROW_MASK:
        mask &= (row < rows)[:, None]
    z = tl.load(x_ptr + row[:, None] * x_row_stride + col[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(dy_ptr + row[:, None] * dy_row_stride + col[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += bias
    offsets = row[:, None] * cols + col[None, :]
    if DROPOUT:
        keep = dropout_keep(seed_ptr, row, tl.program_id(0) * BLOCK_COLS, cols, p, BLOCK_COLS)
        g = apply_dropout(g, keep, keep_scale)
    _, slope = apply_activation(z, ACT)
    g = tl.where(mask, g * slope, 0.0)
    tl.store(dx_ptr + offsets, (g * tl.cast(scale, tl.float32)).to(dx_ptr.dtype.element_ty), mask=mask)
    return g


@triton.jit
def _bias_act_dropout_bwd_kernel(
    x_ptr,
    bias_ptr,
    dy_ptr,
    dx_ptr,
    partial_ptr,
    seed_ptr,
    rows,
    cols,
    x_row_stride,
    dy_row_stride,
    p,
    keep_scale,
    scale,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_producers(PDL)
    col = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    group = tl.program_id(1)
    groups = tl.num_programs(1)
    p = tl.cast(p, tl.float32)
    bias = tl.zeros([1, BLOCK_COLS], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + col, mask=col < cols, other=0.0).to(tl.float32)[None, :]
    acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
    # Whole tiles go without a row mask: with one, a row count that is not a multiple of 16
    # (Triton then cannot prove that a tile's rows share one predicate) made this loop much
    # slower. The forward, one tile per program, loses little and keeps its mask.
    whole = rows // BLOCK_ROWS
    for tile in tl.range(group, whole, groups, num_stages=NUM_STAGES):
        acc += _bwd_tile(
            x_ptr, dy_ptr, dx_ptr, seed_ptr, bias, tile * BLOCK_ROWS, rows, col, cols, x_row_stride, dy_row_stride,
            p, keep_scale, scale, ACT, HAS_BIAS, DROPOUT, BLOCK_ROWS, BLOCK_COLS, False,
        )  # fmt: skip
    if (whole * BLOCK_ROWS < rows) & (whole % groups == group):  # the partial last tile, in its walker's turn
        acc += _bwd_tile(
            x_ptr, dy_ptr, dx_ptr, seed_ptr, bias, whole * BLOCK_ROWS, rows, col, cols, x_row_stride, dy_row_stride,
            p, keep_scale, scale, ACT, HAS_BIAS, DROPOUT, BLOCK_ROWS, BLOCK_COLS, True,
        )  # fmt: skip
    if BIAS_GRAD:
        tl.store(partial_ptr + group.to(tl.int64) * cols + col, tl.sum(acc, axis=0), mask=col < cols)


def bias_act_dropout_fwd(
    x: torch.Tensor, bias: torch.Tensor | None, seed: torch.Tensor | None, p: float, dropout: bool, activation: str
) -> torch.Tensor:
    """Launch the forward kernel on validated inputs; returns y (contiguous, x's dtype)."""
    cols = x.shape[-1]
    x2d = as_rows(x, cols)
    rows = x2d.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows == 0 or cols == 0:
        return y
    plan = elementwise_plan(cols)
    _bias_act_dropout_fwd_kernel[(cdiv(rows, plan.block_rows), cdiv(cols, plan.block_cols))](
        x2d, bias, y, seed, rows, cols, x2d.stride(0), p, dropout_scale(p),
        ACT=ACTIVATIONS.index(activation),
        HAS_BIAS=bias is not None,
        DROPOUT=dropout,
        BLOCK_ROWS=plan.block_rows,
        BLOCK_COLS=plan.block_cols,
        num_warps=plan.num_warps,
        **_backend.dependent_launch(x2d),
    )  # fmt: skip
    return y


def bias_act_dropout_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    seed: torch.Tensor | None,
    p: float,
    dropout: bool,
    activation: str,
    bias_grad: bool,
    scale: float = 1.0,
    out: torch.Tensor | None = None,
    into: Sequence[torch.Tensor | None] = (),
) -> list[torch.Tensor]:
    """``[scale * dx]``, plus dbias (the unscaled dx summed over rows) when ``bias_grad``:
    in bias's dtype, or fp32 where ``bias`` is None (for a caller whose x already holds
    its bias, as gemm's saved pre-activation does). ``out``: a contiguous tensor shaped
    like x to write scale * dx into, x itself included (each element is read before the
    program that owns it writes it); a new one when None. ``into[0]``, when given: where
    to write dbias (the bias's place in a flat gradient buffer)."""
    cols = x.shape[-1]
    x2d = as_rows(x, cols)
    dy2d = as_rows(dy, cols)
    rows = x2d.shape[0]
    grads = [torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out]
    if bias_grad:
        place = into[0] if into else None
        dtype = torch.float32 if bias is None else bias.dtype
        grads.append(torch.empty(cols, dtype=dtype, device=x.device) if place is None else place)
    if cols == 0:
        return grads
    plan = elementwise_plan(cols)
    grid, partials = column_walkers(rows, cols, plan, x, bias_grad)
    _bias_act_dropout_bwd_kernel[grid](
        x2d, bias, dy2d, grads[0], partials, seed, rows, cols, x2d.stride(0), dy2d.stride(0),
        p, dropout_scale(p), scale,
        ACT=ACTIVATIONS.index(activation),
        HAS_BIAS=bias is not None,
        DROPOUT=dropout,
        BIAS_GRAD=bias_grad,
        BLOCK_ROWS=plan.block_rows,
        BLOCK_COLS=plan.block_cols,
        NUM_STAGES=plan.num_stages,
        num_warps=plan.num_warps,
        **_backend.dependent_launch(x2d),
    )  # fmt: skip
    if bias_grad:
        sum_partials(partials, grads[1:])
    return grads


@kernel_op("bias_act_dropout_fwd", bias_act_dropout_fwd)
def bias_act_dropout_fwd_op(
    x: torch.Tensor, bias: torch.Tensor | None, seed: torch.Tensor | None, p: float, dropout: bool, activation: str
) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@kernel_op("bias_act_dropout_bwd", bias_act_dropout_bwd)
def bias_act_dropout_bwd_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    seed: torch.Tensor | None,
    p: float,
    dropout: bool,
    activation: str,
    bias_grad: bool,
    scale: float = 1.0,
) -> list[torch.Tensor]:
    grads = [torch.empty_like(x, memory_format=torch.contiguous_format)]
    if not bias_grad:
        return grads
    return grads + [x.new_empty(x.shape[-1], dtype=torch.float32) if bias is None else bias.new_empty(bias.shape)]


class BiasActDropoutFunction(torch.autograd.Function):
    """Autograd for :func:`bias_act_dropout`; saves x, bias and the seed."""

    @staticmethod
    def forward(ctx, x, bias, seed, p, dropout, activation):
        y = bias_act_dropout_fwd_op(x, bias, seed, p, dropout, activation)
        ctx.save_for_backward(x, bias, seed)
        ctx.options = (p, dropout, activation)
        return y

    @staticmethod
    def backward(ctx, dy):
        refuse_create_graph("bias_act_dropout")
        x, bias, seed = ctx.saved_tensors
        bias_grad = ctx.needs_input_grad[1]
        into = (grad_place(bias) if bias_grad else None,)
        grads = bias_act_dropout_bwd_op(dy, x, bias, seed, *ctx.options, bias_grad, into=into)
        return grads[0], (grads[1] if bias_grad else None), None, None, None, None


def bias_act_dropout(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    activation: str = "gelu",
    dropout: float = 0.0,
    training: bool = True,
    seed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dropout(act(x + bias))`` in one kernel each way.

    Args:
        x: ``[*, H]``, float32/float16/bfloat16 (e.g. an MLP's first projection before its
            bias); only the last dim needs to be contiguous.
        bias: optional ``[H]``.
        activation: ``"gelu"`` (erf), ``"gelu_tanh"``, ``"relu"`` or ``"silu"``.
        dropout: drop probability in [0, 1); kept elements are scaled by 1 / (1 - p).
        training: dropout is the identity when False.
        seed: a 1-element int64 tensor on x's device fixing the mask (see
            :func:`lstrain.ops.dropout_mask`: the same mask on every backend); drawn from
            torch's generator when None.

    Returns:
        y shaped like ``x`` in x's dtype (contiguous); fp32 arithmetic, one rounding.

    Raises:
        ValueError: ``x`` or ``bias`` no tensor (named), an unknown activation, wrong dtype,
            device or shape of ``bias``, ``dropout`` outside [0, 1), or a ``seed`` that is
            not a 1-element int64 tensor on x's device.
    """
    check_tensors("bias_act_dropout", {"x": x}, {"bias": bias})
    dropout = check_dropout_inputs("bias_act_dropout", x, bias, dropout)
    if activation not in ACTIVATIONS:
        raise ValueError(f"bias_act_dropout: activation must be one of {ACTIVATIONS}, got {activation!r}")
    check_seed("bias_act_dropout", seed, x.device)
    active = training and dropout > 0
    backend = _backend.backend_for(x)
    _backend.note("bias_act_dropout", backend)
    if active and seed is None:
        seed = new_seed(x.device)
    if backend == "reference":  # the kernels' mask, drawn by plain PyTorch: a seed means one mask everywhere
        mask = dropout_mask(seed, x.shape, dropout) if active else None
        return bias_act_dropout_ref(x, bias, activation=activation, dropout=dropout if active else 0.0, mask=mask)
    bias = contiguous_or_none(bias)
    return BiasActDropoutFunction.apply(x, bias, seed if active else None, dropout, active, activation)


def bias_act_dropout_ref(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    activation: str = "gelu",
    dropout: float = 0.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch in fp32.

    Args:
        x, bias, activation, dropout: as for :func:`bias_act_dropout`.
        mask: bool, x's shape: which elements are kept, e.g.
            :func:`lstrain.ops.dropout_mask` of the seed an lstrain call used;
            None lets torch's generator draw one.

    Returns:
        ``dropout(act(x + bias))`` in x's dtype.
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    z = x.to(compute) if bias is None else x.to(compute) + bias.to(compute)
    y = activation_ref(activation, z)
    if dropout > 0:
        keep = mask if mask is not None else torch.rand(y.shape, device=y.device) >= dropout
        y = y * keep / (1 - dropout)
    return y.to(x.dtype)
