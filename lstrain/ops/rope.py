"""Rotary position embedding (RoPE) of q or k, and of q and k straight out of a packed QKV projection.

The rotation pairs each element of a head with a partner and turns the pair by the
angle of its position and frequency:

* rotate-half (Hugging Face's LLaMA ``apply_rotary_pos_emb``): element ``i`` of the first
  half pairs with ``i + head_dim / 2``: ``out = x * cos + rotate_half(x) * sin``, where
  ``rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2])``;
* interleaved (GPT-J's ``rotate_every_two``): element ``2i`` pairs with ``2i + 1``:
  ``out = x * cos + rotate_every_two(x) * sin``, where ``rotate_every_two(x)`` puts
  ``-x[2i + 1]`` at ``2i`` and ``x[2i]`` at ``2i + 1``.

cos and sin are taken as given, one full ``head_dim`` row per position, so the kernel
computes exactly these formulas (cos's two halves, or the two entries of a pair, need
not be equal). One program turns a block of positions of up to 8 heads, in fp32, with one
rounding at the store; backward is the transposed rotation by the same kernel.
``rope_qkv`` reads q and k from the packed projection output in place and writes them
in SDPA's [batch, heads, seq, head_dim] layout; its backward writes the gradient of
the packed tensor in one buffer, each column block once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lstrain import _backend
from lstrain._backend import wait_for_producers
from lstrain.ops._lib.custom_op import kernel_op
from lstrain.ops._lib.first_order import refuse_create_graph
from lstrain.ops._lib.layout import cdiv
from lstrain.ops._lib.options import bool_option, check_tensors, int_option

__all__ = [
    "RopeFunction",
    "RopePlan",
    "RopeQKVFunction",
    "dim_order",
    "rope",
    "rope_bwd",
    "rope_fwd",
    "rope_plan",
    "rope_qkv",
    "rope_qkv_bwd",
    "rope_qkv_fwd",
    "rope_qkv_ref",
    "rope_ref",
]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _load_pairs(
    rows, mask, half, HEADS: tl.constexpr, BLOCK_SEQ: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr
):
    """From [HEADS, BLOCK_SEQ, 1] row pointers, a [HEADS, BLOCK_SEQ, BLOCK_HALF] tile of each
    element of the pairs: (first, second)."""
    if INTERLEAVED:
        # One contiguous load of the whole rows, split into the even and odd elements.
        col = tl.arange(0, 2 * BLOCK_HALF)[None, None, :]
        both = tl.load(rows + col, mask=mask & (col < 2 * half), other=0.0)
        first, second = tl.split(tl.reshape(both, [HEADS, BLOCK_SEQ, BLOCK_HALF, 2]))
    else:
        pair = tl.arange(0, BLOCK_HALF)[None, None, :]
        first = tl.load(rows + pair, mask=mask & (pair < half), other=0.0)
        second = tl.load(rows + half + pair, mask=mask & (pair < half), other=0.0)
    return first, second


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    heads,
    seq,
    half,
    x_batch_stride,
    x_head_stride,
    x_seq_stride,
    cos_batch_stride,
    cos_seq_stride,
    sin_batch_stride,
    sin_seq_stride,
    out_batch_stride,
    out_head_stride,
    out_seq_stride,
    INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr,
    ROTATE: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_SEQ: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_producers(PDL)
    # A program turns BLOCK_HEADS heads at BLOCK_SEQ positions: the positions' cos and sin
    # rows, loaded once, serve every head of the block. Without ROTATE it copies them (v's
    # gradient into the packed one: the same strided tiles, none of the tables).
    batch = tl.program_id(2).to(tl.int64)
    head = (tl.program_id(1).to(tl.int64) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS))[:, None, None]
    position = (tl.program_id(0).to(tl.int64) * BLOCK_SEQ + tl.arange(0, BLOCK_SEQ))[None, :, None]
    table_mask = position < seq
    mask = table_mask & (head < heads)
    x_rows = x_ptr + batch * x_batch_stride + head * x_head_stride + position * x_seq_stride
    cos_rows = cos_ptr + batch * cos_batch_stride + position * cos_seq_stride
    sin_rows = sin_ptr + batch * sin_batch_stride + position * sin_seq_stride
    x1, x2 = _load_pairs(x_rows, mask, half, BLOCK_HEADS, BLOCK_SEQ, BLOCK_HALF, INTERLEAVED)
    if ROTATE:
        cos1, cos2 = _load_pairs(cos_rows, table_mask, half, 1, BLOCK_SEQ, BLOCK_HALF, INTERLEAVED)
        sin1, sin2 = _load_pairs(sin_rows, table_mask, half, 1, BLOCK_SEQ, BLOCK_HALF, INTERLEAVED)
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        cos1 = cos1.to(tl.float32)
        cos2 = cos2.to(tl.float32)
        sin1 = sin1.to(tl.float32)
        sin2 = sin2.to(tl.float32)
        if BACKWARD:
            # The transpose of forward's [[cos1, -sin1], [sin2, cos2]] per pair.
            out1 = x1 * cos1 + x2 * sin2
            out2 = x2 * cos2 - x1 * sin1
        else:
            out1 = x1 * cos1 - x2 * sin1
            out2 = x2 * cos2 + x1 * sin2
    else:
        out1, out2 = x1, x2
    out_rows = out_ptr + batch * out_batch_stride + head * out_head_stride + position * out_seq_stride
    out1 = out1.to(out_ptr.dtype.element_ty)
    out2 = out2.to(out_ptr.dtype.element_ty)
    if INTERLEAVED:
        col = tl.arange(0, 2 * BLOCK_HALF)[None, None, :]
        both = tl.reshape(tl.join(out1, out2), [BLOCK_HEADS, BLOCK_SEQ, 2 * BLOCK_HALF])
        tl.store(out_rows + col, both, mask=mask & (col < 2 * half))
    else:
        pair = tl.arange(0, BLOCK_HALF)[None, None, :]
        tl.store(out_rows + pair, out1, mask=mask & (pair < half))
        tl.store(out_rows + half + pair, out2, mask=mask & (pair < half))


@dataclass(frozen=True)
class RopePlan:
    """Launch settings: heads and positions per program, the padded half head, warps."""

    block_heads: int
    block_seq: int
    block_half: int
    num_warps: int


@functools.cache
def rope_plan(heads: int, seq: int, head_dim: int) -> RopePlan:
    """Launch settings for ``heads`` heads of ``head_dim`` elements over ``seq`` positions
    (a pure function).

    A program holds about 4096 elements (8 heads x 4 positions x 128), enough loads in
    flight to stream, few enough registers for 4 warps. Up to 8 heads share a program,
    so its cos and sin rows are read (from L2) once per 8 heads, not per head, which
    would read as many table bytes as head bytes; small heads or sequences get fewer rows.

    Args:
        heads: heads of the tensor rotated.
        seq: its positions.
        head_dim: its (even) head width.

    Returns:
        The :class:`RopePlan`.
    """
    block_half = triton.next_power_of_2(max(1, head_dim // 2))
    block_heads = min(8, triton.next_power_of_2(heads))
    block_seq = max(1, min(4096 // (block_heads * 2 * block_half), triton.next_power_of_2(seq)))
    return RopePlan(block_heads, block_seq, block_half, 4)


def _launch(x, cos, sin, out, interleaved: bool, backward: bool, rotate: bool = True) -> None:
    """Rotate ``x`` [batch, heads, seq, head_dim] (last dim contiguous) into ``out`` (same
    shape, any strides with a contiguous last dim), by cos/sin [batch or 1, seq, head_dim];
    without ``rotate``, copy it (cos and sin unread)."""
    batch, heads, seq, head_dim = x.shape
    if x.numel() == 0:
        return
    plan = rope_plan(heads, seq, head_dim)
    _rope_kernel[(cdiv(seq, plan.block_seq), cdiv(heads, plan.block_heads), batch)](
        x, cos, sin, out, heads, seq, head_dim // 2,
        *x.stride()[:3], *cos.stride()[:2], *sin.stride()[:2], *out.stride()[:3],
        INTERLEAVED=interleaved,
        BACKWARD=backward,
        ROTATE=rotate,
        BLOCK_HEADS=plan.block_heads,
        BLOCK_SEQ=plan.block_seq,
        BLOCK_HALF=plan.block_half,
        num_warps=plan.num_warps,
        **_backend.dependent_launch(x),
    )  # fmt: skip


def _per_batch(table: torch.Tensor, batch: int) -> torch.Tensor:
    """cos or sin as [batch, seq, head_dim] with a contiguous last dim; a shared table's
    batch stride is 0, so every batch reads the same rows."""
    table = table if table.stride(-1) == 1 else table.contiguous()
    table = table.unsqueeze(0) if table.dim() == 2 else table
    return table.expand(batch, *table.shape[1:])


def dim_order(x: torch.Tensor) -> list[int]:
    """``x``'s dims from outermost to innermost in memory where ``x`` is dense (an HF
    ``transpose(1, 2)`` of a projection: [0, 2, 1, 3]), else in order (contiguous).

    Args:
        x: any tensor.

    Returns:
        A permutation of ``range(x.dim())``.
    """
    # an insertion sort by falling stride (ties in dim order): Dynamo cannot sort by the
    # symbolic strides of a dynamic-shape trace, but it can compare them
    order: list[int] = []
    for d in range(x.dim()):
        at = len(order)
        while at > 0 and x.stride(order[at - 1]) < x.stride(d):
            at -= 1
        order.insert(at, d)
    expected, stride = [0] * x.dim(), 1
    for d in reversed(order):
        expected[d], stride = stride, stride * x.shape[d]
    dense = all(x.stride(d) == expected[d] for d in range(x.dim()) if x.shape[d] > 1)
    return order if dense else list(range(x.dim()))


def _empty_in_order(like: torch.Tensor, order: list[int]) -> torch.Tensor:
    """An empty tensor shaped and typed like ``like``, its dims laid out in ``order``."""
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return like.new_empty([like.shape[d] for d in order]).permute(inverse)


def rope_fwd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Launch the forward rotation on validated inputs.

    Args:
        x, cos, sin, interleaved: as for :func:`rope` (x's last dim contiguous).

    Returns:
        The rotated tensor, shaped and typed like ``x``, laid out in :func:`dim_order` of ``x``.
    """
    out = _empty_in_order(x, dim_order(x))
    batch = x.shape[0]
    _launch(x, _per_batch(cos, batch), _per_batch(sin, batch), out, interleaved, False)
    return out


