"""Transformer input embedding: y = dropout(scale * E[token] + P[position]) in one kernel.

Backward scatters the token rows' gradient into the table. By default with atomic adds
into an fp32 table (cast to the weight's dtype at the end) — fast, but the summation
order, hence the last bits, vary from run to run. The deterministic mode (on when
``torch.are_deterministic_algorithms_enabled()``, or asked for) sorts the token ids
instead and gives each table row one program, which sums that row's tokens in a fixed
order and writes the row once: the same bits on every run, no fp32 table, no zero fill.
The position table's gradient is reduced the same way; positions taken from the token
index need no sort at all. The dropout mask is regenerated from its Philox seed; it is
never stored.

Tokens equal to ``padding_idx`` give all-zero output rows and no gradient. Ids or
positions outside their tables are never read: their output rows are NaN (and, for CPU
tensors or with ``check_ids=True``, a ValueError names them first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lstrain import _backend
from lstrain.ops.dropout import dropout_keep, elementwise_plan, new_seed

__all__ = ["EmbeddingFunction", "embedding", "embedding_bwd", "embedding_fwd", "embedding_ref"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _embedding_fwd_kernel(
    ids_ptr,
    positions_ptr,
    weight_ptr,
    pos_weight_ptr,
    y_ptr,
    seed_ptr,
    tokens,
    dim,
    vocab,
    max_positions,
    seq_len,
    padding_idx,
    scale,
    p,
    HAS_POS: tl.constexpr,
    EXPLICIT_POSITIONS: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    col = tl.program_id(1) * BLOCK_DIM + tl.arange(0, BLOCK_DIM)
    token_ok = token < tokens
    mask = token_ok[:, None] & (col < dim)[None, :]
    ids = tl.load(ids_ptr + token, mask=token_ok, other=0).to(tl.int64)
    bad = (ids < 0) | (ids >= vocab)
    padded = (ids == padding_idx) & ~bad
    row_ok = ~(bad | padded)
    v = tl.load(weight_ptr + ids[:, None] * dim + col[None, :], mask=mask & row_ok[:, None], other=0.0)
    v = v.to(tl.float32) * tl.cast(scale, tl.float32)
    if HAS_POS:
        if EXPLICIT_POSITIONS:
            pos = tl.load(positions_ptr + token, mask=token_ok, other=0).to(tl.int64)
        else:
            pos = token % seq_len
        bad = bad | (pos < 0) | (pos >= max_positions)
        pos_ok = (pos >= 0) & (pos < max_positions) & ~padded
        pv = tl.load(pos_weight_ptr + pos[:, None] * dim + col[None, :], mask=mask & pos_ok[:, None], other=0.0)
        v += pv.to(tl.float32)
    offsets = token[:, None] * dim + col[None, :]
    if DROPOUT:
        p = tl.cast(p, tl.float32)
        keep = dropout_keep(seed_ptr, token, tl.program_id(1) * BLOCK_DIM, dim, p, BLOCK_DIM)
        v = tl.where(keep, v / (1.0 - p), 0.0)
    v = tl.where(bad[:, None], float("nan"), v)
    tl.store(y_ptr + offsets, v.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_gradient(dy_ptr, seed_ptr, token, col, col_ok, dim, p, DROPOUT: tl.constexpr, BLOCK_DIM: tl.constexpr):
    """dy of one token's row, with that row's dropout mask and rescale applied (fp32)."""
    g = tl.load(dy_ptr + token * dim + col, mask=col_ok, other=0.0).to(tl.float32)
    if DROPOUT:
        keep = dropout_keep(seed_ptr, token + tl.zeros([1], tl.int64), tl.program_id(1) * BLOCK_DIM, dim, p, BLOCK_DIM)
        g = tl.where(tl.reshape(keep, [BLOCK_DIM]), g / (1.0 - p), 0.0)
    return g


@triton.jit
def _scatter_add_kernel(
    dy_ptr,
    ids_ptr,
    table_ptr,
    seed_ptr,
    tokens,
    dim,
    rows,
    seq_len,
    padding_idx,
    scale,
    p,
    POSITIONS_FROM_INDEX: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    """table[ids[t]] += scale * grad row t, with fp32 atomics (ids = t % seq_len when
    POSITIONS_FROM_INDEX); rows with an out-of-range or padding id are skipped."""
    token = tl.program_id(0).to(tl.int64) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    col = tl.program_id(1) * BLOCK_DIM + tl.arange(0, BLOCK_DIM)
    token_ok = token < tokens
    if POSITIONS_FROM_INDEX:
        ids = token % seq_len
    else:
        ids = tl.load(ids_ptr + token, mask=token_ok, other=-1).to(tl.int64)
    row_ok = token_ok & (ids >= 0) & (ids < rows) & (ids != padding_idx)
    mask = row_ok[:, None] & (col < dim)[None, :]
    g = tl.load(dy_ptr + token[:, None] * dim + col[None, :], mask=mask, other=0.0).to(tl.float32)
    if DROPOUT:
        p = tl.cast(p, tl.float32)
        keep = dropout_keep(seed_ptr, token, tl.program_id(1) * BLOCK_DIM, dim, p, BLOCK_DIM)
        g = tl.where(keep, g / (1.0 - p), 0.0)
    tl.atomic_add(table_ptr + ids[:, None] * dim + col[None, :], g * tl.cast(scale, tl.float32), mask=mask)


@triton.jit
def _segment_sum_kernel(
    dy_ptr,
    order_ptr,
    starts_ptr,
    table_ptr,
    seed_ptr,
    dim,
    seq_len,
    sequences,
    padding_idx,
    scale,
    p,
    POSITIONS_FROM_INDEX: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    """One program per table row: it sums, in a fixed order, the gradient rows of the
    tokens looked up at that row and writes the row once (zeros where no token looked it
    up), so the table needs no zero fill. The tokens of row r are ``order[starts[r]:
    starts[r + 1]]``, or with POSITIONS_FROM_INDEX r, r + seq_len, ... (one per sequence)."""
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK_DIM + tl.arange(0, BLOCK_DIM)
    col_ok = col < dim
    p = tl.cast(p, tl.float32)
    if POSITIONS_FROM_INDEX:
        begin = 0
        end = tl.where(row < seq_len, sequences, 0)
    else:
        begin = tl.load(starts_ptr + row)
        end = tl.load(starts_ptr + row + 1)
    acc = tl.zeros([BLOCK_DIM], dtype=tl.float32)
    for i in range(begin, end):
        if POSITIONS_FROM_INDEX:
            token = row + i * seq_len
        else:
            token = tl.load(order_ptr + i).to(tl.int64)
        acc += _row_gradient(dy_ptr, seed_ptr, token, col, col_ok, dim, p, DROPOUT, BLOCK_DIM)
    acc = tl.where(row == padding_idx, 0.0, acc * tl.cast(scale, tl.float32))
    tl.store(table_ptr + row * dim + col, acc.to(table_ptr.dtype.element_ty), mask=col_ok)


def embedding_fwd(
    ids: torch.Tensor,
    weight: torch.Tensor,
    pos_weight: torch.Tensor | None,
    positions: torch.Tensor | None,
    scale: float,
    padding_idx: int,
    seed: torch.Tensor | None,
    p: float,
) -> torch.Tensor:
    """Launch the forward kernel on validated inputs; returns [*ids.shape, D] in weight's dtype."""
    dim = weight.shape[1]
    flat = ids.reshape(-1).contiguous()
    y = torch.empty((*ids.shape, dim), dtype=weight.dtype, device=weight.device)
    tokens = flat.numel()
    if tokens == 0 or dim == 0:
        return y
    plan = elementwise_plan(dim)
    block_tokens, block_dim = plan.block_rows, plan.block_cols
    flat_positions = None if positions is None else positions.reshape(-1).contiguous()
    _embedding_fwd_kernel[(triton.cdiv(tokens, block_tokens), triton.cdiv(dim, block_dim))](
        flat, flat_positions, weight, pos_weight, y, seed,
        tokens, dim, weight.shape[0], 0 if pos_weight is None else pos_weight.shape[0],
        ids.shape[-1], padding_idx, scale, p,
        HAS_POS=pos_weight is not None,
        EXPLICIT_POSITIONS=positions is not None,
        DROPOUT=seed is not None,
        BLOCK_TOKENS=block_tokens,
        BLOCK_DIM=block_dim,
        num_warps=plan.num_warps,
    )  # fmt: skip
    return y


