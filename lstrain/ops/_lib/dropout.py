"""Dropout masks from Triton's Philox generator: a seed on the device, an element's flat
index as its counter. Kernels regenerate the mask in backward; it is never stored.
Also the pieces the fused bias + dropout ops share: their launch plan and input checks.

The seed is drawn from torch's generator of the tensor's device, so a run is
reproducible under ``torch.manual_seed`` and, on CUDA, every replay of a captured CUDA
graph draws a fresh seed (PyTorch advances the generator's Philox offset per replay).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lstrain import _backend
from lstrain._backend import wait_for_producers
from lstrain.ops._lib.layout import cdiv
from lstrain.ops._lib.options import float_option

__all__ = [
    "ElementwisePlan",
    "apply_dropout",
    "check_dropout_inputs",
    "check_seed",
    "column_walkers",
    "dropout_keep",
    "dropout_mask",
    "dropout_mask_ref",
    "dropout_scale",
    "dropout_seeds",
    "elementwise_plan",
    "new_seed",
]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def dropout_keep(seed_ptr, rows, first_col, cols, p, BLOCK_COLS: tl.constexpr):
    """Keep mask [len(rows), BLOCK_COLS] for columns ``first_col + arange(BLOCK_COLS)`` of
    ``rows`` in a [*, cols] tensor (``first_col`` a multiple of 8, BLOCK_COLS >= 8).

    One Philox call yields four 32-bit numbers, eight 16-bit uniforms, which serve eight
    neighbouring columns: an eighth of the generator work of one call per element, which
    is what keeps a fused dropout memory-bound. Element (r, c) is kept when its 16-bit
    number (counter ``r * ceil(cols / 8) + c // 8``, in a fixed order of the halves) is
    at least round(p * 2**16): P(keep) = 1 - p to within 2**-17.
    """
    threshold = (tl.cast(p, tl.float32) * 65536.0 + 0.5).to(tl.int32)
    octets = (cols + 7) // 8
    octet = first_col // 8 + tl.arange(0, BLOCK_COLS // 8)
    counter = rows.to(tl.int64)[:, None] * octets + octet[None, :]
    r0, r1, r2, r3 = tl.randint4x(tl.load(seed_ptr), counter)
    bits = tl.interleave(tl.interleave(r0, r1), tl.interleave(r2, r3))
    return tl.interleave(bits & 0xFFFF, bits >> 16).to(tl.int32, bitcast=True) >= threshold


@triton.jit
def apply_dropout(v, keep, keep_scale):
    """``v * keep * keep_scale`` in fp32 (``keep_scale`` from :func:`dropout_scale`). A
    product, not a select: a dropped NaN or inf stays NaN, as in torch's
    ``x * mask * scale``, instead of hiding as a zero."""
    return v * tl.where(keep, tl.cast(keep_scale, tl.float32), 0.0)


def dropout_scale(p: float) -> float:
    """The factor kept elements are scaled by, ``1 / (1 - p)``, for a kernel launch.

    Computed here in double and rounded to fp32 once, as torch's dropout does: a kernel's
    own fp32 ``1 / (1 - p)`` from an fp32 ``p`` is off by a few ulp (9.9999976 for p = 0.9),
    which an ill-conditioned consumer (LayerNorm over two columns) turns into large errors.

    Args:
        p: the drop probability, in [0, 1).

    Returns:
        ``1 / (1 - p)`` as a Python float.
    """
    return 1.0 / (1.0 - p)


@triton.jit
def _dropout_mask_kernel(seed_ptr, mask_ptr, cols, p, BLOCK_COLS: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64) + tl.zeros([1], tl.int64)
    first_col = tl.program_id(1) * BLOCK_COLS
    col = first_col + tl.arange(0, BLOCK_COLS)
    keep = dropout_keep(seed_ptr, row, first_col, cols, p, BLOCK_COLS)
    tl.store(mask_ptr + row[:, None] * cols + col[None, :], keep.to(tl.int8), mask=(col < cols)[None, :])


def new_seed(device: torch.device | str) -> torch.Tensor:
    """A fresh seed for the dropout kernels, drawn from torch's generator on ``device``
    (so ``torch.manual_seed`` makes the masks reproducible); no host sync.

    Args:
        device: where the kernels that use it will run.

    Returns:
        A 1-element int64 tensor on ``device``.
    """
    return dropout_seeds(1, device)


def dropout_seeds(count: int, device: torch.device | str) -> torch.Tensor:
    """``count`` fresh dropout seeds in one draw from torch's generator on ``device``, for a
    model whose forward runs many dropout ops: ``seeds[i : i + 1]`` is the ``seed=`` of its
    i-th op. One small kernel per forward instead of one per op (in a CUDA graph of a
    GPT-2 step, 48 launches fewer); every replay of a captured graph draws them afresh.

    Args:
        count: how many seeds (>= 1).
        device: where the kernels that use them will run.

    Returns:
        A ``[count]`` int64 tensor on ``device``, each in [0, 2**31 - 1).

    Raises:
        ValueError: ``count`` not an int >= 1.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"dropout_seeds: count must be an int >= 1, got {count!r}")
    return torch.randint(0, 2**31 - 1, (count,), device=device, dtype=torch.int64)


