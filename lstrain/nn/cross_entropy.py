"""``lstrain.nn.CrossEntropyLoss``: a drop-in for ``torch.nn.CrossEntropyLoss`` (no class weights)."""

from __future__ import annotations

import torch

from lstrain.ops.cross_entropy import cross_entropy

__all__ = ["CrossEntropyLoss"]


class CrossEntropyLoss(torch.nn.Module):
    """Cross-entropy over class logits with lstrain's one-pass kernel.

    Takes ``torch.nn.CrossEntropyLoss``'s arguments (``ignore_index=-100,
    reduction="mean", label_smoothing=0.0``; class ``weight`` is not supported) plus
    ``z_loss`` and ``inplace_backward`` (see :func:`lstrain.ops.cross_entropy`).
    ``forward(input, target)`` takes ``[tokens, V]`` or ``[batch, seq, V]`` logits.

    Raises:
        ValueError: ``weight`` is given, or an argument is out of range.
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
        return cross_entropy(
            input,
            target,
            label_smoothing=self.label_smoothing,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            z_loss=self.z_loss,
            inplace_backward=self.inplace_backward,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
            f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}"
        )
