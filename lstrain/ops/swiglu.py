"""SwiGLU MLP, y = (silu(x W_gate) * (x W_up)) W_down, over gate and up packed in one matrix.

The pair layout: gate and up projections live in one ``[D, 2F]`` matrix ``w_gate_up`` made
of pair blocks of ``PAIR_BLOCK`` (128) hidden units: block ``b`` holds the gate columns of
units ``128b .. 128b + w - 1`` followed by their up columns (``w = 128``, or what is left
for the last block when F is not a multiple of 128). So every GEMM tile holds whole
(gate, up) pairs, and, unlike alternating gate and up columns, as two contiguous halves:
the mainloop keeps one accumulator for each and the epilogue needs no shuffle.
(:func:`pack_gate_up` builds it from the usual separate weights; ``lstrain.nn.SwiGLUMLP``
keeps the familiar ``gate_proj`` / ``up_proj`` / ``down_proj`` state_dict keys.)

Forward: ``h = x @ w_gate_up`` (cuBLAS), then one pass over h that writes
``a = silu(gate) * up`` (half the width, :func:`swiglu_act`); then ``y = a @ w_down``
(cuBLAS). Backward: ``dA = dy @ w_down^T`` (cuBLAS), then one pass over dA and h that
writes ``dgate = dA * up * silu'(gate)`` and ``dup = dA * silu(gate)`` over h's pair
layout (over h itself where the graph is freed) and a again, with the forward's bits, for
``dW_down = a^T dy``; then cuBLAS for dx and dW_gate_up. Saved for backward: x and h, 2F
values per token (a, F more, with ``keep_activation``).

:func:`swiglu_fwd` is the forward GEMM with SwiGLU in its epilogue (h and a written from
the accumulator tile). In a whole LLaMA step both epilogue GEMMs lost to cuBLAS plus the
pass over h, whose memory traffic the epilogues could not hide behind their own mainloop
(docs/notes/swiglu.md); the forward one remains where it writes less: inference, where it
writes a and no h, and :func:`lstrain.ops.linear_add_rms_norm_swiglu`, whose RMSNorm row
scale belongs in that epilogue.

A last, partial pair block (F not a multiple of 128) is launched on its own, by both
kernels: its up columns start at a run-time offset, which would cost every other tile its
aligned accesses.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from lstrain import _backend
from lstrain._backend import wait_for_producers
from lstrain.ops._lib.autocast import autocast_inputs
from lstrain.ops._lib.custom_op import kernel_op
from lstrain.ops._lib.first_order import differentiated, graph_freed_after_backward, refuse_create_graph
from lstrain.ops._lib.layout import cdiv, matmul_like
from lstrain.ops._lib.options import check_tensors
from lstrain.ops.gemm import GemmPlan, column_halves, gemm_plan, k_major, kahan_add, mainloop, tile_ids

__all__ = [
    "PAIR_BLOCK",
    "SwiGLUFunction",
    "pack_gate_up",
    "swiglu_mlp",
    "swiglu_mlp_ref",
    "unpack_gate_up",
]

PAIR_BLOCK = 128

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _gate_column(first_unit, unit_in_launch, PAIR: tl.constexpr):
    """Column of h holding the gate of unit ``first_unit + unit_in_launch`` (first_unit a
    multiple of PAIR): every pair block before it takes 2 * PAIR columns."""
    block = unit_in_launch // PAIR
    return 2 * first_unit + block * (2 * PAIR) + (unit_in_launch - block * PAIR)


@triton.jit
def _aligned_run(first, SIZE: tl.constexpr):
    """``first + arange(SIZE)``, declared contiguous and starting at a multiple of SIZE
    (true of every column run here: tile starts are multiples of the tile width, pair
    blocks of PAIR), which Triton cannot prove through the pair-layout arithmetic; without
    it the epilogue's loads and stores of h were 2 bytes wide instead of 16."""
    return tl.max_contiguous(tl.multiple_of(first + tl.arange(0, SIZE), SIZE), SIZE)


