"""Label-smoothed cross-entropy with optional z-loss, loss and gradient in one pass.

Target distribution p = (1 - a) * onehot(target) + a / V (a = label_smoothing), so

    loss_i = lse_i - (1 - a) * x_i[t_i] - (a / V) * sum_j x_ij  (+ z_loss * lse_i^2)
    dloss_i / dx_ij = softmax_ij * (1 + 2 * z_loss * lse_i) - p_ij

One program per row reads the row once for the statistics (max and sum-exp per run of
16 bytes, plus the sum of logits for smoothing) and, when the loss is reduced (mean or
sum), writes the gradient (q - p) * scale in a second sweep over the same row. On a CUDA
device (compute capability 8.0 or more) a row that fits is held in shared memory (and a
little in registers) by a Gluon kernel, so that each logit comes from DRAM once; longer
rows, unaligned ones and the interpreter (which runs no Gluon) take a Triton kernel whose
second sweep runs backwards from the row's end, so that it finds in L2 what the first
sweep read last. Rows are swept as a
16-byte-aligned body of whole runs plus a few loose elements at either end, so that every
load and store of the body is 16 bytes wide whatever V is. Backward then only
has to multiply by grad_output, and skips even that (touching no memory) when grad_output
is exactly 1, without a host sync. (For any other grad_output the gradient is rounded
twice, before and after the rescale: within the tolerance rule, but up to 1.5 ulp instead
of 0.5.) With ``reduction="none"`` the gradient depends on a per-row grad_output, so backward
recomputes it from the logits and the saved row max and sum of exponentials.

Rows whose target is ``ignore_index`` give zero loss and zero gradient and are not read
(padding costs only its gradient's zeros; unlike torch, a NaN in such a row leaves its
gradient zero rather than NaN). A target outside
[0, V) never causes a read outside the row: its loss and gradient are NaN (and, for CPU
tensors or with ``check_targets=True``, a ValueError names it first). Around the kernel, a
mean's count of kept rows and the reduction of the per-row losses take one single-program
launch each (in eager mode; torch.compile fuses torch's own ops instead).
"""

from __future__ import annotations

import torch

from lstrain import _backend
from lstrain.ops._lib.autocast import loss_dtype
from lstrain.ops._lib.custom_op import kernel_op
from lstrain.ops._lib.first_order import graph_freed_after_backward, refuse_create_graph
from lstrain.ops._lib.layout import as_rows
from lstrain.ops._lib.options import check_tensors, float_option, int_option
from lstrain.ops.cross_entropy.plan import (
    CrossEntropyPlan,
    cross_entropy_plan,
    launch_layout,
    resident_shared_memory,
    rows_aligned,
)
from lstrain.ops.cross_entropy.reductions import count_kept_rows, launch_scale, reduce_row_losses, scale_gradient_
from lstrain.ops.cross_entropy.resident import _cross_entropy_resident_kernel
from lstrain.ops.cross_entropy.two_sweep import _cross_entropy_bwd_kernel, _cross_entropy_fwd_kernel

__all__ = [
    "CrossEntropyFunction",
    "CrossEntropyPlan",
    "cross_entropy",
    "cross_entropy_bwd",
    "cross_entropy_fwd",
    "cross_entropy_plan",
    "cross_entropy_ref",
    "rescale_gradient",
    "scale_gradient_",
]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_REDUCTIONS = ("mean", "sum", "none")


