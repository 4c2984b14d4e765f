"""LLaMA's decoder layer: pre-RMSNorm rotary GQA attention and a SwiGLU MLP, each with a residual."""

from __future__ import annotations

import torch

import lstrain.nn
from lstrain.layers.recompute import RecomputedNorms, remake_rms_norm
from lstrain.layers.rotary import RotaryAttention
from lstrain.layers.swiglu import SwiGLU
from lstrain.ops import add_rms_norm, linear_add_rms_norm_swiglu

__all__ = ["DecoderLayer", "add_norm"]


def add_norm(
    norm: torch.nn.RMSNorm, x: torch.Tensor, residual: torch.Tensor, fused: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)``: fused, one :func:`lstrain.ops.add_rms_norm`
    kernel each way with ``norm``'s weight and eps; unfused, an add and ``norm``.

    Under autocast the sublayer output ``x`` may be bf16 while the stream is fp32: the sum
    is then kept in the wider dtype, as torch's ``residual + x`` keeps it.

    Args:
        norm: the RMSNorm whose weight, eps and ``normalized_shape`` are used.
        x: a sublayer's output, ``[*, *normalized_shape]``.
        residual: the residual stream, shaped like ``x``.
        fused: one :func:`lstrain.ops.add_rms_norm`, or an add and ``norm``.

    A norm of another class than torch's and lstrain's RMSNorm (a LayerNorm, a wrapper)
    runs as a module after the add, fused or not.

    Returns:
        ``(normed, new_residual)``.

    Raises:
        ValueError: from :func:`lstrain.ops.add_rms_norm` (fused) for a bad input.
    """
    if not (fused and _kernel_norm(norm)):
        residual = residual + x
        return norm(residual), residual
    dtype = torch.promote_types(x.dtype, residual.dtype)
    return add_rms_norm(x.to(dtype), residual.to(dtype), norm.normalized_shape, norm.weight, norm.eps)


class DecoderLayer(torch.nn.Module):
    """``x = x + self_attn(input_layernorm(x)); x = x + mlp(post_attention_layernorm(x))``.

    Parameter names are HF ``LlamaDecoderLayer``'s (``input_layernorm``, ``self_attn``,
    ``post_attention_layernorm``, ``mlp``) and so are the state_dict keys
    (``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``), whichever ``fused`` is.

    Fused: :class:`RotaryAttention` and :class:`SwiGLU` on lstrain's kernels, and each
    residual add done inside the next RMSNorm's kernel (:func:`lstrain.ops.add_rms_norm`,
    forward and backward): the layer hands its MLP output and the residual stream on
    separately, and the next layer's ``input_layernorm`` (or the model's final norm) adds
    them. With ``recompute_norms`` (fused, the default) the two norm outputs, which the q/k/v
    projection and the MLP save for their weight gradients, are made again in backward from
    the residual stream the norms keep anyway (:class:`lstrain.layers.RecomputedNorms`): two
    [tokens, dim] tensors a layer fewer kept, for one read and one write of each in
    backward. With ``norm_in_epilogue`` (fused) the attention's output projection, the
    residual add, the post-attention norm and the MLP run as
    :func:`lstrain.ops.linear_add_rms_norm_swiglu`: the add and the norm in the two GEMMs'
    epilogues (issue 33's pattern A), where the stream and the weights share a bf16 or fp32
    dtype and autocast is off; its backward makes that norm's output again as ``recompute_norms``
    does. Off by default: at LLaMA-0.75B's shapes it measured 1.3% slower a layer and 1.6%
    a training step on an H200 (docs/notes/llama.md). Unfused: ``torch.nn.RMSNorm``, plain
    adds and the same layers in plain torch ops.

    Args:
        dim: model width.
        heads, kv_heads, head_dim: of the attention (see :class:`RotaryAttention`).
        intermediate_size: the MLP's inner width.
        eps: the RMSNorms' epsilon.
        attention_bias: biases on the attention's projections.
        attn_dropout: dropout of the attention probabilities.
        fused: lstrain's kernels, or plain torch ops.
        recompute_norms: with ``fused``, make the norm outputs again in backward rather
            than keep them (an attribute: may be switched on a built layer).
        norm_in_epilogue: with ``fused``, the residual add and the post-attention norm in
            GEMM epilogues (an attribute, like ``recompute_norms``).
        device, dtype: of the parameters.

    Raises:
        ValueError: see :class:`RotaryAttention`.

    ``forward(x, cos, sin, key_padding_mask=None, residual=None) -> (mlp_out, residual)``:
    ``x`` ``[batch, seq, dim]`` is the residual stream when ``residual`` is None (the first
    layer), else the previous layer's ``mlp_out``, still to be added to ``residual``; the
    layer's output stream is ``mlp_out + residual`` (see :func:`add_norm`). cos / sin and the
    mask as for :class:`RotaryAttention`.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        intermediate_size: int,
        eps: float = 1e-6,
        attention_bias: bool = False,
        attn_dropout: float = 0.0,
        fused: bool = True,
        recompute_norms: bool = True,
        norm_in_epilogue: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.fused = fused
        self.recompute_norms = recompute_norms
        self.norm_in_epilogue = norm_in_epilogue
        factory = {"device": device, "dtype": dtype}
        norm = lstrain.nn.RMSNorm if fused else torch.nn.RMSNorm
        # HF's order, so the state_dict's keys come in HF's order too
        self.self_attn = RotaryAttention(dim, heads, kv_heads, head_dim, attention_bias, attn_dropout, fused, **factory)
        self.mlp = SwiGLU(dim, intermediate_size, fused, **factory)
        self.input_layernorm = norm(dim, eps=eps, **factory)
        self.post_attention_layernorm = norm(dim, eps=eps, **factory)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with RecomputedNorms(enabled=self.fused and self.recompute_norms) as norms:
            if residual is None:
                residual, normed = x, self.input_layernorm(x)
                if type(self.input_layernorm) is lstrain.nn.RMSNorm:
                    normed = norms.register(normed, remake_rms_norm(self.input_layernorm, residual))
            else:
                normed, residual = add_norm(self.input_layernorm, x, residual, self.fused)
                if _kernel_norm(self.input_layernorm):
                    normed = norms.register(normed, remake_rms_norm(self.input_layernorm, residual))
            if self._epilogue_norm(residual):
                attn, norm, mlp = self.self_attn, self.post_attention_layernorm, self.mlp
                return linear_add_rms_norm_swiglu(
                    attn.context(normed, cos, sin, key_padding_mask), attn.o_proj.weight, residual, norm.weight,
                    mlp.gate_up_weight, mlp.down_weight, bias=attn.o_proj.bias, eps=norm.eps,
                )  # fmt: skip
            attn = self.self_attn(normed, cos, sin, key_padding_mask)
            normed, residual = add_norm(self.post_attention_layernorm, attn, residual, self.fused)
            if _kernel_norm(self.post_attention_layernorm):
                normed = norms.register(normed, remake_rms_norm(self.post_attention_layernorm, residual))
            return self.mlp(normed), residual

    def _epilogue_norm(self, residual: torch.Tensor) -> bool:
        """Whether this call takes :func:`lstrain.ops.linear_add_rms_norm_swiglu`: asked for,
        fused, outside autocast (the unfused path keeps a wide stream wide), the stream and
        every weight in one bf16 or fp32 dtype, a weighted norm, and the stock MLP module
        without hooks; anything else takes the unfused path."""
        if not (self.fused and self.norm_in_epilogue) or torch.is_autocast_enabled(residual.device.type):
            return False
        mlp, o_proj, norm = self.mlp, self.self_attn.o_proj, self.post_attention_layernorm
        tensors = (residual, o_proj.weight, o_proj.bias, mlp.gate_up_weight, mlp.down_weight)
        return (
            residual.dtype in (torch.float32, torch.bfloat16)  # the op's dtypes (fp16 would overflow)
            and all(t is None or t.dtype == residual.dtype for t in tensors)
            and _kernel_norm(norm)
            and norm.weight is not None
            # the op stands in for the MLP module's forward: its hooks and options must not matter
            and type(mlp) is SwiGLU
            and not mlp.keep_activation
            and not (mlp._forward_hooks or mlp._forward_pre_hooks)
        )


def _kernel_norm(norm: torch.nn.Module) -> bool:
    """Whether ``norm`` is an RMSNorm whose output lstrain's RMSNorm kernels make (fused add
    + norm, and the output made again in backward): torch's or lstrain's class itself."""
    return type(norm) in (torch.nn.RMSNorm, lstrain.nn.RMSNorm)
