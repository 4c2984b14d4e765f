"""The small kernels around cross-entropy: the gradient's rescale by grad_output, a
mean's count of kept rows, and the sum of the per-row losses (one launch each, no host
sync; under torch.compile torch's own ops, which Inductor fuses)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lstrain import _backend
from lstrain._backend import wait_for_producers
from lstrain.ops._lib.layout import cdiv


@triton.jit
def _scale_kernel(
    grad_ptr,
    out_ptr,
    grad_output_ptr,
    elements,
    IN_PLACE: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """out = grad * grad_output; IN_PLACE (out is grad): loops zero times when grad_output == 1."""
    wait_for_producers(PDL)
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
def _count_kept_kernel(
    target_ptr,
    count_ptr,
    rows,
    ignore_index,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """How many targets are not ignore_index, by one program (the counts are small: one
    launch instead of torch's comparison and sum)."""
    wait_for_producers(PDL)
    count = tl.zeros([BLOCK], dtype=tl.int32)
    for first in range(0, rows, BLOCK):
        idx = first + tl.arange(0, BLOCK)
        count += (tl.load(target_ptr + idx, mask=idx < rows, other=ignore_index) != ignore_index).to(tl.int32)
    tl.store(count_ptr, tl.sum(count, axis=0))


@triton.jit
def _reduce_loss_kernel(
    loss_ptr,
    count_ptr,
    out_ptr,
    rows,
    MEAN: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The sum of the per-row losses (over the count for a mean), cast to the output's dtype,
    by one program in a fixed order (one launch instead of a sum, a division and a cast)."""
    wait_for_producers(PDL)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for first in range(0, rows, BLOCK):
        idx = first + tl.arange(0, BLOCK)
        total += tl.load(loss_ptr + idx, mask=idx < rows, other=0.0)
    result = tl.sum(total, axis=0)
    if MEAN:  # no rows kept: 0 / 0 = NaN, as torch
        result = result / tl.load(count_ptr).to(tl.float32)
    tl.store(out_ptr, result.to(out_ptr.dtype.element_ty))


def scale_gradient_(grad: torch.Tensor, grad_output: torch.Tensor) -> None:
    """``grad *= grad_output`` in place (grad contiguous, grad_output a 0-d tensor);
    reads and writes nothing of ``grad`` when grad_output is exactly 1, with no host sync."""
    launch_scale(grad, grad, grad_output)


def launch_scale(grad: torch.Tensor, out: torch.Tensor, grad_output: torch.Tensor) -> None:
    elements = grad.numel()
    if elements == 0:
        return
    sms = _backend.multiprocessor_count(_backend.device_index(grad))
    programs = max(1, min(cdiv(elements, 4096), 4 * sms))
    _scale_kernel[(programs,)](
        grad,
        out,
        grad_output,
        elements,
        IN_PLACE=out is grad,
        BLOCK=4096,
        num_warps=8,
        **_backend.dependent_launch(grad),
    )


def count_kept_rows(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The number of targets that are not ``ignore_index``, as a 0-d integer tensor on their
    device (no host sync); torch's own ops under torch.compile, which fuses them."""
    if torch.compiler.is_compiling():
        return (target != ignore_index).sum()
    flat = target.reshape(-1).contiguous()
    count = torch.empty((), dtype=torch.int32, device=target.device)
    _count_kept_kernel[(1,)](
        flat, count, flat.numel(), ignore_index, BLOCK=4096, num_warps=8, **_backend.dependent_launch(flat)
    )
    return count


def reduce_row_losses(loss: torch.Tensor, count: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The 0-d sum of the fp32 per-row ``loss``, divided by ``count`` (mean) unless it is
    None, in ``dtype``; under torch.compile, torch's own ops, left in fp32 (the caller's
    cast follows)."""
    if torch.compiler.is_compiling():
        total = loss.sum()
        return total / count if count is not None else total
    out = torch.empty((), dtype=dtype, device=loss.device)
    _reduce_loss_kernel[(1,)](
        loss,
        count,
        out,
        loss.numel(),
        MEAN=count is not None,
        BLOCK=4096,
        num_warps=8,
        **_backend.dependent_launch(loss),
    )
    return out
