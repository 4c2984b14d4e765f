"""Transformer input embedding: y = dropout(scale * E[token] + P[position]) in one kernel.

Backward touches in fp32 only the table rows that tokens look up. The forward kernel,
which reads every id anyway, also counts how many tokens look up each row (integer
atomics: the same counts in any order); with the counts, rows nobody looked up are written
as zeros and a row looked up once takes its token's gradient directly. By default a row
looked up by several tokens sums their gradients with atomic adds into one of its tokens'
slots (fp32, or fp64 for an fp32 table; cast to the weight's dtype at the end): fast, but
the summation order, hence the last bits, can vary from run to run. The deterministic mode (on when
``torch.are_deterministic_algorithms_enabled()``, or asked for) sorts the ids instead and
sums each run of equal ids in token order, a frequent token's run in parallel chunks
combined in order: the same bits on every run. The position table's gradient, when
positions come from the token index, is a fixed-order sum over the sequences in either
mode (no sort, no atomics); explicit positions go the token table's way. The dropout mask
is regenerated from its Philox seed; it is never stored. A tied LM head can read the token
table as the op's second output (``return_table``): the head's gradient then arrives in
this backward, and the table's gradient is written in one pass, each row the head's plus
its tokens' sum, rounded once (no [V, D] gradient of the embedding's own for autograd to
add to the head's: GPT-2's 50257 x 1024 table is 103 MB a pass).

Tokens equal to ``padding_idx`` give all-zero output rows and no gradient. Ids or
positions outside their tables are never read: their output rows are NaN (and, for CPU
tensors or with ``check_ids=True``, a ValueError names them first).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from lstrain import _backend
from lstrain._backend import wait_for_producers
from lstrain.ops._lib.custom_op import kernel_op
from lstrain.ops._lib.dropout import (
    ElementwisePlan,
    apply_dropout,
    check_seed,
    dropout_keep,
    dropout_mask,
    dropout_scale,
    elementwise_plan,
    new_seed,
)
from lstrain.ops._lib.first_order import refuse_create_graph
from lstrain.ops._lib.layout import cdiv, contiguous_or_none, grad_place, placeable
from lstrain.ops._lib.options import check_tensors, float_option, int_option

__all__ = ["EmbeddingFunction", "embedding", "embedding_bwd", "embedding_fwd", "embedding_ref", "gather_plan"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Places of the sorted ids one program sums in the deterministic backward: a token looked
# up more often is summed by several programs, whose partial sums are then combined.
_RUN_CHUNK = 64


@triton.jit
def _count_ids(ids, token, valid, count_ptr, owner_ptr):
    """count[r] += how many of these tokens look up table row r; owner[r] = 1 + the last
    token that does (so that one zero fill starts both). Integer atomics give the same
    result in any order; relaxed, as they order no other memory."""
    tl.atomic_add(count_ptr + ids, 1, mask=valid, sem="relaxed")
    tl.atomic_max(owner_ptr + ids, token.to(tl.int32) + 1, mask=valid, sem="relaxed")


@triton.jit(do_not_specialize=["vocab", "max_positions", "seq_len", "padding_idx"])
def _embedding_fwd_kernel(
    ids_ptr,
    positions_ptr,
    weight_ptr,
    pos_weight_ptr,
    y_ptr,
    seed_ptr,
    count_ptr,
    owner_ptr,
    tokens,
    dim,
    vocab,
    max_positions,
    seq_len,
    padding_idx,
    scale,
    p,
    keep_scale,
    HAS_POS: tl.constexpr,
    EXPLICIT_POSITIONS: tl.constexpr,
    DROPOUT: tl.constexpr,
    COUNT: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """y rows of BLOCK_TOKENS tokens; with COUNT also the backward's per-row counts of the
    token table, while the ids are at hand (the first column block counts)."""
    wait_for_producers(PDL)
    token = tl.program_id(0).to(tl.int64) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    col = tl.program_id(1) * BLOCK_DIM + tl.arange(0, BLOCK_DIM)
    token_ok = token < tokens
    mask = token_ok[:, None] & (col < dim)[None, :]
    ids = tl.load(ids_ptr + token, mask=token_ok, other=0).to(tl.int64)
    bad = (ids < 0) | (ids >= vocab)
    padded = (ids == padding_idx) & ~bad
    row_ok = ~(bad | padded)
    if COUNT:
        if tl.program_id(1) == 0:
            _count_ids(ids, token, token_ok & row_ok, count_ptr, owner_ptr)
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
        v = apply_dropout(v, keep, keep_scale)
    v = tl.where(bad[:, None], float("nan"), v)
    tl.store(y_ptr + offsets, v.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_gradient(
    dy_ptr, seed_ptr, token, col, col_ok, dim, p, keep_scale, DROPOUT: tl.constexpr, BLOCK_DIM: tl.constexpr
):
    """dy of one token's row, with that row's dropout mask and rescale applied (fp32)."""
    g = tl.load(dy_ptr + token * dim + col, mask=col_ok, other=0.0).to(tl.float32)
    if DROPOUT:
        keep = dropout_keep(seed_ptr, token + tl.zeros([1], tl.int64), tl.program_id(1) * BLOCK_DIM, dim, p, BLOCK_DIM)
        g = apply_dropout(g, tl.reshape(keep, [BLOCK_DIM]), keep_scale)
    return g


@triton.jit
def _tile_gradient(
    dy_ptr, seed_ptr, token, col, mask, dim, p, keep_scale, DROPOUT: tl.constexpr, BLOCK_DIM: tl.constexpr
):
    """dy of the tokens' rows [len(token), BLOCK_DIM] (fp32, masked rows read nothing), with
    their dropout mask and rescale applied."""
    g = tl.load(dy_ptr + token[:, None] * dim + col[None, :], mask=mask, other=0.0).to(tl.float32)
    if DROPOUT:
        keep = dropout_keep(seed_ptr, token, tl.program_id(1) * BLOCK_DIM, dim, p, BLOCK_DIM)
        g = apply_dropout(g, keep, keep_scale)
    return g


@triton.jit(do_not_specialize=["rows", "padding_idx"])
def _count_kernel(
    ids_ptr,
    count_ptr,
    owner_ptr,
    tokens,
    rows,
    padding_idx,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Per-row counts of a table looked up at ``ids`` (see :func:`_count_ids`); padding
    and out-of-range ids are not counted."""
    wait_for_producers(PDL)
    token = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + token, mask=token < tokens, other=-1).to(tl.int64)
    _count_ids(ids, token, (token < tokens) & (ids >= 0) & (ids < rows) & (ids != padding_idx), count_ptr, owner_ptr)


