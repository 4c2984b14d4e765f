"""q, k, v from one packed projection, with their gradients packed and the bias's summed in one pass.

Forward is one GEMM (cuBLAS, ``F.linear``: the bias in its epilogue) whose output q, k and
v are strided views of, in SDPA's ``[batch, heads, seq, head_dim]`` shape. Backward reads
dq, dk and dv once (any strides, as attention's backward leaves them), writes them into one
``[batch, seq, 3 * dim]`` gradient, and sums that over tokens for the bias in the same
pass, through per-program fp32 partials added in a fixed order (deterministic); then the
two GEMMs of a linear layer, the weight's gradient in the weight's layout. Autograd's
own path for ``F.linear`` + a view split stacks the three gradients in one kernel and sums
the bias gradient in another (GPT-2 medium on the H200: 25 and 29 us per layer,
docs/notes/step_profiles.md).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from lstrain import _backend
from lstrain._backend import wait_for_producers
from lstrain.ops._lib.autocast import autocast_inputs
from lstrain.ops._lib.custom_op import kernel_op
from lstrain.ops._lib.dropout import ElementwisePlan, elementwise_plan
from lstrain.ops._lib.first_order import differentiated, refuse_create_graph
from lstrain.ops._lib.layout import as_rows, cdiv, grad_place, matmul_like, placeable
from lstrain.ops._lib.linear_checks import check_projection
from lstrain.ops._lib.options import check_tensors, int_option
from lstrain.ops._lib.partial_sums import sum_partials

__all__ = [
    "QKVProjectionFunction",
    "check_packed_projection",
    "pack_heads_grad",
    "qkv_projection",
    "qkv_projection_ref",
]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _pack_heads_grad_kernel(
    dq_ptr,
    dk_ptr,
    dv_ptr,
    dqkv_ptr,
    partial_ptr,
    rows,
    seq,
    dim,
    head_dim,
    q_batch_stride,
    q_head_stride,
    q_seq_stride,
    k_batch_stride,
    k_head_stride,
    k_seq_stride,
    v_batch_stride,
    v_head_stride,
    v_seq_stride,
    BIAS_GRAD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (column block, part, walker) copies columns of dq / dk / dv (``part`` 0 / 1
    / 2; last dim contiguous) into dqkv[:, part * dim + col] over the walker's row tiles,
    and writes its column sums (fp32) to ``partial[walker, part * dim + col]``."""
    wait_for_producers(PDL)
    # A column block lies within one head (BLOCK_COLS divides head_dim): its source
    # columns are one contiguous run, which Triton vectorizes.
    first_col = tl.program_id(0) * BLOCK_COLS
    col = first_col + tl.arange(0, BLOCK_COLS)
    part = tl.program_id(1)
    walker = tl.program_id(2)
    walkers = tl.num_programs(2)
    col_ok = col < dim
    # Selects, not branches: a stride Triton made a constant (1) in one part merges with
    # the others', and the strides' divisibility hints survive (vectorized loads).
    is_q, is_k = part == 0, part == 1
    src_ptr = tl.where(is_q, dq_ptr, tl.where(is_k, dk_ptr, dv_ptr))
    batch_stride = tl.where(is_q, q_batch_stride, tl.where(is_k, k_batch_stride, v_batch_stride)).to(tl.int64)
    head_stride = tl.where(is_q, q_head_stride, tl.where(is_k, k_head_stride, v_head_stride)).to(tl.int64)
    seq_stride = tl.where(is_q, q_seq_stride, tl.where(is_k, k_seq_stride, v_seq_stride)).to(tl.int64)
    head = first_col // head_dim
    col_offset = head.to(tl.int64) * head_stride + (first_col - head * head_dim) + tl.arange(0, BLOCK_COLS)
    width = 3 * dim
    acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
    for first in tl.range(walker * BLOCK_ROWS, rows, walkers * BLOCK_ROWS, num_stages=NUM_STAGES):
        row = tl.arange(0, BLOCK_ROWS).to(tl.int64) + first
        batch = row // seq
        row_offset = batch * batch_stride + (row - batch * seq) * seq_stride
        mask = (row < rows)[:, None] & col_ok[None, :]
        g = tl.load(src_ptr + row_offset[:, None] + col_offset[None, :], mask=mask, other=0.0)
        tl.store(dqkv_ptr + row[:, None] * width + (part * dim + col)[None, :], g, mask=mask)
        if BIAS_GRAD:
            acc += g.to(tl.float32)
    if BIAS_GRAD:
        tl.store(partial_ptr + walker.to(tl.int64) * width + part * dim + col, tl.sum(acc, axis=0), mask=col_ok)