def rope_bwd(
    dout: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, order: list[int]
) -> torch.Tensor:
    """Launch the backward (transposed) rotation.

    Args:
        dout: the upstream gradient, [batch, heads, seq, head_dim] (last dim contiguous).
        cos, sin, interleaved: as given to :func:`rope_fwd`.
        order: :func:`dim_order` of forward's x, which dx is laid out in, so that the
            gradient of an HF transposed projection reaches it without a copy.

    Returns:
        dx, shaped and typed like ``dout``.
    """
    dx = _empty_in_order(dout, order)
    batch = dout.shape[0]
    _launch(dout, _per_batch(cos, batch), _per_batch(sin, batch), dx, interleaved, True)
    return dx


def _qkv_heads(qkv: torch.Tensor, first: int, count: int, head_dim: int) -> torch.Tensor:
    """Heads ``first .. first + count`` of packed ``qkv`` [batch, seq, heads * head_dim] as a
    strided [batch, count, seq, head_dim] view."""
    cols = qkv[:, :, first * head_dim : (first + count) * head_dim]
    return cols.unflatten(-1, (count, head_dim)).transpose(1, 2)


def _empty_dqkv(
    dq: torch.Tensor | None, dk: torch.Tensor | None, dv: torch.Tensor | None, num_heads: int, num_kv_heads: int
) -> torch.Tensor:
    """The packed gradient's buffer, [batch, seq, (num_heads + 2 * num_kv_heads) * head_dim],
    shaped and typed from the first upstream gradient given."""
    given = next(g for g in (dq, dk, dv) if g is not None)
    batch, _, seq, head_dim = given.shape
    return given.new_empty((batch, seq, (num_heads + 2 * num_kv_heads) * head_dim))