@triton.jit
def _plus_base(total, base_ptr, offsets, mask, HAS_BASE: tl.constexpr):
    """``total`` (fp32) plus the ``base`` table's elements at ``offsets`` where HAS_BASE:
    a gradient that arrived for the same table (a tied LM head's), added before the one
    rounding into the table."""
    if HAS_BASE:
        total += tl.load(base_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    return total


@triton.jit
def _scatter_phase(
    dy_ptr,
    ids_ptr,
    count_ptr,
    owner_ptr,
    sums_ptr,
    table_ptr,
    base_ptr,
    seed_ptr,
    block,
    tokens,
    dim,
    rows,
    padding_idx,
    scale,
    p,
    keep_scale,
    PHASE: tl.constexpr,
    HAS_BASE: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    """The atomic backward over token block ``block``, in three launches. PHASE 0: a row
    looked up by one token gets that token's gradient, cast and written straight into
    the table; the owner (last token) of a row looked up more often stores its gradient
    as the row's fp32 sum (``sums``, indexed by token). PHASE 1: every other token
    atomically adds its gradient into its owner's sum. PHASE 2: owners cast their sums
    into the table. Only the rows that tokens look up are touched in fp32. With HAS_BASE
    a row written is its ``base`` row plus its sum, rounded once."""
    token = block.to(tl.int64) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    col = tl.program_id(1) * BLOCK_DIM + tl.arange(0, BLOCK_DIM)
    col_ok = (col < dim)[None, :]
    ids = tl.load(ids_ptr + token, mask=token < tokens, other=-1).to(tl.int64)
    valid = (token < tokens) & (ids >= 0) & (ids < rows) & (ids != padding_idx)
    count = tl.load(count_ptr + ids, mask=valid, other=0)
    owner = tl.load(owner_ptr + ids, mask=valid, other=0).to(tl.int64) - 1
    shared = valid & (count > 1)
    p = tl.cast(p, tl.float32)
    if PHASE == 0:
        alone = valid & (count == 1)
        owns = shared & (owner == token)
        g = _tile_gradient(
            dy_ptr, seed_ptr, token, col, (alone | owns)[:, None] & col_ok, dim, p, keep_scale, DROPOUT, BLOCK_DIM
        )
        g *= tl.cast(scale, tl.float32)
        row_offsets = ids[:, None] * dim + col[None, :]
        g_alone = _plus_base(g, base_ptr, row_offsets, alone[:, None] & col_ok, HAS_BASE)
        tl.store(table_ptr + row_offsets, g_alone.to(table_ptr.dtype.element_ty), mask=alone[:, None] & col_ok)
        tl.store(
            sums_ptr + token[:, None] * dim + col[None, :], g.to(sums_ptr.dtype.element_ty), mask=owns[:, None] & col_ok
        )
    elif PHASE == 1:
        later = shared & (owner != token)
        if tl.max(later.to(tl.int32), axis=0) > 0:  # most tiles: skip the dropout draws
            g = _tile_gradient(
                dy_ptr, seed_ptr, token, col, later[:, None] & col_ok, dim, p, keep_scale, DROPOUT, BLOCK_DIM
            )
            g *= tl.cast(scale, tl.float32)
            owner_sums = sums_ptr + owner[:, None] * dim + col[None, :]
            tl.atomic_add(owner_sums, g.to(sums_ptr.dtype.element_ty), mask=later[:, None] & col_ok, sem="relaxed")
    else:
        owns = shared & (owner == token)
        if tl.max(owns.to(tl.int32), axis=0) > 0:
            mask = owns[:, None] & col_ok
            s = tl.load(sums_ptr + token[:, None] * dim + col[None, :], mask=mask, other=0.0).to(tl.float32)
            row_offsets = ids[:, None] * dim + col[None, :]
            s = _plus_base(s, base_ptr, row_offsets, mask, HAS_BASE)
            tl.store(table_ptr + row_offsets, s.to(table_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["rows", "padding_idx"])
def _scatter_kernel(
    dy_ptr,
    ids_ptr,
    count_ptr,
    owner_ptr,
    sums_ptr,
    table_ptr,
    base_ptr,
    seed_ptr,
    tokens,
    dim,
    rows,
    padding_idx,
    scale,
    p,
    keep_scale,
    PHASE: tl.constexpr,
    HAS_BASE: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Phases 1 and 2 of the atomic backward (see :func:`_scatter_phase`). A kernel of its
    own rather than a role of :func:`_first_pass_kernel`: its launches take 14 arguments
    instead of 19, and a Triton launch's host time grows with its arguments."""
    wait_for_producers(PDL)
    _scatter_phase(
        dy_ptr, ids_ptr, count_ptr, owner_ptr, sums_ptr, table_ptr, base_ptr, seed_ptr, tl.program_id(0), tokens, dim,
        rows, padding_idx, scale, p, keep_scale, PHASE, HAS_BASE, DROPOUT, BLOCK_TOKENS, BLOCK_DIM,
    )  # fmt: skip


@triton.jit
def _unused_rows(
    table_ptr, base_ptr, count_ptr, block, rows, dim, HAS_BASE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):  # fmt: skip
    """The table rows of row block ``block`` that no token looked up: zeros, or their
    ``base`` rows with HAS_BASE; the others are written by the scatter or the run sums,
    in any order relative to these."""
    row = block.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    col = tl.program_id(1) * BLOCK_DIM + tl.arange(0, BLOCK_DIM)
    unused = tl.load(count_ptr + row, mask=row < rows, other=1) == 0
    mask = unused[:, None] & (col < dim)[None, :]
    offsets = row[:, None] * dim + col[None, :]
    if HAS_BASE:
        values = tl.load(base_ptr + offsets, mask=mask, other=0.0).to(table_ptr.dtype.element_ty)
    else:
        values = tl.zeros([BLOCK_ROWS, BLOCK_DIM], dtype=table_ptr.dtype.element_ty)
    tl.store(table_ptr + offsets, values, mask=mask)


@triton.jit
def _position_row(
    dy_ptr,
    ids_ptr,
    table_ptr,
    seed_ptr,
    row,
    dim,
    seq_len,
    sequences,
    padding_idx,
    p,
    keep_scale,
    DROPOUT: tl.constexpr,
    BLOCK_SEQUENCES: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    """Row ``row`` of the gradient of a position table looked up at token index %
    seq_len: the sum of the gradient rows of tokens row, row + seq_len, ... (padding tokens
    left out) in a fixed order, BLOCK_SEQUENCES at a time; rows from seq_len on are zero.
    Deterministic in either mode: no sort, no atomics."""
    row = row.to(tl.int64)
    col = tl.program_id(1) * BLOCK_DIM + tl.arange(0, BLOCK_DIM)
    col_ok = (col < dim)[None, :]
    p = tl.cast(p, tl.float32)
    acc = tl.zeros([BLOCK_SEQUENCES, BLOCK_DIM], dtype=tl.float32)
    for first in range(0, tl.where(row < seq_len, sequences, 0), BLOCK_SEQUENCES):
        token = row + (first + tl.arange(0, BLOCK_SEQUENCES)) * seq_len
        in_range = first + tl.arange(0, BLOCK_SEQUENCES) < sequences
        ids = tl.load(ids_ptr + token, mask=in_range, other=padding_idx)
        mask = (in_range & (ids != padding_idx))[:, None] & col_ok
        acc += _tile_gradient(dy_ptr, seed_ptr, token, col, mask, dim, p, keep_scale, DROPOUT, BLOCK_DIM)
    total = tl.sum(acc, axis=0)
    tl.store(table_ptr + row * dim + col, total.to(table_ptr.dtype.element_ty), mask=col < dim)


@triton.jit(do_not_specialize=["seq_len", "sequences", "padding_idx", "scatter_programs", "zero_programs"])
def _first_pass_kernel(
    dy_ptr,
    ids_ptr,
    count_ptr,
    owner_ptr,
    sums_ptr,
    table_ptr,
    base_ptr,
    pos_table_ptr,
    seed_ptr,
    tokens,
    dim,
    rows,
    seq_len,
    sequences,
    padding_idx,
    scale,
    p,
    keep_scale,
    scatter_programs,
    zero_programs,
    SCATTER: tl.constexpr,
    ZERO: tl.constexpr,
    HAS_BASE: tl.constexpr,
    POSITIONS: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """All of the backward that needs no more than the counts, in one launch (each launch
    fewer saves host time): programs [0, scatter_programs) run phase 0 of the
    atomic scatter, the next zero_programs write the unused table rows (zeros, or the
    ``base`` rows with HAS_BASE), and the rest sum
    one position-table row each (positions from the token index). The constexpr flags
    leave out the roles a launch has no programs (and maybe no pointers) for."""
    wait_for_producers(PDL)
    pid = tl.program_id(0)
    if pid < scatter_programs:
        if SCATTER:
            _scatter_phase(
                dy_ptr, ids_ptr, count_ptr, owner_ptr, sums_ptr, table_ptr, base_ptr, seed_ptr, pid, tokens, dim, rows,
                padding_idx, scale, p, keep_scale, 0, HAS_BASE, DROPOUT, BLOCK_TOKENS, BLOCK_DIM,
            )  # fmt: skip
    elif pid < scatter_programs + zero_programs:
        if ZERO:
            _unused_rows(
                table_ptr, base_ptr, count_ptr, pid - scatter_programs, rows, dim, HAS_BASE, BLOCK_TOKENS, BLOCK_DIM
            )
    elif POSITIONS:
        _position_row(
            dy_ptr, ids_ptr, pos_table_ptr, seed_ptr, pid - scatter_programs - zero_programs, dim, seq_len,
            sequences, padding_idx, p, keep_scale, DROPOUT, BLOCK_TOKENS, BLOCK_DIM,
        )  # fmt: skip


@triton.jit
def _tokens_sum(
    dy_ptr, order_ptr, seed_ptr, begin, end, col, col_ok, dim, p, keep_scale, DROPOUT, BLOCK_TOKENS, BLOCK_DIM
):
    """Sum of the gradient rows of tokens ``order[begin:end]``, in a fixed order (fp32)."""
    if end - begin == 1:
        total = _row_gradient(
            dy_ptr, seed_ptr, tl.load(order_ptr + begin), col, col_ok, dim, p, keep_scale, DROPOUT, BLOCK_DIM
        )
    else:
        acc = tl.zeros([BLOCK_TOKENS, BLOCK_DIM], dtype=tl.float32)
        for first in range(begin, end, BLOCK_TOKENS):
            place = first + tl.arange(0, BLOCK_TOKENS)
            token = tl.load(order_ptr + place, mask=place < end, other=0)
            mask = (place < end)[:, None] & col_ok[None, :]
            acc += _tile_gradient(dy_ptr, seed_ptr, token, col, mask, dim, p, keep_scale, DROPOUT, BLOCK_DIM)
        total = tl.sum(acc, axis=0)
    return total


@triton.jit(do_not_specialize=["key_offset", "rows", "padding_idx"])
def _run_sum_kernel(
    dy_ptr,
    sorted_ids_ptr,
    key_offset,
    order_ptr,
    run_start_ptr,
    count_ptr,
    partials_ptr,
    table_ptr,
    base_ptr,
    seed_ptr,
    dim,
    rows,
    padding_idx,
    scale,
    p,
    keep_scale,
    COMBINE: tl.constexpr,
    HAS_BASE: tl.constexpr,
    DROPOUT: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The deterministic backward, over the stably sorted ids, where a row's tokens form a
    run in token order. A run is cut into chunks of CHUNK places, each summed by the
    program at its first place (the other programs return at once), so that a frequent
    token's run is summed in parallel: a run of one chunk is written to the table
    directly, a longer one as fp32 partial sums, which the COMBINE launch adds up in
    chunk order. Every sum has a fixed order: the same bits on every run. With HAS_BASE a
    row written is its ``base`` row plus its sum, rounded once."""
    wait_for_producers(PDL)
    i = tl.program_id(0)
    row = tl.load(sorted_ids_ptr + i).to(tl.int64) + key_offset
    start = tl.load(run_start_ptr + i)
    valid = (row >= 0) & (row < rows) & (row != padding_idx)
    count = tl.load(count_ptr + row, mask=valid, other=0)
    col = tl.program_id(1) * BLOCK_DIM + tl.arange(0, BLOCK_DIM)
    col_ok = col < dim
    if COMBINE:
        if valid & (i == start) & (count > CHUNK):
            acc = tl.zeros([BLOCK_TOKENS, BLOCK_DIM], dtype=tl.float32)
            for first in range(start, start + count, CHUNK * BLOCK_TOKENS):
                place = first + tl.arange(0, BLOCK_TOKENS) * CHUNK
                mask = (place < start + count)[:, None] & col_ok[None, :]
                acc += tl.load(partials_ptr + place.to(tl.int64)[:, None] * dim + col[None, :], mask=mask, other=0.0)
            total = tl.sum(acc, axis=0) * tl.cast(scale, tl.float32)
            total = _plus_base(total, base_ptr, row * dim + col, col_ok, HAS_BASE)
            tl.store(table_ptr + row * dim + col, total.to(table_ptr.dtype.element_ty), mask=col_ok)
    elif valid & ((i - start) % CHUNK == 0):
        p = tl.cast(p, tl.float32)
        end = tl.minimum(i + CHUNK, start + count)
        total = _tokens_sum(
            dy_ptr, order_ptr, seed_ptr, i, end, col, col_ok, dim, p, keep_scale, DROPOUT, BLOCK_TOKENS, BLOCK_DIM
        )
        if count <= CHUNK:
            total *= tl.cast(scale, tl.float32)
            total = _plus_base(total, base_ptr, row * dim + col, col_ok, HAS_BASE)
            tl.store(table_ptr + row * dim + col, total.to(table_ptr.dtype.element_ty), mask=col_ok)
        else:
            tl.store(partials_ptr + i.to(tl.int64) * dim + col, total, mask=col_ok)


@functools.cache
def gather_plan(dim: int) -> ElementwisePlan:
    """Tiles of the kernels that gather or scatter whole table rows (forward, atomic
    backward, its first pass), a pure function: about 1024 elements on 2 warps, so one
    program per token at D >= 1024. More, smaller programs keep more id -> row load chains
    in flight (faster than 4 rows on 4 warps)."""
    block_cols = elementwise_plan(dim).block_cols
    return ElementwisePlan(max(1, 1024 // block_cols), block_cols, num_warps=2)


def embedding_fwd(
    ids: torch.Tensor,
    weight: torch.Tensor,
    pos_weight: torch.Tensor | None,
    positions: torch.Tensor | None,
    scale: float,
    padding_idx: int,
    seed: torch.Tensor | None,
    p: float,
    count: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on validated inputs: ``(y, counts)``, y [*ids.shape, D] in
    weight's dtype, counts the [2, V] int32 per-row counts and owners the backward of the
    token table needs when ``count`` (else an empty tensor)."""
    dim = weight.shape[1]
    flat = ids.reshape(-1).contiguous()
    y = torch.empty((*ids.shape, dim), dtype=weight.dtype, device=weight.device)
    counts = torch.zeros((2, weight.shape[0]) if count else (0,), dtype=torch.int32, device=weight.device)
    tokens = flat.numel()
    if tokens == 0 or dim == 0:
        return y, counts
    plan = gather_plan(dim)
    flat_positions = None if positions is None else positions.reshape(-1).contiguous()
    count_ptr, owner_ptr = counts if count else (None, None)
    _embedding_fwd_kernel[(cdiv(tokens, plan.block_rows), cdiv(dim, plan.block_cols))](
        flat, flat_positions, weight, pos_weight, y, seed, count_ptr, owner_ptr,
        tokens, dim, weight.shape[0], 0 if pos_weight is None else pos_weight.shape[0],
        ids.shape[-1], padding_idx, scale, p, dropout_scale(p),
        HAS_POS=pos_weight is not None,
        EXPLICIT_POSITIONS=positions is not None,
        DROPOUT=seed is not None,
        COUNT=count,
        BLOCK_TOKENS=plan.block_rows,
        BLOCK_DIM=plan.block_cols,
        num_warps=plan.num_warps,
        **_backend.dependent_launch(flat),
    )  # fmt: skip
    return y, counts


def _first_pass(dy, ids, counts, sums, table, pos_table, seq_len, padding_idx, scale, seed, p, scatter, base=None):
    """Launch :func:`_first_pass_kernel`: phase 0 of the scatter (``scatter``), the unused
    rows of ``table`` (when given; ``base``'s rows where that is given, else zeros) and the
    position-table rows (``pos_table`` given)."""
    tokens, dim = dy.shape
    tiles = gather_plan(dim)
    scatter_programs = cdiv(tokens, tiles.block_rows) if scatter else 0
    rows = 0 if table is None else table.shape[0]
    zero_programs = cdiv(rows, tiles.block_rows)
    programs = scatter_programs + zero_programs + (0 if pos_table is None else pos_table.shape[0])
    if programs == 0 or dim == 0:
        return
    count_ptr, owner_ptr = (None, None) if counts is None else counts
    _first_pass_kernel[(programs, cdiv(dim, tiles.block_cols))](
        dy, ids, count_ptr, owner_ptr, sums, table, base, pos_table, seed,
        tokens, dim, rows, seq_len, tokens // max(seq_len, 1), padding_idx, scale, p, dropout_scale(p),
        scatter_programs, zero_programs,
        SCATTER=scatter_programs > 0, ZERO=zero_programs > 0, HAS_BASE=base is not None,
        POSITIONS=pos_table is not None, DROPOUT=seed is not None, BLOCK_TOKENS=tiles.block_rows,
        BLOCK_DIM=tiles.block_cols,
        num_warps=tiles.num_warps,
        **_backend.dependent_launch(dy),
    )  # fmt: skip


def _table_gradient(
    dy, ids, counts, rows, dtype, padding_idx, scale, seed, p, deterministic, pos_table, seq_len, place=None,
    base=None,
):  # fmt: skip
    """Gradient of a [rows, D] table looked up at ``ids`` (padding and out-of-range ids left
    out), plus ``base`` (a contiguous gradient of the same table, or None), from its per-row
    ``counts`` (counted here when None), written into ``place`` when given (every row of
    it); the rows of ``pos_table``, if given, are summed in the same first launch."""
    tokens, dim = dy.shape
    table = torch.empty((rows, dim), dtype=dtype, device=dy.device) if place is None else place
    if counts is None:
        counts = torch.zeros((2, rows), dtype=torch.int32, device=dy.device)
        if tokens:
            _count_kernel[(cdiv(tokens, 256),)](
                ids, *counts, tokens, rows, padding_idx, BLOCK=256, **_backend.dependent_launch(ids)
            )
    atomic = not deterministic and tokens > 0
    # fp64 sums for an fp32 table: in any order of the atomic adds, one rounding at the end
    # (in fp32, 408 adds into one row erred by 7.7e-6 where torch's sorted sum erred by 1e-6)
    sums_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    sums = torch.empty((tokens, dim), dtype=sums_dtype, device=dy.device) if atomic else None
    _first_pass(dy, ids, counts, sums, table, pos_table, seq_len, padding_idx, scale, seed, p, atomic, base)
    if tokens == 0 or rows == 0 or dim == 0:
        return table
    if atomic:
        tiles = gather_plan(dim)
        for phase in (1, 2):
            _scatter_kernel[(cdiv(tokens, tiles.block_rows), cdiv(dim, tiles.block_cols))](
                dy, ids, *counts, sums, table, base, seed, tokens, dim, rows, padding_idx, scale, p, dropout_scale(p),
                PHASE=phase, HAS_BASE=base is not None, DROPOUT=seed is not None, BLOCK_TOKENS=tiles.block_rows,
                BLOCK_DIM=tiles.block_cols, num_warps=tiles.num_warps,
                **_backend.dependent_launch(dy),
            )  # fmt: skip
        return table
    # The narrowest keys that hold [-1, rows] (bad ids clamped out of every row) sort in the
    # fewest radix passes: int16 for vocabularies up to 65534 rows.
    key_offset = 32767 if rows <= 65534 else 0
    keys = (ids.clamp(-1, rows) - key_offset).to(torch.int16 if key_offset else torch.int32)
    sorted_ids, order = torch.sort(keys, stable=True)
    run_start = torch.searchsorted(sorted_ids, sorted_ids, out_int32=True)
    partials = torch.empty((tokens, dim), dtype=torch.float32, device=dy.device)
    plan = elementwise_plan(dim)
    for combine in (False, True):
        _run_sum_kernel[(tokens, cdiv(dim, plan.block_cols))](
            dy, sorted_ids, key_offset, order, run_start, counts[0], partials, table, base, seed, dim, rows,
            padding_idx, scale, p, dropout_scale(p),
            COMBINE=combine, HAS_BASE=base is not None, DROPOUT=seed is not None, CHUNK=_RUN_CHUNK,
            BLOCK_TOKENS=plan.block_rows, BLOCK_DIM=plan.block_cols, num_warps=plan.num_warps,
            **_backend.dependent_launch(dy),
        )  # fmt: skip
    return table


def embedding_bwd(
    dy: torch.Tensor,
    ids: torch.Tensor,
    counts: torch.Tensor | None,
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
    tied_grad: torch.Tensor | None = None,
    into: Sequence[torch.Tensor | None] = (),
) -> list[torch.Tensor]:
    """dweight if ``weight_grad``, then dpos_weight if ``pos_grad`` (a list of 0 to 2);
    ``counts`` are the token table's from :func:`embedding_fwd` (None: counted here).
    ``tied_grad``: a gradient of the token table from elsewhere (a tied LM head's), added
    into dweight in the same pass (read, never written). ``into``: where to write
    (dweight, dpos_weight) where given (contiguous, e.g. the tables' places in flat
    gradient buffers)."""
    dim = dy.shape[-1]
    dy2d = dy.reshape(ids.numel(), dim).contiguous()
    flat = ids.reshape(-1).contiguous()
    seq_len = ids.shape[-1] if ids.dim() else 1
    weight_place, pos_place = (*into, None, None)[:2]
    pos_table = None
    if pos_grad and positions is None:  # summed by the token table's first launch
        pos_table = torch.empty((pos_rows, dim), dtype=pos_dtype, device=dy.device) if pos_place is None else pos_place
    grads = []
    if weight_grad:
        grads.append(
            _table_gradient(
                dy2d,
                flat,
                counts,
                weight_rows,
                weight_dtype,
                padding_idx,
                scale,
                seed,
                p,
                deterministic,
                pos_table,
                seq_len,
                weight_place,
                None if tied_grad is None else tied_grad.contiguous(),
            )
        )
    elif pos_table is not None:
        _first_pass(dy2d, flat, None, None, None, pos_table, seq_len, padding_idx, scale, seed, p, scatter=False)
    if pos_grad:
        if pos_table is None:
            # padding tokens take no position gradient: give them an id outside the table
            flat_positions = positions.reshape(-1).contiguous()
            if padding_idx >= 0:
                flat_positions = torch.where(flat == padding_idx, -1, flat_positions)
            pos_table = _table_gradient(
                dy2d, flat_positions, None, pos_rows, pos_dtype, -1, 1.0, seed, p, deterministic, None, seq_len,
                pos_place,
            )  # fmt: skip
        grads.append(pos_table)
    return grads


@kernel_op("embedding_fwd", embedding_fwd)
def embedding_fwd_op(
    ids: torch.Tensor,
    weight: torch.Tensor,
    pos_weight: torch.Tensor | None,
    positions: torch.Tensor | None,
    scale: float,
    padding_idx: int,
    seed: torch.Tensor | None,
    p: float,
    count: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    counts = weight.new_empty((2, weight.shape[0]) if count else (0,), dtype=torch.int32)
    return weight.new_empty((*ids.shape, weight.shape[1])), counts


@kernel_op("embedding_bwd", embedding_bwd)
def embedding_bwd_op(
    dy: torch.Tensor,
    ids: torch.Tensor,
    counts: torch.Tensor | None,
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
    tied_grad: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    grads = [dy.new_empty((weight_rows, dy.shape[-1]), dtype=weight_dtype)] if weight_grad else []
    return grads + ([dy.new_empty((pos_rows, dy.shape[-1]), dtype=pos_dtype)] if pos_grad else [])


class EmbeddingFunction(torch.autograd.Function):
    """Autograd for :func:`embedding`; saves the ids (and positions), the seed and, when the
    token table needs a gradient, its per-row counts (taken by the forward kernel).

    With ``return_table`` the token table is a second output (a view: the same values),
    for a tied LM head to read; the head's gradient then arrives in this backward as that
    output's, and the table's gradient is written once, the head's plus the looked-up
    rows', rather than as a [V, D] gradient of its own that autograd adds to the head's."""

    @staticmethod
    def forward(ctx, ids, weight, pos_weight, positions, scale, padding_idx, seed, p, deterministic, return_table):
        count = ctx.needs_input_grad[1]
        y, counts = embedding_fwd_op(ids, weight, pos_weight, positions, scale, padding_idx, seed, p, count)
        # the tables only as the parameters their gradients may be written into
        ctx.save_for_backward(ids, positions, seed, counts if count else None, placeable(weight), placeable(pos_weight))
        ctx.tables = (weight.shape[0], weight.dtype, 0 if pos_weight is None else pos_weight.shape[0])
        ctx.pos_dtype = None if pos_weight is None else pos_weight.dtype
        ctx.options = (scale, padding_idx, p, deterministic)
        if not return_table:
            return y
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not [V, D] zeros
        return y, weight.view_as(weight)

    @staticmethod
    def backward(ctx, dy, dtable=None):
        refuse_create_graph("embedding")
        if dy is None:  # only the table output was used
            return None, dtable, None, None, None, None, None, None, None, None
        ids, positions, seed, counts, weight, pos_weight = ctx.saved_tensors
        scale, padding_idx, p, deterministic = ctx.options
        rows, dtype, pos_rows = ctx.tables
        weight_grad, pos_grad = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        into = (grad_place(weight) if weight_grad else None, grad_place(pos_weight) if pos_grad else None)
        grads = embedding_bwd_op(
            dy, ids, counts, rows, dtype, pos_rows, ctx.pos_dtype, positions, scale, padding_idx, seed, p,
            deterministic, weight_grad, pos_grad, dtable, into=into,
        )  # fmt: skip
        dweight = grads[0] if weight_grad else None
        dpos_weight = grads[-1] if pos_grad else None
        return None, dweight, dpos_weight, None, None, None, None, None, None, None


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
    return_table: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``dropout(scale * weight[tokens] + pos_weight[positions])`` in one kernel.

    Args:
        tokens: integer ids of any shape; the last dim is the sequence.
        weight: the ``[V, D]`` token table (float32/float16/bfloat16).
        pos_weight: optional ``[max_positions, D]`` position table.
        positions: position ids shaped like ``tokens``; default 0..seq_len-1 along the last dim.
        scale: multiplies the token rows (e.g. sqrt(D)).
        dropout: drop probability in [0, 1), applied when ``training``.
        padding_idx: tokens with this id give all-zero rows and no gradient; negative
            counts from the end of the table, as in ``torch.nn.functional.embedding``.
        deterministic: sorted segment reduction instead of atomics in backward (bit-for-bit
            reproducible); default ``torch.are_deterministic_algorithms_enabled()``.
        seed: a 1-element int64 tensor on weight's device fixing the dropout mask (the
            same mask on every backend: see :func:`lstrain.ops.dropout_mask`, over the
            output's shape); drawn from torch's generator when None.
        check_ids: raise ValueError for ids or positions outside their tables; default on for
            CPU tensors, off on CUDA (the check would synchronise with the host), where such
            rows come out NaN and nothing outside the tables is read.
        return_table: also return ``weight`` as this op's output, for a tied LM head to
            read its weight from: the head's gradient then reaches this op's backward,
            which writes the table's whole gradient in one pass (the head's plus the
            looked-up rows'), where autograd would otherwise add a [V, D] gradient of the
            embedding's own to the head's.

    Returns:
        ``[*tokens.shape, D]`` in weight's dtype; with ``return_table``, ``(that,
        table)``, the table with weight's values (weight itself where nothing is
        differentiated).

    Raises:
        ValueError: a tensor argument that is no tensor (named), non-integer ids or
            positions (int64 / int32 only), 0-d tokens, 2**31 or more ids, mismatched
            tables, devices or positions, a padding_idx that is no integer in [-V, V), a
            dropout outside [0, 1), a scale that is not finite, a ``seed`` that is not a
            1-element int64 tensor on weight's device, or (when checked) an id or position
            out of range.
    """
    check_tensors("embedding", {"tokens": tokens, "weight": weight}, {"pos_weight": pos_weight, "positions": positions})
    if tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"embedding: tokens must be int64 or int32 ids, got {tokens.dtype}; convert with tokens.long()"
        )
    if tokens.dim() == 0:
        raise ValueError(
            "embedding: tokens must have at least one dim (the sequence), got a 0-d tensor; pass tokens[None]"
        )
    if tokens.numel() >= 2**31:
        raise ValueError(f"embedding: at most 2**31 - 1 tokens per call (their counts are int32), got {tokens.numel()}")
    if weight.dim() != 2 or weight.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"embedding: weight must be a [V, D] float table, got {tuple(weight.shape)} {weight.dtype}")
    if pos_weight is not None and (
        pos_weight.dim() != 2 or pos_weight.shape[1] != weight.shape[1] or pos_weight.dtype not in _SUPPORTED_DTYPES
    ):
        raise ValueError(
            f"embedding: pos_weight must be a [max_positions, {weight.shape[1]}] float table, got "
            f"{tuple(pos_weight.shape)} {pos_weight.dtype}"
        )
    if positions is not None and (pos_weight is None or positions.shape != tokens.shape):
        raise ValueError("embedding: positions need pos_weight and must be shaped like tokens")
    if positions is not None and positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"embedding: positions must be int64 or int32 ids, got {positions.dtype}; convert with positions.long()"
        )
    for name, t in (("tokens", tokens), ("pos_weight", pos_weight), ("positions", positions)):
        if t is not None and t.device != weight.device:
            raise ValueError(f"embedding: {name} is on {t.device} but weight is on {weight.device}")
    dropout = float_option("embedding", "dropout", dropout, 0, 1, high_open=True)
    scale = float_option("embedding", "scale", scale)
    check_seed("embedding", seed, weight.device)
    if padding_idx is not None:
        padding_idx = int_option("embedding", "padding_idx", padding_idx)
        if not -weight.shape[0] <= padding_idx < weight.shape[0]:
            raise ValueError(
                f"embedding: padding_idx must be in [-{weight.shape[0]}, {weight.shape[0]}), got {padding_idx}"
            )
        padding_idx %= weight.shape[0]  # the kernels take -1 for "no padding row"
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
    if active and seed is None:
        seed = new_seed(weight.device)
    if backend == "reference":  # the kernels' mask, drawn by plain PyTorch: a seed means one mask everywhere
        mask = dropout_mask(seed, (*tokens.shape, weight.shape[1]), dropout) if active else None
        y = embedding_ref(tokens, weight, pos_weight=pos_weight, positions=positions, scale=scale,
                          dropout=dropout if active else 0.0, padding_idx=padding_idx, mask=mask)  # fmt: skip
        return (y, weight) if return_table else y
    table = weight
    weight, pos_weight = weight.contiguous(), contiguous_or_none(pos_weight)  # rows addressed as row * D
    differentiated = torch.is_grad_enabled()
    if not differentiated:  # nothing will be differentiated: no row counts in forward
        weight, pos_weight = weight.detach(), None if pos_weight is None else pos_weight.detach()
    out = EmbeddingFunction.apply(
        tokens,
        weight,
        pos_weight,
        positions,
        scale,
        padding,
        seed if active else None,
        dropout,
        deterministic,
        return_table and differentiated,
    )
    return (out, table) if return_table and not differentiated else out


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
    """Plain PyTorch in fp32.

    Args:
        tokens, weight, pos_weight, positions, scale, dropout, padding_idx: as for
            :func:`embedding`.
        mask: bool, the output's shape: which elements dropout keeps; None lets torch's
            generator draw one.

    Returns:
        ``dropout(scale * weight[tokens] + pos_weight[positions])`` in weight's dtype, zero
        where a token is padding_idx.
    """
    compute = torch.float64 if weight.dtype == torch.float64 else torch.float32
    v = torch.nn.functional.embedding(tokens.long(), weight.to(compute)) * scale
    if pos_weight is not None:
        pos = positions if positions is not None else torch.arange(tokens.shape[-1], device=tokens.device)
        v = v + torch.nn.functional.embedding(pos.long(), pos_weight.to(compute))
    if padding_idx is not None:
        v = v.masked_fill((tokens == padding_idx)[..., None], 0.0)
    if dropout > 0:
        keep = mask if mask is not None else torch.rand(v.shape, device=v.device) >= dropout
        v = v * keep / (1 - dropout)
    return v.to(weight.dtype)
