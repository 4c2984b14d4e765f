"""Attention softmax: y = softmax(scale * scores + mask) over the last dim of [B, H, Q, K].

Masks: a key-padding mask ([B, K] bool, True = masked), an additive float mask that
broadcasts to the scores, and ``causal`` (key k is masked for query q when k > q, the
top-left alignment of ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``).
Causally masked elements are not loaded, in forward or backward, beyond the 16 bytes
that hold the diagonal (so that every load is 16 bytes wide): their outputs and gradients
are written as zeros. A row with every key masked gives zeros, not NaN.

One kernel each way; a program owns one or more whole rows held in registers.
Backward: dscores = scale * y * (dy - sum(dy * y)).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lstrain import _backend
from lstrain._backend import wait_for_producers
from lstrain.ops._lib.custom_op import kernel_op
from lstrain.ops._lib.first_order import refuse_create_graph
from lstrain.ops._lib.layout import as_rows, cdiv
from lstrain.ops._lib.options import bool_option, check_tensors, float_option

__all__ = [
    "AttentionSoftmaxFunction",
    "AttentionSoftmaxPlan",
    "MAX_K_LEN",
    "attention_softmax",
    "attention_softmax_bwd",
    "attention_softmax_fwd",
    "attention_softmax_plan",
    "attention_softmax_ref",
]

MAX_K_LEN = 65536  # longest row held whole in registers
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LOG2E = 1.4426950408889634


@triton.jit
def _row_coordinates(rows, heads, q_len, BLOCK_ROWS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    q = row % q_len
    bh = row // q_len
    return row, row < rows, bh // heads, bh % heads, q


@triton.jit
def _causal_load_mask(col, q, RUN: tl.constexpr):
    """Keys up to the diagonal, rounded up to whole runs of RUN (16 bytes): a mask that is
    constant over each run lets every load be 16 bytes wide (a mask that ends at the
    diagonal itself cuts them to single elements). The few keys past the diagonal that
    this loads are masked again in registers."""
    return col[None, :] < ((q // RUN + 1) * RUN)[:, None]


@triton.jit(do_not_specialize=["heads", "q_len"])
def _attention_softmax_fwd_kernel(
    x_ptr,
    y_ptr,
    padding_ptr,
    mask_ptr,
    rows,
    heads,
    q_len,
    k_len,
    x_stride_b,
    x_stride_h,
    x_stride_q,
    padding_stride_b,
    mask_stride_b,
    mask_stride_h,
    mask_stride_q,
    mask_stride_k,
    scale,
    HAS_PADDING: tl.constexpr,
    HAS_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    RUN: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_producers(PDL)
    row, row_ok, b, h, q = _row_coordinates(rows, heads, q_len, BLOCK_ROWS)
    col = tl.arange(0, BLOCK_COLS)
    in_bounds = row_ok[:, None] & (col < k_len)[None, :]
    keep = in_bounds
    loaded = in_bounds
    if CAUSAL:
        keep &= col[None, :] <= q[:, None]
        loaded &= _causal_load_mask(col, q, RUN)
    if HAS_PADDING:
        padded = tl.load(padding_ptr + b[:, None] * padding_stride_b + col[None, :], mask=keep, other=1)
        keep &= padded == 0
    x_offset = b[:, None] * x_stride_b + h[:, None] * x_stride_h + q[:, None] * x_stride_q + col[None, :]
    # Scaling by log2(e) once lets the exponential be a bare exp2.
    z = tl.load(x_ptr + x_offset, mask=loaded, other=0.0).to(tl.float32) * (
        tl.cast(scale, tl.float32) * 1.4426950408889634
    )
    if HAS_MASK:
        mask_offset = (
            b[:, None] * mask_stride_b
            + h[:, None] * mask_stride_h
            + q[:, None] * mask_stride_q
            + col[None, :].to(tl.int64) * mask_stride_k
        )
        z += tl.load(mask_ptr + mask_offset, mask=keep, other=0.0).to(tl.float32) * 1.4426950408889634
    z = tl.where(keep, z, -float("inf"))
    row_max = tl.max(z, axis=1)
    row_max = tl.where(row_max == -float("inf"), 0.0, row_max)
    e = tl.exp2(z - row_max[:, None])
    total = tl.sum(e, axis=1)
    # total is 0 only when every key is masked (the max element contributes 1), and then
    # every e is 0: dividing by 1 instead gives the zero row. A NaN total (NaN input)
    # stays NaN and spreads over the row, as in torch.
    y = e * (1.0 / tl.where(total == 0.0, 1.0, total))[:, None]
    tl.store(y_ptr + row[:, None] * k_len + col[None, :], y.to(y_ptr.dtype.element_ty), mask=in_bounds)


@triton.jit(do_not_specialize=["q_len"])
def _attention_softmax_bwd_kernel(
    y_ptr,
    dy_ptr,
    dx_ptr,
    rows,
    q_len,
    k_len,
    dy_stride_row,
    scale,
    CAUSAL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    RUN: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    col = tl.arange(0, BLOCK_COLS)
    in_bounds = (row < rows)[:, None] & (col < k_len)[None, :]
    keep = in_bounds
    loaded = in_bounds
    if CAUSAL:
        keep &= col[None, :] <= (row % q_len)[:, None]
        loaded &= _causal_load_mask(col, row % q_len, RUN)
    # Padded keys need no test here: their y is exactly 0, so their gradient is too.
    y = tl.load(y_ptr + row[:, None] * k_len + col[None, :], mask=loaded, other=0.0)
    dy = tl.load(dy_ptr + row[:, None] * dy_stride_row + col[None, :], mask=loaded, other=0.0)
    y = tl.where(keep, y.to(tl.float32), 0.0)
    dy = tl.where(keep, dy.to(tl.float32), 0.0)
    # Normalising by sum(y) (1 up to the rounding of the stored y) keeps the gradient
    # exactly orthogonal to a constant shift of the row, as the softmax Jacobian's is.
    y_total = tl.sum(y, axis=1)
    dot = tl.sum(y * dy, axis=1) / tl.where(y_total == 0.0, 1.0, y_total)
    dx = tl.cast(scale, tl.float32) * y * (dy - dot[:, None])
    tl.store(dx_ptr + row[:, None] * k_len + col[None, :], dx.to(dx_ptr.dtype.element_ty), mask=in_bounds)


@dataclass(frozen=True)
class AttentionSoftmaxPlan:
    """Launch settings: each program owns ``block_rows`` rows of ``block_cols`` lanes."""

    block_rows: int
    block_cols: int
    num_warps: int


@functools.cache
def attention_softmax_plan(k_len: int, backward: bool = False) -> AttentionSoftmaxPlan:
    """Launch settings for rows of ``k_len`` keys (a pure function of the row length).

    Short rows (a few dozen keys) would leave most threads of a one-row program idle,
    so a program takes many rows; rows of 1024 keys and more get a program each, with
    about 16-32 values per thread (2 warps forward and 1 backward at 1024, the fastest
    measured).
    """
    block_cols = max(16, triton.next_power_of_2(k_len))
    if block_cols <= 32:
        return AttentionSoftmaxPlan(4096 // block_cols, block_cols, num_warps=4)
    if block_cols < 1024:
        return AttentionSoftmaxPlan(2048 // block_cols, block_cols, num_warps=4)
    per_warp = 1024 if backward else 512
    return AttentionSoftmaxPlan(1, block_cols, num_warps=max(1, min(16, block_cols // per_warp)))


def attention_softmax_fwd(
    scores: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool,
    plan: AttentionSoftmaxPlan | None = None,
) -> torch.Tensor:
    """Launch the forward kernel on validated inputs; returns y, contiguous, scores' dtype."""
    batch, heads, q_len, k_len = scores.shape
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    y = torch.empty(scores.shape, dtype=scores.dtype, device=scores.device)
    rows = batch * heads * q_len
    if rows == 0 or k_len == 0:
        return y
    plan = plan or attention_softmax_plan(k_len)
    padding = None
    if key_padding_mask is not None:
        padding = key_padding_mask.view(torch.uint8)
        padding = padding if padding.stride(-1) == 1 else padding.contiguous()
    mask_strides = mask.expand(scores.shape).stride() if mask is not None else (0, 0, 0, 0)
    _attention_softmax_fwd_kernel[(cdiv(rows, plan.block_rows),)](
        scores, y, padding, mask,
        rows, heads, q_len, k_len,
        scores.stride(0), scores.stride(1), scores.stride(2),
        padding.stride(0) if padding is not None else 0,
        *mask_strides,
        scale,
        HAS_PADDING=padding is not None,
        HAS_MASK=mask is not None,
        CAUSAL=causal,
        BLOCK_ROWS=plan.block_rows,
        BLOCK_COLS=plan.block_cols,
        RUN=16 // scores.element_size(),
        num_warps=plan.num_warps,
        **_backend.dependent_launch(scores),
    )  # fmt: skip
    return y