def _empty_heads(qkv: torch.Tensor, count: int, head_dim: int) -> torch.Tensor:
    """An empty [batch, count, seq, head_dim] tensor laid out as [batch, seq, count, head_dim]:
    the layout of HF's ``view(b, s, h, d).transpose(1, 2)``, which SDPA's cuDNN backend gives
    its output and wants its output's gradient in, so that the attention output reshapes to
    [batch, seq, dim] as a view (a contiguous q cost two copies a layer in the LLaMA step)."""
    batch, seq, _ = qkv.shape
    return qkv.new_empty((batch, seq, count, head_dim)).transpose(1, 2)


def rope_qkv_fwd(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward rotations of q and k, read from ``qkv`` in place, and v's copy.

    Args:
        qkv, cos, sin, num_heads, num_kv_heads, interleaved: as for :func:`rope_qkv`
            (qkv's last dim contiguous).

    Returns:
        ``(q, k, v)``: [batch, num_heads, seq, head_dim] and twice [batch, num_kv_heads,
        seq, head_dim] in qkv's dtype, laid out as [batch, seq, heads, head_dim] (see
        :func:`_empty_heads`).
    """
    batch, seq, width = qkv.shape
    head_dim = width // (num_heads + 2 * num_kv_heads)
    cos, sin = _per_batch(cos, batch), _per_batch(sin, batch)
    outputs = []
    for first, count, rotate in ((0, num_heads, True), (num_heads, num_kv_heads, True),
                                 (num_heads + num_kv_heads, num_kv_heads, False)):  # fmt: skip
        out = _empty_heads(qkv, count, head_dim)
        _launch(_qkv_heads(qkv, first, count, head_dim), cos, sin, out, interleaved, False, rotate=rotate)
        outputs.append(out)
    return outputs[0], outputs[1], outputs[2]


def rope_qkv_bwd(
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    interleaved: bool,
) -> torch.Tensor:
    """Write the gradient of the packed tensor: rotated-back dq and dk, and dv, each into its
    own columns of one [batch, seq, (num_heads + 2 * num_kv_heads) * head_dim] buffer.

    Args:
        dq, dk, dv: the upstream gradients of :func:`rope_qkv`'s outputs, any strides (None:
            that output was not used, its columns get zeros); at least one is given.
        cos, sin, num_heads, num_kv_heads, interleaved: as given to :func:`rope_qkv_fwd`.

    Returns:
        d(qkv), contiguous, in the upstream gradients' dtype.
    """
    dqkv = _empty_dqkv(dq, dk, dv, num_heads, num_kv_heads)
    batch, seq, width = dqkv.shape
    head_dim = width // (num_heads + 2 * num_kv_heads)
    cos, sin = _per_batch(cos, batch), _per_batch(sin, batch)
    for grad, first, count in ((dq, 0, num_heads), (dk, num_heads, num_kv_heads)):
        columns = _qkv_heads(dqkv, first, count, head_dim)
        if grad is None:
            columns.zero_()
        else:
            _launch(grad if grad.stride(-1) == 1 else grad.contiguous(), cos, sin, columns, interleaved, True)
    # dv only moves into its columns: the one write of them there is, in the rotation's
    # tiles (torch's strided copy_ took 57 us a layer in the LLaMA-0.75B step, ~3x the bytes' time)
    columns = _qkv_heads(dqkv, num_heads + num_kv_heads, num_kv_heads, head_dim)
    if dv is None:
        columns.zero_()
    else:
        _launch(dv if dv.stride(-1) == 1 else dv.contiguous(), cos, sin, columns, interleaved, True, rotate=False)
    return dqkv


@kernel_op("rope_fwd", rope_fwd)
def rope_fwd_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return _empty_in_order(x, dim_order(x))


@kernel_op("rope_bwd", rope_bwd)
def rope_bwd_op(
    dout: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, order: list[int]
) -> torch.Tensor:
    return _empty_in_order(dout, order)


@kernel_op("rope_qkv_fwd", rope_qkv_fwd)
def rope_qkv_fwd_op(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    head_dim = qkv.shape[-1] // (num_heads + 2 * num_kv_heads)
    heads = (num_heads, num_kv_heads, num_kv_heads)
    q, k, v = (_empty_heads(qkv, count, head_dim) for count in heads)
    return q, k, v


@kernel_op("rope_qkv_bwd", rope_qkv_bwd)
def rope_qkv_bwd_op(
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    interleaved: bool,
) -> torch.Tensor:
    return _empty_dqkv(dq, dk, dv, num_heads, num_kv_heads)


class RopeFunction(torch.autograd.Function):
    """Autograd for :func:`rope`; saves cos and sin (no gradient flows to them)."""

    @staticmethod
    def forward(ctx, x, cos, sin, interleaved):
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        ctx.order = dim_order(x)
        return rope_fwd_op(x, cos, sin, interleaved)

    @staticmethod
    def backward(ctx, dout):
        refuse_create_graph("rope")
        cos, sin = ctx.saved_tensors
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        return rope_bwd_op(dout, cos, sin, ctx.interleaved, ctx.order), None, None, None


class RopeQKVFunction(torch.autograd.Function):
    """Autograd for :func:`rope_qkv`; saves cos and sin."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, num_heads, num_kv_heads, interleaved):
        q, k, v = rope_qkv_fwd_op(qkv, cos, sin, num_heads, num_kv_heads, interleaved)
        ctx.save_for_backward(cos, sin)
        ctx.heads = (num_heads, num_kv_heads, interleaved)
        # An unused output's gradient stays None: its columns are zeroed, not read.
        ctx.set_materialize_grads(False)
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        refuse_create_graph("rope_qkv")
        cos, sin = ctx.saved_tensors
        if dq is None and dk is None and dv is None:
            return None, None, None, None, None, None
        num_heads, num_kv_heads, interleaved = ctx.heads
        dqkv = rope_qkv_bwd_op(dq, dk, dv, cos, sin, num_heads, num_kv_heads, interleaved)
        return dqkv, None, None, None, None, None