def _table_gradient(dy, ids, rows, dtype, seq_len, padding_idx, scale, seed, p, deterministic):
    """Gradient of a [rows, D] table looked up at ``ids`` (None: at token index % seq_len)."""
    tokens, dim = dy.shape
    plan = elementwise_plan(dim)
    block_tokens, block_dim = plan.block_rows, plan.block_cols
    if deterministic:
        table = torch.empty((rows, dim), dtype=dtype, device=dy.device)
        if ids is None:
            order = starts = None
        else:
            sorted_ids, order = torch.sort(ids, stable=True)
            # ids outside [0, rows) (padding tokens' positions are -1) fall outside every segment
            starts = torch.searchsorted(sorted_ids, torch.arange(rows + 1, device=dy.device))
        if rows and dim:
            _segment_sum_kernel[(rows, triton.cdiv(dim, block_dim))](
                dy, order, starts, table, seed, dim, seq_len, tokens // max(seq_len, 1), padding_idx, scale, p,
                POSITIONS_FROM_INDEX=ids is None, DROPOUT=seed is not None, BLOCK_DIM=block_dim,
                num_warps=plan.num_warps,
            )  # fmt: skip
        return table
    table = torch.zeros((rows, dim), dtype=torch.float32, device=dy.device)
    if tokens:
        _scatter_add_kernel[(triton.cdiv(tokens, block_tokens), triton.cdiv(dim, block_dim))](
            dy, ids, table, seed, tokens, dim, rows, seq_len, padding_idx, scale, p,
            POSITIONS_FROM_INDEX=ids is None,
            DROPOUT=seed is not None,
            BLOCK_TOKENS=block_tokens,
            BLOCK_DIM=block_dim,
            num_warps=plan.num_warps,
        )  # fmt: skip
    return table.to(dtype)


