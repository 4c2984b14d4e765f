"""The row math both cross-entropy kernel families share (``triton.jit`` helpers, which
the Gluon kernel calls too): row offsets, the 16-byte runs of a row's body, the running
max and sum of exponentials, the row loss and the gradient q - p."""

from __future__ import annotations

import triton
import triton.language as tl


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

    LOAD_POLICY is the eviction policy of the sweep's loads, chosen by the caller as
    measured fastest (docs/notes/cross_entropy.md): "evict_first" when the statistics
    sweep has just read the row, "evict_last" in the backward's lone sweep.

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