def cross_entropy_fwd(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    z_loss: float,
    grad_scale: str | None,
    grad_out: torch.Tensor | None = None,
    valid_rows: torch.Tensor | None = None,
    plan: CrossEntropyPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on validated inputs.

    Args:
        grad_scale: ``"mean"`` or ``"sum"`` to also write the gradient of that reduction
            of the loss (for grad_output = 1) into ``grad_out``, or None for no gradient.
        grad_out: [rows, V] in the logits' dtype (may be the logits themselves).
        valid_rows: for "mean", the 0-d device tensor counting the non-ignored rows the
            mean divides by (possibly over more rows than these, e.g. chunks of a batch).
        plan: launch settings; by default ``cross_entropy_plan``'s for these rows and this
            device (a resident plan, the Gluon kernel, needs a CUDA device, a gradient to
            write and 16-byte-aligned rows that fit it).

    Returns:
        ``(loss, stats)``: the fp32 per-row loss [rows], and fp32 [2, rows] holding each
        row's max and its sum of exp(x - max).
    """
    x = as_rows(logits, logits.shape[-1])
    rows, vocab = x.shape
    flat_target = target.reshape(-1).contiguous()  # the kernel reads targets at unit stride
    loss = torch.empty(rows, dtype=torch.float32, device=x.device)
    stats = torch.empty((2, rows), dtype=torch.float32, device=x.device)
    if rows == 0:
        return loss, stats
    write_grad = grad_scale is not None
    aligned = rows_aligned(x, grad_out if write_grad else None)
    if plan is None:
        work = "loss_and_gradient" if write_grad else "loss"
        shared_memory = resident_shared_memory(x) if write_grad else 0
        plan = cross_entropy_plan(vocab, x.element_size(), work, aligned, shared_memory)
    if plan.resident:
        run = 16 // x.element_size()
        _cross_entropy_resident_kernel[(rows,)](
            x, flat_target, loss, stats, grad_out, valid_rows,
            rows, vocab, x.stride(0), grad_out.stride(0), ignore_index, label_smoothing, z_loss,
            HAS_SMOOTHING=label_smoothing > 0,
            HAS_Z_LOSS=z_loss > 0,
            MEAN=grad_scale == "mean",
            LANES=plan.block // run,
            RUN=run,
            RESIDENT=plan.resident,
            HELD=plan.held // run,
            NUM_WARPS=plan.num_warps,
            num_warps=plan.num_warps,
        )  # fmt: skip
        return loss, stats
    _cross_entropy_fwd_kernel[(rows,)](
        x, flat_target, loss, stats, grad_out if write_grad else None, valid_rows,
        rows, vocab, x.stride(0), grad_out.stride(0) if write_grad else 0,
        ignore_index, label_smoothing, z_loss,
        HAS_SMOOTHING=label_smoothing > 0,
        HAS_Z_LOSS=z_loss > 0,
        WRITE_GRAD=write_grad,
        MEAN=grad_scale == "mean",
        **launch_layout(x, plan, aligned),
        num_warps=plan.num_warps,
        **_backend.dependent_launch(x),
    )  # fmt: skip
    return loss, stats


def cross_entropy_bwd(
    grad_output: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    stats: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    z_loss: float,
    plan: CrossEntropyPlan | None = None,
) -> torch.Tensor:
    """Gradient of the unreduced loss (``reduction="none"``): a new [*, V] tensor."""
    x = as_rows(logits, logits.shape[-1])
    rows, vocab = x.shape
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if rows == 0:
        return grad
    aligned = rows_aligned(x, grad)
    plan = plan or cross_entropy_plan(vocab, x.element_size(), "gradient", aligned)
    grad_output = grad_output.reshape(-1).contiguous()
    _cross_entropy_bwd_kernel[(rows,)](
        x, target.reshape(-1).contiguous(), stats, grad_output, grad,
        rows, vocab, x.stride(0), vocab, ignore_index, label_smoothing, z_loss,
        HAS_Z_LOSS=z_loss > 0,
        **launch_layout(x, plan, aligned),
        num_warps=plan.num_warps,
        **_backend.dependent_launch(x),
    )  # fmt: skip
    return grad


def cross_entropy_fwd_new(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    z_loss: float,
    grad_scale: str | None,
    valid_rows: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`cross_entropy_fwd` with its gradient (for mean / sum) in a new tensor, the
    functional form torch.compile needs; (0,)-shaped when no gradient is asked for."""
    shape = logits.shape if grad_scale is not None else (0,)
    grad = torch.empty(shape, dtype=logits.dtype, device=logits.device)
    grad_rows = grad.view(-1, logits.shape[-1]) if grad_scale is not None else None
    loss, stats = cross_entropy_fwd(
        logits, target, label_smoothing, ignore_index, z_loss, grad_scale, grad_rows, valid_rows
    )
    return loss, stats, grad


@kernel_op("cross_entropy_fwd", cross_entropy_fwd_new)
def cross_entropy_fwd_new_op(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    z_loss: float,
    grad_scale: str | None,
    valid_rows: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = target.numel()
    loss = logits.new_empty(rows, dtype=torch.float32)
    stats = logits.new_empty((2, rows), dtype=torch.float32)
    return loss, stats, logits.new_empty(logits.shape if grad_scale is not None else (0,))


@kernel_op("cross_entropy_bwd", cross_entropy_bwd)
def cross_entropy_bwd_op(
    grad_output: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    stats: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    z_loss: float,
) -> torch.Tensor:
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@kernel_op("scale_gradient_", scale_gradient_, mutates_args=("grad",))
def scale_gradient_op(grad: torch.Tensor, grad_output: torch.Tensor) -> None:
    return None


def loss_and_gradient(logits, target, options, grad_scale, valid_rows, grad_out):
    """Per-row loss, stats and (for mean/sum) the gradient: written into ``grad_out`` in
    eager mode, a fresh tensor from the custom op under torch.compile."""
    if torch.compiler.is_compiling():
        return cross_entropy_fwd_new_op(logits, target, *options, grad_scale, valid_rows)
    grad_rows = None if grad_out is None else grad_out.view(-1, logits.shape[-1])
    loss, stats = cross_entropy_fwd(logits, target, *options, grad_scale, grad_rows, valid_rows)
    return loss, stats, grad_out


def rescale_gradient(grad: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """``grad * grad_output`` in a backward whose forward computed ``grad``: in place where
    the graph goes with this backward (through the custom op under torch.compile), into a
    new buffer, rounded the same way, where it is kept for another backward, which must
    find ``grad`` as forward left it."""
    if torch.compiler.is_compiling():
        scale_gradient_op(grad, grad_output)
    elif graph_freed_after_backward():
        scale_gradient_(grad, grad_output)
    else:
        out = torch.empty_like(grad)
        launch_scale(grad, out, grad_output)
        return out
    return grad


def recompute_gradient(grad_output, logits, target, stats, options) -> torch.Tensor:
    """:func:`cross_entropy_bwd`, through the custom op under torch.compile."""
    return cross_entropy_bwd_op(grad_output, logits, target, stats, *options)


class CrossEntropyFunction(torch.autograd.Function):
    """Autograd for :func:`cross_entropy`.

    For mean/sum the gradient is computed in forward (into a new buffer, or into the
    logits' own storage with ``inplace_backward``) and backward only rescales it: in place,
    or into a new buffer where the graph is retained for another backward.
    """

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, ignore_index, z_loss, reduction, inplace_backward, out_dtype):
        options = (label_smoothing, ignore_index, z_loss)
        needs_grad = ctx.needs_input_grad[0]
        grad_scale = reduction if needs_grad and reduction != "none" else None
        # only a mean needs the count: one launch fewer per call otherwise
        valid_rows = count_kept_rows(target, ignore_index) if reduction == "mean" else None
        grad_out = None
        in_place = False
        if grad_scale is not None and not torch.compiler.is_compiling():
            in_place = inplace_backward and logits.is_contiguous()
            grad_out = logits.detach() if in_place else torch.empty_like(logits, memory_format=torch.contiguous_format)
        loss, stats, grad = loss_and_gradient(logits, target, options, grad_scale, valid_rows, grad_out)
        if in_place:
            # the logits now hold the gradient: a consumer that saved them earlier must see
            # a new version, so that its backward raises instead of reading the gradient
            torch.autograd.graph.increment_version(logits)
        ctx.reduction = reduction
        ctx.options = options
        if grad_scale is not None:
            ctx.save_for_backward(grad)
        elif needs_grad:
            ctx.save_for_backward(logits, target, stats)
        if reduction == "none":
            return loss.view(target.shape)
        return reduce_row_losses(loss, valid_rows, out_dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_create_graph("cross_entropy")
        if ctx.reduction == "none":
            logits, target, stats = ctx.saved_tensors
            return recompute_gradient(grad_loss, logits, target, stats, ctx.options), *[None] * 7
        (grad,) = ctx.saved_tensors
        return rescale_gradient(grad, grad_loss), *[None] * 7


def _validate(logits, target, label_smoothing, ignore_index, reduction, z_loss) -> tuple[float, int, float]:
    if logits.dim() not in (2, 3):
        raise ValueError(
            f"cross_entropy: logits must be 2-D [tokens, V] or 3-D [batch, seq, V], got {tuple(logits.shape)}"
        )
    if logits.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"cross_entropy: logits has dtype {logits.dtype}; expected float32, float16 or bfloat16")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"cross_entropy: target has shape {tuple(target.shape)}, expected logits' leading shape "
            f"{tuple(logits.shape[:-1])}"
        )
    if target.device != logits.device:
        raise ValueError(f"cross_entropy: target is on {target.device} but logits is on {logits.device}")
    if logits.shape[-1] == 0:
        raise ValueError("cross_entropy: logits has no classes (V = 0)")
    return check_loss_options("cross_entropy", target, label_smoothing, ignore_index, reduction, z_loss)


def check_loss_options(
    op: str, target: torch.Tensor, label_smoothing: object, ignore_index: object, reduction: str, z_loss: object
) -> tuple[float, int, float]:
    """The checks shared by the cross-entropy ops: target dtype and the loss options.

    Returns:
        ``(label_smoothing, ignore_index, z_loss)`` as the Python numbers the kernels take.
    """
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"{op}: target must be int64 or int32 class indices, got {target.dtype}; convert with target.long()"
        )
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    return (
        float_option(op, "label_smoothing", label_smoothing, 0, 1),
        int_option(op, "ignore_index", ignore_index),
        float_option(op, "z_loss", z_loss, 0),
    )