def attention_softmax_bwd(
    dy: torch.Tensor,
    y: torch.Tensor,
    scale: float,
    causal: bool,
    out_dtype: torch.dtype | None = None,
    plan: AttentionSoftmaxPlan | None = None,
) -> torch.Tensor:
    """Launch the backward kernel: returns scale * y * (dy - sum(dy * y)), contiguous,
    in ``out_dtype`` (default y's dtype)."""
    batch, heads, q_len, k_len = y.shape
    dy2d = as_rows(dy, k_len)
    dx = torch.empty(y.shape, dtype=out_dtype or y.dtype, device=y.device)
    rows = batch * heads * q_len
    if rows == 0 or k_len == 0:
        return dx
    plan = plan or attention_softmax_plan(k_len, backward=True)
    _attention_softmax_bwd_kernel[(cdiv(rows, plan.block_rows),)](
        y, dy2d, dx, rows, q_len, k_len, dy2d.stride(0), scale,
        CAUSAL=causal,
        BLOCK_ROWS=plan.block_rows,
        BLOCK_COLS=plan.block_cols,
        RUN=16 // y.element_size(),
        num_warps=plan.num_warps,
        **_backend.dependent_launch(y),
    )  # fmt: skip
    return dx


@kernel_op("attention_softmax_fwd", attention_softmax_fwd)
def attention_softmax_fwd_op(
    scores: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    return torch.empty_like(scores, memory_format=torch.contiguous_format)


@kernel_op("attention_softmax_bwd", attention_softmax_bwd)
def attention_softmax_bwd_op(
    dy: torch.Tensor, y: torch.Tensor, scale: float, causal: bool, out_dtype: torch.dtype | None
) -> torch.Tensor:
    return torch.empty_like(y, dtype=out_dtype or y.dtype)


class AttentionSoftmaxFunction(torch.autograd.Function):
    """Autograd for :func:`attention_softmax`; saves only the output y."""

    @staticmethod
    def forward(ctx, scores, key_padding_mask, mask, scale, causal):
        y = attention_softmax_fwd_op(scores, key_padding_mask, mask, scale, causal)
        ctx.save_for_backward(y)
        ctx.scale = scale
        ctx.causal = causal
        ctx.mask_shape = None if mask is None else mask.shape
        ctx.mask_dtype = None if mask is None else mask.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        refuse_create_graph("attention_softmax")
        (y,) = ctx.saved_tensors
        if not ctx.needs_input_grad[2]:
            return attention_softmax_bwd_op(dy, y, ctx.scale, ctx.causal, None), None, None, None, None
        # A learned additive mask (e.g. a relative-position bias) needs the unscaled
        # gradient, summed in fp32 over the dims it was broadcast along.
        dz = attention_softmax_bwd_op(dy, y, 1.0, ctx.causal, torch.float32)
        dscores = (dz * ctx.scale).to(y.dtype) if ctx.needs_input_grad[0] else None
        return dscores, None, dz.sum_to_size(ctx.mask_shape).to(ctx.mask_dtype), None, None


def _validate(scores, key_padding_mask, mask, scale) -> float:
    if scores.dim() != 4:
        raise ValueError(
            f"attention_softmax: scores must be 4-D [batch, heads, q_len, k_len], got shape {tuple(scores.shape)}"
        )
    if scores.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"attention_softmax: scores has dtype {scores.dtype}; expected float32, float16 or bfloat16")
    batch, _, _, k_len = scores.shape
    if k_len > MAX_K_LEN:
        raise ValueError(f"attention_softmax: k_len {k_len} exceeds the supported maximum {MAX_K_LEN}")
    if key_padding_mask is not None:
        if key_padding_mask.dtype != torch.bool:
            raise ValueError(
                f"attention_softmax: key_padding_mask must be bool (True = masked), got {key_padding_mask.dtype}"
            )
        if tuple(key_padding_mask.shape) != (batch, k_len):
            raise ValueError(
                f"attention_softmax: key_padding_mask has shape {tuple(key_padding_mask.shape)}, "
                f"expected [batch, k_len] = {(batch, k_len)}"
            )
        if key_padding_mask.device != scores.device:
            raise ValueError(
                f"attention_softmax: key_padding_mask is on {key_padding_mask.device} but scores is on {scores.device}"
            )
    if mask is not None:
        if not mask.is_floating_point():
            raise ValueError(
                f"attention_softmax: mask must be an additive float mask (0 or -inf), got {mask.dtype}; "
                "pass boolean key masks as key_padding_mask"
            )
        broadcasts = all(m in (1, n) for m, n in zip(reversed(mask.shape), reversed(scores.shape), strict=False))
        if mask.dim() > 4 or not broadcasts:
            raise ValueError(
                f"attention_softmax: mask of shape {tuple(mask.shape)} does not broadcast to "
                f"scores {tuple(scores.shape)}"
            )
        if mask.device != scores.device:
            raise ValueError(f"attention_softmax: mask is on {mask.device} but scores is on {scores.device}")
    return float_option("attention_softmax", "scale", scale)


