"""Helpers shared by the ops' launchers: row views of tensors, grid sizes, gradient layouts."""

from __future__ import annotations

import math

import torch

from lstrain import _grad_slots

__all__ = ["as_rows", "cdiv", "contiguous_or_none", "grad_place", "matmul_like", "placeable"]


def as_rows(t: torch.Tensor, cols: int) -> torch.Tensor:
    """2-D ``[rows, cols]`` view of ``t`` whose rows are its trailing ``cols`` elements:
    kernels take any row stride, but need the last dim contiguous, so this copies only
    when it is not. Rows of zero width count the leading elements (``reshape(-1, 0)``
    cannot)."""
    rows = t.reshape(t.numel() // cols if cols else math.prod(t.shape[:-1]), cols)
    return rows if rows.stride(-1) == 1 or cols == 1 else rows.contiguous()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids. Not ``triton.cdiv``: that is a constexpr function
    (usable inside kernels) whose host-side call unwraps its arguments first, a cost paid
    several times per op call."""
    return -(-a // b)


def contiguous_or_none(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` contiguous (None stays None): for parameters and tables that kernels index as
    flat arrays, so a strided view (``buf[::2]``, rows padded in a wider buffer) is copied
    rather than read wrongly; a contiguous tensor is returned as it is."""
    return None if t is None else t.contiguous()


def grad_place(param: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """Where a backward may write the gradient of ``param`` (in ``dtype``, default its own):
    its place in a flat gradient buffer (:mod:`lstrain._grad_slots`), so that the optimizer
    copies nothing, or None (a new tensor; also for no parameter, and under torch.compile).
    Ask only for a gradient the backward returns for ``param`` itself."""
    return None if param is None else _grad_slots.take(param, param.dtype if dtype is None else dtype)


def placeable(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` where :func:`grad_place` could find it a place (a leaf tensor that requires
    grad: a parameter), else None: what a forward saves of a tensor it needs in backward
    only to look that place up, so that a copy (``.contiguous()``, an autocast cast) is
    not kept alive for nothing."""
    return t if t is not None and t.is_leaf and t.requires_grad else None


def matmul_like(a: torch.Tensor, b: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (2-D), the gradient of ``like``, in ``like``'s layout: computed as
    ``(b.t() @ a.t()).t()`` where ``like`` is a transposed view (the ``w.t()`` of a
    ``[N, K]`` weight), as torch's own mm backward does. A weight's gradient then reaches
    ``.grad`` contiguous through the view's backward, and accumulating it there is a
    coalesced add (transposed, torch ran its strided add: 125 us per 5632 x 2048 bf16
    gradient in a LLaMA-0.75B step, H200). Where ``like`` is a parameter over a flat
    gradient buffer whose ``.grad`` is None, the GEMM writes straight into the buffer
    (:mod:`lstrain._grad_slots`)."""
    transposed = like.dim() == 2 and like.stride(0) == 1 and like.stride(1) != 1
    out = _grad_slots.take(like, a.dtype)
    if out is None:
        return (b.t() @ a.t()).t() if transposed else a @ b
    if transposed:
        torch.mm(b.t(), a.t(), out=out.t())
    else:
        torch.mm(a, b, out=out)
    return out
