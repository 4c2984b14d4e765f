"""The LM-head losses of the supported families, through ``linear_cross_entropy``.

Each reproduces the loss the model's own forward computes from logits, so that a patched
model trains exactly as the unpatched one, without the ``[tokens, V]`` logits.
"""

from __future__ import annotations

import torch

from lstrain.ops.linear_cross_entropy import linear_cross_entropy

__all__ = ["LOSSES", "causal_lm_loss", "masked_lm_loss"]


def _head_loss(hidden, weight, bias, target, ignore_index, num_items_in_batch) -> torch.Tensor:
    """transformers' ``fixed_cross_entropy`` on ``hidden @ weight.T + bias``."""
    reduction = "mean" if num_items_in_batch is None else "sum"
    # transformers computes the loss from fp32 logits: the loss is fp32 whatever the model's dtype
    loss = linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1).to(hidden.device), bias,
        ignore_index=ignore_index, reduction=reduction, out_dtype=torch.float32,
    )  # fmt: skip
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **_: object,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` without logits.

    Args:
        hidden: ``[batch, seq, D]`` final hidden states (the LM head's input).
        weight: ``[V, D]`` LM head weight.
        bias: ``[V]`` LM head bias, or None.
        labels: ``[batch, seq]`` token ids, not yet shifted; ``ignore_index`` is ignored.
        num_items_in_batch: when given, the loss is the sum over kept tokens divided by it
            (gradient accumulation across micro-batches), else the mean over kept tokens.
        ignore_index: the label that is ignored.
        shift_labels: already shifted labels, used instead of ``labels`` when given.
        _: the model's other keyword arguments, which ``ForCausalLMLoss`` also ignores.

    Returns:
        The 0-d fp32 loss.
    """
    if shift_labels is None:
        # Token t predicts token t + 1; the last position has nothing to predict.
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return _head_loss(hidden, weight, bias, shift_labels, ignore_index, num_items_in_batch)


def masked_lm_loss(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, **_: object
) -> torch.Tensor:
    """BertForMaskedLM's loss without logits: ``CrossEntropyLoss()``, the mean over labels != -100.

    BertForMaskedLM's forward (transformers 5.x) ignores ``num_items_in_batch``, so this does too.

    Args:
        hidden: ``[batch, seq, D]`` the LM head's input (after BERT's head transform).
        weight: ``[V, D]`` decoder weight.
        bias: ``[V]`` decoder bias, or None.
        labels: ``[batch, seq]`` token ids; -100 is ignored.
        _: the model's other keyword arguments, ignored as BertForMaskedLM does.

    Returns:
        The 0-d fp32 loss.
    """
    return _head_loss(hidden, weight, bias, labels, -100, None)


# Family.loss -> the function computing it.
LOSSES = {"causal": causal_lm_loss, "masked": masked_lm_loss}
