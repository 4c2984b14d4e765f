"""A Transformer layer, pre-LN (GPT-2) or post-LN (BERT), fused or in plain torch ops."""

from __future__ import annotations

import torch

import lstrain.nn
from lstrain.layers.attention import SelfAttention
from lstrain.layers.mlp import MLP

__all__ = ["TransformerLayer"]


class TransformerLayer(torch.nn.Module):
    """Self-attention and an MLP, each with a residual connection and a LayerNorm.

    Pre-LN (``norm_first=True``, GPT-2): ``x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))``.
    Post-LN (BERT): ``x = ln_1(x + attn(x)); x = ln_2(x + mlp(x))``. Parameter names are
    GPT-2's (``ln_1``, ``attn.c_attn``, ``attn.c_proj``, ``ln_2``, ``mlp.c_fc``,
    ``mlp.c_proj``) in torch's Linear layout ([out, in]) whichever the order; ``fused``
    changes the modules, not the names or shapes, so a state_dict moves between the two.

    Fused: :class:`lstrain.nn.LayerNorm`, :class:`SelfAttention` and :class:`MLP` with
    lstrain's kernels (cuBLAS GEMMs without their biases, bias + activation in one kernel,
    masks regenerated from seeds). Unfused: ``nn.LayerNorm``, ``nn.Linear``, ``F.gelu``,
    ``F.dropout`` and SDPA, as a careful PyTorch user would write them.

    Args:
        dim: model width.
        heads: attention heads.
        ffn_dim: the MLP's inner width (default 4 * dim).
        norm_first: pre-LN (True) or post-LN (False).
        causal: causal self-attention (GPT-2) or bidirectional (BERT).
        activation: the MLP's, as :class:`MLP` names them.
        attn_dropout: dropout of the attention probabilities.
        resid_dropout: dropout of each sublayer's output before the residual add.
        eps: the LayerNorms' epsilon.
        fused: lstrain's kernels, or plain torch ops.
        attn_implementation: the attention's, as :class:`SelfAttention` names them.
        device, dtype: of the parameters.

    Raises:
        ValueError: see :class:`SelfAttention` and :class:`MLP`; in forward, ``normed`` or
            ``next_norm`` given to a post-LN layer.

    Each residual add and the LayerNorm after it are one
    :func:`lstrain.ops.dropout_add_layer_norm` kernel each way (fused): in pre-LN layers
    ``ln_2`` and, where the caller passes it, the next layer's ``ln_1`` (or the model's final
    norm) as ``next_norm``, whose ``normed`` output the next layer takes; in post-LN layers
    ``ln_1`` and ``ln_2``. The parameters of ``next_norm`` are then read by this layer's
    forward.

    ``forward(x, key_padding_mask=None, attn_bias=None, *, normed=None, next_norm=None,
    seeds=None)``: ``x`` ``[batch, seq, dim]``; the masks as for :class:`SelfAttention`.
    Pre-LN only: ``normed``, ``ln_1(x)`` when the caller has it already (the previous
    layer's ``next_norm`` output); ``next_norm``, a LayerNorm for the layer's output.
    ``seeds`` (fused only): a ``[3]`` int64 tensor, the seeds of the attention's and the
    MLP's residual dropouts and of the attention probabilities' dropout
    (:func:`lstrain.ops.dropout_seeds`: a model draws all of its layers' at once); drawn per
    op when None. Returns the output, or with ``next_norm``
    ``(next_norm(output), output)``.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        ffn_dim: int | None = None,
        norm_first: bool = True,
        causal: bool = True,
        activation: str = "gelu_tanh",
        attn_dropout: float = 0.0,
        resid_dropout: float = 0.0,
        eps: float = 1e-5,
        fused: bool = True,
        attn_implementation: str = "sdpa",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        norm = lstrain.nn.LayerNorm if fused else torch.nn.LayerNorm
        factory = {"device": device, "dtype": dtype}
        self.ln_1 = norm(dim, eps=eps, **factory)
        self.attn = SelfAttention(
            dim, heads, causal, attn_dropout, resid_dropout, fused, attn_implementation=attn_implementation, **factory
        )
        self.ln_2 = norm(dim, eps=eps, **factory)
        self.mlp = MLP(dim, ffn_dim or 4 * dim, activation, resid_dropout, fused, **factory)

    def forward(
        self,
        x: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        attn_bias: torch.Tensor | None = None,
        *,
        normed: torch.Tensor | None = None,
        next_norm: torch.nn.LayerNorm | None = None,
        seeds: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        attn_seed, mlp_seed, probs_seed = (None,) * 3 if seeds is None else (seeds[0:1], seeds[1:2], seeds[2:3])
        if not self.norm_first:
            if normed is not None or next_norm is not None:
                raise ValueError("TransformerLayer: normed and next_norm apply to pre-LN layers (norm_first=True)")
            x = self.attn(x, x, key_padding_mask, attn_bias, norm=self.ln_1, seed=attn_seed, attn_seed=probs_seed)[0]
            return self.mlp(x, x, norm=self.ln_2, seed=mlp_seed)[0]
        if normed is None:
            normed = self.ln_1(x)
        normed, x = self.attn(
            normed, x, key_padding_mask, attn_bias, norm=self.ln_2, seed=attn_seed, attn_seed=probs_seed
        )
        return self.mlp(normed, x, norm=next_norm, seed=mlp_seed)

    def extra_repr(self) -> str:
        return f"norm_first={self.norm_first}"
