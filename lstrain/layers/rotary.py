"""Rotary position embeddings (RoPE, Su et al. 2021) and grouped-query self-attention over one
packed QKV projection, as in LLaMA.

``qkv_proj`` (weight ``[(heads + 2 * kv_heads) * head_dim, dim]``) makes q, k and v in one
GEMM; its rows are Hugging Face's ``q_proj``, ``k_proj`` and ``v_proj`` stacked in that
order, and the state_dict holds them under those three keys, so HF ``LlamaAttention``
weights load as they are. q and k are rotated straight out of the projection
(:func:`lstrain.ops.rope_qkv` in the fused layer, :func:`rope_qkv_torch` in its twin), v is a
strided view of it; ``scaled_dot_product_attention`` computes the attention, with
``enable_gqa`` (flash, no copy of k/v) when there is no padding mask, and k/v repeated per
query head otherwise (SDPA's GQA with a mask runs only its math backend).

cos / sin are in HF ``LlamaRotaryEmbedding``'s layout: ``[seq, head_dim]`` or ``[batch,
seq, head_dim]``, each frequency written twice (``cat(freqs, freqs)``), rotate-half.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lstrain.layers.attention import check_attention_inputs, sdpa_mask
from lstrain.ops import linear, rope_qkv, rope_qkv_ref, rope_ref
from lstrain.ops._lib.options import int_option

__all__ = ["RotaryAttention", "rope_qkv_torch", "rope_torch", "rotary_cos_sin"]

# scaled_dot_product_attention's enable_gqa (flash attention over fewer k/v heads) came in torch 2.5
_SDPA_HAS_GQA = torch.__version__ >= "2.5"


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, as HF ``LlamaRotaryEmbedding`` computes them.

    The angles ``position * theta ** (-2i / head_dim)`` are computed in fp32 (fp64 for an fp64
    ``dtype``) and rounded once to ``dtype``.

    Args:
        positions: integer positions, ``[seq]`` or ``[batch, seq]``.
        head_dim: the (even) head width.
        theta: RoPE's base (``rope_theta``).
        dtype: of the result (the queries' dtype).

    Returns:
        ``(cos, sin)``, each ``positions.shape + (head_dim,)``.
    """
    compute = torch.promote_types(dtype, torch.float32)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).to(compute) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    angles = positions.to(compute)[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _check_rope_args(name: str, x_shape: tuple[int, ...], cos: torch.Tensor, sin: torch.Tensor) -> None:
    """:func:`rope_torch`'s checks of x's shape and of the cos / sin tables that go with it."""
    if len(x_shape) != 4 or x_shape[-1] % 2:
        raise ValueError(f"{name}: x must be [batch, heads, seq, head_dim] with an even head_dim, got {tuple(x_shape)}")
    batch, _, seq, head_dim = x_shape
    for table_name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) not in ((seq, head_dim), (batch, seq, head_dim), (1, seq, head_dim)):
            raise ValueError(
                f"{name}: {table_name} must be [seq, head_dim] = {(seq, head_dim)} or [batch or 1, seq, head_dim], "
                f"got {tuple(t.shape)}"
            )


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False) -> torch.Tensor:
    """Rotate ``x`` by RoPE in plain torch ops: :func:`lstrain.ops.rope_ref`, checked, made contiguous.

    Args:
        x: ``[batch, heads, seq, head_dim]``.
        cos, sin: ``[seq, head_dim]`` or ``[batch or 1, seq, head_dim]``, one full row per
            position, taken as given (HF's layout for rotate-half: ``cat(freqs, freqs)``;
            for interleaved, GPT-J's: each frequency repeated in place); cast to x's dtype.
        interleaved: GPT-J's ``rotate_every_two``, element ``2i`` paired with ``2i + 1``
            (``x * cos + rotate_every_two(x) * sin``) instead of rotate-half's ``i`` with
            ``i + head_dim / 2``.

    Returns:
        The rotated tensor, shaped like ``x``, contiguous, in x's dtype.

    Raises:
        ValueError: x is not 4-D with an even head_dim, or cos / sin do not fit it.
    """
    _check_rope_args("rope_torch", tuple(x.shape), cos, sin)
    return rope_ref(x, cos, sin, interleaved=interleaved).contiguous()


