"""Transformer building blocks from lstrain's fused pieces, each with a plain-torch twin.

:class:`SelfAttention` (packed QKV, SDPA), :class:`MLP` and :class:`TransformerLayer`
(pre-LN or post-LN); ``fused=False`` builds the same modules, with the same parameter
names and shapes, from plain torch ops.
"""

from lstrain.layers.attention import SelfAttention, sdpa_mask, split_heads
from lstrain.layers.mlp import MLP
from lstrain.layers.transformer import TransformerLayer

__all__ = ["MLP", "SelfAttention", "TransformerLayer", "sdpa_mask", "split_heads"]
