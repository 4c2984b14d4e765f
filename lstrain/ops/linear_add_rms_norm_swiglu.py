"""A sublayer's end and the next MLP with the residual add and RMSNorm in GEMM epilogues.

``s = x @ weight^T + bias + residual`` (the output projection that ends an attention
sublayer, plus the residual stream), then ``y = swiglu_mlp(rms_norm(s) * g)``: issue 33's
pattern A (CODA). RMSNorm(s) * g @ W = r * ((s * g) @ W), with r = 1 / rms(s) one scalar
per row, so no kernel needs a whole row before the next GEMM starts:

- the projection's epilogue adds the residual (and bias), stores s (the new residual
  stream, rounded once), stores ``s * g`` as the next GEMM's input, and writes each
  tile's fp32 partial sums of squares of the rounded s (``[slots, rows]``);
- the SwiGLU forward GEMM (:func:`lstrain.ops.swiglu.swiglu_fwd`) sums a row's partials in
  slot order (deterministic), and multiplies its fp32 accumulator rows by r before h is
  rounded.

Against the unfused path (cuBLAS GEMM, :func:`lstrain.ops.add_rms_norm`, the SwiGLU MLP) forward
reads and writes two [rows, D] tensors fewer and launches one kernel fewer, but the
projection runs in lstrain's Triton GEMM instead of cuBLAS's, with a heavier epilogue:
at LLaMA-0.75B's shapes on an H200 the whole was slower (docs/notes/llama.md), and
:class:`lstrain.layers.DecoderLayer` takes it only when asked (``norm_in_epilogue``). The rounding
moves: s is rounded once instead of the projection's output and then the sum, and the
GEMM's input is ``s * g`` rounded rather than ``s * r * g`` rounded, with r applied in fp32
after it (docs/notes/llama.md measures both paths' error against fp32).

Backward is the unfused one: the norm's backward needs a whole row's sum before any of
its outputs, which no GEMM tile holds. The norm output is made again from s (one RMSNorm
kernel, as :class:`lstrain.layers.RecomputedNorms` does), then SwiGLU's backward (cuBLAS
dA and one pass, :func:`lstrain.ops.swiglu.swiglu_grad`), :func:`lstrain.ops.add_rms_norm`'s
backward (which adds the stream's incoming gradient) and the projection's GEMMs. Kept for
backward: x, s and h, as the unfused path with recomputed norms keeps them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lstrain import _backend
from lstrain._backend import wait_for_producers
from lstrain.ops._lib.autocast import autocast_inputs
from lstrain.ops._lib.custom_op import kernel_op
from lstrain.ops._lib.first_order import differentiated, refuse_create_graph
from lstrain.ops._lib.layout import as_rows, cdiv, contiguous_or_none, grad_place, matmul_like
from lstrain.ops._lib.options import check_tensors
from lstrain.ops.add_rms_norm import add_rms_norm_bwd_op
from lstrain.ops.gemm import column_halves, gemm_plan, mainloop, tile_ids
from lstrain.ops.linear import linear_ref
from lstrain.ops.rms_norm import rms_norm_arguments, rms_norm_fwd_op, rms_norm_ref
from lstrain.ops.swiglu import swiglu_act_op, swiglu_fwd, swiglu_grad, swiglu_mlp_ref

__all__ = [
    "LinearAddRMSNormSwiGLUFunction",
    "linear_add_rms_norm_fwd",
    "linear_add_rms_norm_swiglu",
    "linear_add_rms_norm_swiglu_ref",
    "squares_slots",
]

# not float16: s * g is stored before the 1/rms scale, and fp16's range (65504) is exceeded
# by outlier channels that RMSNorm(s) * g keeps in range
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# Columns per partial sum of squares: the narrowest epilogue of gemm's plans, past N <= 32
SLOT_COLS = 64


@triton.jit
def _norm_epilogue(
    acc,
    rows,
    first_col,
    residual_ptr,
    bias_ptr,
    norm_weight_ptr,
    sum_ptr,
    scaled_ptr,
    squares_ptr,
    M,
    N,
    stride_rm,
    HAS_BIAS: tl.constexpr,
    MASK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    WIDTH: tl.constexpr,
    SLOT: tl.constexpr,
):
    """Columns ``first_col + arange(WIDTH)`` of: s = acc + residual (+ bias), rounded once at
    its store; ``s * g`` from the rounded s; the rounded s's sums of squares over each SLOT
    columns (over the WIDTH columns when fewer: a tile that covers all of N), to
    ``squares[slot, rows]``. Columns past N (masked) hold zeros and add nothing."""
    cols = first_col + tl.arange(0, WIDTH)
    if MASK_N:
        mask = (rows < M)[:, None] & (cols < N)[None, :]
    else:
        mask = (rows < M)[:, None]
    z = acc + tl.load(residual_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    offsets = rows[:, None] * N + cols[None, :]
    s = z.to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + offsets, s, mask=mask)
    s = s.to(tl.float32)
    g = tl.load(norm_weight_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(scaled_ptr + offsets, (s * g[None, :]).to(scaled_ptr.dtype.element_ty), mask=mask)
    GROUPS: tl.constexpr = WIDTH // SLOT if WIDTH >= SLOT else 1
    squares = tl.sum(tl.reshape(s * s, [BLOCK_M, GROUPS, WIDTH // GROUPS]), axis=2)
    slots = first_col // SLOT + tl.arange(0, GROUPS)
    slot_ok = slots < tl.cdiv(N, SLOT)
    squares_ptrs = squares_ptr + slots[None, :] * tl.cast(M, tl.int64) + rows[:, None]
    tl.store(squares_ptrs, squares, mask=(rows < M)[:, None] & slot_ok[None, :])


@triton.jit
def _linear_add_rms_norm_tile(
    tile,
    x_ptr,
    w_ptr,
    residual_ptr,
    bias_ptr,
    norm_weight_ptr,
    sum_ptr,
    scaled_ptr,
    squares_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wk,
    stride_wn,
    stride_rm,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    MASK_N: tl.constexpr,
    HALVES: tl.constexpr,
    SLOT: tl.constexpr,
):
    """Output tile ``tile`` (see gemm's ``tile_ids``); HALVES: the epilogue runs on the tile's
    two column halves in turn (half the registers for the residual and the two outputs)."""
    pid_m, pid_n = tile_ids(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = mainloop(
        x_ptr, w_ptr, rows, cols, M, N, K, stride_xm, stride_xk, stride_wk, stride_wn, IEEE, BLOCK_M, BLOCK_N, BLOCK_K,
        True, MASK_N,
    )  # fmt: skip
    if HALVES:
        HALF: tl.constexpr = BLOCK_N // 2
        left, right = column_halves(acc, BLOCK_M, HALF)
        _norm_epilogue(
            left, rows, pid_n * BLOCK_N, residual_ptr, bias_ptr, norm_weight_ptr, sum_ptr, scaled_ptr, squares_ptr,
            M, N, stride_rm, HAS_BIAS, MASK_N, BLOCK_M, HALF, SLOT,
        )  # fmt: skip
        _norm_epilogue(
            right, rows, pid_n * BLOCK_N + HALF, residual_ptr, bias_ptr, norm_weight_ptr, sum_ptr, scaled_ptr,
            squares_ptr, M, N, stride_rm, HAS_BIAS, MASK_N, BLOCK_M, HALF, SLOT,
        )  # fmt: skip
    else:
        _norm_epilogue(
            acc, rows, pid_n * BLOCK_N, residual_ptr, bias_ptr, norm_weight_ptr, sum_ptr, scaled_ptr, squares_ptr, M,
            N, stride_rm, HAS_BIAS, MASK_N, BLOCK_M, BLOCK_N, SLOT,
        )  # fmt: skip


@triton.jit
def _linear_add_rms_norm_fwd_kernel(
    x_ptr,
    w_ptr,
    residual_ptr,
    bias_ptr,
    norm_weight_ptr,
    sum_ptr,
    scaled_ptr,
    squares_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wk,
    stride_wn,
    stride_rm,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr,
    HALVES: tl.constexpr,
    SLOT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """s, s * g and the partial sums of squares of x @ w + residual (+ bias); w is the
    weight's ``.t()``, contiguous along K. PERSISTENT (N a multiple of BLOCK_N): each program
    loops over tiles, the tile loop flattened into the K loop so that the next tile's loads
    start during this tile's epilogue, as gemm's persistent kernel does."""
    wait_for_producers(PDL)
    if PERSISTENT:
        tiles = tl.cdiv(M, BLOCK_M) * (N // BLOCK_N)
        for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
            _linear_add_rms_norm_tile(
                tile, x_ptr, w_ptr, residual_ptr, bias_ptr, norm_weight_ptr, sum_ptr, scaled_ptr, squares_ptr, M, N,
                K, stride_xm, stride_xk, stride_wk, stride_wn, stride_rm, HAS_BIAS, IEEE, BLOCK_M, BLOCK_N, BLOCK_K,
                GROUP_M, False, HALVES, SLOT,
            )  # fmt: skip
    else:
        _linear_add_rms_norm_tile(
            tl.program_id(0), x_ptr, w_ptr, residual_ptr, bias_ptr, norm_weight_ptr, sum_ptr, scaled_ptr,
            squares_ptr, M, N, K, stride_xm, stride_xk, stride_wk, stride_wn, stride_rm, HAS_BIAS, IEEE, BLOCK_M,
            BLOCK_N, BLOCK_K, GROUP_M, True, HALVES, SLOT,
        )  # fmt: skip


def squares_slots(n: int) -> int:
    """Partial sums of squares per row for a norm over ``n`` columns: one per SLOT_COLS
    columns, a count fixed by the width alone (the fake kernel under torch.compile knows no
    launch plan). Whatever gemm's plan for the projection, each slot is written by exactly
    one epilogue chunk: tiles 128 or more wide run their epilogue in halves of at least
    SLOT_COLS, 64 wide whole, and narrower ones only where one tile covers all of N.

    Args:
        n: the norm's width (the projection's outputs).

    Returns:
        ``cdiv(n, SLOT_COLS)``.
    """
    return cdiv(n, SLOT_COLS)


def linear_add_rms_norm_fwd(
    x2d: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the projection with the norm's epilogue on validated inputs.

    Args:
        x2d: ``[M, K]``.
        weight: ``[N, K]`` (a Linear's layout), x's dtype.
        bias: ``[N]``, contiguous, or None.
        residual: ``[*, N]`` with M rows, x's dtype.
        norm_weight: ``[N]``, contiguous.

    Returns:
        ``(s, scaled, squares)``: s = x @ weight^T + bias + residual, shaped like the
        residual, and scaled = s * g ``[M, N]``, both in x's dtype (contiguous); squares fp32
        ``[slots, M]``, the partial sums of squares of s per row (:func:`squares_slots`).
    """
    m, k = x2d.shape
    n = weight.shape[0]
    residual2d = as_rows(residual, n)
    # s in the residual's shape: returned as it is, not as a view, so that it may be
    # changed in place like any other stream
    s = torch.empty(residual.shape, dtype=x2d.dtype, device=x2d.device)
    scaled = torch.empty((m, n), dtype=x2d.dtype, device=x2d.device)
    squares = torch.empty((squares_slots(n), m), dtype=torch.float32, device=x2d.device)
    if m == 0 or n == 0:
        return s, scaled, squares
    device = _backend.device_index(x2d)
    # gemm's plan for the shape; its large plan is persistent where N is a multiple of its tile
    plan = gemm_plan(m, n, k, x2d.element_size(), _backend.shared_memory_per_program(device))
    persistent = plan.persistent and n % plan.block_n == 0
    tiles = cdiv(m, plan.block_m) * cdiv(n, plan.block_n)
    sms = _backend.multiprocessor_count(device)
    w = weight.t()
    _linear_add_rms_norm_fwd_kernel[(min(sms, tiles) if persistent else tiles,)](
        x2d, w, residual2d, bias, norm_weight, s.view(m, n), scaled, squares,
        m, n, k,
        x2d.stride(0), x2d.stride(1), w.stride(0), w.stride(1), residual2d.stride(0),
        HAS_BIAS=bias is not None,
        IEEE=x2d.dtype == torch.float32,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        BLOCK_K=plan.block_k,
        GROUP_M=plan.group_m,
        PERSISTENT=persistent,
        HALVES=plan.block_n >= 2 * SLOT_COLS,
        SLOT=SLOT_COLS,
        num_warps=plan.num_warps,
        num_stages=plan.stages(persistent),
        **_backend.dependent_launch(x2d),
    )  # fmt: skip
    return s, scaled, squares


