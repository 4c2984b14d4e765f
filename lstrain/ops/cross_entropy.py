"""Label-smoothed cross-entropy with optional z-loss, loss and gradient in one pass.

Target distribution p = (1 - a) * onehot(target) + a / V (a = label_smoothing), so

    loss_i = lse_i - (1 - a) * x_i[t_i] - (a / V) * sum_j x_ij  (+ z_loss * lse_i^2)
    dloss_i / dx_ij = softmax_ij * (1 + 2 * z_loss * lse_i) - p_ij

One program per row reads the row once for the statistics (max and sum-exp per run of
16 bytes, plus the sum of logits for smoothing) and, when the loss is reduced (mean or
sum), writes the gradient (q - p) * scale in a second sweep over the same row. On a CUDA
device (compute capability 8.0 or more) a row that fits is held in shared memory (and a
little in registers) by a Gluon kernel, so that each logit comes from DRAM once; longer
rows, unaligned ones and the interpreter (which runs no Gluon) take a Triton kernel whose
second sweep runs backwards from the row's end, so that it finds in L2 what the first
sweep read last. Rows are swept as a
16-byte-aligned body of whole runs plus a few loose elements at either end, so that every
load and store of the body is 16 bytes wide whatever V is. Backward then only
has to multiply by grad_output, and skips even that (touching no memory) when grad_output
is exactly 1, without a host sync. (For any other grad_output the gradient is rounded
twice, before and after the rescale: within the tolerance rule, but up to 1.5 ulp instead
of 0.5.) With ``reduction="none"`` the gradient depends on a per-row grad_output, so backward
recomputes it from the logits and the saved row max and sum of exponentials.

Rows whose target is ``ignore_index`` give zero loss and zero gradient and are not read
(padding costs only its gradient's zeros; unlike torch, a NaN in such a row leaves its
gradient zero rather than NaN). A target outside
[0, V) never causes a read outside the row: its loss and gradient are NaN (and, for CPU
tensors or with ``check_targets=True``, a ValueError names it first). Around the kernel, a
mean's count of kept rows and the reduction of the per-row losses take one single-program
launch each (in eager mode; torch.compile fuses torch's own ops instead).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from lstrain import _backend
from lstrain.ops._lib.first_order import graph_freed_after_backward, refuse_create_graph
from lstrain.ops._lib.layout import as_rows, cdiv

__all__ = [
    "CrossEntropyFunction",
    "CrossEntropyPlan",
    "cross_entropy",
    "cross_entropy_bwd",
    "cross_entropy_fwd",
    "cross_entropy_plan",
    "cross_entropy_ref",
    "rescale_gradient",
    "scale_gradient_",
]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Gluon's names for an asynchronous copy into shared memory and a program-wide barrier
# changed after Triton 3.6 (async_copy_global_to_shared -> async_load, thread_barrier ->
# barrier); the kernel takes whichever this Triton has.
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
_REDUCTIONS = ("mean", "sum", "none")


@triton.jit
def _row_offsets(
    row, row_stride, grad_row_stride, vocab, LANES: tl.constexpr, RUN: tl.constexpr, ALIGNED: tl.constexpr
):
    """Where a row's logits (and gradient) lie, as a 16-byte-aligned body of [LANES, RUN]
    chunks and up to 2 * RUN - 2 loose ends.

    Returns ``(start, grad_start, head, lanes, body, grad_body)``: the row's first element
    in the logits and in the gradient; ``head`` loose elements before the body (so that the
    body starts on a 16-byte boundary: rows of an odd length, such as V = 50257, start
    anywhere); ``lanes`` whole runs in the body; ``body`` and ``grad_body`` the [LANES, RUN]
    offsets of the body's first chunk, hinted as aligned so that every run is one 16-byte
    load or store. Without ALIGNED (a tensor that does not start on a 16-byte boundary,
    or a gradient whose rows do not line up with the logits') there is no head and no hint.
    """
    offs = tl.arange(0, LANES)[:, None] * RUN + tl.arange(0, RUN)[None, :]
    start = row * row_stride
    grad_start = row * grad_row_stride
    if ALIGNED:
        head = tl.minimum((RUN - start % RUN) % RUN, vocab)
        body = tl.multiple_of(start + head + offs, [1, RUN])
        grad_body = tl.multiple_of(grad_start + head + offs, [1, RUN])
    else:
        head = start * 0
        body = start + offs
        grad_body = grad_start + offs
    return start, grad_start, head, (vocab - head) // RUN, body, grad_body


@triton.jit
def _loose_columns(head, lanes, vocab, RUN: tl.constexpr):
    """Columns of the elements outside the body (the head, then the tail after the last
    whole run) and their mask, as one [2 * RUN] vector."""
    e = tl.arange(0, 2 * RUN)
    col = tl.where(e < head, e, head + lanes * RUN + e - head)
    return col, col < vocab


@triton.jit
def _exp(x):
    """exp(x) as exp2(x log2 e): tl.math.exp2 compiles to ex2.approx.ftz, one instruction,
    where tl.exp's ex2.approx without ftz takes three more per logit to keep results below
    2**-126 (which become 0 here: far below any gradient's tolerance)."""
    return tl.math.exp2(x * 1.4426950408889634)


@triton.jit
def _chunk_stats(x, run_max, run_sum):
    """A [LANES, RUN] chunk into each run's max and sum of exp(x - max): the max first,
    then one exponential per logit. Runs start at max = -FLT_MAX, not -inf, so that -inf
    logits (or masked ones) give exp(-inf) = 0 without a special case; a NaN logit makes
    the sum NaN, hence the loss."""
    new_max = tl.maximum(run_max, tl.max(x, axis=1))
    run_sum = run_sum * _exp(run_max - new_max) + tl.sum(_exp(x - new_max[:, None]), axis=1)
    return new_max, run_sum


@triton.jit
def _gradient(x, row_max, e_scale, uniform):
    """(q - p) * scale off the target column: exp(x - max) * (scale / sum_exp) - (a / V) * scale."""
    return _exp(x.to(tl.float32) - row_max) * e_scale - uniform


@triton.jit
def _row_loss(
    log_sum_exp, row_max, x_target, total, vocab, smoothing, z_loss, bad, HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
):  # fmt: skip
    """lse - sum_j p_j x_j (+ z lse^2) from a row's statistics, ``total`` its sum of logits
    (used only with smoothing); NaN for a bad target. Written around the row max so that
    no large lse cancels."""
    loss = log_sum_exp + (1.0 - smoothing) * (row_max - x_target)
    if HAS_SMOOTHING:
        loss += smoothing * (row_max - total / vocab)
    if HAS_Z_LOSS:
        loss += z_loss * (row_max + log_sum_exp) * (row_max + log_sum_exp)
    return tl.where(bad, float("nan"), loss)


@triton.jit
def _gradient_factors(row_max, sum_exp, scale, smoothing, z_loss, vocab, HAS_Z_LOSS: tl.constexpr):
    """``(1 / sum_exp, z', e_scale, uniform)`` for :func:`_gradient` and
    :func:`_target_gradient`: z' = 2 z lse, e_scale = (1 + z') scale / sum_exp, uniform =
    (a / V) scale."""
    inverse_sum = 1.0 / sum_exp
    z_factor = 0.0
    if HAS_Z_LOSS:
        z_factor = 2.0 * z_loss * (row_max + tl.log(sum_exp))
    return inverse_sum, z_factor, inverse_sum * (1.0 + z_factor) * scale, smoothing / vocab * scale


@triton.jit
def _target_gradient(x_target, row_max, sum_exp, inverse_sum, z_factor, smoothing, vocab, scale):
    """q (1 + z') - p at the target column, as (q - 1) + a (1 - 1 / V) + q z' with q - 1 =
    (e - sum_exp) / sum_exp: where q is near 1 (a confident row, or V = 1) q (1 + z') and p
    nearly cancel."""
    e_target = _exp(x_target.to(tl.float32) - row_max)
    g_target = (e_target - sum_exp) * inverse_sum + smoothing * (1.0 - 1.0 / vocab) + e_target * inverse_sum * z_factor
    return g_target * scale


@triton.jit
def _write_gradient(
    x_ptr,
    grad_ptr,
    start,
    grad_start,
    head,
    lanes,
    body,
    grad_body,
    vocab,
    target,
    row_max,
    sum_exp,
    scale,
    smoothing,
    z_loss,
    HAS_Z_LOSS: tl.constexpr,
    LANES: tl.constexpr,
    RUN: tl.constexpr,
    LOAD_POLICY: tl.constexpr,
):
    """grad = (softmax * (1 + 2 z lse) - p) * scale over one row (scale is NaN for a bad
    target, which poisons the row).

    LOAD_POLICY is the eviction policy of the sweep's loads, chosen by the caller from
    timings on the H200 (bf16, ninth session of 2026-11-30, run 2; other policies of loads
    and stores tried beside them): "evict_first" when the statistics sweep has just read
    the row (955 us at 16384 x 50257 against 1023-1052 otherwise; 1230 against 1290-1398
    at 8192 x 128256), "evict_last" in the backward's lone sweep (853 against 944 us with
    "evict_first" and 872 with none; 1020 against 1071 at 128256, 501 against 530 at
    16384 x 32000).

    softmax = exp(x - max) / sum_exp: x - max is exact where it matters, whereas
    exp(x - lse) would carry lse's rounding (an ulp of a large logsumexp) into every q.
    """
    CHUNK: tl.constexpr = LANES * RUN
    inverse_sum, z_factor, e_scale, uniform = _gradient_factors(
        row_max, sum_exp, scale, smoothing, z_loss, vocab, HAS_Z_LOSS
    )
    # The target column is written last, over the sweep's value (read now: the sweep may
    # overwrite the logits in place), so that the sweep needs no per-logit compare.
    has_target = (target >= 0) & (target < vocab)
    x_target = tl.load(x_ptr + start + target, mask=has_target, other=0.0)
    col, ok = _loose_columns(head, lanes, vocab, RUN)
    x_loose = tl.load(x_ptr + start + col, mask=ok, other=0.0)
    g_loose = _gradient(x_loose, row_max, e_scale, uniform)
    tl.store(grad_ptr + grad_start + col, g_loose.to(grad_ptr.dtype.element_ty), mask=ok)
    # Backwards through the body, last chunk first: the chunks the statistics sweep read
    # last are the likeliest to be still in L2. Only the partial chunk is masked (per run,
    # so its loads stay 16 bytes wide); each whole chunk is loaded one iteration ahead.
    # Nothing here is written again: stores may leave L2 first.
    full = lanes // LANES
    rem = lanes - full * LANES
    if rem > 0:
        in_row = (tl.arange(0, LANES) < rem)[:, None]
        x_rem = tl.load(x_ptr + body + full * CHUNK, mask=in_row, other=0.0, eviction_policy=LOAD_POLICY)
        g_rem = _gradient(x_rem, row_max, e_scale, uniform)
        tl.store(
            grad_ptr + grad_body + full * CHUNK, g_rem.to(grad_ptr.dtype.element_ty), mask=in_row,
            eviction_policy="evict_first",
        )  # fmt: skip
    if full > 0:
        x = tl.load(x_ptr + body + (full - 1) * CHUNK, eviction_policy=LOAD_POLICY)
        for k in range(1, full):
            first = (full - k) * CHUNK
            x_next = tl.load(x_ptr + body + first - CHUNK, eviction_policy=LOAD_POLICY)
            g = _gradient(x, row_max, e_scale, uniform)
            tl.store(grad_ptr + grad_body + first, g.to(grad_ptr.dtype.element_ty), eviction_policy="evict_first")
            x = x_next
        g = _gradient(x, row_max, e_scale, uniform)
        tl.store(grad_ptr + grad_body, g.to(grad_ptr.dtype.element_ty), eviction_policy="evict_first")
    # The barrier orders every thread's sweep stores before this one to the same address.
    tl.debug_barrier()
    g_target = _target_gradient(x_target, row_max, sum_exp, inverse_sum, z_factor, smoothing, vocab, scale)
    tl.store(grad_ptr + grad_start + target, g_target.to(grad_ptr.dtype.element_ty), mask=has_target)


@triton.jit
def _write_zeros(grad_ptr, grad_start, head, lanes, grad_body, vocab, LANES: tl.constexpr, RUN: tl.constexpr):
    """A zero gradient row (an ignored target's), in the chunks ``_write_gradient`` writes."""
    CHUNK: tl.constexpr = LANES * RUN
    col, ok = _loose_columns(head, lanes, vocab, RUN)
    tl.store(grad_ptr + grad_start + col, tl.zeros([2 * RUN], dtype=grad_ptr.dtype.element_ty), mask=ok)
    zeros = tl.zeros([LANES, RUN], dtype=grad_ptr.dtype.element_ty)
    full = lanes // LANES
    for c in range(0, full):
        tl.store(grad_ptr + grad_body + c * CHUNK, zeros, eviction_policy="evict_first")
    in_row = (tl.arange(0, LANES) < lanes - full * LANES)[:, None]
    tl.store(grad_ptr + grad_body + full * CHUNK, zeros, mask=in_row, eviction_policy="evict_first")


@triton.jit(do_not_specialize=["rows", "ignore_index"])
def _cross_entropy_fwd_kernel(
    logits_ptr,
    target_ptr,
    loss_ptr,
    stats_ptr,
    grad_ptr,
    count_ptr,
    rows,
    vocab,
    logits_row_stride,
    grad_row_stride,
    ignore_index,
    smoothing,
    z_loss,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    MEAN: tl.constexpr,
    ALIGNED: tl.constexpr,
    LANES: tl.constexpr,
    RUN: tl.constexpr,
):
    CHUNK: tl.constexpr = LANES * RUN
    row = tl.program_id(0).to(tl.int64)
    smoothing = tl.cast(smoothing, tl.float32)
    z_loss = tl.cast(z_loss, tl.float32)
    target = tl.load(target_ptr + row).to(tl.int64)
    ignored = target == ignore_index
    bad = ((target < 0) | (target >= vocab)) & ~ignored
    start, grad_start, head, lanes, body, grad_body = _row_offsets(
        row, logits_row_stride, grad_row_stride, vocab, LANES, RUN, ALIGNED
    )
    if ignored:  # padding, often: its row is not even read, its gradient is zero
        tl.store(loss_ptr + row, 0.0)
        tl.store(stats_ptr + row, 0.0)
        tl.store(stats_ptr + rows + row, 1.0)
        if WRITE_GRAD:
            _write_zeros(grad_ptr, grad_start, head, lanes, grad_body, vocab, LANES, RUN)
    else:
        # Statistics per run of RUN logits: no cross-thread reduction until the row is done.
        run_max = tl.full([LANES], -3.4028234663852886e38, tl.float32)
        run_sum = tl.zeros([LANES], dtype=tl.float32)
        run_total = tl.zeros([LANES], dtype=tl.float32)
        full = lanes // LANES
        if full > 0:  # whole chunks unmasked, each loaded one iteration ahead of its use
            x = tl.load(logits_ptr + body)
            for c in range(1, full):
                x_next = tl.load(logits_ptr + body + c * CHUNK)
                run_max, run_sum = _chunk_stats(x.to(tl.float32), run_max, run_sum)
                if HAS_SMOOTHING:
                    run_total += tl.sum(x.to(tl.float32), axis=1)
                x = x_next
            run_max, run_sum = _chunk_stats(x.to(tl.float32), run_max, run_sum)
            if HAS_SMOOTHING:
                run_total += tl.sum(x.to(tl.float32), axis=1)
        rem = lanes - full * LANES
        if rem > 0:
            in_row = (tl.arange(0, LANES) < rem)[:, None]
            x_rem = tl.load(logits_ptr + body + full * CHUNK, mask=in_row, other=-float("inf")).to(tl.float32)
            run_max, run_sum = _chunk_stats(x_rem, run_max, run_sum)
            if HAS_SMOOTHING:
                run_total += tl.sum(tl.where(in_row, x_rem, 0.0), axis=1)
        col, ok = _loose_columns(head, lanes, vocab, RUN)
        x_loose = tl.load(logits_ptr + start + col, mask=ok, other=-float("inf")).to(tl.float32)
        row_max = tl.maximum(tl.max(run_max, axis=0), tl.max(x_loose, axis=0))
        sum_exp = tl.sum(run_sum * _exp(run_max - row_max), axis=0) + tl.sum(_exp(x_loose - row_max), axis=0)
        log_sum_exp = tl.log(sum_exp)
        x_target = tl.load(logits_ptr + start + target, mask=~bad, other=0.0).to(tl.float32)
        total = tl.sum(run_total, axis=0) + tl.sum(tl.where(ok, x_loose, 0.0), axis=0)
        loss = _row_loss(
            log_sum_exp, row_max, x_target, total, vocab, smoothing, z_loss, bad, HAS_SMOOTHING, HAS_Z_LOSS
        )
        tl.store(loss_ptr + row, loss)
        tl.store(stats_ptr + row, row_max)
        tl.store(stats_ptr + rows + row, sum_exp)
        if WRITE_GRAD:
            scale = 1.0
            if MEAN:
                scale = 1.0 / tl.maximum(tl.load(count_ptr).to(tl.float32), 1.0)
            scale = tl.where(bad, float("nan"), scale)
            _write_gradient(
                logits_ptr, grad_ptr, start, grad_start, head, lanes, body, grad_body, vocab, target, row_max, sum_exp,
                scale, smoothing, z_loss, HAS_Z_LOSS, LANES, RUN, "evict_first",
            )  # fmt: skip


@gluon.jit(do_not_specialize=["rows", "ignore_index"])
def _cross_entropy_resident_kernel(
    logits_ptr,
    target_ptr,
    loss_ptr,
    stats_ptr,
    grad_ptr,
    count_ptr,
    rows,
    vocab,
    logits_row_stride,
    grad_row_stride,
    ignore_index,
    smoothing,
    z_loss,
    HAS_SMOOTHING: gl.constexpr,
    HAS_Z_LOSS: gl.constexpr,
    MEAN: gl.constexpr,
    LANES: gl.constexpr,
    RUN: gl.constexpr,
    RESIDENT: gl.constexpr,
    HELD: gl.constexpr,
    NUM_WARPS: gl.constexpr,
):
    """``_cross_entropy_fwd_kernel`` with the gradient, each row read from DRAM once: the
    row's body is copied into shared memory (RESIDENT chunks of LANES runs of 16 bytes, all
    copies issued at once, so that the whole row is in flight) and, past them, HELD runs
    are held in registers; the gradient sweep reads the row from there instead of L2. The
    launcher checks that the row fits and that the rows are 16-byte aligned."""
    BODY: gl.constexpr = gl.BlockedLayout([1, RUN], [32, 1], [NUM_WARPS, 1], [1, 0])
    LANE: gl.constexpr = gl.SliceLayout(1, BODY)
    LOOSE: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    CHUNK: gl.constexpr = LANES * RUN
    row = gl.program_id(0).to(gl.int64)
    smoothing = smoothing.to(gl.float32)
    z_loss = z_loss.to(gl.float32)
    target = gl.load(target_ptr + row).to(gl.int64)
    ignored = target == ignore_index
    bad = ((target < 0) | (target >= vocab)) & ~ignored
    # The layout of _row_offsets and _loose_columns: an aligned body of whole runs, loose ends.
    start = row * logits_row_stride
    grad_start = row * grad_row_stride
    head = gl.minimum((RUN - start % RUN) % RUN, vocab)
    lanes = (vocab - head) // RUN
    lane = gl.arange(0, LANES, layout=LANE)
    offs = gl.expand_dims(lane, 1) * RUN + gl.expand_dims(gl.arange(0, RUN, layout=gl.SliceLayout(0, BODY)), 0)
    body = gl.multiple_of(start + head + offs, [1, RUN])
    grad_body = gl.multiple_of(grad_start + head + offs, [1, RUN])
    e = gl.arange(0, 2 * RUN, layout=LOOSE)
    col = gl.where(e < head, e, head + lanes * RUN + e - head)
    ok = col < vocab
    grad_dtype: gl.constexpr = grad_ptr.dtype.element_ty
    if ignored:
        gl.store(loss_ptr + row, 0.0)
        gl.store(stats_ptr + row, 0.0)
        gl.store(stats_ptr + rows + row, 1.0)
        gl.store(grad_ptr + grad_start + col, gl.zeros([2 * RUN], grad_dtype, LOOSE), mask=ok)
        zeros = gl.zeros([LANES, RUN], grad_dtype, BODY)
        for z in range(0, gl.cdiv(lanes, LANES)):
            z_in_row = gl.expand_dims(lane + z * LANES < lanes, 1)
            gl.store(grad_ptr + grad_body + z * CHUNK, zeros, mask=z_in_row, eviction_policy="evict_first")
    else:
        held_max = -3.4028234663852886e38
        held_sum = 0.0
        held_total = 0.0
        if HELD > 0:  # loaded first, so that the statistics can start on it while the copies land
            held_lane = gl.arange(0, HELD, layout=LANE)
            held_in_row = gl.expand_dims(held_lane + RESIDENT * LANES < lanes, 1)
            held_offs = gl.expand_dims(held_lane, 1) * RUN + gl.expand_dims(
                gl.arange(0, RUN, layout=gl.SliceLayout(0, BODY)), 0
            )
            held_body = gl.multiple_of(start + head + RESIDENT * CHUNK + held_offs, [1, RUN])
            held = gl.load(logits_ptr + held_body, mask=held_in_row, other=-float("inf"))
        resident = gl.allocate_shared_memory(
            logits_ptr.dtype.element_ty, [RESIDENT, LANES, RUN], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        )
        for c in gl.static_range(RESIDENT):  # one copy group per chunk
            in_row = gl.expand_dims(lane + c * LANES < lanes, 1)
            _async_load(resident.index(c), logits_ptr + body + c * CHUNK, mask=in_row)
            async_copy.commit_group()
        if HELD > 0:
            x_held = held.to(gl.float32)
            held_max = gl.maximum(gl.max(gl.max(x_held, axis=1), axis=0), held_max)
            held_sum = gl.sum(gl.sum(_exp(x_held - held_max), axis=1), axis=0)
            if HAS_SMOOTHING:
                held_total = gl.sum(gl.sum(gl.where(held_in_row, x_held, 0.0), axis=1), axis=0)
        run_max = gl.full([LANES], -3.4028234663852886e38, gl.float32, LANE)
        run_sum = gl.zeros([LANES], gl.float32, LANE)
        run_total = gl.zeros([LANES], gl.float32, LANE)
        for c in gl.static_range(RESIDENT):
            async_copy.wait_group(RESIDENT - 1 - c)  # chunk c has landed
            in_row = gl.expand_dims(lane + c * LANES < lanes, 1)
            x = gl.where(in_row, resident.index(c).load(BODY).to(gl.float32), -float("inf"))
            run_max, run_sum = _chunk_stats(x, run_max, run_sum)
            if HAS_SMOOTHING:
                run_total += gl.sum(gl.where(in_row, x, 0.0), axis=1)
        x_loose = gl.load(logits_ptr + start + col, mask=ok, other=-float("inf")).to(gl.float32)
        row_max = gl.maximum(gl.maximum(gl.max(run_max, axis=0), gl.max(x_loose, axis=0)), held_max)
        sum_exp = (
            gl.sum(run_sum * _exp(run_max - row_max), axis=0)
            + gl.sum(_exp(x_loose - row_max), axis=0)
            + held_sum * _exp(held_max - row_max)
        )
        log_sum_exp = gl.log(sum_exp)
        x_target = gl.load(logits_ptr + start + target, mask=~bad, other=0.0).to(gl.float32)
        total = gl.sum(run_total, axis=0) + gl.sum(gl.where(ok, x_loose, 0.0), axis=0) + held_total
        loss = _row_loss(
            log_sum_exp, row_max, x_target, total, vocab, smoothing, z_loss, bad, HAS_SMOOTHING, HAS_Z_LOSS
        )
        gl.store(loss_ptr + row, loss)
        gl.store(stats_ptr + row, row_max)
        gl.store(stats_ptr + rows + row, sum_exp)
        # The gradient as _write_gradient writes it (see there for the target column's order).
        scale = 1.0
        if MEAN:
            scale = 1.0 / gl.maximum(gl.load(count_ptr).to(gl.float32), 1.0)
        scale = gl.where(bad, float("nan"), scale)
        inverse_sum, z_factor, e_scale, uniform = _gradient_factors(
            row_max, sum_exp, scale, smoothing, z_loss, vocab, HAS_Z_LOSS
        )
        g_loose = _gradient(x_loose, row_max, e_scale, uniform)
        gl.store(grad_ptr + grad_start + col, g_loose.to(grad_dtype), mask=ok)
        if HELD > 0:
            g_held = _gradient(x_held, row_max, e_scale, uniform)
            gl.store(
                grad_ptr + (grad_start - start) + held_body, g_held.to(grad_dtype), mask=held_in_row,
                eviction_policy="evict_first",
            )  # fmt: skip
        for c in gl.static_range(RESIDENT):
            in_row = gl.expand_dims(lane + c * LANES < lanes, 1)
            g = _gradient(resident.index(c).load(BODY), row_max, e_scale, uniform)
            gl.store(grad_ptr + grad_body + c * CHUNK, g.to(grad_dtype), mask=in_row, eviction_policy="evict_first")
        _barrier()
        g_target = _target_gradient(x_target, row_max, sum_exp, inverse_sum, z_factor, smoothing, vocab, scale)
        gl.store(grad_ptr + grad_start + target, g_target.to(grad_dtype), mask=(target >= 0) & (target < vocab))


@triton.jit(do_not_specialize=["rows", "ignore_index"])
def _cross_entropy_bwd_kernel(
    logits_ptr,
    target_ptr,
    stats_ptr,
    grad_output_ptr,
    grad_ptr,
    rows,
    vocab,
    logits_row_stride,
    grad_row_stride,
    ignore_index,
    smoothing,
    z_loss,
    HAS_Z_LOSS: tl.constexpr,
    ALIGNED: tl.constexpr,
    LANES: tl.constexpr,
    RUN: tl.constexpr,
):
    """Gradient of the unreduced loss: row i scaled by grad_output[i]."""
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(target_ptr + row).to(tl.int64)
    ignored = target == ignore_index
    bad = ((target < 0) | (target >= vocab)) & ~ignored
    start, grad_start, head, lanes, body, grad_body = _row_offsets(
        row, logits_row_stride, grad_row_stride, vocab, LANES, RUN, ALIGNED
    )
    if ignored:
        _write_zeros(grad_ptr, grad_start, head, lanes, grad_body, vocab, LANES, RUN)
    else:
        scale = tl.where(bad, float("nan"), tl.load(grad_output_ptr + row).to(tl.float32))
        _write_gradient(
            logits_ptr, grad_ptr, start, grad_start, head, lanes, body, grad_body, vocab, target,
            tl.load(stats_ptr + row), tl.load(stats_ptr + rows + row), scale, tl.cast(smoothing, tl.float32),
            tl.cast(z_loss, tl.float32), HAS_Z_LOSS, LANES, RUN, "evict_last",
        )  # fmt: skip


@triton.jit
def _scale_kernel(grad_ptr, out_ptr, grad_output_ptr, elements, IN_PLACE: tl.constexpr, BLOCK: tl.constexpr):
    """out = grad * grad_output; IN_PLACE (out is grad): loops zero times when grad_output == 1."""
    factor = tl.load(grad_output_ptr).to(tl.float32)
    end = tl.cast(elements, tl.int64)
    if IN_PLACE:
        end = tl.where(factor == 1.0, 0, end)
    offsets = tl.arange(0, BLOCK)
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    for start in range(tl.program_id(0).to(tl.int64) * BLOCK, end, step):
        idx = start + offsets
        ok = idx < elements
        g = tl.load(grad_ptr + idx, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + idx, (g * factor).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["ignore_index"])
def _count_kept_kernel(target_ptr, count_ptr, rows, ignore_index, BLOCK: tl.constexpr):
    """How many targets are not ignore_index, by one program (the counts are small: one
    launch instead of torch's comparison and sum)."""
    count = tl.zeros([BLOCK], dtype=tl.int32)
    for first in range(0, rows, BLOCK):
        idx = first + tl.arange(0, BLOCK)
        count += (tl.load(target_ptr + idx, mask=idx < rows, other=ignore_index) != ignore_index).to(tl.int32)
    tl.store(count_ptr, tl.sum(count, axis=0))


@triton.jit
def _reduce_loss_kernel(loss_ptr, count_ptr, out_ptr, rows, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    """The sum of the per-row losses (over the count for a mean), cast to the output's dtype,
    by one program in a fixed order (one launch instead of a sum, a division and a cast)."""
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for first in range(0, rows, BLOCK):
        idx = first + tl.arange(0, BLOCK)
        total += tl.load(loss_ptr + idx, mask=idx < rows, other=0.0)
    result = tl.sum(total, axis=0)
    if MEAN:  # no rows kept: 0 / 0 = NaN, as torch
        result = result / tl.load(count_ptr).to(tl.float32)
    tl.store(out_ptr, result.to(out_ptr.dtype.element_ty))


@dataclass(frozen=True)
class CrossEntropyPlan:
    """Launch settings: one program per row, sweeping it in chunks of ``block`` logits
    (``block // RUN`` runs of 16 bytes). With ``resident`` > 0 the forward's gradient comes
    from the Gluon kernel, which holds ``resident`` chunks of the row in shared memory and
    ``held`` more logits in registers."""

    block: int
    num_warps: int
    resident: int = 0
    held: int = 0


# Shared memory a resident program leaves unused: Triton's 1 KiB reserve per program and
# the kernel's reduction scratch.
_SHARED_MEMORY_SLACK = 2048


@functools.cache
def cross_entropy_plan(
    vocab: int, element_size: int = 2, work: str = "loss_and_gradient", aligned: bool = True, shared_memory: int = 0
) -> CrossEntropyPlan:
    """Launch settings for rows of ``vocab`` logits of ``element_size`` bytes (a pure function).

    Args:
        vocab: logits per row.
        element_size: bytes per logit (2 for bf16 / fp16, 4 for fp32).
        work: ``"loss_and_gradient"`` (the forward also writes the gradient, reading each
            row twice: statistics, then gradient), ``"loss"`` (the forward alone) or
            ``"gradient"`` (the ``reduction="none"`` backward: one read, one write).
        aligned: whether the rows are 16-byte aligned (logits and gradient start on 16-byte
            boundaries and their rows line up). Unaligned rows lose their 16-byte accesses
            and take 2048-logit chunks on 8 warps whatever the work: wider chunks then cost
            registers (ptxas, Triton 3.6, fp16: 99 registers at 2048 / 8; 8192 / 8 255 and
            spills; 32768 / 32 spills 8 KB per thread).
        shared_memory: bytes of shared memory per program where the Gluon kernel can run
            (a CUDA device of compute capability 8.0 or more; 0 elsewhere). Aligned rows
            of the ``"loss_and_gradient"`` work that fit then take a resident plan.

    Returns:
        The plan, its chunk no wider than the row needs.

    Raises:
        ValueError: ``work`` is none of the three.

    Resident plans (H200, bf16, smoothing 0.1, kernel alone; eighteenth session of
    2026-12-01, runs 1-4): two rows per SM while two fit, in 8 KB chunks on 8 warps: 856 us
    at 16384 x 50257 against 956-965 for the two-sweep kernel below, 508 against 548 at
    16384 x 32000 (4 warps: 1051 and 560), 550 against 580 at 65536 x 8192, 812 against
    1072 at 65536 x 12288; rows of 12 KB break even (508-510 against 511-512 us at 65536 x
    6144) and of 8 KB lose (364 against 342 at 65536 x 4096), hence rows over 8 KB. One row
    per SM beyond, in 16 KB chunks on 16 warps with up to 32 KB more in registers: 1112 us
    at 8192 x 128256 against 1238 (14 chunks and 32 KB held; 12 chunks and 64 KB held 1189,
    on 32 warps 1321; all in shared memory but the last 50 KB, streamed and re-read, 1686),
    903 against 1112 at 8234 x 100000, 796 against 927 at 14359 x 57344 (but 965-1025
    against 957-960 at 12564 x 65536, any row stride, and 993-1000 against 990-994 at
    65528: a tie, where two rows per SM with 32 KB held lost 1048-1083); fp32 1041-1689
    against 1242-1880 us (V = 8192-50257). Longer rows take the two-sweep kernel (5419 x
    151936: 996 us).

    Two sweeps want the second read of a row to come from L2, so few rows may be in flight
    (programs resident per SM x 132 SMs x row bytes within L2's 50 MB), each with many bytes
    in flight. Registers set the residency: 8192-logit chunks on 8 warps take 80 registers,
    3 rows per SM; 32768 on 32 warps, 1 row per SM. The chunks are sized in bytes (8, 16 or
    64 KB), so that fp32 logits keep those registers: 32768 fp32 logits on 32 warps would
    spill 520 B per thread (ptxas, Triton 3.6), 16384 spill none. On the H200 (bf16, smoothing, kernel
    alone; seventh session of 2026-11-30, run 3): 0.99 ms at 16384 x 50257 and 0.55 at
    16384 x 32000 with 8192 / 8 (1.21 and 0.68 with 2048 / 8, 8 rows per SM; 1.30 and 0.85
    with 1 row per SM), 1.27 ms at 8192 x 128256, 1.52 at 8192 x 151936 and 1.36 at 4096 x
    256000 with 32768 / 32 (8192 / 8: 1.43, 1.69, 1.52), 0.29 ms at 32768 x 8192 with
    4096 / 4 (2048 / 8: 0.32; 8192 / 8: 0.38). One sweep streams, and small chunks keep
    most rows in flight: the loss alone with 4096 / 4 was the fastest plan tried, or within
    1.3% of it, at every one of those sizes (0.39 ms at 16384 x 50257, 0.16 at 32768 x 8192
    against 0.18 with 2048 / 8); the backward with 2048 / 8 within 4% of the best.
    """
    if work not in ("loss_and_gradient", "loss", "gradient"):
        raise ValueError(f"work must be 'loss_and_gradient', 'loss' or 'gradient', got {work!r}")
    row_bytes = vocab * element_size
    if work == "loss_and_gradient" and aligned and shared_memory > 0 and row_bytes > 8192:
        runs = cdiv(row_bytes, 16)  # whole 16-byte runs a row's body can hold, at most
        if cdiv(runs, 512) * 8192 <= shared_memory // 2 - _SHARED_MEMORY_SLACK:
            return CrossEntropyPlan(8192 // element_size, 8, resident=cdiv(runs, 512))
        most = (shared_memory - _SHARED_MEMORY_SLACK) // 16384
        if runs <= most * 1024:
            return CrossEntropyPlan(16384 // element_size, 16, resident=cdiv(runs, 1024))
        if runs <= most * 1024 + 2048:
            resident = cdiv(runs - 2048, 1024)
            return CrossEntropyPlan(16384 // element_size, 16, resident=resident, held=32768 // element_size)
    if work == "gradient" or not aligned:
        block, warps = 2048, 8
    elif work == "loss":
        block, warps = 4096, 4
    else:  # sized in bytes: fp32 chunks hold half the logits, and so keep bf16's registers
        chunk_bytes, warps = (8192, 4) if row_bytes <= 16384 else (16384, 8) if row_bytes <= 131072 else (65536, 32)
        block = chunk_bytes // element_size
    block = min(block, triton.next_power_of_2(vocab))
    return CrossEntropyPlan(block, num_warps=max(1, min(warps, block // 256)))


def _resident_shared_memory(x: torch.Tensor) -> int:
    """``cross_entropy_plan``'s ``shared_memory`` for the logits ``x``: 0 where the Gluon
    kernel cannot run (the interpreter runs no Gluon; cp.async needs compute capability 8.0)."""
    if not x.is_cuda:
        return 0
    index = _backend.device_index(x)
    return _backend.shared_memory_per_program(index) if _backend.has_async_copy(index) else 0


def _rows_aligned(x: torch.Tensor, grad: torch.Tensor | None) -> bool:
    """Whether rows may be hinted aligned: both tensors start on a 16-byte boundary and
    their rows line up modulo a 16-byte run."""
    run = 16 // x.element_size()
    return x.data_ptr() % 16 == 0 and (
        grad is None or (grad.data_ptr() % 16 == 0 and (x.stride(0) - grad.stride(0)) % run == 0)
    )


def _launch_layout(x: torch.Tensor, plan: CrossEntropyPlan, aligned: bool) -> dict:
    """The kernels' layout constexprs: 16-byte runs, and whether rows may be hinted aligned
    (``_rows_aligned``, which the launcher also needs for the plan)."""
    run = 16 // x.element_size()
    return {"ALIGNED": aligned, "LANES": max(1, plan.block // run), "RUN": run}


def cross_entropy_fwd(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    z_loss: float,
    grad_scale: str | None,
    grad_out: torch.Tensor | None = None,
    valid_rows: torch.Tensor | None = None,
    plan: CrossEntropyPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on validated inputs.

    Args:
        grad_scale: ``"mean"`` or ``"sum"`` to also write the gradient of that reduction
            of the loss (for grad_output = 1) into ``grad_out``, or None for no gradient.
        grad_out: [rows, V] in the logits' dtype (may be the logits themselves).
        valid_rows: for "mean", the 0-d device tensor counting the non-ignored rows the
            mean divides by (possibly over more rows than these, e.g. chunks of a batch).
        plan: launch settings; by default ``cross_entropy_plan``'s for these rows and this
            device (a resident plan, the Gluon kernel, needs a CUDA device, a gradient to
            write and 16-byte-aligned rows that fit it).

    Returns:
        ``(loss, stats)``: the fp32 per-row loss [rows], and fp32 [2, rows] holding each
        row's max and its sum of exp(x - max).
    """
    x = as_rows(logits, logits.shape[-1])
    rows, vocab = x.shape
    flat_target = target.reshape(-1).contiguous()  # the kernel reads targets at unit stride
    loss = torch.empty(rows, dtype=torch.float32, device=x.device)
    stats = torch.empty((2, rows), dtype=torch.float32, device=x.device)
    if rows == 0:
        return loss, stats
    write_grad = grad_scale is not None
    aligned = _rows_aligned(x, grad_out if write_grad else None)
    if plan is None:
        work = "loss_and_gradient" if write_grad else "loss"
        shared_memory = _resident_shared_memory(x) if write_grad else 0
        plan = cross_entropy_plan(vocab, x.element_size(), work, aligned, shared_memory)
    if plan.resident:
        run = 16 // x.element_size()
        _cross_entropy_resident_kernel[(rows,)](
            x, flat_target, loss, stats, grad_out, valid_rows,
            rows, vocab, x.stride(0), grad_out.stride(0), ignore_index, label_smoothing, z_loss,
            HAS_SMOOTHING=label_smoothing > 0,
            HAS_Z_LOSS=z_loss > 0,
            MEAN=grad_scale == "mean",
            LANES=plan.block // run,
            RUN=run,
            RESIDENT=plan.resident,
            HELD=plan.held // run,
            NUM_WARPS=plan.num_warps,
            num_warps=plan.num_warps,
        )  # fmt: skip
        return loss, stats
    _cross_entropy_fwd_kernel[(rows,)](
        x, flat_target, loss, stats, grad_out if write_grad else None, valid_rows,
        rows, vocab, x.stride(0), grad_out.stride(0) if write_grad else 0,
        ignore_index, label_smoothing, z_loss,
        HAS_SMOOTHING=label_smoothing > 0,
        HAS_Z_LOSS=z_loss > 0,
        WRITE_GRAD=write_grad,
        MEAN=grad_scale == "mean",
        **_launch_layout(x, plan, aligned),
        num_warps=plan.num_warps,
    )  # fmt: skip
    return loss, stats


def cross_entropy_bwd(
    grad_output: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    stats: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    z_loss: float,
    plan: CrossEntropyPlan | None = None,
) -> torch.Tensor:
    """Gradient of the unreduced loss (``reduction="none"``): a new [*, V] tensor."""
    x = as_rows(logits, logits.shape[-1])
    rows, vocab = x.shape
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if rows == 0:
        return grad
    aligned = _rows_aligned(x, grad)
    plan = plan or cross_entropy_plan(vocab, x.element_size(), "gradient", aligned)
    grad_output = grad_output.reshape(-1).contiguous()
    _cross_entropy_bwd_kernel[(rows,)](
        x, target.reshape(-1).contiguous(), stats, grad_output, grad,
        rows, vocab, x.stride(0), vocab, ignore_index, label_smoothing, z_loss,
        HAS_Z_LOSS=z_loss > 0,
        **_launch_layout(x, plan, aligned),
        num_warps=plan.num_warps,
    )  # fmt: skip
    return grad


def scale_gradient_(grad: torch.Tensor, grad_output: torch.Tensor) -> None:
    """``grad *= grad_output`` in place (grad contiguous, grad_output a 0-d tensor);
    reads and writes nothing of ``grad`` when grad_output is exactly 1, with no host sync."""
    _launch_scale(grad, grad, grad_output)


def _launch_scale(grad: torch.Tensor, out: torch.Tensor, grad_output: torch.Tensor) -> None:
    elements = grad.numel()
    if elements == 0:
        return
    sms = _backend.multiprocessor_count(_backend.device_index(grad))
    programs = max(1, min(cdiv(elements, 4096), 4 * sms))
    _scale_kernel[(programs,)](grad, out, grad_output, elements, IN_PLACE=out is grad, BLOCK=4096, num_warps=8)


def count_kept_rows(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The number of targets that are not ``ignore_index``, as a 0-d integer tensor on their
    device (no host sync); torch's own ops under torch.compile, which fuses them."""
    if torch.compiler.is_compiling():
        return (target != ignore_index).sum()
    flat = target.reshape(-1).contiguous()
    count = torch.empty((), dtype=torch.int32, device=target.device)
    _count_kept_kernel[(1,)](flat, count, flat.numel(), ignore_index, BLOCK=4096, num_warps=8)
    return count


def reduce_row_losses(loss: torch.Tensor, count: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The 0-d sum of the fp32 per-row ``loss``, divided by ``count`` (mean) unless it is
    None, in ``dtype``; under torch.compile, torch's own ops, left in fp32 (the caller's
    cast follows)."""
    if torch.compiler.is_compiling():
        total = loss.sum()
        return total / count if count is not None else total
    out = torch.empty((), dtype=dtype, device=loss.device)
    _reduce_loss_kernel[(1,)](loss, count, out, loss.numel(), MEAN=count is not None, BLOCK=4096, num_warps=8)
    return out


@torch.library.custom_op("lstrain::cross_entropy_fwd", mutates_args=())
def _cross_entropy_fwd_op(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    z_loss: float,
    grad_scale: str | None,
    valid_rows: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shape = logits.shape if grad_scale is not None else (0,)
    grad = torch.empty(shape, dtype=logits.dtype, device=logits.device)
    grad_rows = grad.view(-1, logits.shape[-1]) if grad_scale is not None else None
    loss, stats = cross_entropy_fwd(
        logits, target, label_smoothing, ignore_index, z_loss, grad_scale, grad_rows, valid_rows
    )
    return loss, stats, grad


@_cross_entropy_fwd_op.register_fake
def _(logits, target, label_smoothing, ignore_index, z_loss, grad_scale, valid_rows):
    rows = target.numel()
    loss = logits.new_empty(rows, dtype=torch.float32)
    stats = logits.new_empty((2, rows), dtype=torch.float32)
    return loss, stats, logits.new_empty(logits.shape if grad_scale is not None else (0,))


@torch.library.custom_op("lstrain::cross_entropy_bwd", mutates_args=())
def _cross_entropy_bwd_op(
    grad_output: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    stats: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    z_loss: float,
) -> torch.Tensor:
    return cross_entropy_bwd(grad_output, logits, target, stats, label_smoothing, ignore_index, z_loss)


@_cross_entropy_bwd_op.register_fake
def _(grad_output, logits, target, stats, label_smoothing, ignore_index, z_loss):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.custom_op("lstrain::scale_gradient_", mutates_args=("grad",))
def _scale_gradient_op(grad: torch.Tensor, grad_output: torch.Tensor) -> None:
    scale_gradient_(grad, grad_output)


@_scale_gradient_op.register_fake
def _(grad, grad_output):
    return None


def loss_and_gradient(logits, target, options, grad_scale, valid_rows, grad_out):
    """Per-row loss, stats and (for mean/sum) the gradient: written into ``grad_out`` in
    eager mode, a fresh tensor from the custom op under torch.compile."""
    if torch.compiler.is_compiling():
        return _cross_entropy_fwd_op(logits, target, *options, grad_scale, valid_rows)
    grad_rows = None if grad_out is None else grad_out.view(-1, logits.shape[-1])
    loss, stats = cross_entropy_fwd(logits, target, *options, grad_scale, grad_rows, valid_rows)
    return loss, stats, grad_out


def rescale_gradient(grad: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """``grad * grad_output`` in a backward whose forward computed ``grad``: in place where
    the graph goes with this backward (through the custom op under torch.compile), into a
    new buffer, rounded the same way, where it is kept for another backward, which must
    find ``grad`` as forward left it."""
    if torch.compiler.is_compiling():
        _scale_gradient_op(grad, grad_output)
    elif graph_freed_after_backward():
        scale_gradient_(grad, grad_output)
    else:
        out = torch.empty_like(grad)
        _launch_scale(grad, out, grad_output)
        return out
    return grad


def recompute_gradient(grad_output, logits, target, stats, options) -> torch.Tensor:
    """:func:`cross_entropy_bwd`, through the custom op under torch.compile."""
    bwd = _cross_entropy_bwd_op if torch.compiler.is_compiling() else cross_entropy_bwd
    return bwd(grad_output, logits, target, stats, *options)


class CrossEntropyFunction(torch.autograd.Function):
    """Autograd for :func:`cross_entropy`.

    For mean/sum the gradient is computed in forward (into a new buffer, or into the
    logits' own storage with ``inplace_backward``) and backward only rescales it: in place,
    or into a new buffer where the graph is retained for another backward.
    """

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, ignore_index, z_loss, reduction, inplace_backward):
        options = (label_smoothing, ignore_index, z_loss)
        needs_grad = ctx.needs_input_grad[0]
        grad_scale = reduction if needs_grad and reduction != "none" else None
        # only a mean needs the count: one launch fewer per call otherwise
        valid_rows = count_kept_rows(target, ignore_index) if reduction == "mean" else None
        grad_out = None
        if grad_scale is not None and not torch.compiler.is_compiling():
            in_place = inplace_backward and logits.is_contiguous()
            grad_out = logits.detach() if in_place else torch.empty_like(logits, memory_format=torch.contiguous_format)
        loss, stats, grad = loss_and_gradient(logits, target, options, grad_scale, valid_rows, grad_out)
        ctx.reduction = reduction
        ctx.options = options
        if grad_scale is not None:
            ctx.save_for_backward(grad)
        elif needs_grad:
            ctx.save_for_backward(logits, target, stats)
        if reduction == "none":
            return loss.view(target.shape)
        return reduce_row_losses(loss, valid_rows, logits.dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_create_graph("cross_entropy")
        if ctx.reduction == "none":
            logits, target, stats = ctx.saved_tensors
            return recompute_gradient(grad_loss, logits, target, stats, ctx.options), None, None, None, None, None, None
        (grad,) = ctx.saved_tensors
        return rescale_gradient(grad, grad_loss), None, None, None, None, None, None


def _validate(logits, target, label_smoothing, ignore_index, reduction, z_loss) -> None:
    if logits.dim() not in (2, 3):
        raise ValueError(
            f"cross_entropy: logits must be 2-D [tokens, V] or 3-D [batch, seq, V], got {tuple(logits.shape)}"
        )
    if logits.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"cross_entropy: logits has dtype {logits.dtype}; expected float32, float16 or bfloat16")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"cross_entropy: target has shape {tuple(target.shape)}, expected logits' leading shape "
            f"{tuple(logits.shape[:-1])}"
        )
    if target.device != logits.device:
        raise ValueError(f"cross_entropy: target is on {target.device} but logits is on {logits.device}")
    if logits.shape[-1] == 0:
        raise ValueError("cross_entropy: logits has no classes (V = 0)")
    check_loss_options("cross_entropy", target, label_smoothing, reduction, z_loss)


def check_loss_options(op: str, target: torch.Tensor, label_smoothing: float, reduction: str, z_loss: float) -> None:
    """The checks shared by the cross-entropy ops: target dtype and the loss options."""
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{op}: target must be int64 or int32 class indices, got {target.dtype}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= z_loss < float("inf"):
        raise ValueError(f"{op}: z_loss must be a finite number >= 0, got {z_loss}")


def check_target_range(target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bad.any():
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"cross_entropy: target {int(target[index])} at {index} is outside [0, {vocab}) "
            f"and is not ignore_index ({ignore_index})"
        )


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    z_loss: float = 0.0,
    inplace_backward: bool = False,
    check_targets: bool | None = None,
) -> torch.Tensor:
    """Cross-entropy with label smoothing and z-loss; the gradient comes from the same pass.

    Same semantics as ``torch.nn.functional.cross_entropy(logits, target,
    ignore_index=..., label_smoothing=..., reduction=...)`` (no class weights), plus an
    optional z-loss ``z_loss * logsumexp(logits)^2`` per row (PaLM). Statistics in fp32.

    Args:
        logits: ``[tokens, V]`` or ``[batch, seq, V]``, float32/float16/bfloat16; only the
            last dim needs to be contiguous. Any V (rows are swept in chunks).
        target: class indices, int64 or int32, shaped like ``logits[..., 0]``.
        label_smoothing: a in [0, 1]; the target distribution is (1 - a) onehot + a / V.
        ignore_index: rows with this target give zero loss and zero gradient (they are
            not read: a NaN there does not reach the gradient, as it would in torch);
            "mean" divides by the number of other rows (NaN if there are none, as torch).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (per-row loss shaped like target).
        z_loss: coefficient of the z-loss term (0 disables it).
        inplace_backward: write the gradient into the logits' storage (saves a
            [tokens, V] buffer; the logits are overwritten, so nothing else may need
            them). Applies to mean/sum in eager mode with contiguous logits.
        check_targets: raise ValueError for a target outside [0, V) that is not
            ignore_index. Default: on for CPU tensors, off for CUDA, where the check
            would synchronise with the host; never inside torch.compile. Unchecked bad
            targets give NaN loss and gradient for their rows (never a read outside the row).

    Returns:
        The loss in the logits' dtype: a 0-d tensor for mean/sum, else shaped like target.

    Raises:
        ValueError: logits not 2-D/3-D or not a float type, target of the wrong shape,
            dtype or device, label_smoothing outside [0, 1], an unknown reduction, a
            negative z_loss, V = 0, or (when checked) a target out of range.
    """
    _validate(logits, target, label_smoothing, ignore_index, reduction, z_loss)
    check = check_targets if check_targets is not None else not logits.is_cuda
    if check and not torch.compiler.is_compiling():
        check_target_range(target, logits.shape[-1], ignore_index)
    backend = _backend.backend_for(logits)
    _backend.note("cross_entropy", backend)
    if backend == "reference":
        return cross_entropy_ref(
            logits,
            target,
            label_smoothing=label_smoothing,
            ignore_index=ignore_index,
            reduction=reduction,
            z_loss=z_loss,
        )
    if not torch.is_grad_enabled():  # nothing will be differentiated: no gradient in forward
        logits = logits.detach()
    loss = CrossEntropyFunction.apply(
        logits, target, float(label_smoothing), int(ignore_index), float(z_loss), reduction, inplace_backward
    )
    return loss.to(logits.dtype)  # a reduced loss is in that dtype already, outside torch.compile


def cross_entropy_ref(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    z_loss: float = 0.0,
) -> torch.Tensor:
    """PyTorch's own cross-entropy (computed in fp32 for low-precision logits, as its
    kernels do), plus the z-loss term.

    Args:
        logits, target, label_smoothing, ignore_index, reduction, z_loss: as for
            :func:`cross_entropy`.

    Returns:
        The loss in the logits' dtype: 0-d for mean/sum, else shaped like target.
    """
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.reshape(-1, logits.shape[-1]).to(compute)
    t = target.reshape(-1).long()
    loss = torch.nn.functional.cross_entropy(
        x, t, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none"
    )
    if z_loss > 0:
        loss = loss + torch.where(t == ignore_index, 0.0, z_loss * torch.logsumexp(x, dim=-1).square())
    if reduction == "none":
        return loss.view(target.shape).to(logits.dtype)
    total = loss.sum()
    return (total / (t != ignore_index).sum() if reduction == "mean" else total).to(logits.dtype)