def attention_softmax(
    scores: torch.Tensor,
    *,
    scale: float = 1.0,
    key_padding_mask: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Masked, scaled softmax over the keys of attention scores.

    Computes ``softmax(scale * scores + mask)`` over the last dim, with masked keys
    excluded; all arithmetic in fp32, one rounding at the store.

    Args:
        scores: ``[batch, heads, q_len, k_len]``, float32/float16/bfloat16; k_len up to
            ``MAX_K_LEN`` (65536). Only the last dim needs to be contiguous.
        scale: multiplies the scores before the mask is added (e.g. ``head_dim**-0.5``).
        key_padding_mask: optional ``[batch, k_len]`` bool, True where a key is padding.
        mask: optional additive float mask broadcastable to ``scores`` (e.g. 0 / -inf,
            ALiBi or a learned position bias; it receives a gradient if it requires one).
        causal: mask key k for query q when k > q (top-left aligned, as in
            ``scaled_dot_product_attention(is_causal=True)``); those elements are not read.

    Returns:
        Probabilities shaped like ``scores``, in its dtype (contiguous). Rows where every
        key is masked are all zeros. A NaN score makes its row NaN.

    Raises:
        ValueError: ``scores`` or a mask is no tensor (named), ``scores`` is not 4-D or not
            a float type, k_len is too long, a mask has the wrong shape, dtype or device, or
            ``scale`` is not a finite number (a Python or numpy scalar or a 0-d CPU tensor;
            for a CUDA tensor pass a float), or ``causal`` is not a bool.
    """
    check_tensors("attention_softmax", {"scores": scores}, {"key_padding_mask": key_padding_mask, "mask": mask})
    causal = bool_option("attention_softmax", "causal", causal)
    scale = _validate(scores, key_padding_mask, mask, scale)
    backend = _backend.backend_for(scores)
    _backend.note("attention_softmax", backend)
    if backend == "reference":
        return attention_softmax_ref(scores, scale=scale, key_padding_mask=key_padding_mask, mask=mask, causal=causal)
    return AttentionSoftmaxFunction.apply(scores, key_padding_mask, mask, scale, causal)


def attention_softmax_ref(
    scores: torch.Tensor,
    *,
    scale: float = 1.0,
    key_padding_mask: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Plain PyTorch: masked logits in fp32, then ``torch.softmax`` in the scores' dtype.

    The softmax runs in the input dtype as eager PyTorch code would (saving a rounded
    output for backward); fp64 input is computed in fp64 throughout.

    Args:
        scores, scale, key_padding_mask, mask, causal: as for :func:`attention_softmax`.

    Returns:
        The probabilities, shaped and typed like ``scores`` (zeros for fully masked rows).
    """
    compute = torch.float64 if scores.dtype == torch.float64 else torch.float32
    z = scores.to(compute) * scale
    if mask is not None:
        z = z + mask.to(compute)
    q_len, k_len = scores.shape[-2:]
    masked = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    if causal:
        masked = masked | torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).triu(1)
    if key_padding_mask is not None:
        masked = masked | key_padding_mask[:, None, None, :]
    z = z.masked_fill(masked, float("-inf"))
    all_masked = torch.isneginf(z).all(dim=-1, keepdim=True)
    y = torch.softmax(z.masked_fill(all_masked, 0.0).to(scores.dtype), dim=-1)
    return y.masked_fill(all_masked, 0.0)