@kernel_op("linear_add_rms_norm_fwd", linear_add_rms_norm_fwd)
def linear_add_rms_norm_fwd_op(
    x2d: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, n = x2d.shape[0], weight.shape[0]
    s = residual.new_empty(residual.shape, dtype=x2d.dtype)
    return s, x2d.new_empty((m, n)), x2d.new_empty((squares_slots(n), m), dtype=torch.float32)


def swiglu_fwd_row_scaled(
    scaled: torch.Tensor, w_gate_up: torch.Tensor, squares: torch.Tensor, eps: float, store_h: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SwiGLU forward on RMSNorm(s) * g, given ``s * g`` and s's partial sums of squares.

    Args:
        scaled: ``[M, D]``, s * g as :func:`linear_add_rms_norm_fwd` wrote it.
        w_gate_up: ``[D, 2F]`` in the pair layout.
        squares: fp32 ``[slots, M]`` (:func:`lstrain.ops.swiglu.swiglu_fwd`'s ``row_squares``).
        eps: the norm's epsilon.
        store_h: write h for backward (False: inference).

    Returns:
        ``(a, h)``: a ``[M, F]``; h ``[M, 2F]``, or ``[M, 0]`` without ``store_h``.
    """
    a, h = swiglu_fwd(scaled, w_gate_up, store_h=store_h, row_squares=squares, eps=eps)
    return a, h if store_h else scaled.new_empty((scaled.shape[0], 0))


@kernel_op("swiglu_fwd_row_scaled", swiglu_fwd_row_scaled)
def swiglu_fwd_row_scaled_op(
    scaled: torch.Tensor, w_gate_up: torch.Tensor, squares: torch.Tensor, eps: float, store_h: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    m, f = scaled.shape[0], w_gate_up.shape[1] // 2
    return scaled.new_empty((m, f)), scaled.new_empty((m, 2 * f if store_h else 0))


class LinearAddRMSNormSwiGLUFunction(torch.autograd.Function):
    """Autograd for :func:`linear_add_rms_norm_swiglu`. Saves x, the weights, s and h;
    backward makes the norm's output again from s (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, norm_weight, eps, w_gate_up, w_down):
        x2d = as_rows(x, x.shape[-1])
        s, scaled, squares = linear_add_rms_norm_fwd_op(x2d, weight, bias, residual, norm_weight)
        a, h = swiglu_fwd_row_scaled_op(scaled, w_gate_up, squares, eps, True)
        y = _down(a, w_down, residual.shape)
        ctx.save_for_backward(x2d, weight, s, norm_weight, w_gate_up, w_down, h)
        ctx.eps, ctx.has_bias, ctx.x_shape = eps, bias is not None, x.shape
        # An unused output's gradient stays None instead of a tensor of zeros to read.
        ctx.set_materialize_grads(False)
        return y, s

    @staticmethod
    def backward(ctx, dy, ds_out):
        refuse_create_graph("linear_add_rms_norm_swiglu")
        x2d, weight, s, norm_weight, w_gate_up, w_down, h = ctx.saved_tensors
        s = as_rows(s, s.shape[-1])
        need_x, need_weight, need_bias, need_residual, need_norm_weight, _, need_gate_up, need_down = (
            ctx.needs_input_grad
        )
        ds_out = None if ds_out is None else as_rows(ds_out, s.shape[1])
        # s's own inputs may all be frozen: then nothing goes back through the norm
        need_ds = need_x or need_weight or need_bias or need_residual or need_norm_weight
        ds = dnorm_weight = dw_gate_up = dw_down = None
        if dy is None:  # only s was used: its gradient passes straight through
            ds = ds_out
        else:
            dy2d = as_rows(dy, dy.shape[-1])
            if need_gate_up or need_ds:
                dh, a = swiglu_grad(dy2d, w_down, h, write_a=need_down)
            elif need_down:  # only dW_down: a from h alone, no dA
                a = swiglu_act_op(h)
            dw_down = matmul_like(a.t(), dy2d, w_down) if need_down else None
            if need_gate_up or need_ds:
                normed, rstd = rms_norm_fwd_op(s, [s.shape[1]], norm_weight, ctx.eps)
            if need_gate_up:
                dw_gate_up = matmul_like(normed.t(), dh, w_gate_up)
            if need_ds:
                into = (grad_place(norm_weight) if need_norm_weight else None,)
                grads = add_rms_norm_bwd_op(
                    dh @ w_gate_up.t(), ds_out, s, norm_weight, rstd, [s.shape[1]], need_norm_weight, into=into
                )
                ds = grads[0]
                dnorm_weight = grads[1] if need_norm_weight else None
        if ds is None or not need_ds:
            return None, None, None, None, dnorm_weight, None, dw_gate_up, dw_down
        dx = (ds @ weight).view(ctx.x_shape) if need_x else None
        dweight = matmul_like(ds.t(), x2d, weight) if need_weight else None
        dbias = ds.sum(0) if need_bias and ctx.has_bias else None
        dresidual = ds.view(*ctx.x_shape[:-1], s.shape[1]) if need_residual else None
        return dx, dweight, dbias, dresidual, dnorm_weight, None, dw_gate_up, dw_down


def linear_add_rms_norm_swiglu(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    eps: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = F.linear(x, weight, bias) + residual`` and ``y = swiglu_mlp(rms_norm(s) * g)``,
    with the add and the norm in the two GEMMs' epilogues (see the module docstring).

    The end of a pre-norm decoder layer's attention sublayer (its output projection, the
    residual add, the post-attention RMSNorm) and the SwiGLU MLP after it. Under
    ``torch.autocast``, x and the projection and MLP weights are first cast to its dtype,
    as a matmul's are; the residual stream is not (one in a wider dtype is refused).

    Args:
        x: ``[*, K]``, the attention's output before its projection; float32 or bfloat16
            (not float16: ``s * g`` is stored before the 1/rms scale and would overflow
            fp16's range where the unfused path's ``s * g / rms`` does not).
        weight: ``[D, K]``, the projection's weight (a Linear's layout), x's dtype.
        residual: ``[*, D]``, the residual stream, x's leading shape and dtype (its last dim
            contiguous, or it is copied).
        norm_weight: ``[D]``, the RMSNorm's weight (any float dtype).
        w_gate_up: ``[D, 2F]`` in SwiGLU's pair layout (:func:`lstrain.ops.swiglu.pack_gate_up`).
        w_down: ``[F, D_out]``.
        bias: ``[D]``, the projection's bias, or None.
        eps: the RMSNorm's epsilon; None takes torch's default (fp32's machine epsilon).

    Returns:
        ``(y, s)``: the MLP's output ``[*, D_out]`` and the new residual stream ``[*, D]``,
        x's dtype. The layer's output is ``y + s``, left to the next norm's add.

    Raises:
        ValueError: a tensor argument that is no tensor, a 0-d x, shapes, dtypes or devices
            that do not fit (named), a bad eps.
        RuntimeError: (from backward) ``create_graph=True``: second derivatives are not
            supported.
    """
    tensors = {
        "x": x,
        "weight": weight,
        "residual": residual,
        "norm_weight": norm_weight,
        "w_gate_up": w_gate_up,
        "w_down": w_down,
    }
    check_tensors("linear_add_rms_norm_swiglu", tensors, {"bias": bias})
    # the residual stream is not cast: autocast would round it down (then refused below)
    x, weight, bias, w_gate_up, w_down = autocast_inputs(x, weight, bias, w_gate_up, w_down)
    _check(x, weight, bias, residual, w_gate_up, w_down)
    (dim,), eps = rms_norm_arguments(
        "linear_add_rms_norm_swiglu", residual, residual.shape[-1], norm_weight, eps, names=("residual", "norm_weight")
    )
    backend = _backend.backend_for(x)
    _backend.note("linear_add_rms_norm_swiglu", backend)
    if backend == "reference":
        return linear_add_rms_norm_swiglu_ref(x, weight, residual, norm_weight, w_gate_up, w_down, bias=bias, eps=eps)
    norm_weight, bias = norm_weight.contiguous(), contiguous_or_none(bias)
    if differentiated(x, weight, bias, residual, norm_weight, w_gate_up, w_down):
        return LinearAddRMSNormSwiGLUFunction.apply(x, weight, bias, residual, norm_weight, eps, w_gate_up, w_down)
    # inference: h, which only backward reads, is not even written
    s, scaled, squares = linear_add_rms_norm_fwd_op(as_rows(x, x.shape[-1]), weight, bias, residual, norm_weight)
    a, _ = swiglu_fwd_row_scaled_op(scaled, w_gate_up, squares, eps, False)
    return _down(a, w_down, residual.shape), s


def _down(a: torch.Tensor, w_down: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``a @ w_down`` shaped ``[*shape[:-1], D_out]``: through matmul, whose result is a
    tensor of its own, not a view (an autograd Function's view outputs refuse in-place
    changes)."""
    return torch.matmul(a.view(*shape[:-1], a.shape[-1]), w_down)


def _check(x, weight, bias, residual, w_gate_up, w_down) -> None:
    """:func:`linear_add_rms_norm_swiglu`'s checks of shapes, dtypes and devices."""
    name = "linear_add_rms_norm_swiglu"
    if x.dim() == 0:
        raise ValueError(f"{name}: x must be [*, K] (at least one dim), got a 0-d tensor")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(
            f"{name}: x has dtype {x.dtype}; expected float32 or bfloat16 (float16 would store s * g "
            "before the 1/rms scale, which overflows its range where the unfused path does not)"
        )
    tensors = {"weight": weight, "residual": residual, "w_gate_up": w_gate_up, "w_down": w_down, "bias": bias}
    for what, t in tensors.items():
        if t is None:
            continue
        if t.dtype != x.dtype:
            raise ValueError(f"{name}: {what} has dtype {t.dtype}, but x has dtype {x.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name}: {what} is on {t.device} but x is on {x.device}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{name}: weight must be [D, K] with K = {x.shape[-1]}, got {tuple(weight.shape)}")
    dim = weight.shape[0]
    if tuple(residual.shape) != (*x.shape[:-1], dim):
        raise ValueError(f"{name}: residual must have shape {(*x.shape[:-1], dim)}, got {tuple(residual.shape)}")
    if bias is not None and tuple(bias.shape) != (dim,):
        raise ValueError(f"{name}: bias must be [D] with D = {dim}, got {tuple(bias.shape)}")
    if w_gate_up.dim() != 2 or w_gate_up.shape[0] != dim or w_gate_up.shape[1] % 2:
        raise ValueError(f"{name}: w_gate_up must be [D, 2F] with D = {dim}, got {tuple(w_gate_up.shape)}")
    if w_down.dim() != 2 or 2 * w_down.shape[0] != w_gate_up.shape[1]:
        raise ValueError(
            f"{name}: w_down must be [F, D_out] with F = {w_gate_up.shape[1] // 2}, got {tuple(w_down.shape)}"
        )


def linear_add_rms_norm_swiglu_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    eps: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch: ``F.linear``, an add, :func:`lstrain.ops.rms_norm_ref` and
    :func:`lstrain.ops.swiglu_mlp_ref`.

    Args:
        x, weight, residual, norm_weight, w_gate_up, w_down, bias, eps: as for
            :func:`linear_add_rms_norm_swiglu` (eps None: torch's default for x's dtype;
            the tensors may also be fp64).

    Returns:
        ``(y, s)``.
    """
    s = linear_ref(x, weight, bias) + residual
    return swiglu_mlp_ref(rms_norm_ref(s, s.shape[-1], norm_weight, eps), w_gate_up, w_down), s
