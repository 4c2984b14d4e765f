"""Linear + cross-entropy (an LM head's loss) without ever holding the [tokens, V] logits.

Tokens are processed in chunks sized from a memory budget. For each chunk the logits
``hidden_c @ weight.T + bias`` are computed (cuBLAS, fp32 accumulation), the fused
cross-entropy kernel turns them *in place* into the gradient of the loss with respect to
them, and that gradient is folded at once into grad_hidden (one GEMM per chunk, rounded
once) and grad_weight. The weight gradient sums over chunks. When an fp32 [V, D] buffer
would need more memory than one chunk of logits (a large vocabulary: 2 GB for a
128256 x 4096 head) and there are at most ``MAX_16BIT_SUMS`` chunks, each chunk's product,
accumulated in fp32 inside its GEMM, is added to the running gradient in the weight's
dtype, one rounding per chunk, so that the only memory beyond the inputs and their
gradients is one chunk of logits. Otherwise the chunks sum in the fp32 buffer, rounded
once at the end: a 16-bit sum's error grows with the number of chunks, past PyTorch's own
(one rounding of one GEMM) by more than the tolerance rule allows. One chunk is one GEMM,
rounded once, straight into the weight's dtype. ``fp32_weight_grad`` forces either way. So the gradients are ready
when forward ends; backward multiplies them by grad_output, touching no memory when it is
exactly 1 (no host sync). With ``reduction="none"`` the per-row grad_output is needed, so
backward recomputes each chunk's logits instead.

A vocabulary that is not a multiple of 64 (GPT-2's 50257) would give the logits rows that
are not 16-byte aligned, which sends cuBLAS to its slow unaligned kernels: the weight is
copied once per call with zero rows appended, and each chunk's logits are a [rows, V] view
of the padded product (the user's vocabulary, loss and gradients are unchanged). For mean
and sum outside torch.compile the hidden gradient's GEMM then reads the whole padded
product, whose extra columns are zeros (NaN for a non-finite hidden row, as its loss is),
against the padded weight: its K (the vocabulary) is aligned too. (``reduction="none"``
recomputes an unpadded gradient; under torch.compile Inductor pads its own GEMMs.)
"""

from __future__ import annotations

import torch

from lstrain import _backend
from lstrain.ops._lib.autocast import autocast_inputs, loss_dtype
from lstrain.ops._lib.first_order import refuse_create_graph
from lstrain.ops._lib.layout import cdiv
from lstrain.ops._lib.options import check_tensors
from lstrain.ops.cross_entropy import (
    check_loss_options,
    check_target_range,
    count_kept_rows,
    cross_entropy_ref,
    loss_and_gradient,
    recompute_gradient,
    reduce_row_losses,
    rescale_gradient,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_16BIT_SUMS",
    "MIN_CHUNK_BYTES",
    "LinearCrossEntropyFunction",
    "chunk_rows",
    "linear_cross_entropy",
    "linear_cross_entropy_ref",
]