def check_seed(op: str, seed: object, device: torch.device) -> None:
    """Refuse a ``seed=`` the kernels cannot read: anything but a 1-element int64 tensor
    on the op's device (a Python int is refused too rather than copied to the device,
    which a captured CUDA graph could not do, and which would fix its every replay's mask).

    Raises:
        ValueError: naming ``seed``, what it is and what it must be.
    """
    if seed is None:
        return
    fix = f"pass e.g. torch.tensor([3], dtype=torch.int64, device={str(device)!r}), or None to draw one"
    if not isinstance(seed, torch.Tensor):
        raise ValueError(f"{op}: seed must be a 1-element int64 tensor, got {type(seed).__name__} {seed!r}; {fix}")
    if seed.dtype != torch.int64 or seed.numel() != 1:
        raise ValueError(
            f"{op}: seed must be a 1-element int64 tensor, got {seed.dtype} of shape {tuple(seed.shape)}; {fix}"
        )
    if seed.device != device:
        raise ValueError(f"{op}: seed is on {seed.device} but the op runs on {device}; {fix}")


def dropout_mask(seed: torch.Tensor, shape: tuple[int, ...], p: float) -> torch.Tensor:
    """The keep mask (bool, ``shape``) that lstrain's dropout kernels draw from ``seed``.

    The mask is a function of the seed, the last dim (a row's length) and an element's
    (row, column) in the [*, shape[-1]] view, the same on every backend: the kernel draws
    it on CUDA and in the interpreter, plain PyTorch the same Philox numbers otherwise, so
    that an op's reference path honours a seed, and tests can compare a fused op with plain
    PyTorch under the very same mask.

    Args:
        seed: the 1-element int64 seed tensor the op used (its device runs the kernel).
        shape: the shape of the op's input.
        p: the dropout probability.

    Returns:
        A bool tensor of ``shape``: True where an element is kept.

    Raises:
        ValueError: a ``seed`` that is not a 1-element int64 tensor, a ``shape`` that is not
            a sequence of non-negative ints or is empty (the ops refuse scalars: there is no
            row), or a ``p`` outside [0, 1].
    """
    check_seed("dropout_mask", seed, seed.device if isinstance(seed, torch.Tensor) else torch.device("cpu"))
    if not isinstance(shape, (tuple, list, torch.Size)) or not all(
        isinstance(n, (int, torch.SymInt)) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise ValueError(f"dropout_mask: shape must be a sequence of non-negative ints, got {shape!r}")
    shape = tuple(shape)
    if not shape:
        raise ValueError("dropout_mask: shape must have at least one dim (a row's length), got ()")
    # unchecked, p > 1 kept nothing and NaN or p < 0 kept everything, silently
    p = float_option("dropout_mask", "p", p, 0, 1)
    if _backend.backend_for(seed) == "reference":
        return dropout_mask_ref(seed, shape, p)
    mask = torch.empty(shape, dtype=torch.int8, device=seed.device)
    if mask.numel():
        cols = shape[-1]
        block_cols = elementwise_plan(cols).block_cols
        grid = (mask.numel() // cols, cdiv(cols, block_cols))
        _dropout_mask_kernel[grid](seed, mask, cols, p, BLOCK_COLS=block_cols, **_backend.dependent_launch(seed))
    return mask.bool()


_LOW32 = 0xFFFFFFFF


def _mul_wide(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of ``a * b`` for 32-bit ``a`` and ``b`` (int64 tensor),
    from 16-bit pieces of ``a`` so that no int64 product overflows."""
    upper, lower = (a >> 16) * b, (a & 0xFFFF) * b  # a * b = upper * 2**16 + lower
    low = (((upper & 0xFFFF) << 16) + lower) & _LOW32
    high = (upper + (lower >> 16)) >> 16
    return high, low


def dropout_mask_ref(seed: torch.Tensor, shape: tuple[int, ...], p: float) -> torch.Tensor:
    """:func:`dropout_mask`'s mask in plain PyTorch: Triton's Philox4x32-10
    (``tl.randint4x``) in int64 arithmetic on 32-bit values, the eight 16-bit numbers of a
    call in the kernel's order, the same threshold. A reference's way to the mask (an
    implementation independent of the kernels, and fast where the interpreter is slow).

    Args:
        seed, shape, p: as for :func:`dropout_mask` (validated there).

    Returns:
        A bool tensor of ``shape``: True where an element is kept.
    """
    mask = torch.empty(shape, dtype=torch.bool, device=seed.device)
    if mask.numel() == 0:
        return mask
    cols = shape[-1]
    rows, octets = mask.numel() // cols, cdiv(cols, 8)
    counter = torch.arange(rows * octets, dtype=torch.int64, device=seed.device)
    c0, c1 = counter & _LOW32, counter >> 32
    c2 = c3 = torch.zeros_like(counter)
    key = seed.reshape(1)
    k0, k1 = key & _LOW32, (key >> 32) & _LOW32
    for _ in range(10):
        high_b, low_b = _mul_wide(0xCD9E8D57, c2)
        high_a, low_a = _mul_wide(0xD2511F53, c0)
        c0, c1, c2, c3 = high_b ^ c1 ^ k0, low_b, high_a ^ c3 ^ k1, low_a
        k0, k1 = (k0 + 0x9E3779B9) & _LOW32, (k1 + 0xBB67AE85) & _LOW32
    words = torch.stack((c0, c2, c1, c3), dim=-1)  # the kernel's interleave order
    halves = torch.stack((words & 0xFFFF, words >> 16), dim=-1).reshape(rows, octets * 8)[:, :cols]
    threshold = int(torch.tensor(p, dtype=torch.float32) * 65536.0 + 0.5)  # fp32, as the kernel
    return (halves >= threshold).reshape(shape)


@dataclass(frozen=True)
class ElementwisePlan:
    """Tiles of ``block_rows`` x ``block_cols``; backward runs ``programs_per_sm`` column
    walkers per SM over rows, its loop pipelined ``num_stages`` deep."""

    block_rows: int
    block_cols: int
    num_warps: int
    programs_per_sm: int = 4
    num_stages: int = 3


@functools.cache
def elementwise_plan(cols: int) -> ElementwisePlan:
    """Launch settings for rows of ``cols`` elements (a pure function): 4096-element
    tiles, 4 warps (32 values per thread), at most 1024 columns wide."""
    block_cols = max(8, min(1024, triton.next_power_of_2(cols)))  # dropout_keep's minimum
    return ElementwisePlan(max(1, 4096 // block_cols), block_cols, num_warps=4)


def column_walkers(
    rows: int, cols: int, plan: ElementwisePlan, on: torch.Tensor, bias_grad: bool
) -> tuple[tuple[int, int], torch.Tensor | None]:
    """The column-walking backward's grid and its bias-gradient partials.

    Args:
        rows, cols: the [rows, cols] view the kernel walks.
        plan: its tiles.
        on: a tensor on the device it runs on.
        bias_grad: whether it writes per-walker column sums of the gradient.

    Returns:
        ``((column blocks, walkers per column block), partials)``: about
        ``programs_per_sm`` walkers per SM in all, at least one per column block, never more
        than there are row tiles; partials fp32 [1, walkers, cols] for
        :func:`lstrain.ops._lib.partial_sums.sum_partials`, or None without ``bias_grad``.
    """
    col_blocks = cdiv(cols, plan.block_cols)
    sms = _backend.multiprocessor_count(_backend.device_index(on))
    walkers = max(1, min(cdiv(rows, plan.block_rows), sms * plan.programs_per_sm // col_blocks))
    partials = torch.empty((1, walkers, cols), dtype=torch.float32, device=on.device) if bias_grad else None
    return (col_blocks, walkers), partials


def check_dropout_inputs(op: str, x: torch.Tensor, bias: torch.Tensor | None, p: object) -> float:
    """Checks shared by the bias + dropout ops; returns the dropout probability as a float."""
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least one dim, got a scalar")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{op}: x has dtype {x.dtype}; expected float32, float16 or bfloat16")
    if bias is not None:
        if tuple(bias.shape) != (x.shape[-1],):
            raise ValueError(f"{op}: bias has shape {tuple(bias.shape)}, expected ({x.shape[-1]},)")
        if bias.device != x.device:
            raise ValueError(f"{op}: bias is on {bias.device} but x is on {x.device}")
        if bias.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{op}: bias has dtype {bias.dtype}; expected float32, float16 or bfloat16")
    return float_option(op, "dropout", p, 0, 1, high_open=True)
