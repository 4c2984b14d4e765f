"""Multi-head self-attention over one packed QKV projection.

``c_attn`` (weight ``[3 * dim, dim]``, torch's Linear layout) makes q, k and v in one GEMM.
Fused, without masks beyond causality, :func:`lstrain.ops.qkv_attention` runs the attention
in flash attention kernels that read q, k and v in place, write one packed gradient and sum
the bias's from their tiles, with lstrain's attention dropout. Otherwise q, k and v are
strided views of the projection (no copies), :func:`lstrain.ops.qkv_projection`'s backward
packs their gradients and sums the bias's in one pass, and
``torch.nn.functional.scaled_dot_product_attention`` (flash / cuDNN / memory-efficient)
computes the attention, unless the caller passes a learned additive bias, which SDPA
cannot fuse: then the scores go through :func:`lstrain.ops.attention_softmax`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lstrain.layers._residual import add_residual
from lstrain.ops import attention_softmax, linear, qkv_attention, qkv_projection, qkv_projection_ref
from lstrain.ops._lib.options import bool_option, int_option
from lstrain.ops.qkv_attention import SUPPORTED_HEAD_DIMS

__all__ = ["ATTN_IMPLEMENTATIONS", "SelfAttention", "check_attention_inputs", "sdpa_mask"]

# What computes the attention: torch's SDPA, or lstrain's qkv_attention kernels.
ATTN_IMPLEMENTATIONS = ("sdpa", "lstrain")


def check_attention_inputs(owner: str, x: torch.Tensor, key_padding_mask: torch.Tensor | None) -> None:
    """Refuse what the attention layers would otherwise fail on with an error naming nothing
    (or mask silently): an ``x`` that is not ``[batch, seq, dim]``, a ``key_padding_mask``
    that is not bool ``[batch, seq]`` on x's device.

    Args:
        owner: the layer's name, for the message.
        x: the attention's input.
        key_padding_mask: True where a key is padding, or None.

    Raises:
        ValueError: naming the argument and what it must be.
    """
    if x.dim() != 3:
        raise ValueError(f"{owner}: x must be [batch, seq, dim], got shape {tuple(x.shape)}")
    if key_padding_mask is None:
        return
    if key_padding_mask.dtype != torch.bool:
        raise ValueError(
            f"{owner}: key_padding_mask must be bool (True where a key is padding), got {key_padding_mask.dtype}; "
            "from a Hugging Face attention_mask (1 = attend) pass attention_mask == 0"
        )
    if tuple(key_padding_mask.shape) != tuple(x.shape[:2]) or key_padding_mask.device != x.device:
        raise ValueError(
            f"{owner}: key_padding_mask must be [batch, seq] = {tuple(x.shape[:2])} on {x.device}, got "
            f"{tuple(key_padding_mask.shape)} on {key_padding_mask.device}"
        )


def sdpa_mask(key_padding_mask: torch.Tensor, q_len: int, causal: bool, dtype: torch.dtype) -> torch.Tensor:
    """An additive attention mask for ``scaled_dot_product_attention``.

    Masked keys get ``finfo(dtype).min`` rather than -inf, as Hugging Face's models do: a
    query row with every key masked (a left-padded query) then comes out finite instead of
    NaN, and its NaN cannot spread through the next layers' ``0 * v``.

    Args:
        key_padding_mask: ``[batch, k_len]`` bool, True where a key is padding.
        q_len: number of queries.
        causal: also mask key k for query q when k > q (top-left aligned).
        dtype: of the queries (the mask's dtype).

    Returns:
        ``[batch, 1, q_len, k_len]`` if causal, else ``[batch, 1, 1, k_len]``: 0 where a
        key is attended, ``finfo(dtype).min`` where it is masked.
    """
    keep = ~key_padding_mask[:, None, None, :]
    if causal:
        k_len = key_padding_mask.shape[-1]
        keep = keep & torch.ones(q_len, k_len, dtype=torch.bool, device=keep.device).tril()
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


def _masked_softmax(
    scores: torch.Tensor, scale: float, key_padding_mask: torch.Tensor | None, bias: torch.Tensor, causal: bool
) -> torch.Tensor:
    """Plain torch for :func:`lstrain.ops.attention_softmax` (rows with no key: zeros)."""
    z = scores * scale + bias
    q_len, k_len = scores.shape[-2:]
    if causal:
        z = z.masked_fill(torch.ones(q_len, k_len, dtype=torch.bool, device=z.device).triu(1), float("-inf"))
    if key_padding_mask is not None:
        z = z.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    # zeros where every key is masked, with a finite softmax there so that its backward is
    # zero too (not NaN); a NaN score still makes its row NaN
    no_key = torch.isneginf(z).all(dim=-1, keepdim=True)
    return torch.softmax(z.masked_fill(no_key, 0.0), dim=-1).masked_fill(no_key, 0.0)


class SelfAttention(torch.nn.Module):
    """``residual + dropout(c_proj(attention(c_attn(x))))``.

    Fused with ``attn_implementation="lstrain"``, without a padding mask or ``attn_bias``,
    and for a head_dim in :data:`lstrain.ops.qkv_attention.SUPPORTED_HEAD_DIMS`:
    :func:`lstrain.ops.qkv_attention` (the projection and flash attention kernels over it,
    its attention dropout lstrain's Philox mask). Otherwise (``"sdpa"``, the default) q, k,
    v are views of ``c_attn``'s output (their gradients meet in one copy, which also sums
    ``c_attn``'s bias gradient: :func:`lstrain.ops.qkv_projection`) and SDPA attends.
    ``c_proj``'s GEMM runs without its bias and :func:`lstrain.ops.bias_dropout_residual` adds the bias,
    drops and adds the residual in one kernel. Unfused: the same in plain torch ops
    (``F.linear`` and views, SDPA or a torch softmax, ``F.dropout``), with the same
    parameter names and shapes. The GEMMs without an activation to fuse are cuBLAS's
    (``F.linear``) in both.

    Args:
        dim: model width.
        heads: attention heads; ``dim`` must be a multiple of it.
        causal: each query sees only the keys at or before it (GPT-2).
        attn_dropout: dropout of the attention probabilities, in training mode only.
        resid_dropout: dropout of the output projection, in training mode only.
        fused: lstrain's kernels, or plain torch ops.
        attn_implementation: ``"sdpa"`` (``scaled_dot_product_attention``: cuDNN or flash)
            or ``"lstrain"`` (:func:`lstrain.ops.qkv_attention` where it applies; fused only).
        device, dtype: of the parameters.

    Raises:
        ValueError: ``heads`` not an integer >= 1 or ``causal`` not a bool, ``dim`` not a
            multiple of ``heads``, a dropout outside [0, 1), or an unknown
            ``attn_implementation``; in forward, an ``x`` or ``key_padding_mask``
            of the wrong shape, dtype or device (:func:`check_attention_inputs`).

    ``forward(x, residual, key_padding_mask=None, attn_bias=None, norm=None, seed=None,
    attn_seed=None)``: ``x``
    ``[batch, seq, dim]`` (the normalised input), ``residual`` shaped like it,
    ``key_padding_mask`` ``[batch, seq]`` bool (True = padding), ``attn_bias`` an additive
    float bias broadcastable to ``[batch, heads, seq, seq]`` (it may require grad). Returns
    the new residual stream; with a LayerNorm ``norm``, ``(norm(stream), stream)``, fused
    into the residual add's kernel (:func:`lstrain.ops.dropout_add_layer_norm`). ``seed``
    (fused only): the residual dropout's seed, a 1-element int64 tensor (drawn when None);
    ``attn_seed`` (fused only) the attention dropout's, for :func:`lstrain.ops.qkv_attention`
    (drawn when None); SDPA's attention dropout draws from torch's generator.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        causal: bool = True,
        attn_dropout: float = 0.0,
        resid_dropout: float = 0.0,
        fused: bool = True,
        attn_implementation: str = "sdpa",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"SelfAttention: attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {attn_implementation!r}"
            )
        # Python values from numpy ones too: Dynamo cannot trace a numpy scalar in forward
        heads = int_option("SelfAttention", "heads", heads, 1)
        causal = bool_option("SelfAttention", "causal", causal)
        if dim % heads:
            raise ValueError(f"SelfAttention: dim={dim} must be a multiple of heads={heads}")
        for name, p in (("attn_dropout", attn_dropout), ("resid_dropout", resid_dropout)):
            if not 0.0 <= p < 1.0:
                raise ValueError(f"SelfAttention: {name} must be in [0, 1), got {p}")
        self.heads = heads
        self.causal = causal
        self.attn_dropout = attn_dropout
        self.resid_dropout = resid_dropout
        self.fused = fused
        self.attn_implementation = attn_implementation
        self.c_attn = torch.nn.Linear(dim, 3 * dim, device=device, dtype=dtype)
        self.c_proj = torch.nn.Linear(dim, dim, device=device, dtype=dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        attn_bias: torch.Tensor | None = None,
        norm: torch.nn.LayerNorm | None = None,
        seed: torch.Tensor | None = None,
        attn_seed: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        check_attention_inputs("SelfAttention", x, key_padding_mask)
        batch, seq, dim = x.shape
        p = self.attn_dropout if self.training else 0.0
        flash = self.fused and self.attn_implementation == "lstrain"
        if flash and attn_bias is None and key_padding_mask is None and dim // self.heads in SUPPORTED_HEAD_DIMS:
            out = qkv_attention(
                x, self.c_attn.weight, self.c_attn.bias, self.heads, causal=self.causal, dropout_p=p, seed=attn_seed
            )
            y = linear(out, self.c_proj.weight)
            return add_residual(y, self.c_proj.bias, residual, self.resid_dropout, self.training, norm, seed)
        project = qkv_projection if self.fused else qkv_projection_ref
        q, k, v = project(x, self.c_attn.weight, self.c_attn.bias, self.heads)
        if attn_bias is None:
            mask = None if key_padding_mask is None else sdpa_mask(key_padding_mask, seq, self.causal, q.dtype)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, is_causal=self.causal and mask is None
            )
        else:
            scores = q @ k.transpose(-1, -2)
            scale = q.shape[-1] ** -0.5
            if self.fused:
                probs = attention_softmax(
                    scores, scale=scale, key_padding_mask=key_padding_mask, mask=attn_bias, causal=self.causal
                )
            else:
                probs = _masked_softmax(scores, scale, key_padding_mask, attn_bias, self.causal)
            out = F.dropout(probs, p) @ v
        # [batch, heads, seq, head_dim] -> [batch, seq, dim]; a view where SDPA wrote
        # its output in [batch, seq, heads, head_dim] order (flash, memory-efficient)
        out = out.transpose(1, 2).reshape(batch, seq, dim)
        if self.fused:
            y = linear(out, self.c_proj.weight)
            return add_residual(y, self.c_proj.bias, residual, self.resid_dropout, self.training, norm, seed)
        h = residual + F.dropout(self.c_proj(out), self.resid_dropout, self.training)
        return h if norm is None else (norm(h), h)

    def extra_repr(self) -> str:
        return (
            f"heads={self.heads}, causal={self.causal}, attn_dropout={self.attn_dropout}, "
            f"resid_dropout={self.resid_dropout}, fused={self.fused}, attn_implementation={self.attn_implementation!r}"
        )