def embedding_bwd(
    dy: torch.Tensor,
    ids: torch.Tensor,
    weight_rows: int,
    weight_dtype: torch.dtype,
    pos_rows: int,
    pos_dtype: torch.dtype | None,
    positions: torch.Tensor | None,
    scale: float,
    padding_idx: int,
    seed: torch.Tensor | None,
    p: float,
    deterministic: bool,
    weight_grad: bool,
    pos_grad: bool,
) -> list[torch.Tensor]:
    """dweight if ``weight_grad``, then dpos_weight if ``pos_grad`` (a list of 0 to 2)."""
    dim = dy.shape[-1]
    dy2d = dy.reshape(-1, dim).contiguous()
    flat = ids.reshape(-1).contiguous()
    seq_len = ids.shape[-1] if ids.dim() else 1
    grads = []
    if weight_grad:
        grads.append(
            _table_gradient(dy2d, flat, weight_rows, weight_dtype, seq_len, padding_idx, scale, seed, p, deterministic)
        )
    if pos_grad:
        flat_positions = None if positions is None else positions.reshape(-1).contiguous()
        if flat_positions is not None or padding_idx >= 0:
            # padding tokens take no position gradient: give them an id outside the table
            base = (
                flat_positions if flat_positions is not None else torch.arange(flat.numel(), device=dy.device) % seq_len
            )
            flat_positions = torch.where(flat == padding_idx, -1, base)
        grads.append(
            _table_gradient(dy2d, flat_positions, pos_rows, pos_dtype, seq_len, -1, 1.0, seed, p, deterministic)
        )
    return grads


@torch.library.custom_op("lstrain::embedding_fwd", mutates_args=())
def _fwd_op(
    ids: torch.Tensor,
    weight: torch.Tensor,
    pos_weight: torch.Tensor | None,
    positions: torch.Tensor | None,
    scale: float,
    padding_idx: int,
    seed: torch.Tensor | None,
    p: float,
) -> torch.Tensor:
    return embedding_fwd(ids, weight, pos_weight, positions, scale, padding_idx, seed, p)