@functools.cache
def _pack_plan(head_dim: int) -> ElementwisePlan:
    """The elementwise plan's 4096-element tiles with column blocks that divide ``head_dim``
    (the largest power of two that does, at most 256), so that none straddles two heads."""
    block_cols = min(256, head_dim & -head_dim)
    base = elementwise_plan(block_cols)
    return ElementwisePlan(max(1, 4096 // block_cols), block_cols, base.num_warps)


def pack_heads_grad(
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    bias_grad: bool,
    bias_dtype: torch.dtype | None,
    into: Sequence[torch.Tensor | None] = (),
) -> list[torch.Tensor]:
    """``[dqkv, (dbias)]``: the three ``[batch, heads, seq, head_dim]`` gradients packed into
    ``[batch, seq, 3 * heads * head_dim]`` (q then k then v, each head's columns together),
    and with ``bias_grad`` their sum over tokens in ``bias_dtype`` (fp32 partials, one
    rounding).

    Args:
        dq, dk, dv: one shape, dtype and device; any strides with the last dim contiguous.
        bias_grad: also sum the packed gradient over tokens.
        bias_dtype: the bias gradient's dtype (the bias's).
        into: ``into[0]``, when given, is where to write the bias gradient (the bias's
            place in a flat gradient buffer).

    Returns:
        A list: the packed gradient (contiguous), then the bias gradient if asked for.
    """
    batch, heads, seq, head_dim = dq.shape
    dim = heads * head_dim
    dqkv = torch.empty((batch, seq, 3 * dim), dtype=dq.dtype, device=dq.device)
    grads = [dqkv]
    if bias_grad:
        place = into[0] if into else None
        grads.append(torch.empty(3 * dim, dtype=bias_dtype, device=dq.device) if place is None else place)
    rows = batch * seq
    if rows == 0 or dim == 0:
        if bias_grad:
            grads[1].zero_()
        return grads
    dq, dk, dv = (g if g.stride(-1) == 1 else g.contiguous() for g in (dq, dk, dv))
    plan = _pack_plan(head_dim)
    col_blocks = cdiv(dim, plan.block_cols)
    sms = _backend.multiprocessor_count(_backend.device_index(dq))
    walkers = max(1, min(cdiv(rows, plan.block_rows), sms * plan.programs_per_sm // (3 * col_blocks)))
    partials = torch.empty((1, walkers, 3 * dim), dtype=torch.float32, device=dq.device) if bias_grad else None
    strides = [s for g in (dq, dk, dv) for s in g.stride()[:3]]
    _pack_heads_grad_kernel[(col_blocks, 3, walkers)](
        dq, dk, dv, dqkv, partials, rows, seq, dim, head_dim, *strides,
        BIAS_GRAD=bias_grad,
        BLOCK_ROWS=plan.block_rows,
        BLOCK_COLS=plan.block_cols,
        NUM_STAGES=plan.num_stages,
        num_warps=plan.num_warps,
        **_backend.dependent_launch(dq),
    )  # fmt: skip
    if bias_grad:
        sum_partials(partials, [grads[1]])
    return grads


@kernel_op("pack_heads_grad", pack_heads_grad)
def pack_heads_grad_op(
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, bias_grad: bool, bias_dtype: torch.dtype | None
) -> list[torch.Tensor]:
    batch, heads, seq, head_dim = dq.shape
    grads = [dq.new_empty((batch, seq, 3 * heads * head_dim))]
    return grads + ([dq.new_empty(3 * heads * head_dim, dtype=bias_dtype)] if bias_grad else [])


def _split(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, seq, width = qkv.shape
    parts = qkv.view(batch, seq, 3, heads, width // (3 * heads)).permute(2, 0, 3, 1, 4)
    # indexed, not unbind(): torch.compile's autograd refuses the in-place updates its
    # regenerated views need on the outputs of a multi-view function
    return parts[0], parts[1], parts[2]


class QKVProjectionFunction(torch.autograd.Function):
    """Autograd for :func:`qkv_projection`; saves x and the weight, as a linear layer does
    (and the bias, whose gradient's place it looks up)."""

    @staticmethod
    def forward(ctx, x, weight, bias, heads):
        ctx.save_for_backward(x, weight, placeable(bias))  # bias: the parameter its gradient may be written into
        ctx.bias_dtype = None if bias is None else bias.dtype
        q, k, v = _split(F.linear(x, weight, bias), heads)
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        # Undefined gradients arrive as zeros (materialize_grads is on by default).
        refuse_create_graph("qkv_projection")
        x, weight, bias = ctx.saved_tensors
        need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
        grads = pack_heads_grad_op(
            dq, dk, dv, need_bias, ctx.bias_dtype, into=(grad_place(bias) if need_bias else None,)
        )
        dqkv = grads[0].flatten(0, 1)
        x2d = as_rows(x, x.shape[-1])
        dx = (dqkv @ weight).view(x.shape) if need_x else None
        # in the weight's layout (a Conv1D's transposed weight too): a contiguous .grad add
        dweight = matmul_like(dqkv.t(), x2d, weight) if need_weight else None
        return dx, dweight, grads[1] if need_bias else None, None


def check_packed_projection(
    op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, heads: int
) -> None:
    """Refuse inputs that are not a packed QKV projection of ``x`` into ``heads`` heads.

    Args:
        op: the op's name, for the messages.
        x, weight, bias: as for :func:`qkv_projection`.
        heads: the head count, already checked by ``int_option``.

    Raises:
        ValueError: naming the argument: x not 3-D, a weight
            or bias of another shape, a dtype other than float32 / float16 / bfloat16, or
            tensors on several devices.
    """
    if x.dim() != 3:
        raise ValueError(f"{op}: x must be [batch, seq, dim], got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1] or weight.shape[0] % (3 * heads):
        raise ValueError(
            f"{op}: weight must be [3 * dim, {x.shape[-1]}] with dim a multiple of heads={heads}, "
            f"got shape {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{op}: bias has shape {tuple(bias.shape)}, expected ({weight.shape[0]},)")
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{op}: {name} has dtype {t.dtype}; expected float32, float16 or bfloat16")
        if t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device} but x is on {x.device}")


def qkv_projection(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v of a packed projection ``F.linear(x, weight, bias)``, split into heads.

    The forward is ``F.linear`` and views; the backward packs the three gradients and sums
    the bias gradient in one kernel (see the module's docstring). Under ``torch.autocast``
    the GEMMs run in autocast's dtype, as ``F.linear`` does.

    Args:
        x: ``[batch, seq, in_features]``.
        weight: ``[3 * dim, in_features]`` (torch's Linear layout): q's rows, then k's,
            then v's, each head's ``dim / heads`` rows together (GPT-2's and BERT's layout).
        bias: ``[3 * dim]`` or None.
        heads: attention heads; ``dim`` must be a multiple of it.

    Returns:
        ``(q, k, v)``, each ``[batch, heads, seq, dim / heads]``: strided views of one
        ``[batch, seq, 3 * dim]`` projection (the last dim contiguous).

    Raises:
        ValueError: x, weight or bias no tensor, shapes that do not fit (named), dtypes
            other than float32 / float16 / bfloat16, tensors on several devices, or
            ``heads`` not an integer >= 1.
    """
    check_tensors("qkv_projection", {"x": x, "weight": weight}, {"bias": bias})
    heads = int_option("qkv_projection", "heads", heads, 1)
    check_packed_projection("qkv_projection", x, weight, bias, heads)
    x, weight, bias = autocast_inputs(x, weight, bias)
    check_projection("qkv_projection", "x", x, weight, bias)
    backend = _backend.backend_for(x)
    _backend.note("qkv_projection", backend)
    if backend == "reference" or not differentiated(x, weight, bias):
        return qkv_projection_ref(x, weight, bias, heads)
    return QKVProjectionFunction.apply(x, weight, bias, heads)


def qkv_projection_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain PyTorch: ``F.linear`` and views of its output; autograd's own backward.

    Args:
        x, weight, bias, heads: as for :func:`qkv_projection`.

    Returns:
        ``(q, k, v)`` as :func:`qkv_projection`'s.
    """
    return _split(F.linear(x, weight, bias), heads)