def rope_qkv_torch(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v from a packed projection, q and k rotated: plain torch, the contract of
    ``lstrain.ops.rope_qkv`` (:func:`lstrain.ops.rope_qkv_ref`, checked).

    Args:
        qkv: ``[batch, seq, (num_heads + 2 * num_kv_heads) * head_dim]``: q's heads, then k's,
            then v's, each head's ``head_dim`` columns together.
        cos, sin: ``[seq, head_dim]`` or ``[batch or 1, seq, head_dim]``, as for :func:`rope_torch`.
        num_heads: query heads.
        num_kv_heads: key / value heads; divides ``num_heads``.
        interleaved: as for :func:`rope_torch`.

    Returns:
        ``(q, k, v)``: q ``[batch, num_heads, seq, head_dim]`` and k ``[batch, num_kv_heads,
        seq, head_dim]`` rotated, laid out as ``[batch, seq, heads, head_dim]`` (as the
        elementwise ops leave HF's ``transpose(1, 2)``); v ``[batch, num_kv_heads, seq, head_dim]``, a
        strided view of ``qkv``.

    Raises:
        ValueError: qkv is not 3-D, its width is not a multiple of the head count, the
            head counts do not divide, or cos / sin do not fit (as for :func:`rope_torch`).
    """
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"rope_qkv_torch: num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}"
        )
    heads = num_heads + 2 * num_kv_heads
    if qkv.dim() != 3 or qkv.shape[-1] % heads:
        raise ValueError(
            f"rope_qkv_torch: qkv must be [batch, seq, (num_heads + 2 * num_kv_heads) * head_dim] with "
            f"{heads} heads, got shape {tuple(qkv.shape)}"
        )
    batch, seq, width = qkv.shape
    # q's heads as rope_torch sees them (k's differ only in the head count, which it does not check)
    _check_rope_args("rope_torch", (batch, num_heads, seq, width // heads), cos, sin)
    return rope_qkv_ref(qkv, cos, sin, num_heads, num_kv_heads, interleaved=interleaved)


class RotaryAttention(torch.nn.Module):
    """``o_proj(attention(rope(q), rope(k), v))`` with q, k, v from one packed projection and
    grouped-query attention (``kv_heads`` <= ``heads``), causal, as in LLaMA.

    Parameters: ``qkv_proj.weight`` ``[(heads + 2 * kv_heads) * head_dim, dim]`` (and
    ``qkv_proj.bias`` with ``bias``), ``o_proj.weight`` ``[dim, heads * head_dim]``;
    state_dict keys are HF's ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj``. Fused, the
    rotary step is :func:`lstrain.ops.rope_qkv` (q and k read from the projection in place,
    rotated in one kernel, its backward writing the packed gradient in one buffer); unfused,
    :func:`rope_qkv_torch`. The parameters are the same either way.

    Args:
        dim: model width.
        heads: query heads.
        kv_heads: key / value heads; divides ``heads``.
        head_dim: the (even) width of a head.
        bias: biases on all four projections (HF's ``attention_bias``).
        attn_dropout: dropout of the attention probabilities, in training mode only.
        fused: lstrain's kernels, or plain torch ops.
        device, dtype: of the parameters.

    Raises:
        ValueError: head counts or head_dim not integers >= 1, head counts that do not
            divide, an odd head_dim, or a dropout outside [0, 1).

    ``forward(x, cos, sin, key_padding_mask=None)``: ``x`` ``[batch, seq, dim]`` (normalised),
    cos / sin as for :func:`rope_torch`, ``key_padding_mask`` ``[batch, seq]`` bool (True =
    padding). Returns ``[batch, seq, dim]`` (the residual is the caller's).
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        bias: bool = False,
        attn_dropout: float = 0.0,
        fused: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        # Python ints from numpy ones too: Dynamo cannot trace a numpy scalar in forward
        heads, kv_heads, head_dim = (
            int_option("RotaryAttention", name, value, 1)
            for name, value in (("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim))
        )
        if heads % kv_heads:
            raise ValueError(f"RotaryAttention: heads={heads} must be a positive multiple of kv_heads={kv_heads}")
        if head_dim % 2:
            raise ValueError(f"RotaryAttention: head_dim must be a positive even number, got {head_dim}")
        if not 0.0 <= attn_dropout < 1.0:
            raise ValueError(f"RotaryAttention: attn_dropout must be in [0, 1), got {attn_dropout}")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.attn_dropout = attn_dropout
        self.fused = fused
        factory = {"device": device, "dtype": dtype}
        self.qkv_proj = torch.nn.Linear(dim, (heads + 2 * kv_heads) * head_dim, bias=bias, **factory)
        self.o_proj = torch.nn.Linear(heads * head_dim, dim, bias=bias, **factory)
        self._register_state_dict_hook(_split_qkv)
        self._register_load_state_dict_pre_hook(self._pack_qkv)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self._project(self.o_proj, self.context(x, cos, sin, key_padding_mask))

    def context(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The attention's output before ``o_proj``: ``[batch, seq, heads * head_dim]``
        (for a caller that folds the projection into what follows it, as
        :class:`lstrain.layers.DecoderLayer` does with ``norm_in_epilogue``). Arguments as
        for ``forward``.

        Raises:
            ValueError: an ``x`` that is not ``[batch, seq, dim]``, a ``key_padding_mask``
                that is not bool ``[batch, seq]`` on x's device.
        """
        check_attention_inputs("RotaryAttention", x, key_padding_mask)
        batch, seq, _ = x.shape
        rotary = rope_qkv if self.fused else rope_qkv_torch
        q, k, v = rotary(self._project(self.qkv_proj, x), cos, sin, self.heads, self.kv_heads)
        p = self.attn_dropout if self.training else 0.0
        if self.kv_heads != self.heads and key_padding_mask is None and _SDPA_HAS_GQA:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=True)
        else:
            if self.kv_heads != self.heads:  # SDPA's GQA with a mask runs only its math backend: repeat k/v
                k, v = (t.repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (k, v))
            mask = None if key_padding_mask is None else sdpa_mask(key_padding_mask, seq, True, q.dtype)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None)
        return out.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim)

    def _project(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        # fused: lstrain's linear, whose weight gradient goes straight into a flat gradient buffer
        return linear(x, module.weight, module.bias) if self.fused else module(x)

    def _sizes(self) -> tuple[int, int, int]:
        return self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim

    def _pack_qkv(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        """HF's q_proj / k_proj / v_proj -> qkv_proj, when all three of a parameter are there
        (otherwise they stay, reported as unexpected, and qkv_proj as missing)."""
        for param in ("weight", "bias"):
            keys = [f"{prefix}{name}_proj.{param}" for name in "qkv"]
            if all(key in state_dict for key in keys) and _fits([state_dict[key] for key in keys], self._sizes()):
                state_dict[f"{prefix}qkv_proj.{param}"] = torch.cat([state_dict.pop(key) for key in keys])

    def extra_repr(self) -> str:
        return (
            f"heads={self.heads}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, "
            f"attn_dropout={self.attn_dropout}, fused={self.fused}"
        )


def _fits(parts: list[torch.Tensor], sizes: tuple[int, int, int]) -> bool:
    """Whether q, k, v tensors have this layer's row counts and agree in the rest of their
    shape (else they are left unpacked: reported as unexpected, qkv_proj as missing)."""
    rows_fit = all(t.dim() >= 1 and t.shape[0] == n for t, n in zip(parts, sizes, strict=True))
    return rows_fit and len({tuple(t.shape[1:]) for t in parts}) == 1


def _split_qkv(module: RotaryAttention, state_dict, prefix, local_metadata):
    """qkv_proj -> HF's q_proj, k_proj, v_proj (views), in qkv_proj's place in the order."""
    mine = [key for key in state_dict if key.startswith(prefix)]  # this module's keys come last
    items = [(key, state_dict.pop(key)) for key in mine]
    for key, value in items:
        param = key.removeprefix(f"{prefix}qkv_proj.")
        if param == key:
            state_dict[key] = value
            continue
        for name, part in zip("qkv", value.split(module._sizes()), strict=True):
            state_dict[f"{prefix}{name}_proj.{param}"] = part