@triton.jit
def _mainloop_pairs(
    a_ptr,
    b_ptr,
    rows,
    gate_cols,
    up_offset,
    gate_ok,
    up_ok,
    M,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """fp32 A[rows, :] @ B[:, gate_cols] and A[rows, :] @ B[:, gate_cols + up_offset], edges
    masked: one tile of the product over two column blocks (each A tile loaded once for
    both), as two accumulators."""
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + ks[:, None] * stride_bk + gate_cols[None, :] * stride_bn
    acc0 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    compensation0 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    compensation1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(rows < M)[:, None] & (ks < k_left)[None, :], other=0.0)
        k_ok = (ks < k_left)[:, None]
        b0 = tl.load(b_ptrs, mask=k_ok & gate_ok[None, :], other=0.0)
        b1 = tl.load(b_ptrs + up_offset * stride_bn, mask=k_ok & up_ok[None, :], other=0.0)
        if IEEE:  # fp32 operands: full fp32 products, joined as gemm's mainloop joins them
            acc0, compensation0 = kahan_add(acc0, compensation0, tl.dot(a, b0, input_precision="ieee"))
            acc1, compensation1 = kahan_add(acc1, compensation1, tl.dot(a, b1, input_precision="ieee"))
        else:
            acc0 = tl.dot(a, b0, acc0)
            acc1 = tl.dot(a, b1, acc1)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc0, acc1


@triton.jit
def _inv_rms(squares_ptr, rows, M, inv_cols, eps, SLOTS: tl.constexpr):
    """1 / rms of each row from its SLOTS partial sums of squares (``squares[slot, row]``,
    fp32, summed in slot order: deterministic), as RMSNorm's forward computes it."""
    total = tl.load(squares_ptr + rows, mask=rows < M, other=0.0)
    for slot in tl.static_range(1, SLOTS):
        total += tl.load(squares_ptr + slot * tl.cast(M, tl.int64) + rows, mask=rows < M, other=0.0)
    return 1.0 / tl.sqrt(total * tl.cast(inv_cols, tl.float32) + tl.cast(eps, tl.float32))