def refuse_leaf_overwrite(logits: torch.Tensor) -> None:
    """Refuse ``inplace_backward`` for a leaf that requires grad or a view of one, as torch
    refuses in-place ops on them: the leaf's values would be lost to its own gradient."""
    root = logits._base if logits._base is not None else logits
    if root.is_leaf and root.requires_grad:
        what = "a view of a leaf" if root is not logits else "a leaf"
        raise RuntimeError(
            f"cross_entropy: inplace_backward=True would overwrite logits, {what} tensor that requires grad "
            "(torch refuses in-place ops on such leaves); pass inplace_backward=False, or logits computed "
            "from the leaf"
        )


def check_target_range(op: str, target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Raise ValueError for a target outside [0, vocab) that is not ignore_index (a host sync)."""
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bad.any():
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{op}: target {int(target[index])} at {index} is outside [0, {vocab}) "
            f"and is not ignore_index ({ignore_index})"
        )


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    z_loss: float = 0.0,
    inplace_backward: bool = False,
    check_targets: bool | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Cross-entropy with label smoothing and z-loss; the gradient comes from the same pass.

    Same semantics as ``torch.nn.functional.cross_entropy(logits, target,
    ignore_index=..., label_smoothing=..., reduction=...)`` for ``[tokens, V]`` logits (no
    class weights, no class-probability targets), plus an optional z-loss
    ``z_loss * logsumexp(logits)^2`` per row (PaLM). Statistics in fp32. The classes are
    always the last dim: ``[batch, seq, V]`` logits are torch's ``[batch, V, seq]``
    (``lstrain.nn.CrossEntropyLoss`` takes torch's layout).

    Args:
        logits: ``[tokens, V]`` or ``[batch, seq, V]`` (classes last), float32/float16/
            bfloat16; only the last dim needs to be contiguous. Any V (rows are swept in
            chunks).
        target: class indices, int64 or int32, shaped like ``logits[..., 0]``.
        label_smoothing: a in [0, 1]; the target distribution is (1 - a) onehot + a / V.
        ignore_index: rows with this target give zero loss and zero gradient (they are
            not read: a NaN there does not reach the gradient, as it would in torch);
            "mean" divides by the number of other rows (NaN if there are none, as torch).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (per-row loss shaped like target).
        z_loss: coefficient of the z-loss term (0 disables it).
        inplace_backward: write the gradient into the logits' storage (saves a
            [tokens, V] buffer; the logits are overwritten, so nothing else may need
            them: their version counter is bumped, so that a backward through an earlier
            consumer that saved them raises torch's "modified by an inplace operation"
            error). Applies to mean/sum in eager mode with contiguous logits (torch.compile
            gets the gradient functionally); a leaf that requires grad is refused, as
            torch refuses in-place ops on one.
        check_targets: raise ValueError for a target outside [0, V) that is not
            ignore_index. Default: on for CPU tensors, off for CUDA, where the check
            would synchronise with the host; never inside torch.compile. Unchecked bad
            targets give NaN loss and gradient for their rows (never a read outside the row).
        out_dtype: the loss's dtype: None (default) what ``F.cross_entropy`` gives: the
            logits', or float32 under autocast (which runs torch's losses in float32);
            ``torch.float32`` the value the kernels reduced, not rounded to 16 bits.

    Returns:
        The loss in ``out_dtype``: a 0-d tensor for mean/sum, else shaped like target.

    Raises:
        ValueError: logits or target not a tensor (named), logits not 2-D/3-D or not a float
            type, target of the wrong shape, dtype or device, label_smoothing outside
            [0, 1], an unknown reduction, a z_loss that is negative or not finite, an
            ignore_index that is no integer, V = 0, an ``out_dtype`` that is no floating
            dtype, or (when checked) a target out of range. The numbers may be Python or
            numpy scalars or 0-d CPU tensors; a CUDA tensor is refused (reading it would
            sync).
        RuntimeError: ``inplace_backward=True`` for logits that are a leaf requiring grad
            (or a view of one), with grad mode on (eager mode).
    """
    check_tensors("cross_entropy", {"logits": logits, "target": target})
    label_smoothing, ignore_index, z_loss = _validate(logits, target, label_smoothing, ignore_index, reduction, z_loss)
    out_dtype = loss_dtype("cross_entropy", logits, out_dtype)
    check = check_targets if check_targets is not None else not logits.is_cuda
    if check and not torch.compiler.is_compiling():
        check_target_range("cross_entropy", target, logits.shape[-1], ignore_index)
    backend = _backend.backend_for(logits)
    _backend.note("cross_entropy", backend)
    if backend == "reference":
        return cross_entropy_ref(
            logits,
            target,
            label_smoothing=label_smoothing,
            ignore_index=ignore_index,
            reduction=reduction,
            z_loss=z_loss,
        ).to(out_dtype)
    if not torch.is_grad_enabled():  # nothing will be differentiated: no gradient in forward
        logits = logits.detach()
    elif inplace_backward and not torch.compiler.is_compiling():
        refuse_leaf_overwrite(logits)
    loss = CrossEntropyFunction.apply(
        logits, target, label_smoothing, ignore_index, z_loss, reduction, inplace_backward, out_dtype
    )
    return loss.to(out_dtype)  # a reduced loss is in that dtype already, outside torch.compile


def cross_entropy_ref(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    z_loss: float = 0.0,
) -> torch.Tensor:
    """PyTorch's own cross-entropy (computed in fp32 for low-precision logits, as its
    kernels do), plus the z-loss term.

    Args:
        logits, target, label_smoothing, ignore_index, reduction, z_loss: as for
            :func:`cross_entropy`.

    Returns:
        The loss in the logits' dtype: 0-d for mean/sum, else shaped like target.
    """
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.reshape(-1, logits.shape[-1]).to(compute)
    t = target.reshape(-1).long()
    loss = torch.nn.functional.cross_entropy(
        x, t, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none"
    )
    if z_loss > 0:
        loss = loss + torch.where(t == ignore_index, 0.0, z_loss * torch.logsumexp(x, dim=-1).square())
    if reduction == "none":
        return loss.view(target.shape).to(logits.dtype)
    total = loss.sum()
    return (total / (t != ignore_index).sum() if reduction == "mean" else total).to(logits.dtype)
