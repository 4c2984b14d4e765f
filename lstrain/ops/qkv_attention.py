"""Self-attention over one packed QKV projection: flash attention kernels that read q, k and
v where the projection's GEMM wrote them and write their gradients into one packed gradient.

``softmax(q k^T / sqrt(head_dim) [causal]) [dropout] v`` per head, with q, k and v the
column blocks of ``F.linear(x, weight, bias)``, ``[batch, seq, 3 * dim]`` (GPT-2's and
BERT's layout: q's columns, then k's, then v's, each head's ``head_dim`` together). The
output is ``[batch, seq, dim]``, the layout the output projection reads. SDPA on strided
views of the projection costs what this op avoids (GPT-2 medium, H200): a copy of the three
gradients into the packed one (25 us a layer), a separate column sum for the bias gradient
(29 us, which the kernels here make as fp32 partials of their own tiles) and, with
attention dropout, cuDNN's own dropout (96 us of its 423 us a layer).

The kernels follow FlashAttention-2: forward keeps a running max and sum per query row and
stores the log-sum-exp (base 2); backward computes ``delta = rowsum(dO * O)``, then dK and
dV per key block (looping over queries) and dQ per query block (looping over keys), so
that no gradient is accumulated atomically: deterministic. Dropout is lstrain's Philox
mask (:func:`lstrain.ops._lib.dropout.dropout_keep`) of the ``[batch, heads, seq, seq]``
probabilities: ``dropout_mask(seed, (batch, heads, seq, seq), p)`` is the mask the op
applies. Forward draws it and, where it is small next to the projection
(:func:`keeps_mask_bits`), stores it as bits for backward; else each backward kernel
draws it again.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from lstrain import _backend
from lstrain._backend import wait_for_producers
from lstrain.ops._lib.autocast import autocast_inputs
from lstrain.ops._lib.custom_op import kernel_op
from lstrain.ops._lib.dropout import check_seed, dropout_keep, dropout_mask_ref, dropout_scale, new_seed
from lstrain.ops._lib.first_order import differentiated, refuse_create_graph
from lstrain.ops._lib.layout import as_rows, cdiv, grad_place, matmul_like, placeable
from lstrain.ops._lib.linear_checks import check_projection
from lstrain.ops._lib.options import bool_option, check_tensors, float_option, int_option
from lstrain.ops._lib.partial_sums import sum_partials
from lstrain.ops.qkv_projection import check_packed_projection

__all__ = [
    "SUPPORTED_HEAD_DIMS",
    "AttentionPlan",
    "QKVAttentionFunction",
    "attention_plan",
    "keeps_mask_bits",
    "qkv_attention",
    "qkv_attention_bwd",
    "qkv_attention_fwd",
    "qkv_attention_ref",
]

# tl.dot needs tiles of at least 16; 256 would not fit the tiles in shared memory
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
_LOG2E = 1.4426950408889634


@triton.jit
def _load_zero_padded(ptrs, mask, MASKED: tl.constexpr):
    """``tl.load``, with 0 where ``mask`` is off: past the sequence a probability of 0 meets
    these values in a product, where an undefined value could be a NaN."""
    if MASKED:
        value = tl.load(ptrs, mask=mask, other=0.0)
    else:
        value = tl.load(ptrs)
    return value


@triton.jit
def _store_keep(bits_ptr, keep, rows, row_ok, start_n, S, BM: tl.constexpr, BN: tl.constexpr):
    """Store forward's keep mask of a [BM, BN] tile as bits, eight columns a byte, in a
    [rows, ceil(S / 8)] uint8 tensor: backward then reads 1 bit an element instead of
    running Philox again in each of its two kernels."""
    octets = (S + 7) // 8
    octet = start_n // 8 + tl.arange(0, BN // 8)
    byte = tl.sum(tl.reshape(keep.to(tl.int32), (BM, BN // 8, 8)) << tl.arange(0, 8)[None, None, :], axis=2)
    mask = row_ok[:, None] & (octet < octets)[None, :]
    tl.store(bits_ptr + rows[:, None] * octets + octet[None, :], byte.to(tl.uint8), mask=mask)


@triton.jit
def _stored_keep(bits_ptr, rows, row_ok, start_n, S, BM: tl.constexpr, BN: tl.constexpr):
    """The keep mask of a [BM, BN] tile that :func:`_store_keep` stored (False outside it)."""
    octets = (S + 7) // 8
    octet = start_n // 8 + tl.arange(0, BN // 8)
    mask = row_ok[:, None] & (octet < octets)[None, :]
    byte = tl.load(bits_ptr + rows[:, None] * octets + octet[None, :], mask=mask, other=0).to(tl.int32)
    return tl.reshape((byte[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1, (BM, BN)) != 0


@triton.jit
def _fwd_blocks(
    acc, l_i, m_i, q, k_base, v_base, seed_ptr, bits_ptr, rows, offs_m, lo, hi, S, s_seq, qk_scale, p_drop,
    DIAGONAL: tl.constexpr, BOUNDS: tl.constexpr, DROPOUT: tl.constexpr, KEEP_BITS: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, HD: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The online softmax over key blocks [lo, hi) for one query block."""
    offs_d = tl.arange(0, HD)
    for start_n in range(lo, hi, BN):
        offs_n = start_n + tl.arange(0, BN)
        in_seq = offs_n < S
        kT = _load_zero_padded(k_base + offs_n[None, :] * s_seq + offs_d[:, None], in_seq[None, :], BOUNDS)
        s = tl.dot(q, kT, input_precision=PRECISION) * qk_scale
        if DIAGONAL:
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
        if BOUNDS:
            s = tl.where(in_seq[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        # the normaliser sums the probabilities before dropout, as softmax-then-dropout does
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            keep = dropout_keep(seed_ptr, rows, start_n, S, p_drop, BN)
            if KEEP_BITS:
                _store_keep(bits_ptr, keep, rows, offs_m < S, start_n, S, BM, BN)
            p = tl.where(keep, p, 0.0)
        v = _load_zero_padded(v_base + offs_n[:, None] * s_seq + offs_d[None, :], in_seq[:, None], BOUNDS)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attention_fwd_kernel(
    qkv_ptr, o_ptr, lse_ptr, seed_ptr, bits_ptr, H, S, D, qk_scale, p_drop, keep_scale, CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr, KEEP_BITS: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, HD: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_producers(PDL)
    blocks = tl.cdiv(S, BM)
    pid = tl.program_id(0)
    # the longest causal rows first: the last programs to start are then the short ones
    pid_m = blocks - 1 - pid % blocks
    bh = pid // blocks
    b = bh // H
    h = bh % H
    s_seq = 3 * D
    q_base = qkv_ptr + b.to(tl.int64) * S * s_seq + h * HD
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, HD)
    row_ok = offs_m < S
    q = tl.load(q_base + offs_m[:, None] * s_seq + offs_d[None, :], mask=None if EVEN_M else row_ok[:, None])
    rows = bh.to(tl.int64) * S + offs_m
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, HD], tl.float32)
    start_m = pid_m * BM
    if CAUSAL:
        # whole blocks left of the diagonal, then the diagonal's, masked
        acc, l_i, m_i = _fwd_blocks(
            acc, l_i, m_i, q, q_base + D, q_base + 2 * D, seed_ptr, bits_ptr, rows, offs_m, 0, start_m, S, s_seq,
            qk_scale, p_drop, False, False, DROPOUT, KEEP_BITS, BM, BN, HD, PRECISION,
        )  # fmt: skip
        acc, l_i, m_i = _fwd_blocks(
            acc, l_i, m_i, q, q_base + D, q_base + 2 * D, seed_ptr, bits_ptr, rows, offs_m, start_m, start_m + BM,
            S, s_seq, qk_scale, p_drop, True, not (EVEN_M and EVEN_N), DROPOUT, KEEP_BITS, BM, BN, HD, PRECISION,
        )  # fmt: skip
    else:
        whole = (S // BN) * BN
        acc, l_i, m_i = _fwd_blocks(
            acc, l_i, m_i, q, q_base + D, q_base + 2 * D, seed_ptr, bits_ptr, rows, offs_m, 0, whole, S, s_seq,
            qk_scale, p_drop, False, False, DROPOUT, KEEP_BITS, BM, BN, HD, PRECISION,
        )  # fmt: skip
        if not EVEN_N:
            acc, l_i, m_i = _fwd_blocks(
                acc, l_i, m_i, q, q_base + D, q_base + 2 * D, seed_ptr, bits_ptr, rows, offs_m, whole, S, S, s_seq,
                qk_scale, p_drop, False, True, DROPOUT, KEEP_BITS, BM, BN, HD, PRECISION,
            )  # fmt: skip
    out = acc / l_i[:, None]
    if DROPOUT:
        out = out * keep_scale
    o_ptrs = o_ptr + b.to(tl.int64) * S * D + h * HD + offs_m[:, None] * D + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=None if EVEN_M else row_ok[:, None])
    tl.store(lse_ptr + rows, m_i + tl.math.log2(l_i), mask=None if EVEN_M else row_ok)


