"""Transformer building blocks from lstrain's fused pieces, each with a plain-torch twin.

:class:`SelfAttention` (packed QKV, SDPA), :class:`MLP` and :class:`TransformerLayer`
(pre-LN or post-LN); LLaMA's :class:`RotaryAttention` (RoPE, grouped-query, packed QKV),
:class:`SwiGLU` and :class:`DecoderLayer` (pre-RMSNorm, its norm outputs made again in
backward by :class:`RecomputedNorms`); ``fused=False`` builds the same modules, with the
same parameter names and shapes, from plain torch ops.
"""

from lstrain.layers.attention import SelfAttention, sdpa_mask
from lstrain.layers.decoder import DecoderLayer, add_norm
from lstrain.layers.mlp import MLP
from lstrain.layers.recompute import RecomputedNorms, register_norm_output, remake_rms_norm
from lstrain.layers.rotary import RotaryAttention, rope_qkv_torch, rope_torch, rotary_cos_sin
from lstrain.layers.swiglu import SwiGLU
from lstrain.layers.transformer import TransformerLayer

__all__ = [
    "MLP",
    "DecoderLayer",
    "RecomputedNorms",
    "RotaryAttention",
    "SelfAttention",
    "SwiGLU",
    "TransformerLayer",
    "add_norm",
    "register_norm_output",
    "remake_rms_norm",
    "rope_qkv_torch",
    "rope_torch",
    "rotary_cos_sin",
    "sdpa_mask",
]
