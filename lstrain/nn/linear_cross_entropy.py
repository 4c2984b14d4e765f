"""``lstrain.nn.LinearCrossEntropyLoss``: an LM head's loss without the [tokens, V] logits."""

from __future__ import annotations

import torch

from lstrain.ops.linear_cross_entropy import DEFAULT_CHUNK_BYTES, linear_cross_entropy

__all__ = ["LinearCrossEntropyLoss"]


class LinearCrossEntropyLoss(torch.nn.Module):
    """``cross_entropy(hidden @ weight.T + bias, target)`` computed chunk by chunk.

    The module holds only options; the LM head weight stays with the model (often tied to
    the token embedding): ``loss = criterion(hidden, model.lm_head.weight, target)``.
    Leading dims of ``hidden`` ([batch, seq, D]) and ``target`` ([batch, seq]) are flattened.

    Args:
        ignore_index, reduction, label_smoothing, z_loss: as in
            :func:`lstrain.ops.cross_entropy`.
        chunk_bytes: the most memory one chunk's logits may take (default 512 MiB).
        fp32_weight_grad: how the chunks' weight gradients are summed (see
            :func:`lstrain.ops.linear_cross_entropy`; None chooses by memory).

    Raises:
        ValueError: in forward, a ``target`` not shaped like ``hidden``'s leading dims (a
            0-d ``hidden`` included), or any error of :func:`lstrain.ops.linear_cross_entropy`.
    """

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        *,
        z_loss: float = 0.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        fp32_weight_grad: bool | None = None,
    ) -> None:
        super().__init__()
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.chunk_bytes = chunk_bytes
        self.fp32_weight_grad = fp32_weight_grad

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if hidden.dim() == 0 or tuple(target.shape) != tuple(hidden.shape[:-1]):
            # flattening alone would pair a [seq, batch] target with [batch, seq] hidden states
            raise ValueError(
                f"LinearCrossEntropyLoss: target has shape {tuple(target.shape)}, expected hidden's leading shape "
                f"{tuple(hidden.shape[:-1]) if hidden.dim() else '(hidden is 0-d: it needs a D dim)'}"
            )
        loss = linear_cross_entropy(
            hidden.reshape(target.numel(), hidden.shape[-1]),  # not -1: ambiguous for D = 0
            weight,
            target.reshape(-1),
            bias,
            label_smoothing=self.label_smoothing,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            z_loss=self.z_loss,
            chunk_bytes=self.chunk_bytes,
            fp32_weight_grad=self.fp32_weight_grad,
        )
        return loss.view(target.shape) if self.reduction == "none" else loss

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
            f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, chunk_bytes={self.chunk_bytes}, "
            f"fp32_weight_grad={self.fp32_weight_grad}"
        )
