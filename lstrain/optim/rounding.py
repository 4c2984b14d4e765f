"""Stochastic rounding to bf16, for optimizers that keep no fp32 copy of what they update.

Without fp32 master weights a bf16 weight is updated in fp32 and rounded back every step.
Rounded to nearest, an update below half a unit in the last place is lost outright: a
weight near 1 has units of 2**-7 (bf16 keeps 8 significant bits), and AdamW's step of
lr = 1e-4 moves it by about 1e-4, so the weight never moves; a second moment decayed by
beta2 = 0.999 stays where it is for the same reason. Rounded stochastically (up with
probability equal to the distance from the value below, in units of the gap) the rounded
value is the exact one on average, and small updates accumulate as they should.

The random bits come from Triton's Philox, keyed on the optimizer's seed and the
parameter's step count (a fresh stream every step, also in a CUDA graph replay, whose
step counts live on the device), with the element's index in its flat buffer as counter:
one call gives 16 bits to each of eight neighbouring elements, as the dropout masks do,
and ``stream`` tells apart what one element rounds (the weight, each moment).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["random_halves", "rounding_key", "round_to_bf16"]


@triton.jit
def rounding_key(seed, step):
    """The Philox key of one parameter's step: ``seed`` (an int below 2**31, an argument
    the kernel does not specialize: a constant has no ``.to``) in the low 32 bits, the step
    count (fp32 or fp64, a whole number) in the high ones."""
    return seed.to(tl.int64) + (step.to(tl.int64) << 32)


@triton.jit
def random_halves(key, first, stream, BLOCK: tl.constexpr):
    """Random 16-bit numbers (uint32 values below 2**16) for the elements ``first +
    arange(BLOCK)`` of a flat buffer (``first`` an int64 multiple of 8): counter (the
    element's index // 8, ``stream``), the eight halves of one call in a fixed order."""
    octet = first // 8 + tl.arange(0, BLOCK // 8).to(tl.int64)
    low = octet.to(tl.uint32)
    high = (octet >> 32).to(tl.uint32)
    stream_counter = low * 0 + stream
    r0, r1, r2, r3 = tl.philox(key, low, high, stream_counter, low * 0)
    words = tl.interleave(tl.interleave(r0, r1), tl.interleave(r2, r3))
    return tl.interleave(words & 0xFFFF, words >> 16)


@triton.jit
def round_to_bf16(x, halves):
    """fp32 ``x`` to bf16, rounded up (away from zero) with probability (|x| - |down|) /
    (|up| - |down|), so that the mean of the result is ``x``: ``halves`` (uint32 below
    2**16) are added to the 16 bits that bf16 drops, then dropped. Values that bf16 holds
    exactly are unchanged; inf stays inf; NaN stays NaN (the add could carry a NaN's bits
    into another number)."""
    bits = x.to(tl.uint32, bitcast=True)
    kept = ((bits + halves) >> 16) << 16
    return tl.where(x == x, kept.to(tl.float32, bitcast=True), x).to(tl.bfloat16)
