"""The Triton kernels: the forward reads each row once for its statistics and, for a
reduced loss, sweeps it again backwards from its end to write the gradient (finding in L2
what the first sweep read last); the backward of ``reduction="none"`` recomputes the
gradient from the saved statistics. They serve every device, rows of any length and
alignment, and the interpreter."""

from __future__ import annotations

import triton
import triton.language as tl

from lstrain._backend import wait_for_producers
from lstrain.ops.cross_entropy.row_math import (
    _chunk_stats,
    _exp,
    _loose_columns,
    _row_loss,
    _row_offsets,
    _write_gradient,
    _write_zeros,
)


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
    PDL: tl.constexpr = False,
):
    wait_for_producers(PDL)
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
    PDL: tl.constexpr = False,
):
    """Gradient of the unreduced loss: row i scaled by grad_output[i]."""
    wait_for_producers(PDL)
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
