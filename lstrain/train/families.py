"""The model families ``lstrain train`` knows: one table, one entry per ``[model] name``.

An entry says everything the loop needs that differs between families: the Config dataclass
and the model class (with ``from_pretrained`` / ``save_pretrained``), the presets, which
fields come from the tokenizer, whether the data is causal LM or masked LM, the longest
sequence, how the model's inputs are taken from a data batch, the FLOPs of a token (the one
count ``benchmarks/e2e.py`` uses too) and whether a text sample can be generated. Adding a
family is a Config dataclass and a model in
:mod:`lstrain.models` plus one :class:`Family` in :data:`FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lstrain.data import IGNORE_INDEX
from lstrain.models import GPT2, BertConfig, BertForMaskedLM, GPT2Config, Llama, LlamaConfig

__all__ = ["FAMILIES", "Family"]

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Family:
    """What the training loop needs to know about one model family.

    Attributes:
        name: ``[model] name``.
        label: the family's name in messages and the loss curve's title.
        config_cls: the model's Config dataclass (HF's field names; its ``[model]`` keys).
        model_cls: ``model_cls(config, device=, dtype=)``, ``from_pretrained(dir, device=,
            dtype=)`` and ``save_pretrained(dir)`` (HF's config.json + model.safetensors).
        presets: the config classmethods ``[model] preset`` may name.
        mlm: the data is masked LM (``lstrain.data.build_data(mlm=True)``), not causal LM.
        tokenizer_fields: (vocab_size, pad_id) of the tokenizer -> the config fields taken
            from it; a recipe may set any of them but ``vocab_size`` itself.
        positions_field: the config field that bounds seq_len (the position table's rows).
        shape_fields: the config fields of (layers, width), for messages.
        inputs: a data batch (``TokenStream.batch``'s dict) -> the model's keyword arguments.
        loss_tokens: the model's keyword arguments -> how many tokens its loss is the mean
            over (an int64 device scalar): gradient accumulation weighs micro-batches by it.
        flop_params: config -> N of ``6 N``: the non-embedding parameters plus the LM head's
            ``V x D`` (a GEMM, tied or not); BERT's MLM head is ``head_params`` instead.
        generates: whether ``[sample]`` can continue a prompt (causal families).
        head_params: config -> the parameters of a head that runs on the labelled rows
            only (BERT's MLM transform and decoder), or None.
    """

    name: str
    label: str
    config_cls: type
    model_cls: type
    presets: tuple[str, ...]
    mlm: bool
    tokenizer_fields: Callable[[int, int | None], dict[str, Any]]
    positions_field: str
    shape_fields: tuple[str, str]
    inputs: Callable[[Batch], Batch]
    loss_tokens: Callable[[Batch], torch.Tensor]
    flop_params: Callable[[Any], int]
    generates: bool
    head_params: Callable[[Any], int] | None = None

    def flops_per_token(self, config: Any, seq_len: int, head_share: float = 0.0) -> float:
        """Training FLOPs per token: ``6 N + 12 L T D`` (PaLM's; attention's causal half not
        halved), plus ``6`` times the head's parameters on its share of the rows. The one
        count MFU uses here and in ``benchmarks/e2e.py``.

        Args:
            config: the family's config.
            seq_len: T.
            head_share: the share of rows ``head_params``' head runs on (BERT's labelled
                positions per sequence over ``seq_len``).

        Returns:
            FLOPs per token.
        """
        layers, width = self.shape(config)
        flops = 6 * self.flop_params(config) + 12 * layers * seq_len * width
        if self.head_params is not None:
            flops += head_share * 6 * self.head_params(config)
        return flops

    def positions(self, config: Any) -> int:
        """The longest sequence a model of ``config`` takes.

        Args:
            config: the family's config.

        Returns:
            ``config``'s ``positions_field``.
        """
        return getattr(config, self.positions_field)

    def shape(self, config: Any) -> tuple[int, int]:
        """(layers, width) of ``config``, for messages.

        Args:
            config: the family's config.

        Returns:
            ``config``'s ``shape_fields``.
        """
        return tuple(getattr(config, name) for name in self.shape_fields)


def _gpt2_params(config: GPT2Config) -> int:
    d = config.n_embd
    inner = config.n_inner or 4 * d
    per_layer = 4 * d * d + 4 * d + 2 * d * inner + inner + d + 4 * d  # attention, MLP, two LayerNorms
    return config.n_layer * per_layer + 2 * d + config.vocab_size * d


def _causal_lm_inputs(batch: Batch) -> Batch:
    """A causal-LM batch's input ids and labels, and its attention mask where it has one."""
    out = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    if "attention_mask" in batch:
        out["attention_mask"] = batch["attention_mask"]
    return out


def _causal_lm_tokens(inputs: Batch) -> torch.Tensor:
    """The labels the model's loss counts: all but the first of each row (the model shifts
    them), less the ignored ones."""
    return (inputs["labels"][..., 1:] != IGNORE_INDEX).sum()


def _bert_params(config: BertConfig) -> int:
    d, ffn = config.hidden_size, config.intermediate_size
    return config.num_hidden_layers * (4 * d * d + 2 * d * ffn + ffn + 9 * d) + 2 * d  # + embeddings' LayerNorm


def _bert_head_params(config: BertConfig) -> int:
    d = config.hidden_size
    return d * d + d + 2 * d + config.vocab_size * d  # transform, its LayerNorm, the decoder


def _bert_inputs(batch: Batch) -> Batch:
    """The fixed-size masked positions when the data has them (the static-shape, capturable
    loss), else the full labels."""
    out = {"input_ids": batch["input_ids"]}
    if "attention_mask" in batch:
        out["attention_mask"] = batch["attention_mask"]
    if "masked_positions" in batch:
        out["masked_positions"], out["labels"] = batch["masked_positions"], batch["masked_labels"]
    else:
        out["labels"] = batch["labels"]
    return out


def _masked_lm_tokens(inputs: Batch) -> torch.Tensor:
    """The masked positions the model's loss counts (the full labels' or the fixed-size ones')."""
    return (inputs["labels"] != IGNORE_INDEX).sum()


def _llama_params(config: LlamaConfig) -> int:
    d = config.hidden_size
    head_dim = config.head_dim or d // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = (config.num_key_value_heads or config.num_attention_heads) * head_dim
    per_layer = 2 * d * q + 2 * d * kv + 3 * d * config.intermediate_size + 2 * d  # q, o; k, v; SwiGLU; norms
    return config.num_hidden_layers * per_layer + d + config.vocab_size * d


FAMILIES: dict[str, Family] = {
    "gpt2": Family(
        name="gpt2",
        label="GPT-2",
        config_cls=GPT2Config,
        model_cls=GPT2,
        presets=("small", "medium", "large"),
        mlm=False,
        tokenizer_fields=lambda vocab_size, pad_id: {"vocab_size": vocab_size},
        positions_field="n_positions",
        shape_fields=("n_layer", "n_embd"),
        inputs=_causal_lm_inputs,
        loss_tokens=_causal_lm_tokens,
        flop_params=_gpt2_params,
        generates=True,
    ),
    "bert": Family(
        name="bert",
        label="BERT",
        config_cls=BertConfig,
        model_cls=BertForMaskedLM,
        presets=("base", "large"),
        mlm=True,
        tokenizer_fields=lambda vocab_size, pad_id: {"vocab_size": vocab_size, "pad_token_id": pad_id},
        positions_field="max_position_embeddings",
        shape_fields=("num_hidden_layers", "hidden_size"),
        inputs=_bert_inputs,
        loss_tokens=_masked_lm_tokens,
        flop_params=_bert_params,
        generates=False,
        head_params=_bert_head_params,
    ),
    "llama": Family(
        name="llama",
        label="LLaMA",
        config_cls=LlamaConfig,
        model_cls=Llama,
        presets=("llama_0_75b", "llama_1b"),
        mlm=False,
        tokenizer_fields=lambda vocab_size, pad_id: {"vocab_size": vocab_size},
        positions_field="max_position_embeddings",
        shape_fields=("num_hidden_layers", "hidden_size"),
        inputs=_causal_lm_inputs,  # HF's label shift is inside the model, as in GPT-2
        loss_tokens=_causal_lm_tokens,
        flop_params=_llama_params,
        generates=True,
    ),
}
