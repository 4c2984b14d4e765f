"""The Gluon kernel that holds each row in shared memory (and up to 32 KB of it in
registers), so that the forward's gradient sweep reads no logit from DRAM twice: every
16-byte run of the row's body is copied with cp.async, all copies issued at once, and the
statistics consume the chunks as they land. Gluon, Triton's lower-level language, is the
only way to place a row in shared memory; the interpreter does not run it."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from lstrain.ops.cross_entropy.row_math import (
    _chunk_stats,
    _exp,
    _gradient,
    _gradient_factors,
    _row_loss,
    _target_gradient,
)

# Gluon's names for an asynchronous copy into shared memory and a program-wide barrier
# changed after Triton 3.6 (async_copy_global_to_shared -> async_load, thread_barrier ->
# barrier); the kernel takes whichever this Triton has.
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


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