# The most one chunk's logits may take. Every chunk after the first reads and writes the
# weight gradient (V x D), so fewer, larger chunks cost less (docs/notes/linear_cross_entropy.md).
DEFAULT_CHUNK_BYTES = 512 * 2**20
# Chunks whose weight gradients may be summed in a 16-bit dtype (one rounding each).
MAX_16BIT_SUMS = 4
# 16-bit logits that fit in MAX_16BIT_SUMS chunks are split into up to that many (a
# quarter of the logits' memory for up to three more passes over a 16-bit weight
# gradient), of about this size: below it the memory saved is not worth a launch.
MIN_CHUNK_BYTES = 128 * 2**20
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def chunk_rows(tokens: int, vocab: int, element_size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES, dim: int = 0) -> int:
    """Tokens per chunk so that a chunk's [rows, vocab] logits fit in ``chunk_bytes``.

    16-bit logits that fit in ``MAX_16BIT_SUMS`` such chunks are split evenly into chunks
    of about ``MIN_CHUNK_BYTES`` (the nearest count), at most ``MAX_16BIT_SUMS``, when
    the weight gradient's sum then stays in its 16-bit dtype (an fp32 [vocab, dim] sum
    would be larger than one chunk): each more chunk costs one pass over the 16-bit weight
    gradient, and the peak holds a quarter of the logits instead of all of them
    (LLaMA-0.75B's 8192 x 32000 bf16: 125 MiB, not 500). Where the sum is fp32 every
    chunk costs a pass over 4 x vocab x dim bytes, and the budget alone decides.
    A multiple of 64 rows (GEMM tiles) when the budget allows, at least 1, at most ``tokens``.

    Args:
        tokens, vocab: the logits' shape.
        element_size: bytes per logit (the inputs' dtype).
        chunk_bytes: the most one chunk's logits may take.
        dim: the hidden width (0: none given, no split).

    Returns:
        The rows per chunk.
    """
    row_bytes = max(1, vocab * element_size)
    rows = max(1, chunk_bytes // row_bytes)
    if element_size == 2 and tokens <= MAX_16BIT_SUMS * rows:
        chunks = max(1, min(MAX_16BIT_SUMS, (tokens * row_bytes + MIN_CHUNK_BYTES // 2) // MIN_CHUNK_BYTES))
        split = cdiv(cdiv(tokens, chunks), 64) * 64
        if chunks > 1 and 4 * vocab * dim > split * row_bytes:
            rows = min(rows, split)
    if rows >= 64:
        rows -= rows % 64
    return max(1, min(tokens, rows))


def _accumulate_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: int = 1) -> None:
    """acc = beta * acc + a @ b, the product accumulated in fp32 and added with one rounding;
    at beta 0 acc is not read (it may hold anything: no zero fill before a first chunk)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b, beta=beta)  # cuBLAS adds the fp32 product to C before rounding it
        return
    if acc.is_cuda and not torch.compiler.is_compiling():  # fake tensors cannot run addmm's out_dtype
        try:
            # 16-bit inputs, fp32 output (torch >= 2.8)
            torch.addmm(acc, a, b, out_dtype=acc.dtype, beta=beta, out=acc)
            return
        except TypeError:
            pass
    acc.addmm_(a.to(acc.dtype), b.to(acc.dtype), beta=beta)  # no mixed-precision GEMM here: upcast the chunk


class _ChunkGradients:
    """Gradients of hidden (written chunk by chunk), weight (summed over chunks, in fp32 when
    asked) and bias (summed in fp32: V floats).

    The weight gradient's buffer has ``weight_rows`` rows (the padded product's width where
    the chunks' gradients come padded): its GEMM then reads the whole padded product, whose
    M is aligned (an odd vocabulary's M sent cuBLAS's fp32-output GEMM to cutlass_80, 1.74 ms
    for GPT-2 medium's two chunks against 1.12 for bf16 nvjet); the rows past V are dropped."""

    def __init__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        needs: tuple[bool, bool, bool],
        fp32_weight_grad: bool,
        weight_rows: int,
    ) -> None:
        vocab = self.vocab = weight.shape[0]
        weight_dtype = torch.float32 if fp32_weight_grad else weight.dtype
        self.hidden = torch.empty_like(hidden) if needs[0] else None
        # the first chunk writes the weight gradient whole; with no tokens there is none
        alloc = torch.empty if hidden.shape[0] else torch.zeros
        shape = (weight_rows, weight.shape[1])
        self.weight = alloc(shape, dtype=weight_dtype, device=weight.device) if needs[1] else None
        self.bias = torch.zeros(vocab, dtype=torch.float32, device=weight.device) if needs[2] else None

    def add(self, rows: slice, grad_logits: torch.Tensor, hidden_c: torch.Tensor, weight: torch.Tensor) -> None:
        """Fold one chunk's ``grad_logits`` [rows, V] into the gradients; ``weight`` is [V, D],
        or [V_padded, D] with zero rows appended when ``grad_logits`` is a [rows, V_padded]
        product whose extra columns are zeros (an aligned GEMM K for the hidden gradient)."""
        if self.hidden is not None:
            torch.mm(grad_logits, weight, out=self.hidden[rows])  # no product buffer, no copy
        if self.weight is not None:
            # the leading rows (contiguous); the buffer itself when it is not padded: under
            # torch.compile a sliced out= view failed AOTAutograd on the H200
            width = grad_logits.shape[1]
            target = self.weight if width == self.weight.shape[0] else self.weight[:width]
            first = rows.start == 0
            if first and target.dtype == grad_logits.dtype:
                torch.mm(grad_logits.t(), hidden_c, out=target)  # no zero fill, no read
            else:
                _accumulate_product(target, grad_logits.t(), hidden_c, beta=0 if first else 1)
        if self.bias is not None:
            self.bias += grad_logits[:, : self.vocab].sum(dim=0, dtype=torch.float32)

    def weight_grad(self, dtype: torch.dtype) -> torch.Tensor | None:
        if self.weight is None:
            return None
        rows = self.weight if self.weight.shape[0] == self.vocab else self.weight[: self.vocab]
        return rows.to(dtype)


# Row stride of a chunk's logits, in elements: cuBLAS falls back to slow unaligned kernels
# for an output (and later an operand) whose rows are not 16-byte aligned, as GPT-2's odd
# vocabulary of 50257 makes them; a padded stride keeps the user's vocabulary.
_LOGITS_ROW_ALIGNMENT = 64


def _padded_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [V, D] with zero rows appended up to a multiple of ``_LOGITS_ROW_ALIGNMENT``
    (``weight`` itself where V is one, or under torch.compile, where Inductor pads its own
    GEMM outputs). One copy per call: torch.mm into a strided ``out=`` would compute into a
    contiguous, unaligned temporary and copy it."""
    vocab = weight.shape[0]
    padded = cdiv(vocab, _LOGITS_ROW_ALIGNMENT) * _LOGITS_ROW_ALIGNMENT
    if padded == vocab or torch.compiler.is_compiling():
        return weight
    out = weight.new_empty((padded, weight.shape[1]))
    out[:vocab] = weight
    out[vocab:] = 0  # only the padding rows: zeroing all of them first would write the table twice
    return out


def _chunk_logits(hidden_c: torch.Tensor, padded_weight: torch.Tensor, vocab: int, bias: torch.Tensor | None):
    """``hidden_c @ weight.T + bias`` as [rows, V], and the [rows, V_padded] product with
    ``padded_weight`` it is a view of, whose extra columns are exact zeros (and stay so:
    the cross-entropy kernel reads and writes the first V only)."""
    product = hidden_c @ padded_weight.t()
    logits = product[:, :vocab]
    if bias is not None:
        logits += bias
    return product, logits


def _chunks(tokens: int, vocab: int, hidden: torch.Tensor, chunk_bytes: int):
    step = chunk_rows(tokens, vocab, hidden.element_size(), chunk_bytes, hidden.shape[1])
    return (slice(start, min(tokens, start + step)) for start in range(0, tokens, step))


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd for :func:`linear_cross_entropy`; gradients are computed in forward for mean/sum."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        target,
        bias,
        label_smoothing,
        ignore_index,
        z_loss,
        reduction,
        chunk_bytes,
        fp32_sum,
        out_dtype,
    ):
        options = (label_smoothing, ignore_index, z_loss)
        tokens, vocab = hidden.shape[0], weight.shape[0]
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3])
        grad_scale = reduction if any(needs) and reduction != "none" else None
        loss = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        # only a mean needs the count: one launch fewer per call otherwise
        valid_rows = count_kept_rows(target, ignore_index) if reduction == "mean" else None
        padded_weight = _padded_weight(weight)
        grads = None
        if grad_scale is not None:
            grads = _ChunkGradients(hidden, weight, needs, fp32_sum, padded_weight.shape[0])
        for rows in _chunks(tokens, vocab, hidden, chunk_bytes):
            product, logits = _chunk_logits(hidden[rows], padded_weight, vocab, bias)
            # In eager mode the kernel overwrites the chunk's logits with their gradient.
            grad_out = logits if grad_scale is not None else None
            chunk_loss, _, grad_logits = loss_and_gradient(
                logits, target[rows], options, grad_scale, valid_rows, grad_out
            )
            loss[rows] = chunk_loss
            if grads is not None:
                # the gradient is then the padded product's: the hidden gradient's GEMM gets
                # an aligned K (an odd vocabulary's K sends cuBLAS to its align1 kernels)
                in_place = grad_logits is logits
                grads.add(rows, product if in_place else grad_logits, hidden[rows],
                          padded_weight if in_place else weight)  # fmt: skip
            del product, logits, grad_out, grad_logits  # before the next chunk's logits are allocated
        ctx.reduction = reduction
        ctx.options = options
        ctx.chunk_bytes = chunk_bytes
        ctx.fp32_sum = fp32_sum
        ctx.bias_dtype = None if bias is None else bias.dtype
        if grads is not None:
            ctx.save_for_backward(grads.hidden, grads.weight_grad(weight.dtype), grads.bias)
        elif any(needs):
            ctx.save_for_backward(hidden, weight, target, bias)
        if reduction == "none":
            return loss
        # in out_dtype already (outside torch.compile): the caller's cast is then no node of
        # the graph, whose backward would cost a launch and an engine step
        return reduce_row_losses(loss, valid_rows, out_dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_create_graph("linear_cross_entropy")
        if ctx.reduction == "none":
            return (*_recompute_gradients(ctx, grad_loss), None, None, None, None, None, None, None)
        grad_hidden, grad_weight, grad_bias = (
            None if grad is None else rescale_gradient(grad, grad_loss) for grad in ctx.saved_tensors
        )
        if grad_bias is not None:
            grad_bias = grad_bias.to(ctx.bias_dtype)
        return grad_hidden, grad_weight, None, grad_bias, None, None, None, None, None, None, None


def _recompute_gradients(ctx, grad_loss):
    """Backward of ``reduction="none"``: each chunk's logits again, scaled per row."""
    hidden, weight, target, bias = ctx.saved_tensors
    needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3])
    grads = _ChunkGradients(hidden, weight, needs, ctx.fp32_sum, weight.shape[0])
    padded_weight = _padded_weight(weight)
    for rows in _chunks(hidden.shape[0], weight.shape[0], hidden, ctx.chunk_bytes):
        _, logits = _chunk_logits(hidden[rows], padded_weight, weight.shape[0], bias)
        _, stats, _ = loss_and_gradient(logits, target[rows], ctx.options, None, None, None)
        grad_logits = recompute_gradient(grad_loss[rows], logits, target[rows], stats, ctx.options)
        grads.add(rows, grad_logits, hidden[rows], weight)
        del logits, grad_logits
    grad_bias = None if grads.bias is None else grads.bias.to(ctx.bias_dtype)
    return grads.hidden, grads.weight_grad(weight.dtype), None, grad_bias


def _fp32_sum(fp32_weight_grad: bool | None, hidden: torch.Tensor, weight: torch.Tensor, chunk_bytes: int) -> bool:
    if fp32_weight_grad is not None:
        return bool(fp32_weight_grad)
    if weight.dtype == torch.float32:
        return False  # the gradient itself is the fp32 sum
    tokens = hidden.shape[0]
    rows = chunk_rows(tokens, weight.shape[0], hidden.element_size(), chunk_bytes, hidden.shape[1])
    chunks = cdiv(tokens, rows)
    if chunks <= 1:
        # one GEMM, accumulated in fp32 and rounded once either way: an fp32 buffer would
        # only cost its memory and cuBLAS's slower 16-bit-in, fp32-out kernels
        return False
    return 4 * weight.numel() <= rows * weight.shape[0] * hidden.element_size() or chunks > MAX_16BIT_SUMS


def _validate(hidden, weight, target, bias, label_smoothing, ignore_index, reduction, z_loss, chunk_bytes):
    if hidden.dim() != 2:
        raise ValueError(f"linear_cross_entropy: hidden must be 2-D [tokens, D], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: weight must be [V, D] with D = {hidden.shape[1]}, got shape {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError("linear_cross_entropy: weight has no rows (V = 0)")
    if hidden.dtype not in _SUPPORTED_DTYPES or weight.dtype != hidden.dtype:
        raise ValueError(
            f"linear_cross_entropy: hidden and weight must share a float dtype (float32, float16 or bfloat16), "
            f"got {hidden.dtype} and {weight.dtype}"
        )
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or bias.dtype != hidden.dtype):
        raise ValueError(
            f"linear_cross_entropy: bias must be [V] = [{weight.shape[0]}] in {hidden.dtype}, "
            f"got {tuple(bias.shape)} {bias.dtype}"
        )
    if tuple(target.shape) != (hidden.shape[0],):
        raise ValueError(f"linear_cross_entropy: target has shape {tuple(target.shape)}, expected ({hidden.shape[0]},)")
    for name, t in (("weight", weight), ("target", target), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"linear_cross_entropy: {name} is on {t.device} but hidden is on {hidden.device}")
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(f"linear_cross_entropy: chunk_bytes must be a positive int, got {chunk_bytes!r}")
    return check_loss_options("linear_cross_entropy", target, label_smoothing, ignore_index, reduction, z_loss)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    z_loss: float = 0.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    fp32_weight_grad: bool | None = None,
    check_targets: bool | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T + bias`` without materialising the logits.

    Same result as ``lstrain.ops.cross_entropy(hidden @ weight.T + bias, target, ...)``;
    the logits exist one chunk of tokens at a time (``chunk_bytes`` of them). Under
    ``torch.autocast``, hidden, weight and bias are first cast to its dtype, as a matmul's
    inputs are.

    Args:
        hidden: ``[tokens, D]`` (flatten batch and sequence first), float32/float16/bfloat16.
        weight: ``[V, D]``, the LM head (or tied embedding) weight, same dtype.
        target: ``[tokens]`` int64/int32 class indices.
        bias: optional ``[V]``, same dtype.
        label_smoothing, ignore_index, reduction, z_loss, check_targets: as in
            :func:`lstrain.ops.cross_entropy`.
        chunk_bytes: the most memory one chunk's logits may take (default 512 MiB; see
            :func:`chunk_rows` for how tokens are split under it).
        fp32_weight_grad: True to sum the chunks' weight gradients in an fp32 [V, D]
            buffer, so that the weight gradient is rounded once rather than once per
            chunk, at the cost of 4 x V x D bytes while the loss runs; False to add each
            chunk's (fp32-accumulated) product to the gradient in the weight's dtype;
            None (default): with one chunk the weight's dtype (one GEMM, one rounding),
            else the fp32 buffer when it is no larger than one chunk's logits or there
            are more than ``MAX_16BIT_SUMS`` chunks.
        out_dtype: the loss's dtype: None (default) what ``F.cross_entropy`` of the
            logits gives: hidden's, or float32 under autocast; ``torch.float32`` (or
            float64) the value the kernels reduced in fp32, not rounded to 16 bits (what
            Hugging Face's models return).

    Returns:
        The loss in ``out_dtype`` (0-d for mean/sum, ``[tokens]`` for none).

    Raises:
        ValueError: a tensor argument that is no tensor (named), mismatched shapes, dtypes
            or devices, a ``chunk_bytes`` that is not a positive int, or a bad option (see
            :func:`lstrain.ops.cross_entropy`); errors name linear_cross_entropy.
    """
    check_tensors("linear_cross_entropy", {"hidden": hidden, "weight": weight, "target": target}, {"bias": bias})
    out_dtype = loss_dtype("linear_cross_entropy", hidden, out_dtype)
    hidden, weight, bias = autocast_inputs(hidden, weight, bias)
    label_smoothing, ignore_index, z_loss = _validate(
        hidden, weight, target, bias, label_smoothing, ignore_index, reduction, z_loss, chunk_bytes
    )
    check = check_targets if check_targets is not None else not hidden.is_cuda
    if check and not torch.compiler.is_compiling():
        check_target_range("linear_cross_entropy", target, weight.shape[0], ignore_index)
    backend = _backend.backend_for(hidden)
    _backend.note("linear_cross_entropy", backend)
    if backend == "reference":
        return linear_cross_entropy_ref(
            hidden, weight, target, bias, label_smoothing=label_smoothing, ignore_index=ignore_index,
            reduction=reduction, z_loss=z_loss,
        ).to(out_dtype)  # fmt: skip
    if not torch.is_grad_enabled():  # nothing will be differentiated: no gradients in forward
        hidden, weight, bias = hidden.detach(), weight.detach(), None if bias is None else bias.detach()
    loss = LinearCrossEntropyFunction.apply(
        hidden, weight, target, bias, label_smoothing, ignore_index, z_loss, reduction,
        chunk_bytes, _fp32_sum(fp32_weight_grad, hidden, weight, chunk_bytes), out_dtype,
    )  # fmt: skip
    return loss.to(out_dtype)


def linear_cross_entropy_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    z_loss: float = 0.0,
) -> torch.Tensor:
    """Plain PyTorch: the full logits, then :func:`cross_entropy_ref`.

    Args:
        hidden, weight, target, bias, label_smoothing, ignore_index, reduction, z_loss:
            as for :func:`linear_cross_entropy`.

    Returns:
        The loss of ``hidden @ weight.T + bias``, as :func:`cross_entropy_ref` gives it.
    """
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return cross_entropy_ref(
        logits, target, label_smoothing=label_smoothing, ignore_index=ignore_index, reduction=reduction, z_loss=z_loss
    )