@triton.jit
def _attention_delta_kernel(
    o_ptr, do_ptr, delta_ptr, H, S, D, BM: tl.constexpr, HD: tl.constexpr, PDL: tl.constexpr = False
):
    """delta = rowsum(dO * O) per head and query row, fp32."""
    wait_for_producers(PDL)
    blocks = tl.cdiv(S, BM)
    pid = tl.program_id(0)
    pid_m = pid % blocks
    bh = pid // blocks
    b = bh // H
    h = bh % H
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, HD)
    row_ok = offs_m < S
    offsets = b.to(tl.int64) * S * D + h * HD + offs_m[:, None] * D + offs_d[None, :]
    o = tl.load(o_ptr + offsets, mask=row_ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(do_ptr + offsets, mask=row_ok[:, None], other=0.0).to(tl.float32)
    tl.store(delta_ptr + bh.to(tl.int64) * S + offs_m, tl.sum(o * do, 1), mask=row_ok)


@triton.jit
def _dkdv_blocks(
    dk, dv, k, v, q_base, do_base, lse_ptr, delta_ptr, seed_ptr, bits_ptr, row0, offs_n, start_n, lo, hi, S, s_seq,
    D, qk_scale, p_drop, keep_scale, DIAGONAL: tl.constexpr, BOUNDS: tl.constexpr, DROPOUT: tl.constexpr,
    KEEP_BITS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, HD: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dK and dV of one key block from the query blocks [lo, hi), transposed: P^T is
    [keys, queries], so that dV += P^T dO and dK += dS^T Q are plain products."""
    offs_d = tl.arange(0, HD)
    for start_m in range(lo, hi, BM):
        offs_m = start_m + tl.arange(0, BM)
        in_seq = offs_m < S
        qT = _load_zero_padded(q_base + offs_m[None, :] * s_seq + offs_d[:, None], in_seq[None, :], BOUNDS)
        # a row past the sequence gets lse = inf: probability 0, no contribution
        if BOUNDS:
            lse = tl.load(lse_ptr + row0 + offs_m, mask=in_seq, other=float("inf"))
        else:
            lse = tl.load(lse_ptr + row0 + offs_m)
        pT = tl.math.exp2(tl.dot(k, qT, input_precision=PRECISION) * qk_scale - lse[None, :])
        if DIAGONAL:
            pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
        do = _load_zero_padded(do_base + offs_m[:, None] * D + offs_d[None, :], in_seq[:, None], BOUNDS)
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        if DROPOUT:
            if KEEP_BITS:
                keepT = tl.trans(_stored_keep(bits_ptr, row0 + offs_m, in_seq, start_n, S, BM, BN))
            else:
                keepT = tl.trans(dropout_keep(seed_ptr, row0 + offs_m, start_n, S, p_drop, BN))
            dv += tl.dot(tl.where(keepT, pT * keep_scale, 0.0).to(do.dtype), do, input_precision=PRECISION)
            dpT = tl.where(keepT, dpT * keep_scale, 0.0)
        else:
            dv += tl.dot(pT.to(do.dtype), do, input_precision=PRECISION)
        delta = _load_zero_padded(delta_ptr + row0 + offs_m, in_seq, BOUNDS)
        dsT = pT * (dpT - delta[None, :])
        dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT), input_precision=PRECISION)
    return dk, dv


@triton.jit
def _attention_dkdv_kernel(
    qkv_ptr, do_ptr, lse_ptr, delta_ptr, dqkv_ptr, partial_ptr, seed_ptr, bits_ptr, B, H, S, D, qk_scale, sm_scale,
    p_drop, keep_scale, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, KEEP_BITS: tl.constexpr,
    BIAS_GRAD: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HD: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_producers(PDL)
    blocks = tl.cdiv(S, BN)
    pid = tl.program_id(0)
    pid_n = pid % blocks  # causal: the first key blocks have the most queries, and start first
    bh = pid // blocks
    b = bh // H
    h = bh % H
    s_seq = 3 * D
    q_base = qkv_ptr + b.to(tl.int64) * S * s_seq + h * HD
    do_base = do_ptr + b.to(tl.int64) * S * D + h * HD
    start_n = pid_n * BN
    offs_n = start_n + tl.arange(0, BN)
    offs_d = tl.arange(0, HD)
    key_ok = offs_n < S
    kv_offsets = offs_n[:, None] * s_seq + offs_d[None, :]
    k = tl.load(q_base + D + kv_offsets, mask=None if EVEN_N else key_ok[:, None])
    v = tl.load(q_base + 2 * D + kv_offsets, mask=None if EVEN_N else key_ok[:, None])
    row0 = bh.to(tl.int64) * S
    dk = tl.zeros([BN, HD], tl.float32)
    dv = tl.zeros([BN, HD], tl.float32)
    whole = (S // BM) * BM
    if CAUSAL:
        # the queries of the diagonal block, masked; then the later ones, whole blocks, then a tail
        dk, dv = _dkdv_blocks(
            dk, dv, k, v, q_base, do_base, lse_ptr, delta_ptr, seed_ptr, bits_ptr, row0, offs_n, start_n, start_n,
            start_n + BN, S, s_seq, D, qk_scale, p_drop, keep_scale, True, not (EVEN_M and EVEN_N), DROPOUT,
            KEEP_BITS, BM, BN, HD, PRECISION,
        )  # fmt: skip
        first = start_n + BN
        tail = tl.maximum(first, whole)
    else:
        first = 0
        tail = whole
    dk, dv = _dkdv_blocks(
        dk, dv, k, v, q_base, do_base, lse_ptr, delta_ptr, seed_ptr, bits_ptr, row0, offs_n, start_n, first, tail,
        S, s_seq, D, qk_scale, p_drop, keep_scale, False, False, DROPOUT, KEEP_BITS, BM, BN, HD, PRECISION,
    )  # fmt: skip
    if not EVEN_M:
        dk, dv = _dkdv_blocks(
            dk, dv, k, v, q_base, do_base, lse_ptr, delta_ptr, seed_ptr, bits_ptr, row0, offs_n, start_n, tail, S,
            S, s_seq, D, qk_scale, p_drop, keep_scale, False, True, DROPOUT, KEEP_BITS, BM, BN, HD, PRECISION,
        )  # fmt: skip
    dk = dk * sm_scale
    g_ptrs = dqkv_ptr + b.to(tl.int64) * S * s_seq + h * HD + kv_offsets
    tl.store(g_ptrs + D, dk.to(dqkv_ptr.dtype.element_ty), mask=None if EVEN_N else key_ok[:, None])
    tl.store(g_ptrs + 2 * D, dv.to(dqkv_ptr.dtype.element_ty), mask=None if EVEN_N else key_ok[:, None])
    if BIAS_GRAD:
        # this block's column sums of dk and dv, before rounding: planes 0 and 1 of [2, B * blocks, D]
        partial = partial_ptr + (b * blocks + pid_n).to(tl.int64) * D + h * HD + offs_d
        tl.store(partial, tl.sum(tl.where(key_ok[:, None], dk, 0.0), 0))
        tl.store(partial + B * blocks * D, tl.sum(tl.where(key_ok[:, None], dv, 0.0), 0))


@triton.jit
def _dq_blocks(
    dq, q, do, lse, delta, k_base, seed_ptr, bits_ptr, rows, offs_m, lo, hi, S, s_seq, D, qk_scale, p_drop,
    keep_scale, DIAGONAL: tl.constexpr, BOUNDS: tl.constexpr, DROPOUT: tl.constexpr, KEEP_BITS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, HD: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dQ of one query block from the key blocks [lo, hi)."""
    offs_d = tl.arange(0, HD)
    for start_n in range(lo, hi, BN):
        offs_n = start_n + tl.arange(0, BN)
        in_seq = offs_n < S
        kT = _load_zero_padded(k_base + offs_n[None, :] * s_seq + offs_d[:, None], in_seq[None, :], BOUNDS)
        vT = _load_zero_padded(k_base + D + offs_n[None, :] * s_seq + offs_d[:, None], in_seq[None, :], BOUNDS)
        p = tl.math.exp2(tl.dot(q, kT, input_precision=PRECISION) * qk_scale - lse[:, None])
        if DIAGONAL:
            p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
        if BOUNDS:
            p = tl.where(in_seq[None, :], p, 0.0)
        dp = tl.dot(do, vT, input_precision=PRECISION)
        if DROPOUT:
            if KEEP_BITS:
                keep = _stored_keep(bits_ptr, rows, offs_m < S, start_n, S, BM, BN)
            else:
                keep = dropout_keep(seed_ptr, rows, start_n, S, p_drop, BN)
            dp = tl.where(keep, dp * keep_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kT.dtype), tl.trans(kT), input_precision=PRECISION)
    return dq


@triton.jit
def _attention_dq_kernel(
    qkv_ptr, do_ptr, lse_ptr, delta_ptr, dqkv_ptr, partial_ptr, seed_ptr, bits_ptr, H, S, D, qk_scale, sm_scale,
    p_drop, keep_scale, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, KEEP_BITS: tl.constexpr,
    BIAS_GRAD: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HD: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_producers(PDL)
    blocks = tl.cdiv(S, BM)
    pid = tl.program_id(0)
    pid_m = blocks - 1 - pid % blocks  # causal: the last query blocks see the most keys
    bh = pid // blocks
    b = bh // H
    h = bh % H
    s_seq = 3 * D
    q_base = qkv_ptr + b.to(tl.int64) * S * s_seq + h * HD
    start_m = pid_m * BM
    offs_m = start_m + tl.arange(0, BM)
    offs_d = tl.arange(0, HD)
    row_ok = offs_m < S
    q = tl.load(q_base + offs_m[:, None] * s_seq + offs_d[None, :], mask=None if EVEN_M else row_ok[:, None])
    do_ptrs = do_ptr + b.to(tl.int64) * S * D + h * HD + offs_m[:, None] * D + offs_d[None, :]
    do = tl.load(do_ptrs, mask=None if EVEN_M else row_ok[:, None])
    rows = bh.to(tl.int64) * S + offs_m
    lse = tl.load(lse_ptr + rows, mask=None if EVEN_M else row_ok)
    delta = tl.load(delta_ptr + rows, mask=None if EVEN_M else row_ok)
    dq = tl.zeros([BM, HD], tl.float32)
    if CAUSAL:
        dq = _dq_blocks(
            dq, q, do, lse, delta, q_base + D, seed_ptr, bits_ptr, rows, offs_m, 0, start_m, S, s_seq, D, qk_scale,
            p_drop, keep_scale, False, False, DROPOUT, KEEP_BITS, BM, BN, HD, PRECISION,
        )  # fmt: skip
        dq = _dq_blocks(
            dq, q, do, lse, delta, q_base + D, seed_ptr, bits_ptr, rows, offs_m, start_m, start_m + BM, S, s_seq,
            D, qk_scale, p_drop, keep_scale, True, not (EVEN_M and EVEN_N), DROPOUT, KEEP_BITS, BM, BN, HD,
            PRECISION,
        )  # fmt: skip
    else:
        whole = (S // BN) * BN
        dq = _dq_blocks(
            dq, q, do, lse, delta, q_base + D, seed_ptr, bits_ptr, rows, offs_m, 0, whole, S, s_seq, D, qk_scale,
            p_drop, keep_scale, False, False, DROPOUT, KEEP_BITS, BM, BN, HD, PRECISION,
        )  # fmt: skip
        if not EVEN_N:
            dq = _dq_blocks(
                dq, q, do, lse, delta, q_base + D, seed_ptr, bits_ptr, rows, offs_m, whole, S, S, s_seq, D,
                qk_scale, p_drop, keep_scale, False, True, DROPOUT, KEEP_BITS, BM, BN, HD, PRECISION,
            )  # fmt: skip
    dq = dq * sm_scale
    g_ptrs = dqkv_ptr + b.to(tl.int64) * S * s_seq + h * HD + offs_m[:, None] * s_seq + offs_d[None, :]
    tl.store(g_ptrs, dq.to(dqkv_ptr.dtype.element_ty), mask=None if EVEN_M else row_ok[:, None])
    if BIAS_GRAD:
        partial = partial_ptr + (b * blocks + pid_m).to(tl.int64) * D + h * HD + offs_d
        tl.store(partial, tl.sum(tl.where(row_ok[:, None], dq, 0.0), 0))


@dataclass(frozen=True)
class AttentionPlan:
    """Tiles of the three kernels: (query rows, key rows, warps, stages) each. Causal
    masking needs the forward's and dQ's key tile to divide their query tile, and dK/dV's
    query tile to divide its key tile."""

    fwd: tuple[int, int, int, int]
    dkdv: tuple[int, int, int, int]
    dq: tuple[int, int, int, int]


@functools.cache
def attention_plan(head_dim: int, dtype: torch.dtype, seq: int) -> AttentionPlan:
    """The tiles for a head width, dtype and sequence length (see :class:`AttentionPlan`).

    Args:
        head_dim: one of :data:`SUPPORTED_HEAD_DIMS`.
        dtype: of q, k and v (fp32 runs IEEE products in smaller tiles).
        seq: the sequence length: tiles are at most half of it rounded up to a power of two
            (at least 16), so that a short sequence still spreads over several programs.

    Returns:
        The plan.
    """
    if dtype == torch.float32:
        plan = AttentionPlan((64, 32, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2))
    elif head_dim <= 64:
        # forward and dQ at 8 warps (4 spilled at sm_90 with dropout); dK / dV at 4 measured
        # faster despite its 140 B of spills (H100: 351 vs 363 us causal, 277 vs 323 bidirectional)
        plan = AttentionPlan((128, 64, 8, 3), (32, 128, 4, 3), (128, 32, 8, 3))
    else:
        plan = AttentionPlan((128, 64, 8, 3), (32, 128, 8, 2), (128, 32, 8, 2))
    cap = max(16, triton.next_power_of_2(seq) // 2)
    return AttentionPlan(*((min(bm, cap), min(bn, cap), w, s) for bm, bn, w, s in (plan.fwd, plan.dkdv, plan.dq)))


def _launch_args(qkv: torch.Tensor, heads: int) -> tuple[int, int, int, int, float, str]:
    batch, seq, width = qkv.shape
    dim = width // 3
    head_dim = dim // heads
    precision = "ieee" if qkv.dtype == torch.float32 else "tf32"  # tf32: unused for 16-bit inputs
    return batch, seq, dim, head_dim, 1.0 / math.sqrt(head_dim), precision


def keeps_mask_bits(qkv: torch.Tensor, heads: int, p: float) -> bool:
    """Whether forward stores its dropout mask as bits for backward (``[batch * heads * seq,
    ceil(seq / 8)]`` bytes) rather than backward drawing it again in both its kernels:
    with dropout, when the bits take no more memory than the projection backward keeps
    anyway (GPT-2 medium at 8 x 1024: 16.8 MB against 50 MB a layer). Longer sequences
    draw again: the bits grow with seq squared."""
    batch, seq, width = qkv.shape
    return p > 0 and batch * heads * seq * cdiv(seq, 8) <= qkv.numel() * qkv.element_size()


def qkv_attention_fwd(
    qkv: torch.Tensor,
    seed: torch.Tensor | None,
    heads: int,
    causal: bool,
    p: float,
    keep_bits: bool,
    plan: AttentionPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on a validated, contiguous packed projection.

    Args:
        qkv: ``[batch, seq, 3 * dim]``.
        seed: the dropout seed (1-element int64 on qkv's device; None when ``p`` is 0).
        heads: attention heads.
        causal: mask keys after each query.
        p: attention dropout probability.
        keep_bits: also store the dropout mask as bits (:func:`keeps_mask_bits`).
        plan: tiles (default :func:`attention_plan`'s; the forward's are used).

    Returns:
        ``(out, lse, bits)``: out ``[batch, seq, dim]`` in qkv's dtype; lse fp32
        ``[batch * heads * seq]``, the base-2 log-sum-exp of each row's scaled scores; bits
        uint8 ``[batch * heads * seq, ceil(seq / 8)]`` (column c of a row is bit c % 8 of
        byte c // 8; blocks a causal row never reaches are left unwritten), or ``[0]``
        without ``keep_bits``.
    """
    batch, seq, dim, head_dim, sm_scale, precision = _launch_args(qkv, heads)
    out = torch.empty((batch, seq, dim), dtype=qkv.dtype, device=qkv.device)
    lse = torch.empty(batch * heads * seq, dtype=torch.float32, device=qkv.device)
    bits_shape = (batch * heads * seq, cdiv(seq, 8)) if keep_bits else (0,)
    bits = torch.empty(bits_shape, dtype=torch.uint8, device=qkv.device)
    if out.numel() == 0:
        return out, lse, bits
    bm, bn, warps, stages = (plan or attention_plan(head_dim, qkv.dtype, seq)).fwd
    _attention_fwd_kernel[(cdiv(seq, bm) * batch * heads,)](
        qkv, out, lse, qkv if seed is None else seed, bits, heads, seq, dim, sm_scale * _LOG2E, p,
        dropout_scale(p), CAUSAL=causal, DROPOUT=p > 0, KEEP_BITS=keep_bits, EVEN_M=seq % bm == 0,
        EVEN_N=seq % bn == 0, BM=bm, BN=bn, HD=head_dim, PRECISION=precision, num_warps=warps, num_stages=stages,
        **_backend.dependent_launch(qkv),
    )  # fmt: skip
    return out, lse, bits


@kernel_op("qkv_attention_fwd", qkv_attention_fwd)
def qkv_attention_fwd_op(
    qkv: torch.Tensor, seed: torch.Tensor | None, heads: int, causal: bool, p: float, keep_bits: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, seq, width = qkv.shape
    bits_shape = (batch * heads * seq, cdiv(seq, 8)) if keep_bits else (0,)
    return (
        qkv.new_empty((batch, seq, width // 3)),
        qkv.new_empty(batch * heads * seq, dtype=torch.float32),
        qkv.new_empty(bits_shape, dtype=torch.uint8),
    )


def qkv_attention_bwd(
    dout: torch.Tensor,
    qkv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    seed: torch.Tensor | None,
    bits: torch.Tensor,
    heads: int,
    causal: bool,
    p: float,
    bias_grad: bool,
    bias_dtype: torch.dtype | None,
    into: Sequence[torch.Tensor | None] = (),
    plan: AttentionPlan | None = None,
) -> list[torch.Tensor]:
    """Launch the backward kernels.

    Args:
        dout: the gradient of ``out``, ``[batch, seq, dim]``.
        qkv, seed, heads, causal, p: as given to :func:`qkv_attention_fwd`.
        out, lse, bits: what it returned (bits ``[0]``: draw the mask again).
        bias_grad: also sum the packed gradient over tokens (the projection's bias gradient).
        bias_dtype: the bias gradient's dtype.
        into: ``into[0]``, when given, is where to write the bias gradient (its place in a
            flat gradient buffer).
        plan: tiles (default :func:`attention_plan`'s; dK / dV's and dQ's are used).

    Returns:
        ``[dqkv]`` (``[batch, seq, 3 * dim]``, contiguous), then the bias gradient
        ``[3 * dim]`` if asked for (fp32 per-tile partials summed in a fixed order).
    """
    batch, seq, dim, head_dim, sm_scale, precision = _launch_args(qkv, heads)
    dqkv = torch.empty_like(qkv)
    grads = [dqkv]
    if bias_grad:
        place = into[0] if into else None
        grads.append(torch.empty(3 * dim, dtype=bias_dtype, device=qkv.device) if place is None else place)
    if dqkv.numel() == 0:
        if bias_grad:
            grads[1].zero_()
        return grads
    dout = dout.contiguous()
    plan = plan or attention_plan(head_dim, qkv.dtype, seq)
    bh = batch * heads
    delta = torch.empty_like(lse)
    delta_rows = min(64, max(16, triton.next_power_of_2(seq)))
    _attention_delta_kernel[(cdiv(seq, delta_rows) * bh,)](
        out, dout, delta, heads, seq, dim, BM=delta_rows, HD=head_dim, num_warps=4, **_backend.dependent_launch(qkv)
    )
    seed = qkv if seed is None else seed
    keep_bits = bits.numel() > 0
    scales = (sm_scale * _LOG2E, sm_scale, p, dropout_scale(p))
    bm, bn, warps, stages = plan.dkdv
    kv_blocks = cdiv(seq, bn)
    partials = functools.partial(torch.empty, dtype=torch.float32, device=qkv.device)
    kv_partials = partials((2, batch * kv_blocks, dim)) if bias_grad else None
    _attention_dkdv_kernel[(kv_blocks * bh,)](
        qkv, dout, lse, delta, dqkv, kv_partials, seed, bits, batch, heads, seq, dim, *scales, CAUSAL=causal,
        DROPOUT=p > 0, KEEP_BITS=keep_bits, BIAS_GRAD=bias_grad, EVEN_M=seq % bm == 0, EVEN_N=seq % bn == 0, BM=bm,
        BN=bn, HD=head_dim, PRECISION=precision, num_warps=warps, num_stages=stages,
        **_backend.dependent_launch(qkv),
    )  # fmt: skip
    bm, bn, warps, stages = plan.dq
    q_partials = partials((1, batch * cdiv(seq, bm), dim)) if bias_grad else None
    _attention_dq_kernel[(cdiv(seq, bm) * bh,)](
        qkv, dout, lse, delta, dqkv, q_partials, seed, bits, heads, seq, dim, *scales, CAUSAL=causal,
        DROPOUT=p > 0, KEEP_BITS=keep_bits, BIAS_GRAD=bias_grad, EVEN_M=seq % bm == 0, EVEN_N=seq % bn == 0, BM=bm,
        BN=bn, HD=head_dim, PRECISION=precision, num_warps=warps, num_stages=stages,
        **_backend.dependent_launch(qkv),
    )  # fmt: skip
    if bias_grad:
        dbias = grads[1]
        sum_partials(q_partials, [dbias[:dim]])
        sum_partials(kv_partials, [dbias[dim : 2 * dim], dbias[2 * dim :]])
    return grads


@kernel_op("qkv_attention_bwd", qkv_attention_bwd)
def qkv_attention_bwd_op(
    dout: torch.Tensor,
    qkv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    seed: torch.Tensor | None,
    bits: torch.Tensor,
    heads: int,
    causal: bool,
    p: float,
    bias_grad: bool,
    bias_dtype: torch.dtype | None,
) -> list[torch.Tensor]:
    grads = [torch.empty_like(qkv)]
    return grads + ([qkv.new_empty(qkv.shape[-1], dtype=bias_dtype)] if bias_grad else [])


class QKVAttentionFunction(torch.autograd.Function):
    """Autograd for :func:`qkv_attention`: saves x and the weight (the projection's
    gradients), the projection, the output and the log-sum-exp (attention's)."""

    @staticmethod
    def forward(ctx, x, weight, bias, heads, causal, p, seed):
        qkv = F.linear(x, weight, bias)
        out, lse, bits = qkv_attention_fwd_op(qkv, seed, heads, causal, p, keeps_mask_bits(qkv, heads, p))
        ctx.save_for_backward(x, weight, placeable(bias), qkv, out, lse, seed, bits)
        ctx.options = (heads, causal, p)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        refuse_create_graph("qkv_attention")
        x, weight, bias, qkv, out, lse, seed, bits = ctx.saved_tensors
        need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
        grads = qkv_attention_bwd_op(
            dout, qkv, out, lse, seed, bits, *ctx.options, need_bias, ctx.bias_dtype,
            into=(grad_place(bias) if need_bias else None,),
        )  # fmt: skip
        dqkv = grads[0].flatten(0, 1)
        dx = (dqkv @ weight).view(x.shape) if need_x else None
        dweight = matmul_like(dqkv.t(), as_rows(x, x.shape[-1]), weight) if need_weight else None
        return dx, dweight, grads[1] if need_bias else None, None, None, None, None


def _check(x, weight, bias, heads) -> int:
    """Validate the inputs; returns head_dim."""
    check_packed_projection("qkv_attention", x, weight, bias, heads)
    head_dim = weight.shape[0] // (3 * heads)
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"qkv_attention: head_dim = dim / heads = {head_dim} is not one of {SUPPORTED_HEAD_DIMS}; "
            "use qkv_projection and scaled_dot_product_attention for it"
        )
    if x.shape[1] * weight.shape[0] >= 2**31:
        raise ValueError(
            f"qkv_attention: seq * 3 * dim = {x.shape[1] * weight.shape[0]} must be below 2**31 "
            "(one sequence's projection is addressed with 32-bit offsets)"
        )
    return head_dim


def qkv_attention(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    heads: int,
    *,
    causal: bool = True,
    dropout_p: float = 0.0,
    seed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Multi-head self-attention of the packed projection ``F.linear(x, weight, bias)``.

    ``out[b, s, h * head_dim : (h + 1) * head_dim] = (dropout(softmax(q k^T / sqrt(
    head_dim))) v)[s]`` for head h, with q, k and v head h's columns of the projection's
    three blocks (see the module's docstring). The projection is cuBLAS's, as ``F.linear``;
    the attention and its backward are flash attention kernels that read it in place and
    write one packed gradient, and sum the bias gradient from their own tiles. Under
    ``torch.autocast`` the inputs are first cast to its dtype.

    Args:
        x: ``[batch, seq, in_features]``.
        weight: ``[3 * dim, in_features]`` (torch's Linear layout): q's rows, then k's,
            then v's, each head's rows together (GPT-2's ``c_attn``, BERT's q / k / v).
        bias: ``[3 * dim]`` or None.
        heads: attention heads; ``head_dim = dim / heads`` must be one of
            :data:`SUPPORTED_HEAD_DIMS`.
        causal: each query attends only to the keys at or before it.
        dropout_p: dropout of the attention probabilities (pass 0 in evaluation).
        seed: the dropout seed, a 1-element int64 tensor on x's device (drawn from torch's
            generator when None); the mask is ``dropout_mask(seed, (batch, heads, seq,
            seq), dropout_p)``.

    Returns:
        ``[batch, seq, dim]`` in x's (autocast) dtype.

    Raises:
        ValueError: x, weight or bias no tensor, shapes that do not fit (named), a head_dim
            outside :data:`SUPPORTED_HEAD_DIMS`, dtypes other than float32 / float16 /
            bfloat16, tensors on several devices, ``heads`` not an integer >= 1, ``causal``
            not a bool, ``dropout_p`` outside [0, 1), or a bad ``seed``.
    """
    check_tensors("qkv_attention", {"x": x, "weight": weight}, {"bias": bias})
    heads = int_option("qkv_attention", "heads", heads, 1)
    causal = bool_option("qkv_attention", "causal", causal)
    _check(x, weight, bias, heads)
    p = float_option("qkv_attention", "dropout_p", dropout_p, 0, 1, high_open=True)
    check_seed("qkv_attention", seed, x.device)
    x, weight, bias = autocast_inputs(x, weight, bias)
    check_projection("qkv_attention", "x", x, weight, bias)
    if p > 0 and seed is None:
        seed = new_seed(x.device)
    backend = _backend.backend_for(x)
    _backend.note("qkv_attention", backend)
    if backend == "reference":
        return qkv_attention_ref(x, weight, bias, heads, causal=causal, dropout_p=p, seed=seed)
    if not differentiated(x, weight, bias):
        qkv = F.linear(x, weight, bias)
        return qkv_attention_fwd_op(qkv, seed if p > 0 else None, heads, causal, p, False)[0]
    return QKVAttentionFunction.apply(x, weight, bias, heads, causal, p, seed if p > 0 else None)


def qkv_attention_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    heads: int,
    *,
    causal: bool = True,
    dropout_p: float = 0.0,
    seed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch in the inputs' dtype, as SDPA's math path computes it (``F.linear``,
    scores, softmax, the dropout mask :func:`lstrain.ops.dropout_mask` draws, computed
    in torch ops, the product with v); autograd's backward.

    Args:
        x, weight, bias, heads, causal, dropout_p, seed: as for :func:`qkv_attention`
            (a seed is drawn when dropout is on and none is given).

    Returns:
        ``[batch, seq, dim]`` in x's dtype.
    """
    batch, seq, _ = x.shape
    dim = weight.shape[0] // 3
    qkv = F.linear(x, weight, bias)
    q, k, v = qkv.view(batch, seq, 3, heads, dim // heads).permute(2, 0, 3, 1, 4).unbind(0)
    scores = (q @ k.transpose(-1, -2)) * (dim // heads) ** -0.5
    if causal:
        later = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(later, float("-inf"))
    probs = scores.softmax(-1)
    if dropout_p > 0:
        seed = new_seed(x.device) if seed is None else seed
        probs = probs * dropout_mask_ref(seed, (batch, heads, seq, seq), dropout_p) * dropout_scale(dropout_p)
    return (probs @ v).transpose(1, 2).reshape(batch, seq, dim)
