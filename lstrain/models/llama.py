"""LLaMA (Touvron et al. 2023) over lstrain's layers, loadable from Hugging Face checkpoints.

``Llama(LlamaConfig.llama_1b())`` is a TinyLlama-1.1B-shaped model whose ``state_dict()`` has
Hugging Face ``LlamaForCausalLM``'s keys and layouts (``model.embed_tokens.weight``,
``model.layers.0.self_attn.q_proj.weight``, ..., ``model.layers.0.mlp.gate_proj.weight``,
``model.norm.weight``, ``lm_head.weight``): ``model.load_state_dict(hf.state_dict())`` works
both ways. Inside, q/k/v are one packed projection and gate/up one pair-layout matrix
(:class:`lstrain.layers.RotaryAttention`, :class:`lstrain.layers.SwiGLU`), so the named
parameters differ from the state_dict keys there. :meth:`Llama.from_pretrained` /
:meth:`Llama.save_pretrained` read and write HF's own files (config.json + model.safetensors).

``fused=False`` builds the same model, with the same parameters, from plain torch ops:
the reference twin of tests and benchmarks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import lstrain.nn
from lstrain.layers import DecoderLayer, add_norm, rotary_cos_sin
from lstrain.models.hf_checkpoint import (
    check_state_fits,
    config_from_hf,
    config_to_hf,
    read_checkpoint,
    write_checkpoint,
)
from lstrain.models.inputs import (
    check_ids_in_range,
    check_input_ids,
    check_integer,
    check_shaped_like_input_ids,
    should_check_ids,
)
from lstrain.ops import embedding, linear_cross_entropy

__all__ = ["Llama", "LlamaConfig", "LlamaOutput"]

IGNORE_INDEX = -100

# HF LLaMA settings this model does not implement, with the value it assumes; a checkpoint
# whose config.json says otherwise is refused rather than loaded into a different model.
_FIXED_HF_SETTINGS = {"pretraining_tp": 1}


@dataclass
class LlamaConfig:
    """LLaMA's shape, with Hugging Face ``LlamaConfig``'s field names and defaults.

    :meth:`llama_0_75b` and :meth:`llama_1b` give lstrain's benchmark shapes and take any
    field as a keyword override.

    Args:
        vocab_size: token table rows.
        hidden_size: model width.
        intermediate_size: the SwiGLU MLP's inner width.
        num_hidden_layers: decoder layers.
        num_attention_heads: query heads.
        num_key_value_heads: key / value heads (grouped-query attention); divides
            num_attention_heads; None means num_attention_heads (HF's default).
        max_position_embeddings: the longest sequence.
        rms_norm_eps: the RMSNorms' epsilon.
        rope_theta: RoPE's base.
        rope_scaling: only None (plain RoPE): scaled variants (linear, dynamic, llama3, yarn)
            are refused.
        tie_word_embeddings: the LM head is the token embedding.
        attention_bias: biases on q/k/v/o projections.
        attention_dropout: dropout of the attention probabilities.
        mlp_bias: only False (lstrain's SwiGLU MLP has no biases).
        head_dim: a head's width (even); None means hidden_size // num_attention_heads.
        hidden_act: only ``"silu"`` (SwiGLU).
        initializer_range: std of the normal initialisation (HF's).
        fused: lstrain's kernels, or the same model in plain torch ops.

    Raises:
        ValueError: a field out of range or of the wrong type; the message names it.
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_dropout: float = 0.0
    mlp_bias: bool = False
    head_dim: int | None = None
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    fused: bool = True

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and _positive_int(self.hidden_size) and _positive_int(self.num_attention_heads):
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
            "head_dim",
        ):
            value = getattr(self, name)
            if not _positive_int(value):
                raise ValueError(f"LlamaConfig: {name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"LlamaConfig: num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta", "initializer_range"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < math.inf:
                raise ValueError(f"LlamaConfig: {name} must be a positive finite number, got {value!r}")
        p = self.attention_dropout
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
            raise ValueError(f"LlamaConfig: attention_dropout must be a probability in [0, 1), got {p!r}")
        if self.rope_scaling is not None:
            raise ValueError(
                f"LlamaConfig: rope_scaling must be None (plain RoPE); scaled RoPE is not implemented, "
                f"got {self.rope_scaling!r}"
            )
        if self.mlp_bias is not False:
            raise ValueError(
                f"LlamaConfig: mlp_bias must be False (the SwiGLU MLP has no biases), got {self.mlp_bias!r}"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"LlamaConfig: hidden_act must be 'silu' (SwiGLU), got {self.hidden_act!r}")
        for name in ("tie_word_embeddings", "attention_bias", "fused"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LlamaConfig: {name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def llama_0_75b(cls, **overrides) -> LlamaConfig:
        """Issue 33's LLaMA-style 0.75B (748M parameters): 12 layers x 2048, 16 heads (no
        grouping: 16 key / value heads), SwiGLU 5632, vocabulary 32000, untied head.

        Args:
            **overrides: any field, e.g. ``fused=False``.

        Returns:
            The config.
        """
        shape = {
            "vocab_size": 32000,
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_hidden_layers": 12,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
        }
        return cls(**{**shape, **overrides})

    @classmethod
    def llama_1b(cls, **overrides) -> LlamaConfig:
        """TinyLlama-1.1B's published shape: 22 layers x 2048, 32 heads, 4 key / value heads,
        SwiGLU 5632, vocabulary 32000, untied head, 2048 positions.

        Args:
            **overrides: any field.

        Returns:
            The config.
        """
        shape = {
            "vocab_size": 32000,
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_hidden_layers": 22,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
        }
        return cls(**{**shape, **overrides})

    @classmethod
    def from_hf_dict(cls, hf: dict, **overrides) -> LlamaConfig:
        """The config of a Hugging Face LLaMA config.json.

        Reads both spellings of RoPE's settings: ``rope_theta`` / ``rope_scaling``
        (transformers 4) and ``rope_parameters`` (transformers 5).

        Args:
            hf: the parsed config.json; fields this config does not have are ignored.
            **overrides: fields to set regardless (e.g. ``fused=False``).

        Returns:
            The config.

        Raises:
            ValueError: the file is not a LLaMA config, or sets a variant this model does not
                implement (scaled RoPE, ``mlp_bias``, ``pretraining_tp`` > 1, ...).
        """
        hf = dict(hf)
        rope = hf.pop("rope_parameters", None) or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(
                f"LlamaConfig: config.json sets rope_parameters={rope!r}; only plain RoPE (rope_type 'default') "
                "is supported"
            )
        if "rope_theta" in rope:
            hf["rope_theta"] = rope["rope_theta"]
        scaling = hf.get("rope_scaling")
        if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "default":
            hf["rope_scaling"] = None  # some files spell plain RoPE out
        return config_from_hf(cls, hf, "llama", _FIXED_HF_SETTINGS, overrides)

    def to_hf_dict(self) -> dict:
        """This config as a Hugging Face LLaMA config.json (``model_type`` "llama").

        Returns:
            A JSON-serialisable dict that ``transformers.LlamaConfig`` reads, old and new
            (``rope_theta`` and ``rope_parameters`` both written).
        """
        hf = config_to_hf(self, "LlamaForCausalLM", "llama", _FIXED_HF_SETTINGS)
        hf["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        return hf


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass
class LlamaOutput:
    """What :meth:`Llama.forward` returns.

    Attributes:
        loss: the mean next-token cross-entropy over the kept labels, when labels are given.
        logits: ``[batch, seq, vocab_size]``; None when the fused model computed the loss
            (it never builds the logits).
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class Llama(torch.nn.Module):
    """LLaMA causal language model: a token embedding, ``num_hidden_layers`` pre-RMSNorm
    decoder layers (rotary grouped-query attention, SwiGLU MLP), a final RMSNorm and an LM
    head, tied to the embedding or not.

    Fused (``config.fused``): :func:`lstrain.ops.embedding`, :class:`lstrain.nn.RMSNorm`,
    :class:`lstrain.layers.DecoderLayer`'s fused pieces (SwiGLU in one pass each way between
    cuBLAS GEMMs, SDPA, each residual add inside the next RMSNorm's kernel:
    :func:`lstrain.ops.add_rms_norm`), and
    with labels the loss through :func:`lstrain.ops.linear_cross_entropy` on the hidden
    states (no logits). For memory, backward makes again what is cheap to make: the SwiGLU
    activation (in the SwiGLU backward's pass) and the layers' norm outputs
    (``DecoderLayer.recompute_norms``; set it False on ``model.model.layers`` to keep them),
    the same bits either way. ``DecoderLayer.norm_in_epilogue`` (off: it measured slower)
    moves each post-attention residual add and norm into GEMM epilogues
    (:func:`lstrain.ops.linear_add_rms_norm_swiglu`). Unfused: ``nn.Embedding``,
    ``torch.nn.RMSNorm``, plain-torch layers,
    the logits and ``F.cross_entropy`` on them in fp32 (as HF computes it).

    State_dict keys and layouts are HF ``LlamaForCausalLM``'s. Initialisation is HF's:
    normal with ``initializer_range`` std, RMSNorm weights one.

    Args:
        config: the model's :class:`LlamaConfig`.
        device, dtype: of the parameters.
    """

    def __init__(self, config: LlamaConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        factory = {"device": device, "dtype": dtype}
        dim = config.hidden_size
        norm = lstrain.nn.RMSNorm if config.fused else torch.nn.RMSNorm
        self.model = torch.nn.ModuleDict(
            {
                "embed_tokens": torch.nn.Embedding(config.vocab_size, dim, **factory),
                "layers": torch.nn.ModuleList(
                    DecoderLayer(
                        dim,
                        config.num_attention_heads,
                        config.num_key_value_heads,
                        config.head_dim,
                        config.intermediate_size,
                        eps=config.rms_norm_eps,
                        attention_bias=config.attention_bias,
                        attn_dropout=config.attention_dropout,
                        fused=config.fused,
                        **factory,
                    )
                    for _ in range(config.num_hidden_layers)
                ),
                "norm": norm(dim, eps=config.rms_norm_eps, **factory),
            }
        )
        self.lm_head = torch.nn.Linear(dim, config.vocab_size, bias=False, **factory)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model["embed_tokens"].weight
        self._init_weights()

    def _init_weights(self) -> None:
        std = self.config.initializer_range
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("layernorm.weight") or name == "model.norm.weight":
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, std)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        position_ids: torch.Tensor | None = None,
        check_ids: bool | None = None,
    ) -> LlamaOutput:
        """Next-token logits, or with ``labels`` the language-modelling loss.

        Args:
            input_ids: ``[batch, seq]`` int64/int32 token ids, seq at most
                max_position_embeddings.
            labels: optional ``[batch, seq]`` ids, HF's semantics: shifted inside
                (position t predicts ``labels[:, t + 1]``), -100 ignored, the loss the
                mean over the kept tokens.
            attention_mask: optional ``[batch, seq]``, 1 (or True) for tokens to attend
                to, 0 for padding, as in HF. Positions are 0..seq-1 whatever the mask (as
                HF's forward without position_ids).
            position_ids: optional ``[batch, seq]`` or ``[1, seq]`` integer positions of the
                tokens, as HF's (e.g. counted from each row's first real token under left
                padding); default 0..seq-1. They set RoPE's angles only, not the mask.
            check_ids: check that input_ids and labels lie in the vocabulary (labels may
                also be -100) and position_ids in [0, max_position_embeddings). The check
                reads them on the host, so it defaults to on for CPU tensors only and never
                runs under torch.compile; on CUDA pass True to pay for the sync.

        Returns:
            A :class:`LlamaOutput`: ``loss`` with labels; ``logits`` without them (and with
            them in the unfused model).

        Raises:
            ValueError: input_ids not a 2-D integer tensor or longer than
                max_position_embeddings, labels or attention_mask not shaped like
                input_ids, position_ids of another shape or not integers, or (when
                checked) an id outside the vocabulary or a position outside the table; the
                message names the argument.
        """
        self._check_inputs(input_ids, labels, attention_mask, check_ids, position_ids)
        key_padding_mask = None if attention_mask is None else attention_mask == 0
        embed = self.model["embed_tokens"]
        if self.config.fused:  # ids were checked (or deliberately not) above
            x = embedding(input_ids, embed.weight, training=self.training, check_ids=False)
        else:
            x = embed(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device) if position_ids is None else position_ids
        # rounded to the model's dtype as HF does; fp32 for the fused kernel, which computes in fp32
        table_dtype = torch.promote_types(x.dtype, torch.float32) if self.config.fused else x.dtype
        cos, sin = rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta, table_dtype)
        residual = None  # each layer hands on (its MLP output, the stream); the next norm adds them
        for layer in self.model["layers"]:
            x, residual = layer(x, cos, sin, key_padding_mask, residual)
        norm = self.model["norm"]
        x = norm(x) if residual is None else add_norm(norm, x, residual, self.config.fused)[0]
        if labels is None:
            return LlamaOutput(logits=self.lm_head(x))
        # Position t predicts labels[t + 1]; the last position predicts nothing.
        target = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
        if self.config.fused:
            loss = linear_cross_entropy(
                x.reshape(-1, x.shape[-1]), self.lm_head.weight, target, ignore_index=IGNORE_INDEX,
                check_targets=False, out_dtype=torch.promote_types(x.dtype, torch.float32),  # as the twin's and HF's
            )  # fmt: skip
            return LlamaOutput(loss=loss)
        logits = self.lm_head(x)
        # at least fp32, as HF upcasts (an fp64 twin stays fp64)
        flat = logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32))
        loss = F.cross_entropy(flat, target.long(), ignore_index=IGNORE_INDEX)  # int32 labels as the fused path
        return LlamaOutput(loss=loss, logits=logits)

    def _check_inputs(self, input_ids, labels, attention_mask, check_ids: bool | None, position_ids=None) -> None:
        limit = self.config.max_position_embeddings
        check_input_ids("Llama", input_ids, "max_position_embeddings", limit)
        seq = input_ids.shape[1]
        check_shaped_like_input_ids("Llama", input_ids, (("labels", labels), ("attention_mask", attention_mask)))
        check_integer("Llama", (("labels", labels),))
        if position_ids is not None and (
            position_ids.dim() != 2
            or position_ids.shape[0] not in (1, input_ids.shape[0])
            or position_ids.shape[1] != seq
            or position_ids.dtype not in (torch.int64, torch.int32)
        ):
            raise ValueError(
                f"Llama: position_ids must be [batch or 1, seq] = {tuple(input_ids.shape)} int64 or int32, got shape "
                f"{tuple(position_ids.shape)} {position_ids.dtype}"
            )
        if not should_check_ids(check_ids, input_ids):
            return
        vocab = self.config.vocab_size
        check_ids_in_range("Llama", "input_ids", input_ids, vocab, table="vocabulary")
        check_ids_in_range("Llama", "labels", labels, vocab, ignore=IGNORE_INDEX, table="vocabulary")
        check_ids_in_range("Llama", "position_ids", position_ids, limit, note=" (max_position_embeddings)")

    @classmethod
    def from_pretrained(cls, path: str | Path, device=None, dtype=None, **overrides) -> Llama:
        """Load a Hugging Face LLaMA checkpoint (``LlamaForCausalLM``) from a local directory.

        Reads ``config.json`` and ``model.safetensors`` (or the shards listed in
        ``model.safetensors.index.json``) as ``save_pretrained`` writes them; HF's rotary
        ``inv_freq`` buffers of older files ignored. Nothing is downloaded: fetch a hub
        model first (``huggingface_hub.snapshot_download``).

        Args:
            path: the directory.
            device, dtype: of the model (default torch's; the checkpoint's tensors are
                converted).
            **overrides: config fields to set, e.g. ``fused=False``.

        Returns:
            The model in eval mode, as HF returns it (call ``.train()`` to fine-tune).

        Raises:
            FileNotFoundError: ``path`` is not a directory holding those files.
            ValueError: an unsupported config (see :meth:`LlamaConfig.from_hf_dict`), or
                tensors missing, unexpected or of the wrong shape (by HF's names), or a
                tied head stored with other values than the embedding.
        """
        hf_config, tensors = read_checkpoint(path, "Llama.from_pretrained")
        model = cls(LlamaConfig.from_hf_dict(hf_config, **overrides), device=device, dtype=dtype)
        model.load_state_dict(_from_hf_tensors(tensors, model))
        return model.eval()

    def save_pretrained(self, path: str | Path) -> None:
        """Write the model as Hugging Face's ``LlamaForCausalLM.save_pretrained`` does.

        ``config.json`` (model_type "llama") and ``model.safetensors`` with HF's keys, a tied
        LM head stored once (as ``model.embed_tokens``), tensors in the parameters' dtype.
        ``transformers.LlamaForCausalLM.from_pretrained`` and :meth:`from_pretrained` read it.

        Args:
            path: a directory, created if needed.
        """
        tensors = self.state_dict()
        if self.config.tie_word_embeddings:
            tensors.pop("lm_head.weight")
        write_checkpoint(path, self.config.to_hf_dict(), tensors)


def _from_hf_tensors(tensors: dict[str, torch.Tensor], model: Llama) -> dict[str, torch.Tensor]:
    """HF checkpoint tensors -> ``model``'s state_dict (HF's keys), checked by HF's names."""
    state = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    if model.config.tie_word_embeddings:
        embed = state.get("model.embed_tokens.weight")
        head = state.pop("lm_head.weight", None)
        if head is not None and embed is not None and not torch.equal(head, embed):
            raise ValueError(
                "Llama.from_pretrained: lm_head.weight differs from model.embed_tokens.weight but the config "
                "ties them (tie_word_embeddings)"
            )
        if embed is not None:
            state["lm_head.weight"] = embed
    check_state_fits("Llama.from_pretrained", model, state)
    return state