def _check_head_dim(op: str, head_dim: int) -> None:
    if head_dim % 2:
        raise ValueError(f"{op}: head_dim must be even (the rotation turns pairs), got {head_dim}")


def _check_tables(op: str, cos: torch.Tensor, sin: torch.Tensor, batch: int, seq: int, head_dim: int, x) -> None:
    """cos and sin: [seq, head_dim] or [batch or 1, seq, head_dim], float, on x's device, no gradient."""
    for name, table in (("cos", cos), ("sin", sin)):
        expected = f"[{seq}, {head_dim}] or [{batch} or 1, {seq}, {head_dim}]"
        shape = tuple(table.shape)
        if (
            table.dim() not in (2, 3)
            or shape[-2:] != (seq, head_dim)
            or (table.dim() == 3 and shape[0] not in (1, batch))
        ):
            raise ValueError(f"{op}: {name} has shape {shape}, expected {expected} (one row per position)")
        if table.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{op}: {name} has dtype {table.dtype}; expected float32, float16 or bfloat16")
        if table.device != x.device:
            raise ValueError(f"{op}: {name} is on {table.device} but the input is on {x.device}")
        if table.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{op}: {name} requires grad, but no gradient flows to cos and sin; pass it detached")


def _check_input(op: str, name: str, t: torch.Tensor, dims: int) -> None:
    if t.dim() != dims:
        raise ValueError(f"{op}: {name} must be a {dims}-d tensor, got {tuple(t.shape)}")
    if t.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{op}: {name} has dtype {t.dtype}; expected float32, float16 or bfloat16")


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False) -> torch.Tensor:
    """Rotary position embedding of q or k: ``x * cos + rotate(x) * sin``.

    With ``interleaved=False`` this is Hugging Face's ``apply_rotary_pos_emb`` for one
    tensor (``rotate_half``); with ``interleaved=True``, GPT-J's ``rotate_every_two``.
    Computed in fp32 whatever the dtypes, with one rounding at the store.

    Args:
        x: [batch, heads, seq, head_dim], float32, float16 or bfloat16, head_dim even;
            any strides with a contiguous last dim (HF's ``view(b, s, h, d).transpose(1, 2)``
            of a projection is read in place).
        cos, sin: the tables, one row per position of ``x`` (positions are the caller's:
            gather rows by position id first, as HF's rotary embedding does), shape
            [seq, head_dim] or [batch or 1, seq, head_dim], any float dtype. For
            rotate-half, ``cos = cat(freqs, freqs, -1).cos()`` (LlamaRotaryEmbedding's
            output as it is); for interleaved, each angle repeated for its pair,
            ``freqs.repeat_interleave(2, -1).cos()``; likewise ``sin``. They get no gradient.
        interleaved: pair element 2i with 2i + 1 (GPT-J, GPT-NeoX's ``rotary_interleaved``)
            instead of i with i + head_dim / 2.

    Returns:
        The rotated tensor, shape and dtype of ``x``; with ``x``'s strides where ``x`` is
        dense (an HF transpose stays one), else contiguous. The gradient of ``x`` is laid
        out the same way, so an HF projection's gradient needs no copy.

    Raises:
        ValueError: ``x``, ``cos`` or ``sin`` is no tensor (named), ``x`` is not 4-d or has
            an unsupported dtype, ``head_dim`` is odd, ``cos`` / ``sin`` have the wrong
            shape, dtype or device or require grad, or ``interleaved`` is not a bool.
    """
    check_tensors("rope", {"x": x, "cos": cos, "sin": sin})
    interleaved = bool_option("rope", "interleaved", interleaved)
    _check_input("rope", "x", x, 4)
    batch, _, seq, head_dim = x.shape
    _check_head_dim("rope", head_dim)
    _check_tables("rope", cos, sin, batch, seq, head_dim, x)
    backend = _backend.backend_for(x)
    _backend.note("rope", backend)
    if backend == "reference":
        return rope_ref(x, cos, sin, interleaved=interleaved)
    x = x if x.stride(-1) == 1 else x.contiguous()
    return RopeFunction.apply(x, cos, sin, interleaved)


