"""Deterministic column sums of per-program fp32 partials (parameter gradients).

Kernels that reduce over rows (dweight, dbias) write one fp32 row of partial sums per
program; :func:`sum_partials` adds those rows in a fixed order and casts once, so the
result is the same bit for bit on every run, without atomics.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from lstrain import _backend
from lstrain._backend import wait_for_producers
from lstrain.ops._lib.layout import cdiv

__all__ = ["sum_partials"]


@triton.jit
def _column_sum_kernel(
    partial_ptr,
    first_out_ptr,
    second_out_ptr,
    third_out_ptr,
    programs,
    cols,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Sum [outputs, programs, cols] fp32 partials over programs; output 1, 2 or 3 on axis 1.

    Narrow column slices give enough programs to fill the GPU; the loop is pipelined so
    that its few iterations do not wait on each other's loads.
    """
    wait_for_producers(PDL)
    which = tl.program_id(1)
    col = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_ok = col < cols
    base = partial_ptr + which.to(tl.int64) * programs * cols
    acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
    for first in tl.range(0, programs, BLOCK_ROWS, num_stages=2):
        row = first + tl.arange(0, BLOCK_ROWS)
        mask = (row < programs)[:, None] & col_ok[None, :]
        acc += tl.load(base + row[:, None] * cols + col[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    if which == 0:
        tl.store(first_out_ptr + col, total.to(first_out_ptr.dtype.element_ty), mask=col_ok)
    elif which == 1:
        tl.store(second_out_ptr + col, total.to(second_out_ptr.dtype.element_ty), mask=col_ok)
    else:
        tl.store(third_out_ptr + col, total.to(third_out_ptr.dtype.element_ty), mask=col_ok)


def sum_partials(partials: torch.Tensor, outputs: Sequence[torch.Tensor]) -> None:
    """``outputs[i] = partials[i].sum(0)`` for fp32 ``partials`` of shape [len(outputs), programs, cols].

    Each output is a contiguous tensor of ``cols`` elements, of any float dtype (the sum is
    rounded to it once). One to three outputs, in one launch.
    """
    count, programs, cols = partials.shape
    if not 1 <= count <= 3 or len(outputs) != count:
        raise ValueError(f"sum_partials: 1 to 3 outputs, one per partials plane; got {len(outputs)} for {count}")
    _column_sum_kernel[(cdiv(cols, 16), count)](
        partials, outputs[0], outputs[min(1, count - 1)], outputs[-1], programs, cols,
        BLOCK_ROWS=256, BLOCK_COLS=16, num_warps=4,
        **_backend.dependent_launch(partials),
    )  # fmt: skip