@_fwd_op.register_fake
def _(ids, weight, pos_weight, positions, scale, padding_idx, seed, p):
    return weight.new_empty((*ids.shape, weight.shape[1]))


@torch.library.custom_op("lstrain::embedding_bwd", mutates_args=())
def _bwd_op(
    dy: torch.Tensor,
    ids: torch.Tensor,
    weight_rows: int,
    weight_dtype: torch.dtype,
    pos_rows: int,
    pos_dtype: torch.dtype | None,
    positions: torch.Tensor | None,
    scale: float,
    padding_idx: int,
    seed: torch.Tensor | None,
    p: float,
    deterministic: bool,
    weight_grad: bool,
    pos_grad: bool,
) -> list[torch.Tensor]:
    return embedding_bwd(
        dy, ids, weight_rows, weight_dtype, pos_rows, pos_dtype, positions, scale, padding_idx, seed, p,
        deterministic, weight_grad, pos_grad,
    )  # fmt: skip


@_bwd_op.register_fake
def _(
    dy,
    ids,
    weight_rows,
    weight_dtype,
    pos_rows,
    pos_dtype,
    positions,
    scale,
    padding_idx,
    seed,
    p,
    deterministic,
    weight_grad,
    pos_grad,
):
    grads = [dy.new_empty((weight_rows, dy.shape[-1]), dtype=weight_dtype)] if weight_grad else []
    return grads + ([dy.new_empty((pos_rows, dy.shape[-1]), dtype=pos_dtype)] if pos_grad else [])


class EmbeddingFunction(torch.autograd.Function):
    """Autograd for :func:`embedding`; saves the ids (and positions) and the seed."""

    @staticmethod
    def forward(ctx, ids, weight, pos_weight, positions, scale, padding_idx, seed, p, deterministic):
        fwd = _fwd_op if torch.compiler.is_compiling() else embedding_fwd
        y = fwd(ids, weight, pos_weight, positions, scale, padding_idx, seed, p)
        ctx.save_for_backward(ids, positions, seed)
        ctx.tables = (weight.shape[0], weight.dtype, 0 if pos_weight is None else pos_weight.shape[0])
        ctx.pos_dtype = None if pos_weight is None else pos_weight.dtype
        ctx.options = (scale, padding_idx, p, deterministic)
        return y

    @staticmethod
    def backward(ctx, dy):
        ids, positions, seed = ctx.saved_tensors
        scale, padding_idx, p, deterministic = ctx.options
        rows, dtype, pos_rows = ctx.tables
        weight_grad, pos_grad = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        bwd = _bwd_op if torch.compiler.is_compiling() else embedding_bwd
        grads = bwd(
            dy,
            ids,
            rows,
            dtype,
            pos_rows,
            ctx.pos_dtype,
            positions,
            scale,
            padding_idx,
            seed,
            p,
            deterministic,
            weight_grad,
            pos_grad,
        )
        dweight = grads[0] if weight_grad else None
        dpos_weight = grads[-1] if pos_grad else None
        return None, dweight, dpos_weight, None, None, None, None, None, None


def _check_ids(name: str, ids: torch.Tensor, rows: int, skip: int | None) -> None:
    bad = (ids < 0) | (ids >= rows)
    if skip is not None:
        bad &= ids != skip
    if bad.any():
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"embedding: {name} {int(ids[index])} at {index} is outside [0, {rows})")