def rope_qkv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a packed QKV projection into heads and rotate q and k, reading them in place.

    ``qkv[..., :num_heads * d]`` are q's heads, the next ``num_kv_heads * d`` columns k's
    and the last ``num_kv_heads * d`` v's (``d = head_dim``); grouped-query attention
    has ``num_kv_heads < num_heads``. Same rotation as :func:`rope`.

    Args:
        qkv: [batch, seq, (num_heads + 2 * num_kv_heads) * head_dim], float32, float16
            or bfloat16, head_dim even; any strides with a contiguous last dim.
        cos, sin: as for :func:`rope`, [seq, head_dim] or [batch or 1, seq, head_dim].
        num_heads: query heads.
        num_kv_heads: key and value heads.
        interleaved: as for :func:`rope`.

    Returns:
        ``(q, k, v)``: rotated q [batch, num_heads, seq, head_dim] and k [batch,
        num_kv_heads, seq, head_dim], laid out as [batch, seq, heads, head_dim] (as an HF
        ``transpose(1, 2)`` is: SDPA then writes its output so that it reshapes to [batch,
        seq, dim] without a copy), and v [batch, num_kv_heads, seq, head_dim], a copy in
        the same layout: a view would keep the whole projection alive for attention's
        backward, which saves v (in the LLaMA-style 0.75B, 8 KiB per token and layer more
        than q, k and v need: 768 MiB at 4 x 2048 tokens). Backward writes the gradient of
        ``qkv`` in one buffer, each column block once.

    Raises:
        ValueError: ``qkv``, ``cos`` or ``sin`` is no tensor (named), ``qkv`` is not 3-d or
            has an unsupported dtype, the head counts are not integers >= 1 or do not divide
            its width, ``head_dim`` is odd, or ``cos`` / ``sin`` / ``interleaved`` are wrong
            as for :func:`rope`.
    """
    check_tensors("rope_qkv", {"qkv": qkv, "cos": cos, "sin": sin})
    interleaved = bool_option("rope_qkv", "interleaved", interleaved)
    _check_input("rope_qkv", "qkv", qkv, 3)
    num_heads = int_option("rope_qkv", "num_heads", num_heads, 1)
    num_kv_heads = int_option("rope_qkv", "num_kv_heads", num_kv_heads, 1)
    batch, seq, width = qkv.shape
    heads = num_heads + 2 * num_kv_heads
    if width % heads:
        raise ValueError(
            f"rope_qkv: qkv's last dim {width} is not a multiple of num_heads + 2 * num_kv_heads = {heads}"
        )
    head_dim = width // heads
    _check_head_dim("rope_qkv", head_dim)
    _check_tables("rope_qkv", cos, sin, batch, seq, head_dim, qkv)
    backend = _backend.backend_for(qkv)
    _backend.note("rope_qkv", backend)
    if backend == "reference":
        return rope_qkv_ref(qkv, cos, sin, num_heads, num_kv_heads, interleaved=interleaved)
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    return RopeQKVFunction.apply(qkv, cos, sin, num_heads, num_kv_heads, interleaved)


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """HF's ``rotate_half`` (LLaMA), or GPT-J's ``rotate_every_two``."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False) -> torch.Tensor:
    """RoPE in plain PyTorch, HF's formula in ``x``'s dtype (the tables cast to it, as
    LlamaRotaryEmbedding returns them): ``x * cos + rotate(x) * sin``.

    Args:
        x, cos, sin, interleaved: as for :func:`rope` (x may also be fp64).

    Returns:
        The rotated tensor, shaped and typed like ``x``.
    """
    # [batch, seq, head_dim] -> [batch, 1, seq, head_dim], one table for every head
    cos, sin = (t.to(x.dtype).unsqueeze(1) if t.dim() == 3 else t.to(x.dtype) for t in (cos, sin))
    return x * cos + _rotate(x, interleaved) * sin


def rope_qkv_ref(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`rope_qkv` in plain PyTorch: views of the heads, then :func:`rope_ref` of q and k.

    Args:
        qkv, cos, sin, num_heads, num_kv_heads, interleaved: as for :func:`rope_qkv`.

    Returns:
        ``(q, k, v)``, each [batch, heads, seq, head_dim] (v a view of ``qkv``).
    """
    head_dim = qkv.shape[-1] // (num_heads + 2 * num_kv_heads)
    q = _qkv_heads(qkv, 0, num_heads, head_dim)
    k = _qkv_heads(qkv, num_heads, num_kv_heads, head_dim)
    v = _qkv_heads(qkv, num_heads + num_kv_heads, num_kv_heads, head_dim)
    return rope_ref(q, cos, sin, interleaved=interleaved), rope_ref(k, cos, sin, interleaved=interleaved), v