@triton.jit
def _swiglu_fwd_tile(
    tile,
    x_ptr,
    w_ptr,
    a_ptr,
    h_ptr,
    h_desc,
    squares_ptr,
    M,
    F,
    K,
    first_unit,
    units_here,
    stride_xm,
    stride_xk,
    stride_wk,
    stride_wn,
    inv_cols,
    eps,
    TAIL: tl.constexpr,
    IEEE: tl.constexpr,
    PAIR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    B_K_MAJOR: tl.constexpr,
    STORE_H: tl.constexpr,
    H_TMA: tl.constexpr,
    SLOTS: tl.constexpr,
):
    """Tile ``tile`` of h = x @ w_gate_up (BLOCK_F gate and BLOCK_F up columns) and of a.
    STORE_H=False (nothing to differentiate): h is not written, only a. H_TMA: a whole
    pair block's h leaves through ``h_desc`` (a [BLOCK_M, BLOCK_F] TMA descriptor over h),
    asynchronously from shared memory, so that a persistent program starts the next
    tile's mainloop while the store drains. SLOTS > 0: x is an RMSNorm's input times its
    weight, not yet divided by the row's rms; the accumulator rows are, before h is
    rounded (see :func:`_inv_rms`)."""
    pid_m, pid_n = tile_ids(tile, M, units_here, BLOCK_M, BLOCK_F, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    unit_in_launch = pid_n * BLOCK_F + tl.arange(0, BLOCK_F)
    unit_ok = unit_in_launch < units_here
    mask = (rows < M)[:, None] & unit_ok[None, :]
    gate_col = _gate_column(first_unit, pid_n * BLOCK_F, PAIR)
    if not TAIL and BLOCK_F == PAIR:
        # A tile is one whole pair block, 2 * PAIR contiguous columns that all exist: the
        # plain GEMM mainloop (one accumulator, one B tile per step, B masked along K only),
        # h stored as it comes out, and the gate and up halves split apart only for a.
        cols = _aligned_run(gate_col, 2 * BLOCK_F)
        acc = mainloop(
            x_ptr, w_ptr, rows, cols, M, 2 * F, K, stride_xm, stride_xk, stride_wk, stride_wn,
            IEEE, BLOCK_M, 2 * BLOCK_F, BLOCK_K, B_K_MAJOR, MASK_N=False,
        )  # fmt: skip
        if SLOTS:
            acc *= _inv_rms(squares_ptr, rows, M, inv_cols, eps, SLOTS)[:, None]
        h_tile = acc.to(a_ptr.dtype.element_ty)
        h_gate, h_up = column_halves(h_tile, BLOCK_M, BLOCK_F)
        if STORE_H and H_TMA:  # in halves: one [BLOCK_M, 2 * BLOCK_F] staging buffer overflows shared memory
            row0 = (pid_m * BLOCK_M).to(tl.int32)
            col0 = gate_col.to(tl.int32)
            h_desc.store([row0, col0], h_gate)
            h_desc.store([row0, col0 + BLOCK_F], h_up)
        elif STORE_H:
            tl.store(h_ptr + rows[:, None] * (2 * F) + cols[None, :], h_tile, mask=(rows < M)[:, None])
    else:
        # The last, partial pair block (its up columns start at a run-time offset) or
        # tiles narrower than a pair block: gate and up columns as two column blocks.
        gate_cols = _aligned_run(gate_col, BLOCK_F)
        up_offset = units_here if TAIL else PAIR
        acc_gate, acc_up = _mainloop_pairs(
            x_ptr, w_ptr, rows, gate_cols, up_offset, unit_ok, unit_ok, M, K, stride_xm, stride_xk, stride_wk,
            stride_wn, IEEE, BLOCK_M, BLOCK_F, BLOCK_K,
        )  # fmt: skip
        if SLOTS:
            inv_rms = _inv_rms(squares_ptr, rows, M, inv_cols, eps, SLOTS)[:, None]
            acc_gate *= inv_rms
            acc_up *= inv_rms
        h_gate = acc_gate.to(a_ptr.dtype.element_ty)
        h_up = acc_up.to(a_ptr.dtype.element_ty)
        if STORE_H:
            h_ptrs = h_ptr + rows[:, None] * (2 * F) + gate_cols[None, :]
            tl.store(h_ptrs, h_gate, mask=mask)
            tl.store(h_ptrs + up_offset, h_up, mask=mask)
    # SwiGLU on the rounded h, the values whose derivative backward takes.
    gate = h_gate.to(tl.float32)
    a = gate * tl.sigmoid(gate) * h_up.to(tl.float32)
    units = _aligned_run(first_unit + pid_n * BLOCK_F, BLOCK_F)
    tl.store(a_ptr + rows[:, None] * F + units[None, :], a.to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_fwd_kernel(
    x_ptr,
    w_ptr,
    a_ptr,
    h_ptr,
    h_desc,
    squares_ptr,
    M,
    F,
    K,
    first_unit,
    units_here,
    stride_xm,
    stride_xk,
    stride_wk,
    stride_wn,
    inv_cols,
    eps,
    TAIL: tl.constexpr,
    IEEE: tl.constexpr,
    PAIR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    B_K_MAJOR: tl.constexpr,
    PERSISTENT: tl.constexpr,
    STORE_H: tl.constexpr,
    H_TMA: tl.constexpr,
    SLOTS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """h = x @ w_gate_up and a over units [first_unit, first_unit + units_here): whole pair
    blocks, or (TAIL) the last, partial one. B_K_MAJOR: w_gate_up is contiguous along K (see
    gemm's ``mainloop``). PERSISTENT: each program loops over tiles, the tile loop flattened
    into the K loop so that the next tile's loads start during this tile's epilogue (whole
    pair blocks only: the other tiles' column masks would leave B's loads synchronous).
    STORE_H, H_TMA, SLOTS: see :func:`_swiglu_fwd_tile`."""
    wait_for_producers(PDL)
    if PERSISTENT:
        tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(units_here, BLOCK_F)
        for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
            _swiglu_fwd_tile(
                tile, x_ptr, w_ptr, a_ptr, h_ptr, h_desc, squares_ptr, M, F, K, first_unit, units_here, stride_xm,
                stride_xk, stride_wk, stride_wn, inv_cols, eps, TAIL, IEEE, PAIR, BLOCK_M, BLOCK_F, BLOCK_K, GROUP_M,
                B_K_MAJOR, STORE_H, H_TMA, SLOTS,
            )  # fmt: skip
    else:
        _swiglu_fwd_tile(
            tl.program_id(0), x_ptr, w_ptr, a_ptr, h_ptr, h_desc, squares_ptr, M, F, K, first_unit, units_here,
            stride_xm, stride_xk, stride_wk, stride_wn, inv_cols, eps, TAIL, IEEE, PAIR, BLOCK_M, BLOCK_F, BLOCK_K,
            GROUP_M, B_K_MAJOR, STORE_H, H_TMA, SLOTS,
        )  # fmt: skip


@triton.jit
def _swiglu_act_kernel(
    da_ptr, h_ptr, dh_ptr, a_ptr, M, F, first_unit, units_here, up_offset, BACKWARD: tl.constexpr,
    STORE_A: tl.constexpr, PAIR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """SwiGLU over h's pair layout, one [BLOCK_M, BLOCK_F] tile of units each way. Forward
    (BACKWARD False): a = silu(gate) * up. Backward: dgate and dup from dA ([M, F]) over
    their tiles of dh, which may be h itself (each program reads its elements before it
    writes them); STORE_A: a as well, with the forward's bits, for dW_down, into a buffer
    that may be dA itself (read first, element by element, by the same program)."""
    wait_for_producers(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    unit_start = tl.program_id(1) * BLOCK_F
    mask = (rows < M)[:, None] & (unit_start + tl.arange(0, BLOCK_F) < units_here)[None, :]
    gate_cols = _aligned_run(_gate_column(first_unit, unit_start, PAIR), BLOCK_F)
    offsets = rows[:, None] * (2 * F) + gate_cols[None, :]
    units = _aligned_run(first_unit + unit_start, BLOCK_F)
    unit_offsets = rows[:, None] * F + units[None, :]
    gate = tl.load(h_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + offsets + up_offset, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    if BACKWARD:
        da = tl.load(da_ptr + unit_offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(dh_ptr + offsets, (da * up * sig * (1.0 + gate * (1.0 - sig))).to(dh_ptr.dtype.element_ty), mask)
        tl.store(dh_ptr + offsets + up_offset, (da * gate * sig).to(dh_ptr.dtype.element_ty), mask=mask)
    if STORE_A:
        tl.store(a_ptr + unit_offsets, (gate * sig * up).to(a_ptr.dtype.element_ty), mask=mask)


def _swiglu_act_launch(
    h: torch.Tensor, a: torch.Tensor | None, da: torch.Tensor | None = None, dh: torch.Tensor | None = None
) -> None:
    """Run :func:`_swiglu_act_kernel` over contiguous h [M, 2F]: forward (``da`` None) into
    ``a``, else backward into ``dh`` (and ``a`` unless None). A tile is 32 rows of up to a
    pair block of units (4096 elements); the backward moves three tensors in and out per
    unit and takes twice the warps, as ``silu_mul``'s does."""
    m, f = h.shape[0], h.shape[1] // 2
    if m == 0 or f == 0:
        return
    backward = da is not None
    for first, units, tail in _launches(f):
        block_f = min(PAIR_BLOCK, triton.next_power_of_2(units))
        block_m = 4096 // block_f
        _swiglu_act_kernel[(cdiv(m, block_m), cdiv(units, block_f))](
            da, h, dh, a, m, f, first, units, units if tail else PAIR_BLOCK, BACKWARD=backward,
            STORE_A=a is not None, PAIR=PAIR_BLOCK, BLOCK_M=block_m, BLOCK_F=block_f,
            num_warps=8 if backward else 4, **_backend.dependent_launch(h),
        )  # fmt: skip


def swiglu_act(h: torch.Tensor) -> torch.Tensor:
    """a = silu(gate) * up, ``[M, F]``, from h = x @ w_gate_up (``[M, 2F]``, contiguous, pair
    layout); fp32 arithmetic on h's values, one rounding."""
    h = h.contiguous()
    a = h.new_empty((h.shape[0], h.shape[1] // 2))
    _swiglu_act_launch(h, a)
    return a


@kernel_op("swiglu_act", swiglu_act)
def swiglu_act_op(h: torch.Tensor) -> torch.Tensor:
    return h.new_empty((h.shape[0], h.shape[1] // 2))


@functools.cache
def _launches(f: int) -> tuple[tuple[int, int, bool], ...]:
    """``(first_unit, units, tail)`` of each launch over F units: the whole pair blocks,
    then the partial block if there is one."""
    whole = f - f % PAIR_BLOCK
    launches = [(0, whole, False)] if whole else []
    if whole < f:
        launches.append((whole, f - whole, True))
    return tuple(launches)


def _block_f(plan) -> int:
    """Units per epilogue tile: half the GEMM tile's columns (its gate half and its up
    half), a divisor of PAIR_BLOCK."""
    return min(PAIR_BLOCK, max(16, plan.block_n // 2))


def _tma_descriptor(t: torch.Tensor, block: list[int], device: int) -> TensorDescriptor | None:
    """A TMA descriptor over the 2-D ``t`` in ``block`` tiles, or None where TMA cannot serve:
    before Hopper, or with a base or rows not 16-byte aligned (which TensorDescriptor asserts)."""
    aligned = t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
    return TensorDescriptor.from_tensor(t, block) if aligned and _backend.has_tma(device) else None


@functools.cache
def _fwd_plan(
    m: int, f: int, k: int, element_size: int, shared_memory: int = _backend.HOPPER_SHARED_MEMORY
) -> GemmPlan:
    """The forward's launch settings: the GEMM's for [M, K] @ [K, 2F], persistent whenever
    its tile is a pair block wide (16-bit): at mid sizes too, where the plain GEMM's
    128 x 256 tiles run a program each, the SwiGLU forward measured faster persistent."""
    plan = gemm_plan(m, 2 * f, k, element_size, shared_memory)
    if element_size <= 2 and _block_f(plan) == PAIR_BLOCK:
        return dataclasses.replace(plan, persistent=True)
    return plan


def swiglu_fwd(
    x2d: torch.Tensor,
    w_gate_up: torch.Tensor,
    plan: GemmPlan | None = None,
    store_h: bool = True,
    row_squares: torch.Tensor | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(a, h)``: a = silu(gate) * up [M, F] and h = x @ w_gate_up [M, 2F], x's dtype
    (``plan``: the GEMM's launch settings, by default :func:`_fwd_plan`'s; ``store_h``
    False: h, which only backward needs, is neither allocated nor written, and is None).

    With ``row_squares`` (fp32 ``[slots, M]``, partial sums of squares of each row of an
    RMSNorm's input s, with x = s * weight): h = (x @ w_gate_up) / rms(s), the row scale
    applied to the fp32 accumulator, so the SwiGLU sees RMSNorm(s) @ w_gate_up; rms over
    K columns, with ``eps`` (:func:`lstrain.ops.linear_add_rms_norm_swiglu`).

    Under a persistent plan (``plan.persistent``) whole pair blocks run as persistent
    programs, their tile loop flattened into the K loop (the next tile's loads overlap this
    tile's epilogue), at most 3 stages; their h leaves through a TMA descriptor where rows
    are 16-byte aligned. Both measured faster (docs/notes/swiglu.md).

    w_gate_up may have any strides (``SwiGLUMLP`` passes its row-major [D, 2F] parameter);
    contiguous along K (the ``.t()`` of a [2F, D] matrix) it takes the mainloop's K-major
    count, as gemm does."""
    m, k = x2d.shape
    f = w_gate_up.shape[1] // 2
    a = torch.empty((m, f), dtype=x2d.dtype, device=x2d.device)
    h = torch.empty((m, 2 * f), dtype=x2d.dtype, device=x2d.device) if store_h else None
    if m == 0 or f == 0:
        return a, h
    device = _backend.device_index(x2d)
    plan = plan or _fwd_plan(m, f, k, x2d.element_size(), _backend.shared_memory_per_program(device))
    block_f = _block_f(plan)
    sms = _backend.multiprocessor_count(device)
    for first, units, tail in _launches(f):
        tiles = cdiv(m, plan.block_m) * cdiv(units, block_f)
        persistent = plan.persistent and not tail and block_f == PAIR_BLOCK
        h_desc = _tma_descriptor(h, [plan.block_m, block_f], device) if persistent and store_h else None
        _swiglu_fwd_kernel[(min(sms, tiles) if persistent else tiles,)](
            x2d, w_gate_up, a, h, h_desc, row_squares, m, f, k, first, units,
            x2d.stride(0), x2d.stride(1), w_gate_up.stride(0), w_gate_up.stride(1), 1.0 / max(k, 1), eps,
            TAIL=tail, IEEE=x2d.dtype == torch.float32, PAIR=PAIR_BLOCK,
            BLOCK_M=plan.block_m, BLOCK_F=block_f, BLOCK_K=plan.block_k, GROUP_M=plan.group_m,
            B_K_MAJOR=k_major(w_gate_up), PERSISTENT=persistent, STORE_H=store_h, H_TMA=h_desc is not None,
            SLOTS=0 if row_squares is None else row_squares.shape[0],
            num_warps=plan.num_warps, num_stages=plan.stages(persistent),
            **_backend.dependent_launch(x2d),
        )  # fmt: skip
    return a, h


def swiglu_fwd_activation(x2d: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    """The activation a of :func:`swiglu_fwd` alone: inference writes no h."""
    return swiglu_fwd(x2d, w_gate_up, store_h=False)[0]


@kernel_op("swiglu_fwd_activation", swiglu_fwd_activation)
def swiglu_fwd_activation_op(x2d: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    return x2d.new_empty((x2d.shape[0], w_gate_up.shape[1] // 2))


def swiglu_act_bwd(da: torch.Tensor, h: torch.Tensor, write_a: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """dh (new, h's shape) from dA and h and, with ``write_a``, a new a beside it (else a
    is ``[M, 0]``): the custom op's form of :func:`swiglu_grad`'s kernel."""
    da, h = da.contiguous(), h.contiguous()
    dh = h.new_empty(h.shape)
    a = h.new_empty((h.shape[0], h.shape[1] // 2 if write_a else 0))
    _swiglu_act_launch(h, a if write_a else None, da, dh)
    return dh, a


@kernel_op("swiglu_act_bwd", swiglu_act_bwd)
def swiglu_act_bwd_op(da: torch.Tensor, h: torch.Tensor, write_a: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return h.new_empty(h.shape), h.new_empty((h.shape[0], h.shape[1] // 2 if write_a else 0))


def swiglu_grad(
    dy2d: torch.Tensor, w_down: torch.Tensor, h: torch.Tensor, write_a: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradient of h from inside an autograd backward: dA = dy @ w_down^T (cuBLAS), then
    one pass over dA and h that writes dgate and dup in h's pair layout.

    Args:
        dy2d: ``[M, D_out]`` gradient of the MLP's output.
        w_down: ``[F, D_out]``.
        h: the saved ``[M, 2F]`` gate and up pre-activations (copied first where a
            saved-tensor hook hands them back non-contiguous).
        write_a: also write the activation a again, for dW_down.

    Returns:
        ``(dh, a)``, a None without ``write_a``. In eager mode dh is written over h where
        the graph goes with this backward (one [tokens, 2F] buffer fewer) and a over dA;
        under torch.compile, the custom op into new tensors.
    """
    da = dy2d @ w_down.t()
    if torch.compiler.is_compiling():
        dh, written = swiglu_act_bwd_op(da, h, write_a)
        return dh, written if write_a else None
    h = h.contiguous()
    dh = h if graph_freed_after_backward() else torch.empty_like(h)
    written = da if write_a else None  # dA is ours and read before a is written over it
    _swiglu_act_launch(h, written, da, dh)
    return dh, written


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[tokens, t.shape[-1]]``, strides kept where a view can; ``reshape(-1, 0)``
    cannot count the tokens of a zero-width tensor."""
    return t.reshape(t.shape[:-1].numel(), t.shape[-1])


class SwiGLUFunction(torch.autograd.Function):
    """Autograd for :func:`swiglu_mlp`. Saves x, the weights, h and, with
    ``keep_activation``, a (else backward's pass writes a again beside dh); outside
    torch.compile dh is written over h unless the graph is retained for another backward."""

    @staticmethod
    def forward(ctx, x, w_gate_up, w_down, keep_activation):
        h = _rows(x) @ w_gate_up
        a = swiglu_act_op(h)
        y = a @ w_down
        # x itself, not a view made here: a saved-tensor hook then sees the autograd node that
        # made it (RecomputedNorms makes an autocast cast of a norm output again by it)
        ctx.save_for_backward(x, w_gate_up, w_down, h, *((a,) if keep_activation else ()))
        ctx.x_shape = x.shape
        return y.view(*x.shape[:-1], w_down.shape[1])

    @staticmethod
    def backward(ctx, dy):
        refuse_create_graph("swiglu_mlp")
        x, w_gate_up, w_down, h, *kept = ctx.saved_tensors
        x2d, dy2d = _rows(x), _rows(dy)
        needs_dh = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        # len(), not `not kept`: Dynamo (torch 2.11) cannot pass `not` of a tuple as a value
        write_a = ctx.needs_input_grad[2] and len(kept) == 0
        dh, a = None, (kept[0] if kept else None)
        if needs_dh:  # the pass that writes dh writes a again beside it
            dh, written = swiglu_grad(dy2d, w_down, h, write_a=write_a)
            a = written if write_a else a
        elif write_a:  # only dW_down: a from h alone, no dA
            a = swiglu_act_op(h)
        # weight gradients in the weights' layouts: a w.t() view's gradient reaches .grad contiguous
        dw_down = matmul_like(a.t(), dy2d, w_down) if ctx.needs_input_grad[2] else None
        if not needs_dh:
            return None, None, dw_down, None
        dx = (dh @ w_gate_up.t()).view(ctx.x_shape) if ctx.needs_input_grad[0] else None
        dw_gate_up = matmul_like(x2d.t(), dh, w_gate_up) if ctx.needs_input_grad[1] else None
        return dx, dw_gate_up, dw_down, None


def pack_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """The pair layout of the gate and up projections (see the module docstring).

    Args:
        w_gate: ``[D, F]`` gate matrix, ``x @ w`` convention (a ``torch.nn.Linear``'s
            weight transposed).
        w_up: ``[D, F]`` up matrix, same convention.

    Returns:
        A new ``[D, 2F]`` tensor: whole pair blocks of 128 gate then 128 up columns, then
        the last partial block's gate and up columns.
    """
    d, f = w_gate.shape
    whole = f - f % PAIR_BLOCK
    pairs = whole // PAIR_BLOCK  # not -1 in the reshapes: ambiguous when D = 0
    blocks = torch.stack(
        (w_gate[:, :whole].reshape(d, pairs, PAIR_BLOCK), w_up[:, :whole].reshape(d, pairs, PAIR_BLOCK)), 2
    )
    return torch.cat((blocks.reshape(d, 2 * whole), w_gate[:, whole:], w_up[:, whole:]), dim=1)


def unpack_gate_up(w_gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Undo :func:`pack_gate_up`.

    Args:
        w_gate_up: a ``[D, 2F]`` matrix in the pair layout.

    Returns:
        ``(w_gate, w_up)``: new ``[D, F]`` tensors.
    """
    d, f = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    whole = f - f % PAIR_BLOCK
    blocks = w_gate_up[:, : 2 * whole].reshape(d, whole // PAIR_BLOCK, 2, PAIR_BLOCK)  # not -1: D may be 0
    tail = w_gate_up[:, 2 * whole :]
    gate = torch.cat((blocks[:, :, 0].reshape(d, whole), tail[:, : f - whole]), dim=1)
    up = torch.cat((blocks[:, :, 1].reshape(d, whole), tail[:, f - whole :]), dim=1)
    return gate, up


def swiglu_mlp(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, *, keep_activation: bool = False
) -> torch.Tensor:
    """``(silu(x @ W_gate) * (x @ W_up)) @ w_down``: cuBLAS GEMMs, SwiGLU and its derivative
    in one pass each way over the pair layout (see the module docstring).

    Under ``torch.autocast``, x and the weights are first cast to its dtype, as a
    matmul's inputs are. Backward keeps x and h = x @ [W_gate, W_up]; the activation a
    (F values per token), which dW_down needs, is written again by backward's pass over h,
    with the forward's bits, unless ``keep_activation``. Without gradients (inference) the
    GEMM with SwiGLU in its epilogue writes a alone, never h (its sums run in another
    order than cuBLAS's: the same values within rounding, not the same bits).

    Args:
        x: ``[*, D]``, float16/bfloat16/float32.
        w_gate_up: ``[D, 2F]`` in the pair layout (see :func:`pack_gate_up`), x's dtype;
            any strides, fastest row-major (a ``.t()`` view of a [2F, D] matrix is slower).
        w_down: ``[F, D_out]``, x's dtype, any strides.
        keep_activation: keep a from forward for backward: a third more saved memory
            than h alone, for one store fewer in backward (docs/notes/swiglu.md).

    Returns:
        ``[*, D_out]`` in x's dtype.

    Raises:
        ValueError: x or a weight no tensor (named), a 0-d x, mismatched shapes, dtypes or
            devices, or a ``keep_activation`` that is not a bool.
        RuntimeError: (from backward) ``create_graph=True``: second derivatives are not
            supported.
    """
    check_tensors("swiglu_mlp", {"x": x, "w_gate_up": w_gate_up, "w_down": w_down})
    if not isinstance(keep_activation, bool):
        raise ValueError(f"swiglu_mlp: keep_activation must be a bool, got {keep_activation!r}")
    x, w_gate_up, w_down = autocast_inputs(x, w_gate_up, w_down)
    if x.dim() == 0:
        raise ValueError("swiglu_mlp: x must be [*, D] (at least one dim), got a 0-d tensor")
    if x.dtype not in _SUPPORTED_DTYPES or w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise ValueError(
            "swiglu_mlp: x, w_gate_up and w_down must share a float dtype (float32, float16 or bfloat16), "
            f"got {x.dtype}, {w_gate_up.dtype}, {w_down.dtype}"
        )
    if w_gate_up.dim() != 2 or w_gate_up.shape[0] != x.shape[-1] or w_gate_up.shape[1] % 2:
        raise ValueError(f"swiglu_mlp: w_gate_up must be [D, 2F] with D = {x.shape[-1]}, got {tuple(w_gate_up.shape)}")
    if w_down.dim() != 2 or 2 * w_down.shape[0] != w_gate_up.shape[1]:
        raise ValueError(
            f"swiglu_mlp: w_down must be [F, D_out] with F = {w_gate_up.shape[1] // 2}, got {tuple(w_down.shape)}"
        )
    for name, t in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if t.device != x.device:
            raise ValueError(f"swiglu_mlp: {name} is on {t.device} but x is on {x.device}")
    backend = _backend.backend_for(x)
    _backend.note("swiglu_mlp", backend)
    if backend == "reference":
        return swiglu_mlp_ref(x, w_gate_up, w_down)
    if differentiated(x, w_gate_up, w_down):
        return SwiGLUFunction.apply(x, w_gate_up, w_down, keep_activation)
    # inference: no autograd node, and the epilogue GEMM writes a without h
    a = swiglu_fwd_activation_op(_rows(x), w_gate_up)
    return (a @ w_down).view(*x.shape[:-1], w_down.shape[1])


def swiglu_mlp_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch with the separate gate and up matrices.

    Args:
        x, w_gate_up, w_down: as for :func:`swiglu_mlp` (``w_gate_up`` in the pair layout).

    Returns:
        ``(silu(x @ W_gate) * (x @ W_up)) @ w_down``, x's dtype.
    """
    w_gate, w_up = unpack_gate_up(w_gate_up)
    return (torch.nn.functional.silu(x @ w_gate) * (x @ w_up)) @ w_down