def embedding(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    *,
    pos_weight: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    scale: float = 1.0,
    dropout: float = 0.0,
    padding_idx: int | None = None,
    training: bool = True,
    deterministic: bool | None = None,
    seed: torch.Tensor | None = None,
    check_ids: bool | None = None,
) -> torch.Tensor:
    """``dropout(scale * weight[tokens] + pos_weight[positions])`` in one kernel.

    Args:
        tokens: integer ids of any shape; the last dim is the sequence.
        weight: the ``[V, D]`` token table (float32/float16/bfloat16).
        pos_weight: optional ``[max_positions, D]`` position table.
        positions: position ids shaped like ``tokens``; default 0..seq_len-1 along the last dim.
        scale: multiplies the token rows (e.g. sqrt(D)).
        dropout: drop probability in [0, 1), applied when ``training``.
        padding_idx: tokens with this id give all-zero rows and no gradient.
        deterministic: sorted segment reduction instead of atomics in backward (bit-for-bit
            reproducible); default ``torch.are_deterministic_algorithms_enabled()``.
        seed: a 1-element int64 tensor fixing the dropout mask (drawn when None).
        check_ids: raise ValueError for ids or positions outside their tables; default on for
            CPU tensors, off on CUDA (the check would synchronise with the host), where such
            rows come out NaN and nothing outside the tables is read.

    Returns:
        ``[*tokens.shape, D]`` in weight's dtype.

    Raises:
        ValueError: non-integer ids, mismatched tables, devices or positions, a dropout
            outside [0, 1), or (when checked) an id or position out of range.
    """
    if tokens.dtype not in (torch.int64, torch.int32) or tokens.dim() == 0:
        raise ValueError(f"embedding: tokens must be int64 or int32 ids with at least one dim, got {tokens.dtype}")
    if weight.dim() != 2 or weight.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"embedding: weight must be a [V, D] float table, got {tuple(weight.shape)} {weight.dtype}")
    if pos_weight is not None and (pos_weight.dim() != 2 or pos_weight.shape[1] != weight.shape[1]):
        raise ValueError(
            f"embedding: pos_weight must be [max_positions, {weight.shape[1]}], got {tuple(pos_weight.shape)}"
        )
    if positions is not None and (pos_weight is None or positions.shape != tokens.shape):
        raise ValueError("embedding: positions need pos_weight and must be shaped like tokens")
    for name, t in (("tokens", tokens), ("pos_weight", pos_weight), ("positions", positions)):
        if t is not None and t.device != weight.device:
            raise ValueError(f"embedding: {name} is on {t.device} but weight is on {weight.device}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"embedding: dropout must be in [0, 1), got {dropout}")
    check = check_ids if check_ids is not None else not weight.is_cuda
    if check and not torch.compiler.is_compiling():
        _check_ids("token id", tokens, weight.shape[0], padding_idx)
        if positions is not None:
            _check_ids("position", positions, pos_weight.shape[0], None)
        elif pos_weight is not None and tokens.shape[-1] > pos_weight.shape[0]:
            raise ValueError(f"embedding: seq_len {tokens.shape[-1]} exceeds max_positions {pos_weight.shape[0]}")
    active = training and dropout > 0
    deterministic = torch.are_deterministic_algorithms_enabled() if deterministic is None else deterministic
    backend = _backend.backend_for(weight)
    _backend.note("embedding", backend)
    padding = -1 if padding_idx is None else padding_idx
    if backend == "reference":
        return embedding_ref(tokens, weight, pos_weight=pos_weight, positions=positions, scale=scale,
                             dropout=dropout if active else 0.0, padding_idx=padding_idx)  # fmt: skip
    if active and seed is None:
        seed = new_seed(weight.device)
    return EmbeddingFunction.apply(
        tokens,
        weight,
        pos_weight,
        positions,
        float(scale),
        padding,
        seed if active else None,
        float(dropout),
        deterministic,
    )


def embedding_ref(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    *,
    pos_weight: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    scale: float = 1.0,
    dropout: float = 0.0,
    padding_idx: int | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch in fp32; ``mask`` (bool, the output's shape) fixes the dropout."""
    compute = torch.float64 if weight.dtype == torch.float64 else torch.float32
    v = torch.nn.functional.embedding(tokens.long(), weight.to(compute)) * scale
    if pos_weight is not None:
        pos = positions if positions is not None else torch.arange(tokens.shape[-1], device=tokens.device)
        v = v + torch.nn.functional.embedding(pos.long(), pos_weight.to(compute))
    if padding_idx is not None:
        v = v.masked_fill((tokens == padding_idx)[..., None], 0.0)
    if dropout > 0:
        keep = mask if mask is not None else torch.rand(v.shape, device=v.device) >= dropout
        v = torch.where(keep, v / (1 - dropout), 0.0)
    return v.to(weight.dtype)
