"""GEMM with a fused epilogue: D = act(alpha * (a @ b) + beta * c + bias).

The fp32 accumulator gets the whole affine part and the activation in registers, and is
rounded once, at the store. ``beta == 0`` (or no ``c``) compiles a kernel that never
loads C. Operands may be transposed (any strides); edges are masked, so any M, N, K.
Tiles are ordered in groups of ``group_m`` tile rows so that neighbouring programs share
tiles of ``b`` in L2. With more tiles than SMs (16-bit inputs), one persistent program per
SM loops over the tiles whose columns all exist, its tile loop flattened into the K loop
so that the next tile's loads overlap this tile's epilogue; a last, partial column strip
gets a program per tile. With too few tiles to fill the SMs and a long K (16-bit), K is
split over programs that write fp32 partials, and a second kernel sums them in a fixed
order and runs the epilogue (deterministic: no atomics); narrower tiles where those
fill the SMs instead (:func:`small_grid_plan`).

Backward uses cuBLAS GEMMs for the gradients. With an activation, the forward epilogue
also stores the pre-activation z when an input requires grad (in D's dtype, as torch
keeps a Linear's output for the activation after it; not for relu, whose slope D itself
gives), and one pass (the backward of :func:`lstrain.ops.bias_act_dropout`) turns dD into
dz = dD * act'(z), over z where the graph is freed, and sums it over rows for dbias.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lstrain import _backend
from lstrain._backend import wait_for_producers
from lstrain.ops._lib.activations import (
    ACTIVATIONS,
    activation_index,
    activation_ref,
    apply_activation,
)
from lstrain.ops._lib.autocast import autocast_inputs
from lstrain.ops._lib.custom_op import kernel_op
from lstrain.ops._lib.first_order import differentiated, graph_freed_after_backward, refuse_create_graph
from lstrain.ops._lib.layout import cdiv, contiguous_or_none, matmul_like
from lstrain.ops._lib.options import check_tensors, float_option
from lstrain.ops.bias_act_dropout import bias_act_dropout_bwd, bias_act_dropout_bwd_op

__all__ = [
    "GemmFunction",
    "GemmPlan",
    "gemm",
    "gemm_fwd",
    "gemm_fwd_saving_preactivation",
    "gemm_plan",
    "gemm_ref",
    "k_major",
    "kahan_add",
    "mainloop",
    "small_grid_plan",
    "tile_ids",
]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_GELU = ACTIVATIONS.index("gelu")
_RELU = ACTIVATIONS.index("relu")
# About one wave of programs on the 132 SMs of an H100 / H200 (a constant: plans do not
# depend on the SM count)
_WAVE_TILES = 128
# Shared memory per program that the 128 x 256 tiles need (Triton 3.6, bf16: up to 144 KiB on
# sm_80, 192 KiB on sm_90); sm_86 / sm_89 parts offer 99 KiB.
_BIG_TILE_SHARED_MEMORY = 160 * 1024


@triton.jit
def tile_ids(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(tile row, tile column) of tile ``pid``, int64; tiles are numbered over groups of
    GROUP_M tile rows, column by column, so that neighbouring programs share tiles of B
    in L2."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m.to(tl.int64), pid_n.to(tl.int64)


@triton.jit
def column_halves(tile, BLOCK_M: tl.constexpr, HALF: tl.constexpr):
    """The two [BLOCK_M, HALF] column halves of a [BLOCK_M, 2 * HALF] tile (an epilogue run
    on one half at a time needs half the registers)."""
    return tl.split(tl.permute(tl.reshape(tile, [BLOCK_M, 2, HALF]), (0, 2, 1)))


@triton.jit
def kahan_add(total, compensation, block):
    """``(total + block, new compensation)``: a K block of fp32 products, summed on its own,
    joins the accumulator with Kahan compensation, so that the rounding error grows with
    BLOCK_K, not K (one fp32 chain over K = 431 gave 4x cuBLAS's error). The compensation
    is subtracted from the block, not folded into the dot, so that the compiler cannot
    merge the block back into one chain."""
    block = block - compensation
    new_total = total + block
    return new_total, (new_total - total) - block


@triton.jit
def mainloop(
    a_ptr,
    b_ptr,
    rows,
    cols,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    B_K_MAJOR: tl.constexpr = False,
    MASK_N: tl.constexpr = True,
    ONE_STEP_AT_LEAST: tl.constexpr = False,
):
    """fp32 accumulator of A[rows, :] @ B[:, cols], edges masked.

    MASK_N=False: every column of the tile exists (the caller knows), so B is masked along K
    only. In a loop flattened over tiles that is what lets Triton 3.6 copy a row-major B
    asynchronously: the flattened loop carries ``cols`` as a loop value, the column mask
    loses its contiguity along N, and the load falls under an asynchronous copy's 4 bytes.

    B_K_MAJOR (B contiguous along K, as ``w.t()`` of a row-major weight is) makes the loop
    run at least one step (for K = 0 a fully masked one, adding zeros): Triton 3.6's ptxas
    otherwise serialized every wgmma of that layout (C7515, "non wgmma instructions defining
    accumulator registers"), and ``gemm(x, w.t())`` ran much slower than with the step
    count forced. Other layouts keep the plain count, which measured faster for them
    (docs/notes/gemm.md). The SwiGLU forward passes
    the flag from w_gate_up's strides as gemm does (ptxas serialized it the same way);
    its backward keeps the plain count: its w_down^T is K-major, but ptxas did not
    serialize that kernel, and the longer count was within noise there.

    ONE_STEP_AT_LEAST forces that step count for any layout: the split-K partial kernel,
    whose K chunk is a runtime value, had every wgmma serialized (C7515) with a row-major
    B and 128 x 128 tiles without it (Triton 3.6, sm_90, compile-level).
    """
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    compensation = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    steps = tl.cdiv(K, BLOCK_K)
    if B_K_MAJOR or ONE_STEP_AT_LEAST:
        steps = tl.maximum(steps, 1)
    for k in range(0, steps):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(rows < M)[:, None] & (ks < k_left)[None, :], other=0.0)
        if MASK_N:
            b = tl.load(b_ptrs, mask=(ks < k_left)[:, None] & (cols < N)[None, :], other=0.0)
        else:
            b = tl.load(b_ptrs, mask=(ks < k_left)[:, None], other=0.0)
        if IEEE:  # fp32 operands: full fp32 products, as torch.matmul gives by default
            acc, compensation = kahan_add(acc, compensation, tl.dot(a, b, input_precision="ieee"))
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _gemm_tile(
    tile,
    a_ptr,
    b_ptr,
    c_ptr,
    bias_ptr,
    d_ptr,
    z_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    stride_dm,
    alpha,
    beta,
    HAS_C: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    B_K_MAJOR: tl.constexpr,
    MASK_N: tl.constexpr,
    SPLIT_EPILOGUE: tl.constexpr,
    STORE_Z: tl.constexpr,
):
    """Output tile ``tile`` (see :func:`tile_ids`); MASK_N=False: all its columns exist;
    SPLIT_EPILOGUE: the epilogue runs on the tile's two column halves in turn; STORE_Z:
    the pre-activation is stored too (see :func:`_epilogue`)."""
    pid_m, pid_n = tile_ids(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = mainloop(
        a_ptr, b_ptr, rows, cols, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, IEEE, BLOCK_M, BLOCK_N, BLOCK_K,
        B_K_MAJOR, MASK_N,
    )  # fmt: skip
    if SPLIT_EPILOGUE:
        # Two column halves, one after the other: the erf of gelu then needs its temporaries
        # for half the tile (Triton 3.6, 128 x 256 persistent: 56 bytes of spills, not 496).
        left, right = column_halves(acc, BLOCK_M, BLOCK_N // 2)
        half = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
        _epilogue(
            left, rows, half, c_ptr, bias_ptr, d_ptr, z_ptr, M, N, stride_cm, stride_cn, stride_dm, alpha, beta,
            HAS_C, HAS_BIAS, ACT, MASK_N, STORE_Z,
        )  # fmt: skip
        _epilogue(
            right, rows, half + BLOCK_N // 2, c_ptr, bias_ptr, d_ptr, z_ptr, M, N, stride_cm, stride_cn, stride_dm,
            alpha, beta, HAS_C, HAS_BIAS, ACT, MASK_N, STORE_Z,
        )  # fmt: skip
    else:
        _epilogue(
            acc, rows, cols, c_ptr, bias_ptr, d_ptr, z_ptr, M, N, stride_cm, stride_cn, stride_dm, alpha, beta, HAS_C,
            HAS_BIAS, ACT, MASK_N, STORE_Z,
        )  # fmt: skip


@triton.jit
def _epilogue(
    acc,
    rows,
    cols,
    c_ptr,
    bias_ptr,
    d_ptr,
    z_ptr,
    M,
    N,
    stride_cm,
    stride_cn,
    stride_dm,
    alpha,
    beta,
    HAS_C: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    MASK_N: tl.constexpr,
    STORE_Z: tl.constexpr,
):
    """D[rows, cols] = act(alpha * acc + beta * C + bias), in fp32, rounded at the store.
    STORE_Z: the pre-activation z (everything but act) is stored too, in D's layout and
    dtype, for backward's act'(z) (as torch keeps a Linear's output for its activation)."""
    if MASK_N:
        mask = (rows < M)[:, None] & (cols < N)[None, :]
    else:
        mask = (rows < M)[:, None]
    z = acc * tl.cast(alpha, tl.float32)
    if HAS_C:
        c = tl.load(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, mask=mask, other=0.0)
        z += tl.cast(beta, tl.float32) * c.to(tl.float32)
    if HAS_BIAS:
        z += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if STORE_Z:
        tl.store(z_ptr + rows[:, None] * stride_dm + cols[None, :], z.to(z_ptr.dtype.element_ty), mask=mask)
    d, _ = apply_activation(z, ACT)
    tl.store(d_ptr + rows[:, None] * stride_dm + cols[None, :], d.to(d_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    bias_ptr,
    d_ptr,
    z_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    stride_dm,
    alpha,
    beta,
    HAS_C: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    B_K_MAJOR: tl.constexpr,
    PERSISTENT: tl.constexpr,
    SPLIT_EPILOGUE: tl.constexpr,
    STORE_Z: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """D = act(alpha * (a @ b) + beta * c + bias), and its pre-activation where STORE_Z.
    PERSISTENT (N a multiple of BLOCK_N): each program loops over tiles, the tile loop
    flattened into the K loop so that the next tile's loads start during this tile's
    epilogue; B is then masked along K only, which keeps a row-major B's loads
    asynchronous copies (see ``mainloop``'s MASK_N).
    SPLIT_EPILOGUE: the epilogue in two column halves, which keeps erf's temporaries to
    half a tile: faster for gelu; gelu_tanh and silu were slower in halves."""
    wait_for_producers(PDL)
    if PERSISTENT:
        tiles = tl.cdiv(M, BLOCK_M) * (N // BLOCK_N)
        for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
            _gemm_tile(
                tile, a_ptr, b_ptr, c_ptr, bias_ptr, d_ptr, z_ptr, M, N, K, stride_am, stride_ak, stride_bk,
                stride_bn, stride_cm, stride_cn, stride_dm, alpha, beta, HAS_C, HAS_BIAS, ACT, IEEE, BLOCK_M, BLOCK_N,
                BLOCK_K, GROUP_M, B_K_MAJOR, False, SPLIT_EPILOGUE, STORE_Z,
            )  # fmt: skip
    else:
        _gemm_tile(
            tl.program_id(0), a_ptr, b_ptr, c_ptr, bias_ptr, d_ptr, z_ptr, M, N, K, stride_am, stride_ak, stride_bk,
            stride_bn, stride_cm, stride_cn, stride_dm, alpha, beta, HAS_C, HAS_BIAS, ACT, IEEE, BLOCK_M, BLOCK_N,
            BLOCK_K, GROUP_M, B_K_MAJOR, True, SPLIT_EPILOGUE, STORE_Z,
        )  # fmt: skip


@triton.jit
def _split_k_partial_kernel(
    a_ptr,
    b_ptr,
    partial_ptr,
    M,
    N,
    K,
    k_chunk,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    B_K_MAJOR: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """fp32 partial products of one K chunk per program: program ``s * tiles + t`` writes
    A[tile t's rows, chunk s] @ B[chunk s, tile t's columns] to partials[s]."""
    wait_for_producers(PDL)
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    split = tl.program_id(0) // tiles
    pid_m, pid_n = tile_ids(tl.program_id(0) % tiles, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = split.to(tl.int64) * k_chunk
    acc = mainloop(
        a_ptr + k0 * stride_ak, b_ptr + k0 * stride_bk, rows, cols, M, N, tl.minimum(k_chunk, K - k0),
        stride_am, stride_ak, stride_bk, stride_bn, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, B_K_MAJOR,
        ONE_STEP_AT_LEAST=True,
    )  # fmt: skip
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    plane = split.to(tl.int64) * M * N  # int64: S x M x N partials may pass 2**31 elements
    tl.store(partial_ptr + plane + rows[:, None] * N + cols[None, :], acc, mask=mask)


@triton.jit
def _split_k_epilogue_kernel(
    partial_ptr,
    c_ptr,
    bias_ptr,
    d_ptr,
    z_ptr,
    M,
    N,
    stride_cm,
    stride_cn,
    stride_dm,
    alpha,
    beta,
    SPLITS: tl.constexpr,
    HAS_C: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    STORE_Z: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """D = act(alpha * sum of the partials + beta * C + bias); the partials are summed in
    split order, so D does not depend on which program finished first."""
    wait_for_producers(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offsets = rows[:, None] * N + cols[None, :]
    plane = tl.cast(M, tl.int64) * N
    acc = tl.load(partial_ptr + offsets, mask=mask, other=0.0)
    for split in tl.static_range(1, SPLITS):
        acc += tl.load(partial_ptr + split * plane + offsets, mask=mask, other=0.0)
    _epilogue(
        acc, rows, cols, c_ptr, bias_ptr, d_ptr, z_ptr, M, N, stride_cm, stride_cn, stride_dm, alpha, beta, HAS_C,
        HAS_BIAS, ACT, True, STORE_Z,
    )  # fmt: skip


@dataclass(frozen=True)
class GemmPlan:
    """Tile shape, program grouping and pipelining of one GEMM launch."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    # one program per SM looping over the tiles: gemm_plan's large 16-bit plan only (mid-size
    # plans ran slower persistent, see gemm_plan); the SwiGLU forward sets it for every plan
    # whose tile is a pair block wide
    persistent: bool = False
    # K split over this many programs per output tile (fp32 partials, then an epilogue kernel)
    splits: int = 1

    def stages(self, persistent: bool) -> int:
        """Pipeline depth of a launch: persistent launches (their flattened loop also holds
        the epilogue's registers) take at most 3, which timed as fast or faster for the
        GEMM and both SwiGLU kernels."""
        return min(self.num_stages, 3) if persistent else self.num_stages


@functools.cache
def gemm_plan(
    m: int, n: int, k: int, element_size: int, shared_memory: int = _backend.HOPPER_SHARED_MEMORY
) -> GemmPlan:
    """Launch settings from the problem shape and the device's shared memory per program
    (a pure function; ``lstrain._backend.shared_memory_per_program``).

    16-bit inputs (each rule the fastest measured, docs/notes/gemm.md):

    - M and N >= 2048: 128 x 256 x 64 tiles, 8 warps, persistent (see :func:`gemm_fwd`; a
      persistent launch takes 3 stages, :meth:`GemmPlan.stages`).
    - Otherwise, when its 128 x 128 tiles fit in one wave of programs (``_WAVE_TILES``):
      those tiles at 8 warps and 4 stages, a program each (faster than 4 warps).
    - More tiles than that and N >= 256: 128 x 256 tiles, 8 warps, 4 stages, a program
      each (persistent, the gelu epilogue was slower).
    - Else 128 x 128 (or the next power of two of a smaller M, N) at 4 warps, 3 stages.

    Devices with less than 160 KiB of shared memory per program (sm_86 / sm_89 parts such
    as the A10, L4 or RTX 4090 have 99) always take that last plan: compiled for them by
    Triton 3.6, the 128 x 256 tiles at 3 stages need 104-128 KiB persistent or with the
    SwiGLU epilogues (the A100's 163 KiB holds every plan).

    fp32 inputs take the last plan below 2048 and K tiles of 16, the least ``tl.dot`` allows:
    each tile's products sum in one fp32 chain before joining the accumulator (see
    :func:`kahan_add`), and 16 keeps that chain's error at a 32-lane GEMV's, which is what
    cuBLAS runs for N = 1 (simulated: tiles of 16 err as a 32-lane GEMV does, tiles of 32
    more; with tiles of 32 a GEMV-like fp32 case failed the tolerance rule).
    """
    block_k = 64 if element_size <= 2 else 16
    big_tiles = shared_memory >= _BIG_TILE_SHARED_MEMORY
    if big_tiles and m >= 2048 and n >= 2048:
        return GemmPlan(128, 256, block_k, 8, num_warps=8, num_stages=4, persistent=element_size <= 2)
    block_m = min(128, max(16, triton.next_power_of_2(m)))
    block_n = min(128, max(16, triton.next_power_of_2(n)))
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    if big_tiles and element_size <= 2 and block_m == block_n == 128:
        if cdiv(m, 128) * cdiv(n, 128) <= _WAVE_TILES:
            return GemmPlan(128, 128, block_k, 8, num_warps=8, num_stages=4)
        if n >= 256:
            return GemmPlan(128, 256, block_k, 8, num_warps=8, num_stages=4)
    return GemmPlan(block_m, block_n, block_k, 8, num_warps=4, num_stages=3)


@functools.cache
def small_grid_plan(
    m: int, n: int, k: int, element_size: int, shared_memory: int = _backend.HOPPER_SHARED_MEMORY
) -> GemmPlan | None:
    """A plan for 16-bit GEMMs whose 128 x 128 tiles leave SMs idle, or None where
    :func:`gemm_plan`'s is the better one (a pure function, like it).

    - 64 x 128 tiles (8 warps, 5 stages), a program each, when they fit one wave
      (``_WAVE_TILES``) and either fill more than half of it or K is at most 2048.
    - Else K split over programs (:func:`_launch_split_k`: fp32 partials, then a second
      kernel sums them in chunk order and runs the epilogue): up to 4 chunks of at least
      1024, 128 x 128 or 128 x 256 tiles, whichever brings the programs closest to one
      wave, the narrower on a tie (fewer partials to sum).

    8 warps beat 4 for the bias + gelu epilogue (the plain product loses a little), 5
    stages beat 4 and 3. Past one wave every split lost, and so did a single launch whose
    last-arriving program sums the partials. The figures: docs/notes/gemm.md.
    """
    if element_size > 2 or shared_memory < _BIG_TILE_SHARED_MEMORY or min(m, n) <= 64:
        return None
    narrow_tiles = cdiv(m, 64) * cdiv(n, 128)
    if narrow_tiles <= _WAVE_TILES and (2 * narrow_tiles > _WAVE_TILES or k <= 2048):
        return GemmPlan(64, 128, 64, 8, num_warps=8, num_stages=5)
    best = None
    for block_n in (128, 256) if n >= 256 else (128,):
        tiles = cdiv(m, 128) * cdiv(n, block_n)
        splits = min(4, _WAVE_TILES // tiles, k // 1024)
        if splits >= 2 and (best is None or tiles * splits > best[0]):
            best = tiles * splits, GemmPlan(128, block_n, 64, 8, num_warps=8, num_stages=4, splits=splits)
    return None if best is None else best[1]


def k_major(b: torch.Tensor) -> bool:
    """Whether a [K, N] operand is contiguous along K (``w.t()`` of a row-major [N, K]
    weight): the mainloop's ``B_K_MAJOR``."""
    return b.stride(0) == 1 and b.stride(1) != 1


def _launch(a, b, c, bias, d, z, alpha, beta, act, plan: GemmPlan, persistent: bool, sms: int) -> None:
    """One launch of the kernel over d = act(alpha * a @ b + beta * c + bias) (c None: not
    read; z None: the pre-activation is not stored)."""
    m, k = a.shape
    n = b.shape[1]
    tiles = cdiv(m, plan.block_m) * cdiv(n, plan.block_n)
    _gemm_kernel[(min(sms, tiles) if persistent else tiles,)](
        a, b, c, bias, d, z,
        m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        0 if c is None else c.stride(0), 0 if c is None else c.stride(1), d.stride(0),
        alpha, beta,
        HAS_C=c is not None,
        HAS_BIAS=bias is not None,
        ACT=act,
        IEEE=a.dtype == torch.float32,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        BLOCK_K=plan.block_k,
        GROUP_M=plan.group_m,
        B_K_MAJOR=k_major(b),
        PERSISTENT=persistent,
        SPLIT_EPILOGUE=plan.block_n >= 64 and (act == _GELU or z is not None or d.element_size() == 4),
        STORE_Z=z is not None,
        num_warps=plan.num_warps,
        num_stages=plan.stages(persistent),
        **_backend.dependent_launch(a),
    )  # fmt: skip


def _launch_split_k(a, b, c, bias, d, z, alpha, beta, act, plan: GemmPlan) -> None:
    """d = act(alpha * a @ b + beta * c + bias) with K split in plan.splits chunks (multiples
    of BLOCK_K): fp32 partials [splits, M, N], then one epilogue kernel sums them in order."""
    m, k = a.shape
    n = b.shape[1]
    k_chunk = cdiv(cdiv(k, plan.splits), plan.block_k) * plan.block_k
    splits = cdiv(k, k_chunk)
    partials = torch.empty((splits, m, n), dtype=torch.float32, device=a.device)
    tiles = cdiv(m, plan.block_m) * cdiv(n, plan.block_n)
    _split_k_partial_kernel[(tiles * splits,)](
        a, b, partials, m, n, k, k_chunk, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        IEEE=a.dtype == torch.float32, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        GROUP_M=plan.group_m, B_K_MAJOR=k_major(b), num_warps=plan.num_warps, num_stages=plan.num_stages,
        **_backend.dependent_launch(a),
    )  # fmt: skip
    _split_k_epilogue_kernel[(cdiv(m, 64), cdiv(n, 128))](
        partials, c, bias, d, z, m, n,
        0 if c is None else c.stride(0), 0 if c is None else c.stride(1), d.stride(0), alpha, beta,
        SPLITS=splits, HAS_C=c is not None, HAS_BIAS=bias is not None, ACT=act, STORE_Z=z is not None, BLOCK_M=64,
        BLOCK_N=128, num_warps=4,
        **_backend.dependent_launch(partials),
    )  # fmt: skip


def gemm_fwd(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None,
    bias: torch.Tensor | None,
    alpha: float,
    beta: float,
    act: int,
    out_dtype: torch.dtype,
    plan: GemmPlan | None = None,
) -> torch.Tensor:
    """Launch the kernel(s) on validated 2-D operands; returns D [M, N] in ``out_dtype``.
    ``plan`` None: :func:`small_grid_plan`'s where it has one, else :func:`gemm_plan`'s."""
    d = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    _gemm_into(a, b, c, bias, d, None, alpha, beta, act, plan)
    return d


def gemm_fwd_saving_preactivation(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None,
    bias: torch.Tensor | None,
    alpha: float,
    beta: float,
    act: int,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gemm_fwd` that also returns the pre-activation ``alpha * a @ b + beta * c +
    bias`` (in ``out_dtype``, from the same epilogue) for the activation's backward."""
    d = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    z = torch.empty_like(d)
    _gemm_into(a, b, c, bias, d, z, alpha, beta, act, None)
    return d, z


def _gemm_into(a, b, c, bias, d, z, alpha, beta, act, plan: GemmPlan | None) -> None:
    """d (and z, when given: the pre-activation) = the GEMM with its epilogue."""
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0:
        return
    device = _backend.device_index(a)
    if plan is None:
        shared_memory = _backend.shared_memory_per_program(device)
        plan = small_grid_plan(m, n, k, a.element_size(), shared_memory) or gemm_plan(
            m, n, k, a.element_size(), shared_memory
        )
    c = c if c is not None and beta != 0.0 else None
    sms = _backend.multiprocessor_count(device)
    whole = n - n % plan.block_n
    # K split over programs when the plan says so; else persistent programs over the whole
    # column tiles when the plan says so and there are more tiles than SMs, one program per
    # tile for the last, partial column strip.
    if plan.splits > 1:
        _launch_split_k(a, b, c, bias, d, z, alpha, beta, act, plan)
    elif plan.persistent and cdiv(m, plan.block_m) * (whole // plan.block_n) > sms:
        for first, last, persistent in ((0, whole, True), (whole, n, False)):
            if first < last:
                _launch(
                    a, b[:, first:last], None if c is None else c[:, first:last],
                    None if bias is None else bias[first:last], d[:, first:last],
                    None if z is None else z[:, first:last], alpha, beta, act, plan, persistent, sms,
                )  # fmt: skip
    else:
        _launch(a, b, c, bias, d, z, alpha, beta, act, plan, False, sms)


@kernel_op("gemm", gemm_fwd)
def gemm_fwd_op(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None,
    bias: torch.Tensor | None,
    alpha: float,
    beta: float,
    act: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@kernel_op("gemm_saving_preactivation", gemm_fwd_saving_preactivation)
def gemm_fwd_saving_preactivation_op(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None,
    bias: torch.Tensor | None,
    alpha: float,
    beta: float,
    act: int,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    d = a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)
    return d, torch.empty_like(d)


class GemmFunction(torch.autograd.Function):
    """Autograd for :func:`gemm`. With an activation the forward also stores the
    pre-activation z (when an input needs a gradient), and backward turns dD into
    dz = dD * act'(z) in one pass (written over z unless the graph is retained); then
    dA = alpha dz B^T, dB = alpha A^T dz (cuBLAS), dC = beta dz, dbias = sum dz. relu
    keeps no z: its slope is read off D (D > 0 exactly where z > 0, as torch's relu
    backward reads its output), which the next layer usually keeps anyway."""

    @staticmethod
    def forward(ctx, a, b, c, bias, alpha, beta, act, out_dtype):
        z = None
        if act >= 0 and act != _RELU and any(ctx.needs_input_grad[:4]):
            d, z = gemm_fwd_saving_preactivation_op(a, b, c, bias, alpha, beta, act, out_dtype)
        else:
            d = gemm_fwd_op(a, b, c, bias, alpha, beta, act, out_dtype)
        ctx.save_for_backward(a, b, c, bias, d if act == _RELU else z)  # what act' reads
        ctx.options = (alpha, beta, act)
        return d

    @staticmethod
    def backward(ctx, dd):
        refuse_create_graph("gemm")
        a, b, c, bias, z = ctx.saved_tensors  # z: the pre-activation (relu: D, whose sign is z's)
        alpha, beta, act = ctx.options
        need_a, need_b, need_c, need_bias = ctx.needs_input_grad[:4]
        need_c, need_bias = need_c and c is not None, need_bias and bias is not None
        if act >= 0:
            # dz = dD * act'(z) in one pass: bias_act_dropout's backward (no bias, no dropout),
            # which also sums dz over rows (fp32 partials, a fixed order) for dbias. Its last
            # pass writes dz over z where the graph goes with this backward: one [M, N]
            # buffer fewer (z is the forward's own, and nothing reads it afterwards).
            compiling = torch.compiler.is_compiling()
            reuse_z = not compiling and act != _RELU and graph_freed_after_backward()  # relu's D is the caller's

            def grad(scale, dtype, column_sum=False, last=False):
                """(scale * dz in dtype, [dz summed over rows, fp32] if column_sum)."""
                args = (dd, z, None, None, 0.0, False, ACTIVATIONS[act], column_sum, scale)
                if compiling:
                    dz, *sums = bias_act_dropout_bwd_op(*args)
                else:
                    dz, *sums = bias_act_dropout_bwd(*args, out=z if last and reuse_z else None)
                return dz.to(dtype), sums

        else:  # dz = dD: scaled and cast only where needed (a Linear's backward copies nothing)

            def grad(scale, dtype, column_sum=False, last=False):
                dz = dd.to(dtype) if scale == 1.0 else (scale * dd.float()).to(dtype)
                return dz, [dd.sum(0, dtype=torch.float32)] if column_sum else []

        da = db = dc = dbias = None
        sums = []
        if need_c:
            dc, _ = grad(beta, c.dtype)
        if need_a or need_b:
            dp, sums = grad(alpha, a.dtype, need_bias, last=True)  # alpha dz in the operands' dtype, for cuBLAS
            da = dp @ b.t() if need_a else None
            db = matmul_like(a.t(), dp, b) if need_b else None  # in b's layout: a w.t() gets a contiguous grad
        elif need_bias:
            _, sums = grad(1.0, dd.dtype, True, last=True)
        if need_bias:
            dbias = sums[0].to(bias.dtype)
        return da, db, dc, dbias, None, None, None, None


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    c: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    activation: str | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``act(alpha * (a @ b) + beta * c + bias)`` with the epilogue fused into the GEMM.

    Under ``torch.autocast``, a and b are first cast to its dtype, as torch.matmul's are.

    Args:
        a: ``[M, K]``, float16/bfloat16/float32 (fp32 products are full fp32, as in
            torch.matmul by default); any strides (a transposed view needs no copy).
        b: ``[K, N]``, same dtype; any strides: a ``w.t()`` view of a ``[N, K]`` weight
            runs nearly as fast as a row-major B (BENCHMARKS.md has the figures).
        c: optional ``[M, N]`` added as ``beta * c`` (never read when ``beta == 0``).
        bias: optional ``[N]``, added to every row.
        alpha, beta: scalars of the affine epilogue.
        activation: None, ``"relu"``, ``"gelu"``, ``"gelu_tanh"`` or ``"silu"``.
        out_dtype: dtype of D (default a's dtype); the accumulator is fp32 until the store.

    Returns:
        D, ``[M, N]`` contiguous. Where K is split (16-bit, few output tiles) the call also
        holds an fp32 workspace of the partial products while it runs: at most 128
        programs' tiles of 128 x 256, 16 MiB.

    Raises:
        ValueError: an operand, ``c`` or ``bias`` that is no tensor (named), operands not
            2-D, inner dims that differ, mixed dtypes or devices, a ``c`` or ``bias`` of the
            wrong shape or not floating point, an ``out_dtype`` other than float32 /
            float16 / bfloat16, an unknown activation, or an alpha or beta that is not a
            finite number (a Python or numpy scalar or a 0-d CPU tensor).
    """
    check_tensors("gemm", {"a": a, "b": b}, {"c": c, "bias": bias})
    a, b = autocast_inputs(a, b)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"gemm: need a [M, K] and b [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype not in _SUPPORTED_DTYPES or b.dtype != a.dtype:
        raise ValueError(
            f"gemm: a and b must share a float dtype (float32, float16 or bfloat16), got {a.dtype} and {b.dtype}"
        )
    m, n = a.shape[0], b.shape[1]
    for name, t, shape in (("c", c, (m, n)), ("bias", bias, (n,))):
        if t is None:
            continue
        if not t.is_floating_point():
            raise ValueError(f"gemm: {name} must be a float tensor, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"gemm: {name} has shape {tuple(t.shape)}, expected {shape}")
        if t.device != a.device:
            raise ValueError(f"gemm: {name} is on {t.device} but a is on {a.device}")
    if b.device != a.device:
        raise ValueError(f"gemm: b is on {b.device} but a is on {a.device}")
    act = activation_index(activation, "gemm")
    alpha, beta = float_option("gemm", "alpha", alpha), float_option("gemm", "beta", beta)
    out_dtype = out_dtype or a.dtype
    if out_dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"gemm: out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
    backend = _backend.backend_for(a)
    _backend.note("gemm", backend)
    if backend == "reference":
        return gemm_ref(a, b, c=c, bias=bias, alpha=alpha, beta=beta, activation=activation, out_dtype=out_dtype)
    options = (alpha, beta, act, out_dtype)
    bias = contiguous_or_none(bias)
    if differentiated(a, b, c, bias):
        return GemmFunction.apply(a, b, c, bias, *options)
    return gemm_fwd_op(a, b, c, bias, *options)


def gemm_ref(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    c: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    activation: str | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Plain PyTorch: the product in fp32 (fp64 for fp64 input), epilogue in the same precision.

    Args:
        a, b, c, bias, alpha, beta, activation, out_dtype: as for :func:`gemm`.

    Returns:
        ``act(alpha * (a @ b) + beta * c + bias)`` in ``out_dtype`` (default a's dtype).
    """
    compute = torch.float64 if a.dtype == torch.float64 else torch.float32
    z = alpha * (a.to(compute) @ b.to(compute))
    if c is not None and beta != 0.0:
        z = z + beta * c.to(compute)
    if bias is not None:
        z = z + bias.to(compute)
    return activation_ref(activation, z).to(out_dtype or a.dtype)
