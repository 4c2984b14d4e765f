"""BERT (Devlin et al. 2019) for masked-language modelling over lstrain's layers, loadable
from Hugging Face checkpoints.

``BertForMaskedLM(BertConfig.large())`` is BERT-large with the MLM head: word, position and
token-type embeddings, an embedding LayerNorm, ``num_hidden_layers`` post-LN
:class:`lstrain.layers.TransformerLayer` s and the head's transform (dense + activation +
LayerNorm) with a decoder tied to the word embeddings.

Parameter names. The embeddings and the head carry Hugging Face ``BertForMaskedLM``'s names
(``bert.embeddings.word_embeddings.weight``, ``cls.predictions.transform.dense.weight``,
``cls.predictions.bias``, ...); the layers keep :class:`~lstrain.layers.TransformerLayer`'s
(``bert.encoder.layer.{i}.attn.c_attn.weight``, ...), because HF's separate query / key /
value weights are one packed ``[3 * hidden, hidden]`` ``c_attn`` here and cannot be named
as three parameters. The translation lives in :meth:`BertForMaskedLM.from_pretrained` /
:meth:`~BertForMaskedLM.save_pretrained` (HF's own files), not in state_dict hooks: so
``state_dict()`` keys stay the parameters' names, which optimizers, FSDP / distributed
checkpoints and the fused / unfused twins' ``load_state_dict`` rely on, and a checkpoint
key is never a slice of a parameter. :data:`HF_LAYER_NAMES` is the table.

``fused=False`` builds the same model, with the same parameters, from plain torch ops: the
reference twin of tests and benchmarks.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import lstrain.nn
from lstrain.layers import TransformerLayer
from lstrain.layers.attention import ATTN_IMPLEMENTATIONS
from lstrain.layers.mlp import ACTIVATIONS
from lstrain.models.hf_checkpoint import config_from_hf, config_to_hf, read_checkpoint, write_checkpoint
from lstrain.models.inputs import (
    check_ids_in_range,
    check_input_ids,
    check_integer,
    check_shaped_like_input_ids,
    should_check_ids,
)
from lstrain.ops import dropout_seeds, embedding, linear_cross_entropy

__all__ = ["HF_LAYER_NAMES", "BertConfig", "BertForMaskedLM", "BertOutput"]

IGNORE_INDEX = -100

# HF's hidden_act names -> lstrain's (HF's "gelu" is the erf GELU).
_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}

# HF BERT settings this model does not implement, with the value it assumes; a checkpoint
# whose config.json says otherwise is refused rather than loaded into a different model.
_FIXED_HF_SETTINGS = {
    "position_embedding_type": "absolute",
    "is_decoder": False,
    "add_cross_attention": False,
    "tie_word_embeddings": True,
}

# Per layer, lstrain's module name -> HF's (under ``bert.encoder.layer.{i}.``), for
# ``.weight`` and ``.bias``; ``attn.c_attn`` is HF's query, key and value stacked in order.
HF_LAYER_NAMES = {
    "attn.c_attn": ("attention.self.query", "attention.self.key", "attention.self.value"),
    "attn.c_proj": ("attention.output.dense",),
    "ln_1": ("attention.output.LayerNorm",),
    "mlp.c_fc": ("intermediate.dense",),
    "mlp.c_proj": ("output.dense",),
    "ln_2": ("output.LayerNorm",),
}
_FROM_HF_LAYER = {hf: ours for ours, names in HF_LAYER_NAMES.items() if len(names) == 1 for hf in names}
_QKV = HF_LAYER_NAMES["attn.c_attn"]
_LAYER_KEY = re.compile(r"bert\.encoder\.layer\.(\d+)\.(.+)\.(weight|bias)")

# Checkpoint tensors HF's BertForMaskedLM itself skips: buffers, and the pooler and
# next-sentence head of BertForPreTraining checkpoints (bert-base-uncased's).
_IGNORED_HF_KEYS = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids")
_IGNORED_HF_PREFIXES = ("bert.pooler.", "cls.seq_relationship.")


@dataclass
class BertConfig:
    """BERT's shape and dropout, with Hugging Face ``BertConfig``'s field names.

    The defaults are BERT-base (110M); :meth:`base` and :meth:`large` give the published
    sizes and take any field as a keyword override.

    Args:
        vocab_size: word table rows (BERT's uncased WordPiece: 30522).
        hidden_size: model width.
        num_hidden_layers: Transformer layers.
        num_attention_heads: attention heads; must divide ``hidden_size``.
        intermediate_size: the MLP's inner width.
        hidden_act: activation of the MLP and the MLM transform: ``"gelu"`` (erf, BERT's),
            ``"gelu_new"`` / ``"gelu_pytorch_tanh"`` (tanh approximation), ``"relu"``,
            ``"silu"`` / ``"swish"``.
        hidden_dropout_prob: dropout of the embeddings and of each sublayer's output.
        attention_probs_dropout_prob: dropout of the attention probabilities.
        max_position_embeddings: position table rows: the longest sequence.
        type_vocab_size: token-type (segment) table rows.
        layer_norm_eps: the LayerNorms' epsilon.
        pad_token_id: the word whose embedding lookup gets no gradient (``nn.Embedding``'s
            ``padding_idx``, as in HF), or None.
        initializer_range: std of the normal initialisation (HF's).
        fused: lstrain's kernels, or the same model in plain torch ops.
        attn_implementation: what computes the fused model's attention: ``"sdpa"`` (torch's
            ``scaled_dot_product_attention``, cuDNN or flash) or ``"lstrain"``
            (:func:`lstrain.ops.qkv_attention`'s kernels where there is no padding mask).
            lstrain's own field, as ``fused``: not read from or written to a config.json.

    Raises:
        ValueError: a field out of range or of the wrong type; the message names it.
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int | None = 0
    initializer_range: float = 0.02
    fused: bool = True
    attn_implementation: str = "sdpa"

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "type_vocab_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"BertConfig: {name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"BertConfig: hidden_size ({self.hidden_size}) must be a multiple of "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"BertConfig: {name} must be a probability in [0, 1), got {value!r}")
        for name in ("layer_norm_eps", "initializer_range"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < math.inf:
                raise ValueError(f"BertConfig: {name} must be a positive finite number, got {value!r}")
        pad = self.pad_token_id
        if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < self.vocab_size):
            raise ValueError(f"BertConfig: pad_token_id must be None or an int in [0, {self.vocab_size}), got {pad!r}")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"BertConfig: hidden_act must be one of {sorted(_ACTIVATIONS)}, got {self.hidden_act!r}")
        if not isinstance(self.fused, bool):
            raise ValueError(f"BertConfig: fused must be a bool, got {self.fused!r}")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"BertConfig: attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, "
                f"got {self.attn_implementation!r}"
            )

    @classmethod
    def base(cls, **overrides) -> BertConfig:
        """BERT-base, 110M parameters: 12 layers, width 768, 12 heads, MLP 3072.

        Args:
            **overrides: any field, e.g. ``fused=False`` or ``hidden_dropout_prob=0.0``.

        Returns:
            The config.
        """
        sizes = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072}
        return cls(**{**sizes, **overrides})

    @classmethod
    def large(cls, **overrides) -> BertConfig:
        """BERT-large, 340M parameters: 24 layers, width 1024, 16 heads, MLP 4096.

        Args:
            **overrides: any field.

        Returns:
            The config.
        """
        sizes = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096}
        return cls(**{**sizes, **overrides})

    @classmethod
    def from_hf_dict(cls, hf: dict, **overrides) -> BertConfig:
        """The config of a Hugging Face BERT config.json.

        Args:
            hf: the parsed config.json; fields this config does not have are ignored.
            **overrides: fields to set regardless (e.g. ``fused=False``).

        Returns:
            The config.

        Raises:
            ValueError: the file is not a BERT config, or sets a variant this model does
                not implement (relative position embeddings, a decoder, untied embeddings).
        """
        return config_from_hf(cls, hf, "bert", _FIXED_HF_SETTINGS, overrides)

    def to_hf_dict(self) -> dict:
        """This config as a Hugging Face BERT config.json (``model_type`` "bert").

        Returns:
            A JSON-serialisable dict that ``transformers.BertConfig`` reads.
        """
        return config_to_hf(self, "BertForMaskedLM", "bert", _FIXED_HF_SETTINGS)


