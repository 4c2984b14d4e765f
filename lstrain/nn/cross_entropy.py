"""``lstrain.nn.CrossEntropyLoss``: a drop-in for ``torch.nn.CrossEntropyLoss`` (no class weights)."""

from __future__ import annotations

import math

import torch

from lstrain.ops.cross_entropy import cross_entropy

__all__ = ["CrossEntropyLoss"]


class CrossEntropyLoss(torch.nn.Module):
    """Cross-entropy over class logits with lstrain's one-pass kernel.

    Takes ``torch.nn.CrossEntropyLoss``'s arguments (``ignore_index=-100,
    reduction="mean", label_smoothing=0.0``; class ``weight`` is not supported) plus
    ``z_loss`` and ``inplace_backward`` (see :func:`lstrain.ops.cross_entropy`).

    ``forward(input, target)`` takes torch's layout: ``input`` ``[C]`` (unbatched, with a
    0-d ``target``), ``[N, C]`` or ``[N, C, d1, ...]`` with ``target`` ``[N, d1, ...]``
    of class indices (class probabilities are not supported). Classes are in dim 1 of a
    batched input, as in torch; the kernel wants them last, so an input of 3 or more dims
    is copied with its dim 1 moved last. For ``[batch, seq, V]`` logits without that
    copy, call :func:`lstrain.ops.cross_entropy`.

    Raises:
        ValueError: ``weight`` is given, or an argument is out of range; in forward,
            ``input`` and ``target`` shapes that torch would refuse.
    """

    def __init__(
        self,
        weight: torch.Tensor | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        *,
        z_loss: float = 0.0,
        inplace_backward: bool = False,
    ) -> None:
        super().__init__()
        if weight is not None:
            raise ValueError("CrossEntropyLoss: class weights are not supported (weight must be None)")
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.inplace_backward = inplace_backward

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if input.dim() == 0:
            raise ValueError(
                "CrossEntropyLoss: input must have a class dim ([C], [N, C] or [N, C, d1, ...]), got a 0-d tensor"
            )
        classes = input.shape[0] if input.dim() == 1 else input.shape[1]
        expected = () if input.dim() == 1 else (input.shape[0], *input.shape[2:])
        if tuple(target.shape) != expected:
            raise ValueError(
                f"CrossEntropyLoss: target has shape {tuple(target.shape)}; for input {tuple(input.shape)} "
                f"(classes in dim {0 if input.dim() == 1 else 1}) it must be {expected}"
            )
        # the token count, not -1: reshape(-1, 0) cannot infer it when there are no classes
        # (which the op then refuses); reshape, not view: a transposed [N, C] has no view
        tokens = math.prod(expected)
        logits = input.movedim(1, -1).reshape(tokens, classes) if input.dim() > 2 else input.reshape(tokens, classes)
        loss = cross_entropy(
            logits,
            target.reshape(-1),
            label_smoothing=self.label_smoothing,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            z_loss=self.z_loss,
            inplace_backward=self.inplace_backward,
        )
        return loss.view(target.shape) if self.reduction == "none" else loss

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
            f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}"
        )
