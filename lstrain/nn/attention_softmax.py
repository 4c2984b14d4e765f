"""``lstrain.nn.AttentionSoftmax``: the masked, scaled softmax of attention as a module."""

from __future__ import annotations

import torch

from lstrain.ops._lib.options import bool_option
from lstrain.ops.attention_softmax import attention_softmax

__all__ = ["AttentionSoftmax"]


class AttentionSoftmax(torch.nn.Module):
    """``softmax(scale * scores + mask)`` over the keys of ``[batch, heads, q_len, k_len]`` scores.

    Args:
        scale: multiplies the scores (e.g. ``head_dim ** -0.5``).
        causal: mask keys after each query (top-left aligned, as SDPA's ``is_causal``).

    ``forward(scores, key_padding_mask=None, mask=None)``: see
    :func:`lstrain.ops.attention_softmax` for the masks.

    Raises:
        ValueError: ``causal`` is not a bool (``bool()`` would read ``"no"`` as True).
    """

    def __init__(self, scale: float = 1.0, causal: bool = False) -> None:
        super().__init__()
        self.scale = scale
        self.causal = bool_option("AttentionSoftmax", "causal", causal)  # refused here, not at forward

    def forward(
        self,
        scores: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return attention_softmax(
            scores, scale=self.scale, key_padding_mask=key_padding_mask, mask=mask, causal=self.causal
        )

    def extra_repr(self) -> str:
        return f"scale={self.scale}, causal={self.causal}"
