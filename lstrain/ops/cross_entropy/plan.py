"""Launch plans of the cross-entropy forward and backward: a pure function of the row's
length, element size, work, alignment and the device's shared memory per program."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from lstrain import _backend
from lstrain.ops._lib.layout import cdiv


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
            and take 2048-logit chunks on 8 warps whatever the work: wider chunks then
            spill registers.
        shared_memory: bytes of shared memory per program where the Gluon kernel can run
            (a CUDA device of compute capability 8.0 or more; 0 elsewhere). Aligned rows
            of the ``"loss_and_gradient"`` work that fit then take a resident plan.

    Returns:
        The plan, its chunk no wider than the row needs.

    Raises:
        ValueError: ``work`` is none of the three.

    Resident plans: two rows per SM while two fit, in 8 KB chunks on 8 warps, for rows
    over 8 KB only (12 KB rows break even with the two-sweep kernel, 8 KB rows lose); one
    row per SM beyond, in 16 KB chunks on 16 warps with up to 32 KB more in registers;
    longer rows take the two-sweep kernel.

    Two sweeps want the second read of a row to come from L2, so few rows may be in flight
    (programs resident per SM x SMs x row bytes within L2), each with many bytes in flight;
    registers set the residency (8192-logit chunks on 8 warps: 3 rows per SM; 32768 on 32
    warps: 1). The chunks are sized in bytes (8, 16 or 64 KB), so that fp32 logits keep
    bf16's registers without spilling. One sweep streams, and small chunks keep most rows
    in flight: 4096 / 4 for the loss alone, 2048 / 8 for the backward. The figures behind
    each choice: docs/notes/cross_entropy.md.
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


def resident_shared_memory(x: torch.Tensor) -> int:
    """``cross_entropy_plan``'s ``shared_memory`` for the logits ``x``: 0 where the Gluon
    kernel cannot run (the interpreter runs no Gluon; cp.async needs compute capability 8.0)."""
    if not x.is_cuda:
        return 0
    index = _backend.device_index(x)
    return _backend.shared_memory_per_program(index) if _backend.has_async_copy(index) else 0


def rows_aligned(x: torch.Tensor, grad: torch.Tensor | None) -> bool:
    """Whether rows may be hinted aligned: both tensors start on a 16-byte boundary and
    their rows line up modulo a 16-byte run."""
    run = 16 // x.element_size()
    return x.data_ptr() % 16 == 0 and (
        grad is None or (grad.data_ptr() % 16 == 0 and (x.stride(0) - grad.stride(0)) % run == 0)
    )


def launch_layout(x: torch.Tensor, plan: CrossEntropyPlan, aligned: bool) -> dict:
    """The kernels' layout constexprs: 16-byte runs, and whether rows may be hinted aligned
    (``rows_aligned``, which the launcher also needs for the plan)."""
    run = 16 // x.element_size()
    return {"ALIGNED": aligned, "LANES": max(1, plan.block // run), "RUN": run}