@dataclass
class BertOutput:
    """What :meth:`BertForMaskedLM.forward` returns.

    Attributes:
        loss: the mean cross-entropy over the positions whose label is not -100, when
            labels are given.
        logits: ``[batch, seq, vocab_size]``; None when the fused model computed the loss
            (it never builds the logits).
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class _NoRowGradient(torch.autograd.Function):
    """The word table as it is, but with no gradient for one row through this use: HF's
    ``nn.Embedding(padding_idx=pad)`` looks the pad row up (whatever it holds) and gives it
    no gradient, while the tied decoder still trains it. lstrain's embedding op zeroes a
    padding token's output instead, so the fused model masks the row's gradient here."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, row: int) -> torch.Tensor:
        ctx.row = row
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()  # the incoming gradient may be shared; never write it
        grad[ctx.row] = 0
        return grad, None


class _MaskedLMHead(torch.nn.Module):
    """HF's ``cls.predictions``: ``transform`` (dense + activation + LayerNorm) and the
    decoder's own ``bias``; the decoder weight is the word table, passed to forward."""

    def __init__(self, config: BertConfig, device=None, dtype=None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        dim = config.hidden_size
        self.activation = _ACTIVATIONS[config.hidden_act]
        self.fused = config.fused
        if config.fused:  # bias and activation in the GEMM's epilogue
            dense = lstrain.nn.Linear(dim, dim, activation=self.activation, **factory)
        else:
            dense = torch.nn.Linear(dim, dim, **factory)
        norm = lstrain.nn.LayerNorm if config.fused else torch.nn.LayerNorm
        self.transform = torch.nn.ModuleDict(
            {"dense": dense, "LayerNorm": norm(dim, eps=config.layer_norm_eps, **factory)}
        )
        self.bias = torch.nn.Parameter(torch.zeros(config.vocab_size, **factory))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The transform of the encoder's output.

        Args:
            x: ``[*, hidden_size]`` hidden states.

        Returns:
            The decoder's input, shaped like ``x``.
        """
        h = self.transform["dense"](x)
        if not self.fused:
            h = ACTIVATIONS[self.activation](h)
        return self.transform["LayerNorm"](h)


class BertForMaskedLM(torch.nn.Module):
    """BERT with the masked-language-modelling head.

    ``LayerNorm(word + position + token_type)`` and dropout, ``num_hidden_layers`` post-LN
    layers (bidirectional attention, key padding from ``attention_mask``), then the head:
    transform (dense + activation + LayerNorm) and a decoder tied to the word table with
    its own bias (``cls.predictions.bias``).

    Fused (``config.fused``): the three embeddings are one :func:`lstrain.ops.embedding`
    kernel (the position and token-type tables are summed into one small
    ``[seq * type_vocab_size, hidden]`` table, looked up at ``position * type_vocab_size +
    token_type``), :class:`lstrain.nn.LayerNorm`, the fused layers, the transform's bias
    and activation in its GEMM's epilogue, and with labels only the rows whose label is
    not -100 go through the head: gathered, transformed and scored by
    :func:`lstrain.ops.linear_cross_entropy` (no logits); at BERT's 15% masking that skips
    85% of the head's work. The gather reads how many rows there are on the host (one
    sync per step); under torch.compile, where that count would be a data-dependent shape
    linear_cross_entropy cannot trace, every row is scored with -100 ignored instead.
    That sync cannot be captured in a CUDA graph: pass ``masked_positions`` (a fixed
    number per sequence, original BERT's ``max_predictions_per_seq``, with their labels)
    and the head's rows are gathered with a static shape instead, in both models (the
    unfused one then builds the logits of those rows only).
    The embeddings' dropout is ``F.dropout`` in both (lstrain has no dropout-only op, and
    it must follow the LayerNorm). Unfused: ``nn.Embedding`` x 3, ``nn.LayerNorm``, the
    plain-torch layers, the full logits and ``F.cross_entropy`` on them with -100 ignored,
    as HF computes them, but in at least fp32 (HF keeps the model's dtype).

    Parameter names: see the module docstring; load HF weights with
    :meth:`from_pretrained`, not ``load_state_dict``. Initialisation is HF's: normal with
    ``initializer_range`` std, zero biases and pad row, unit LayerNorm weights.

    Args:
        config: the model's :class:`BertConfig`.
        device, dtype: of the parameters.
    """

    def __init__(self, config: BertConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        factory = {"device": device, "dtype": dtype}
        dim = config.hidden_size
        norm = lstrain.nn.LayerNorm if config.fused else torch.nn.LayerNorm
        embeddings = torch.nn.ModuleDict(
            {
                "word_embeddings": torch.nn.Embedding(
                    config.vocab_size, dim, padding_idx=config.pad_token_id, **factory
                ),
                "position_embeddings": torch.nn.Embedding(config.max_position_embeddings, dim, **factory),
                "token_type_embeddings": torch.nn.Embedding(config.type_vocab_size, dim, **factory),
                "LayerNorm": norm(dim, eps=config.layer_norm_eps, **factory),
            }
        )
        layers = torch.nn.ModuleList(
            TransformerLayer(
                dim,
                config.num_attention_heads,
                ffn_dim=config.intermediate_size,
                norm_first=False,
                causal=False,
                activation=_ACTIVATIONS[config.hidden_act],
                attn_dropout=config.attention_probs_dropout_prob,
                resid_dropout=config.hidden_dropout_prob,
                eps=config.layer_norm_eps,
                fused=config.fused,
                attn_implementation=config.attn_implementation,
                **factory,
            )
            for _ in range(config.num_hidden_layers)
        )
        self.bert = torch.nn.ModuleDict({"embeddings": embeddings, "encoder": torch.nn.ModuleDict({"layer": layers})})
        self.cls = torch.nn.ModuleDict({"predictions": _MaskedLMHead(config, **factory)})
        self._init_weights()

    def _init_weights(self) -> None:
        std = self.config.initializer_range
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith(("LayerNorm.weight", "ln_1.weight", "ln_2.weight")):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, std)
            if self.config.pad_token_id is not None:
                self.bert["embeddings"]["word_embeddings"].weight[self.config.pad_token_id].zero_()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        masked_positions: torch.Tensor | None = None,
        check_ids: bool | None = None,
    ) -> BertOutput:
        """MLM logits, or with ``labels`` the masked-language-modelling loss.

        Args:
            input_ids: ``[batch, seq]`` int64/int32 token ids, seq at most
                max_position_embeddings.
            attention_mask: optional ``[batch, seq]``, 1 (or True) for tokens to attend
                to, 0 for padding, as in HF. Positions are 0..seq-1 whatever the mask.
            token_type_ids: optional ``[batch, seq]`` segment ids in [0, type_vocab_size);
                default all 0.
            labels: optional ``[batch, seq]`` ids, HF's semantics: position t predicts
                ``labels[:, t]`` (no shift), -100 ignored, the loss the mean over the rest
                (NaN when every label is -100, as in HF). With ``masked_positions``,
                ``[batch, predictions]``: the label of each gathered position (-100 for
                padding slots).
            masked_positions: optional ``[batch, predictions]`` int64/int32 positions in
                [0, seq) whose rows the MLM head scores (original BERT's
                ``masked_lm_positions``, padded to a fixed count; a padding slot's label is
                -100, its position any valid one, e.g. 0). The rows are gathered with a
                static shape (no host sync: capturable in a CUDA graph, traceable by
                torch.compile), and the loss is the mean over the labels that are not -100,
                the same loss as ``labels`` over the whole sequence. Needs labels.
            check_ids: check that input_ids, token_type_ids and labels lie in their tables
                (labels may also be -100) and masked_positions in [0, seq). The check reads
                the ids on the host, so it defaults to on for CPU tensors only and never runs
                under torch.compile; on CUDA pass True to pay for the sync. Unchecked bad ids on CUDA give NaN
                rows (fused) or a device-side assert (unfused).

        Returns:
            A :class:`BertOutput`: ``loss`` with labels; ``logits`` without them (and with
            them in the unfused model: ``[batch, predictions, vocab_size]`` with
            masked_positions).

        Raises:
            ValueError: input_ids not a 2-D integer tensor or longer than
                max_position_embeddings, attention_mask, token_type_ids or labels not
                shaped like input_ids (labels: like masked_positions when given) or of the
                wrong dtype, masked_positions not 2-D integer with input_ids' batch or
                without labels, or (when checked) an id or a position outside its range;
                the message names the argument.
        """
        self._check_inputs(input_ids, attention_mask, token_type_ids, labels, check_ids, masked_positions)
        key_padding_mask = None if attention_mask is None else attention_mask == 0
        x = self._embed(input_ids, token_type_ids)
        config = self.config
        # the fused layers' dropout seeds in one draw, three per layer
        dropouts = (config.hidden_dropout_prob, config.attention_probs_dropout_prob)
        drop = config.fused and self.training and max(dropouts) > 0
        seeds = dropout_seeds(3 * config.num_hidden_layers, input_ids.device) if drop else None
        for i, layer in enumerate(self.bert["encoder"]["layer"]):
            x = layer(x, key_padding_mask, seeds=None if seeds is None else seeds[3 * i : 3 * i + 3])
        head = self.cls["predictions"]
        decoder = self.bert["embeddings"]["word_embeddings"].weight
        if labels is None:
            return BertOutput(logits=F.linear(head(x), decoder, head.bias))
        if masked_positions is not None:
            return self._masked_loss(x, masked_positions, labels)
        if self.config.fused:
            target, hidden = labels.reshape(-1), x.reshape(-1, x.shape[-1])
            if not torch.compiler.is_compiling():  # see the class docstring
                rows = (target != IGNORE_INDEX).nonzero().squeeze(1)
                hidden, target = hidden.index_select(0, rows), target.index_select(0, rows)
            loss = linear_cross_entropy(
                head(hidden), decoder, target, head.bias, ignore_index=IGNORE_INDEX, check_targets=False,
                out_dtype=torch.promote_types(hidden.dtype, torch.float32),  # the fp32 loss, as the twin's
            )  # fmt: skip
            return BertOutput(loss=loss)
        logits = F.linear(head(x), decoder, head.bias)
        # at least fp32 (an fp64 twin stays fp64): the reference's loss rounded once
        flat = logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32))
        loss = F.cross_entropy(flat, labels.reshape(-1).long(), ignore_index=IGNORE_INDEX)  # int32 labels too
        return BertOutput(loss=loss, logits=logits)

    def _masked_loss(self, x: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor) -> BertOutput:
        """The MLM loss over the rows at ``positions`` (``[batch, predictions]``), gathered
        with a static shape: ``index_select`` of the flattened rows, no nonzero."""
        batch, seq, dim = x.shape
        offsets = torch.arange(batch, device=positions.device, dtype=torch.int64)[:, None] * seq
        rows = (positions.to(torch.int64) + offsets).reshape(-1)
        hidden = x.reshape(batch * seq, dim).index_select(0, rows)
        target = labels.reshape(-1)
        head = self.cls["predictions"]
        decoder = self.bert["embeddings"]["word_embeddings"].weight
        if self.config.fused:
            loss = linear_cross_entropy(
                head(hidden), decoder, target, head.bias, ignore_index=IGNORE_INDEX, check_targets=False,
                out_dtype=torch.promote_types(hidden.dtype, torch.float32),  # the fp32 loss, as the twin's
            )  # fmt: skip
            return BertOutput(loss=loss)
        logits = F.linear(head(hidden), decoder, head.bias)
        flat = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss = F.cross_entropy(flat, target.long(), ignore_index=IGNORE_INDEX)
        return BertOutput(loss=loss, logits=logits.reshape(batch, -1, logits.shape[-1]))

    def _embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        tables = self.bert["embeddings"]
        word, position, token_type = (
            tables[name].weight for name in ("word_embeddings", "position_embeddings", "token_type_embeddings")
        )
        seq = input_ids.shape[1]
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        if self.config.fused:  # ids were checked (or deliberately not) in forward
            types = self.config.type_vocab_size
            # position and token type in one [seq * types, dim] table: one lookup, and their
            # gradients flow back through the (small) broadcast sum
            pos_type = (position[:seq, None, :] + token_type[None, :, :]).reshape(seq * types, -1)
            positions = torch.arange(seq, device=input_ids.device) * types + token_type_ids
            # an unchecked bad token type would land on a neighbour position's row: send it
            # past the table instead, where the kernel writes NaN (never a silent wrong row)
            in_range = (token_type_ids >= 0) & (token_type_ids < types)
            positions = positions.masked_fill(~in_range, seq * types)
            if self.config.pad_token_id is not None and torch.is_grad_enabled():
                word = _NoRowGradient.apply(word, self.config.pad_token_id)
            x = embedding(input_ids, word, pos_weight=pos_type, positions=positions, check_ids=False)
        else:
            positions = torch.arange(seq, device=input_ids.device)
            x = tables["word_embeddings"](input_ids) + tables["token_type_embeddings"](token_type_ids)
            x = x + tables["position_embeddings"](positions)
        return F.dropout(tables["LayerNorm"](x), self.config.hidden_dropout_prob, self.training)

    def _check_inputs(
        self, input_ids, attention_mask, token_type_ids, labels, check_ids: bool | None, masked_positions=None
    ) -> None:
        model = "BertForMaskedLM"
        check_input_ids(model, input_ids, "max_position_embeddings", self.config.max_position_embeddings)
        seq = input_ids.shape[1]
        if masked_positions is not None:
            if masked_positions.dim() != 2 or masked_positions.dtype not in (torch.int64, torch.int32):
                raise ValueError(
                    f"BertForMaskedLM: masked_positions must be [batch, predictions] int64 or int32, got shape "
                    f"{tuple(masked_positions.shape)} {masked_positions.dtype}"
                )
            if masked_positions.shape[0] != input_ids.shape[0]:
                raise ValueError(
                    f"BertForMaskedLM: masked_positions has batch {masked_positions.shape[0]}, input_ids "
                    f"{input_ids.shape[0]}"
                )
            if labels is None:
                raise ValueError("BertForMaskedLM: masked_positions needs labels (one per position, -100 for padding)")
            if tuple(labels.shape) != tuple(masked_positions.shape):
                raise ValueError(
                    f"BertForMaskedLM: labels must be shaped like masked_positions {tuple(masked_positions.shape)}, "
                    f"got {tuple(labels.shape)}"
                )
        sequence_shaped = [("attention_mask", attention_mask), ("token_type_ids", token_type_ids)]
        if masked_positions is None:
            sequence_shaped.append(("labels", labels))
        check_shaped_like_input_ids(model, input_ids, sequence_shaped)
        check_integer(model, (("token_type_ids", token_type_ids), ("labels", labels)))
        if not should_check_ids(check_ids, input_ids):
            return
        vocab, types = self.config.vocab_size, self.config.type_vocab_size
        check_ids_in_range(model, "input_ids", input_ids, vocab)
        check_ids_in_range(model, "token_type_ids", token_type_ids, types)
        check_ids_in_range(model, "labels", labels, vocab, ignore=IGNORE_INDEX)
        check_ids_in_range(model, "masked_positions", masked_positions, seq)

    @classmethod
    def from_pretrained(cls, path: str | Path, device=None, dtype=None, **overrides) -> BertForMaskedLM:
        """Load a Hugging Face BERT checkpoint from a local directory.

        Reads ``config.json`` and ``model.safetensors`` (or the shards listed in
        ``model.safetensors.index.json``) as ``BertForMaskedLM.save_pretrained`` writes
        them: query / key / value packed into ``c_attn``, HF's layer names mapped to
        :data:`HF_LAYER_NAMES`'s, old ``LayerNorm.gamma`` / ``beta`` names read as weight /
        bias, keys without the ``bert.`` prefix accepted, and what HF's BertForMaskedLM
        skips too (the position / token-type id buffers, a BertForPreTraining file's
        pooler and next-sentence head) ignored. Nothing is downloaded: fetch a hub model
        first (``huggingface_hub.snapshot_download``).

        Args:
            path: the directory.
            device, dtype: of the model (default torch's; the checkpoint's tensors are
                converted).
            **overrides: config fields to set, e.g. ``fused=False`` or
                ``hidden_dropout_prob=0.0``.

        Returns:
            The model in eval mode, as HF returns it (call ``.train()`` to fine-tune).

        Raises:
            FileNotFoundError: ``path`` is not a directory holding those files.
            ValueError: an unsupported config (see :meth:`BertConfig.from_hf_dict`), or
                tensors missing, unexpected or of the wrong shape, or a decoder that is not
                the word table.
        """
        hf_config, tensors = read_checkpoint(path, "BertForMaskedLM.from_pretrained")
        model = cls(BertConfig.from_hf_dict(hf_config, **overrides), device=device, dtype=dtype)
        model.load_state_dict(_from_hf_tensors(tensors, model))
        return model.eval()

    def save_pretrained(self, path: str | Path) -> None:
        """Write the model as Hugging Face's ``BertForMaskedLM.save_pretrained`` does.

        ``config.json`` (model_type "bert") and ``model.safetensors`` with HF's keys: ``c_attn``
        split into query / key / value, the tied decoder stored once (as the word table and
        ``cls.predictions.bias``), tensors in the parameters' dtype.
        ``transformers.BertForMaskedLM.from_pretrained`` and :meth:`from_pretrained` read it.

        Args:
            path: a directory, created if needed.
        """
        write_checkpoint(path, self.config.to_hf_dict(), _to_hf_tensors(self.state_dict()))


def _hf_names(key: str) -> tuple[str, ...]:
    """The HF checkpoint key(s) of one of our state_dict keys (c_attn's are three)."""
    match = _LAYER_KEY.fullmatch(key)
    if match is None or match.group(2) not in HF_LAYER_NAMES:
        return (key,)
    layer, module, param = match.groups()
    return tuple(f"bert.encoder.layer.{layer}.{name}.{param}" for name in HF_LAYER_NAMES[module])


def _to_hf_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state_dict -> HF BertForMaskedLM's checkpoint tensors (c_attn split in three)."""
    tensors = {}
    for key, value in state.items():
        names = _hf_names(key)
        tensors.update(zip(names, value.chunk(len(names)), strict=True))
    return tensors


def _hf_key(key: str) -> str:
    """A checkpoint key in today's HF spelling: ``bert.`` prefixed, LayerNorm weight / bias."""
    if not key.startswith(("bert.", "cls.")):
        key = f"bert.{key}"  # a BertModel checkpoint's keys
    return re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", key))


def _from_hf_tensors(tensors: dict[str, torch.Tensor], model: BertForMaskedLM) -> dict[str, torch.Tensor]:
    """HF checkpoint tensors -> ``model``'s state_dict: lstrain's layer names, packed QKV."""
    state, qkv, problems = {}, {}, []
    for key, value in tensors.items():
        key = _hf_key(key)
        if key in _IGNORED_HF_KEYS or key.startswith(_IGNORED_HF_PREFIXES):
            continue
        match = _LAYER_KEY.fullmatch(key)
        if match is not None:
            layer, module, param = match.groups()
            if module in _QKV:
                qkv.setdefault((layer, param), {})[module] = value
                continue
            if module in _FROM_HF_LAYER:
                key = f"bert.encoder.layer.{layer}.{_FROM_HF_LAYER[module]}.{param}"
        state[key] = value
    for (layer, param), parts in qkv.items():
        absent = [f"bert.encoder.layer.{layer}.{name}.{param}" for name in _QKV if name not in parts]
        if absent:
            problems.append(f"missing {absent}")
        else:
            state[f"bert.encoder.layer.{layer}.attn.c_attn.{param}"] = torch.cat([parts[name] for name in _QKV])
    # the tied decoder, when a file stores it: it must be the word table and the head's bias
    for key, tied in (
        ("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"),
        ("cls.predictions.decoder.bias", "cls.predictions.bias"),
    ):
        value = state.pop(key, None)
        if value is None:
            continue
        if tied not in state:
            state[tied] = value
        elif not torch.equal(value, state[tied]):
            raise ValueError(f"BertForMaskedLM.from_pretrained: {key} differs from {tied} (an untied decoder)")
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in state.items()}
    # missing and unexpected tensors by the checkpoint's (HF's) names
    for word, keys in (("missing", expected.keys() - found.keys()), ("unexpected", found.keys() - expected.keys())):
        if keys:
            problems.append(f"{word} {sorted(name for key in keys for name in _hf_names(key))}")
    problems += [f"{k} has shape {found[k]}, expected {s}" for k, s in expected.items() if k in found and found[k] != s]
    if problems:
        raise ValueError(
            f"BertForMaskedLM.from_pretrained: the checkpoint does not fit the config: {'; '.join(problems)}"
        )
    return state
