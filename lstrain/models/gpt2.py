"""GPT-2 (Radford et al. 2019) over lstrain's layers, loadable from Hugging Face checkpoints.

``GPT2(GPT2Config.medium())`` is a GPT-2 medium whose ``state_dict()`` has Hugging Face
``GPT2LMHeadModel``'s key names (``transformer.wte.weight``, ``transformer.h.0.attn.c_attn.weight``,
..., ``lm_head.weight`` tied to ``transformer.wte.weight``) in torch's Linear layout:
HF's Conv1D weights are ``[in, out]``, ours ``[out, in]``, so a state_dict moves between the
two only through :meth:`GPT2.from_pretrained` / :meth:`GPT2.save_pretrained`, which read and
write HF's own files (config.json + model.safetensors) and transpose those weights.

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
from lstrain.layers import TransformerLayer
from lstrain.layers.attention import ATTN_IMPLEMENTATIONS
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
from lstrain.ops import dropout_seeds, embedding, linear_cross_entropy

__all__ = ["GPT2", "GPT2Config", "GPT2Output"]

IGNORE_INDEX = -100

# HF's activation_function names -> lstrain's.
_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}

# HF GPT-2 settings this model does not implement, with the value it assumes; a checkpoint
# whose config.json says otherwise is refused rather than loaded into a different model.
_FIXED_HF_SETTINGS = {
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
    "tie_word_embeddings": True,
}

# Weights HF's GPT-2 keeps in Conv1D's [in, out] layout.
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


@dataclass
class GPT2Config:
    """GPT-2's shape and dropout, with Hugging Face ``GPT2Config``'s field names.

    The defaults are GPT-2 small (124M); :meth:`small`, :meth:`medium` and :meth:`large`
    give the published sizes and take any field as a keyword override.

    Args:
        vocab_size: token table rows (GPT-2's BPE: 50257).
        n_positions: position table rows: the longest sequence.
        n_embd: model width.
        n_layer: Transformer layers.
        n_head: attention heads; must divide ``n_embd``.
        n_inner: the MLP's inner width; None means 4 * n_embd.
        activation_function: ``"gelu_new"`` (tanh approximation, GPT-2's),
            ``"gelu_pytorch_tanh"`` (the same), ``"gelu"`` or ``"relu"``.
        resid_pdrop: dropout of each sublayer's output.
        embd_pdrop: dropout of the embeddings.
        attn_pdrop: dropout of the attention probabilities.
        layer_norm_epsilon: the LayerNorms' epsilon.
        initializer_range: std of the normal initialisation (HF's).
        fused: lstrain's kernels, or the same model in plain torch ops.
        attn_implementation: what computes the fused model's attention: ``"sdpa"`` (torch's
            ``scaled_dot_product_attention``, cuDNN or flash) or ``"lstrain"``
            (:func:`lstrain.ops.qkv_attention`'s kernels where there is no padding mask).
            lstrain's own field, as ``fused``: not read from or written to a config.json.

    Raises:
        ValueError: a field out of range or of the wrong type; the message names it.
    """

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    fused: bool = True
    attn_implementation: str = "sdpa"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner"):
            value = getattr(self, name)
            if value is None and name == "n_inner":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPT2Config: {name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPT2Config: n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"GPT2Config: {name} must be a probability in [0, 1), got {value!r}")
        for name in ("layer_norm_epsilon", "initializer_range"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < math.inf:
                raise ValueError(f"GPT2Config: {name} must be a positive finite number, got {value!r}")
        if self.activation_function not in _ACTIVATIONS:
            raise ValueError(
                f"GPT2Config: activation_function must be one of {sorted(_ACTIVATIONS)}, "
                f"got {self.activation_function!r}"
            )
        if not isinstance(self.fused, bool):
            raise ValueError(f"GPT2Config: fused must be a bool, got {self.fused!r}")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"GPT2Config: attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, "
                f"got {self.attn_implementation!r}"
            )

    @classmethod
    def small(cls, **overrides) -> GPT2Config:
        """GPT-2 small, 124M parameters: 12 layers, width 768, 12 heads.

        Args:
            **overrides: any field, e.g. ``fused=False`` or ``resid_pdrop=0.0``.

        Returns:
            The config.
        """
        return cls(**{"n_embd": 768, "n_layer": 12, "n_head": 12, **overrides})

    @classmethod
    def medium(cls, **overrides) -> GPT2Config:
        """GPT-2 medium, 355M parameters: 24 layers, width 1024, 16 heads.

        Args:
            **overrides: any field.

        Returns:
            The config.
        """
        return cls(**{"n_embd": 1024, "n_layer": 24, "n_head": 16, **overrides})

    @classmethod
    def large(cls, **overrides) -> GPT2Config:
        """GPT-2 large, 774M parameters: 36 layers, width 1280, 20 heads.

        Args:
            **overrides: any field.

        Returns:
            The config.
        """
        return cls(**{"n_embd": 1280, "n_layer": 36, "n_head": 20, **overrides})

    @classmethod
    def from_hf_dict(cls, hf: dict, **overrides) -> GPT2Config:
        """The config of a Hugging Face GPT-2 config.json.

        Args:
            hf: the parsed config.json; fields this config does not have are ignored.
            **overrides: fields to set regardless (e.g. ``fused=False``).

        Returns:
            The config.

        Raises:
            ValueError: the file is not a GPT-2 config, or sets a variant this model does
                not implement (e.g. ``scale_attn_by_inverse_layer_idx``, untied embeddings).
        """
        return config_from_hf(cls, hf, "gpt2", _FIXED_HF_SETTINGS, overrides)

    def to_hf_dict(self) -> dict:
        """This config as a Hugging Face GPT-2 config.json (``model_type`` "gpt2").

        Returns:
            A JSON-serialisable dict that ``transformers.GPT2Config`` reads.
        """
        return config_to_hf(self, "GPT2LMHeadModel", "gpt2", _FIXED_HF_SETTINGS)


@dataclass
class GPT2Output:
    """What :meth:`GPT2.forward` returns.

    Attributes:
        loss: the mean next-token cross-entropy over the kept labels, when labels are given.
        logits: ``[batch, seq, vocab_size]``; None when the fused model computed the loss
            (it never builds the logits).
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class GPT2(torch.nn.Module):
    """GPT-2 language model: embeddings, ``n_layer`` pre-LN layers, a final LayerNorm and
    an LM head tied to the token embedding.

    Fused (``config.fused``): the embedding sum and its dropout in one
    :func:`lstrain.ops.embedding` kernel, :class:`lstrain.layers.TransformerLayer`'s fused
    pieces, each layer's last residual add carrying the next LayerNorm (the next layer's
    ``ln_1``, or ``ln_f``: a layer's forward reads those parameters, and those norms'
    forward hooks do not run), and with labels the loss through
    :func:`lstrain.ops.linear_cross_entropy` on the hidden states (no logits). Unfused:
    ``nn.Embedding`` x 2 + dropout, the plain-torch layers, ``nn.LayerNorm``, the logits
    and ``F.cross_entropy`` on them in fp32 (as HF computes it).

    Parameters (``state_dict`` keys) are HF ``GPT2LMHeadModel``'s names in torch's Linear
    layout (``[out, in]``; HF's Conv1D files hold ``[in, out]``): load HF weights with
    :meth:`from_pretrained`, not ``load_state_dict``. Initialisation is HF's: normal with
    ``initializer_range`` std, residual projections scaled by ``1 / sqrt(2 n_layer)``.

    Args:
        config: the model's :class:`GPT2Config`.
        device, dtype: of the parameters.
    """

    def __init__(self, config: GPT2Config, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        factory = {"device": device, "dtype": dtype}
        dim = config.n_embd
        norm = lstrain.nn.LayerNorm if config.fused else torch.nn.LayerNorm
        # nn.Embedding holds both tables under HF's names in the fused model too; its
        # forward runs the fused op on them (lstrain.nn.TransformerEmbedding's keys are
        # weight / position_weight, not HF's wte / wpe).
        self.transformer = torch.nn.ModuleDict(
            {
                "wte": torch.nn.Embedding(config.vocab_size, dim, **factory),
                "wpe": torch.nn.Embedding(config.n_positions, dim, **factory),
                "h": torch.nn.ModuleList(
                    TransformerLayer(
                        dim,
                        config.n_head,
                        ffn_dim=config.n_inner,
                        norm_first=True,
                        causal=True,
                        activation=_ACTIVATIONS[config.activation_function],
                        attn_dropout=config.attn_pdrop,
                        resid_dropout=config.resid_pdrop,
                        eps=config.layer_norm_epsilon,
                        fused=config.fused,
                        attn_implementation=config.attn_implementation,
                        **factory,
                    )
                    for _ in range(config.n_layer)
                ),
                "ln_f": norm(dim, eps=config.layer_norm_epsilon, **factory),
            }
        )
        self.lm_head = torch.nn.Linear(dim, config.vocab_size, bias=False, **factory)
        self.lm_head.weight = self.transformer["wte"].weight
        self._init_weights()

    def _init_weights(self) -> None:
        std = self.config.initializer_range
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                elif name.endswith("c_proj.weight"):  # GPT-2 paper: residual projections scaled down
                    p.normal_(0.0, std / math.sqrt(2 * self.config.n_layer))
                else:
                    p.normal_(0.0, std)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        check_ids: bool | None = None,
    ) -> GPT2Output:
        """Next-token logits, or with ``labels`` the language-modelling loss.

        Args:
            input_ids: ``[batch, seq]`` int64/int32 token ids, seq at most n_positions.
            labels: optional ``[batch, seq]`` ids, HF's semantics: shifted inside
                (position t predicts ``labels[:, t + 1]``), -100 ignored, the loss the
                mean over the kept tokens.
            attention_mask: optional ``[batch, seq]``, 1 (or True) for tokens to attend
                to, 0 for padding, as in HF. Positions are 0..seq-1 whatever the mask.
            check_ids: check that input_ids and labels lie in the vocabulary (labels may
                also be -100). The check reads the ids on the host, so it defaults to on
                for CPU tensors only and never runs under torch.compile; on CUDA pass
                True to pay for the sync. Unchecked bad ids on CUDA give NaN rows (fused)
                or a device-side assert (unfused).

        Returns:
            A :class:`GPT2Output`: ``loss`` with labels; ``logits`` without them (and with
            them in the unfused model).

        Raises:
            ValueError: input_ids not a 2-D integer tensor or longer than n_positions,
                labels or attention_mask not shaped like input_ids, or (when checked) an
                id outside the vocabulary; the message names the argument.
        """
        self._check_inputs(input_ids, labels, attention_mask, check_ids)
        key_padding_mask = None if attention_mask is None else attention_mask == 0
        seeds = self._dropout_seeds(input_ids.device)
        tied = labels is not None and self.lm_head.weight is self.transformer["wte"].weight
        x, head_weight = self._embed(input_ids, None if seeds is None else seeds[0:1], tied_head=tied)
        # Each layer applies the next LayerNorm (the next layer's ln_1, or ln_f) in its last
        # residual add's kernel and hands on both the stream and its normalised copy.
        layers, normed = self.transformer["h"], None
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].ln_1 if i + 1 < len(layers) else self.transformer["ln_f"]
            layer_seeds = None if seeds is None else seeds[1 + 3 * i : 4 + 3 * i]
            normed, x = layer(x, key_padding_mask, normed=normed, next_norm=next_norm, seeds=layer_seeds)
        x = normed
        if labels is None:
            return GPT2Output(logits=self.lm_head(x))
        # Position t predicts labels[t + 1]; the last position predicts nothing. Padding the
        # labels (as HF does) rather than slicing the states keeps hidden a view.
        target = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
        if self.config.fused:
            loss = linear_cross_entropy(
                x.reshape(-1, x.shape[-1]), head_weight, target, ignore_index=IGNORE_INDEX, check_targets=False,
                out_dtype=torch.promote_types(x.dtype, torch.float32),  # the fp32 loss, as the twin's and HF's
            )  # fmt: skip
            return GPT2Output(loss=loss)
        logits = self.lm_head(x)
        # at least fp32, as HF upcasts (an fp64 twin stays fp64)
        flat = logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32))
        loss = F.cross_entropy(flat, target.long(), ignore_index=IGNORE_INDEX)  # int32 labels as the fused path
        return GPT2Output(loss=loss, logits=logits)

    def _dropout_seeds(self, device: torch.device) -> torch.Tensor | None:
        """The fused forward's dropout seeds in one draw (the embedding's, then each layer's
        three), or None where no lstrain dropout runs."""
        config = self.config
        if not (config.fused and self.training and max(config.embd_pdrop, config.resid_pdrop, config.attn_pdrop) > 0):
            return None
        return dropout_seeds(1 + 3 * config.n_layer, device)

    def _embed(
        self, input_ids: torch.Tensor, seed: torch.Tensor | None, tied_head: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The embedded stream and the weight the LM head reads: with ``tied_head`` (fused)
        the token table as the embedding op's second output, so that the head's gradient
        meets the table's in the op's backward (one pass, no [V, D] add)."""
        wte, wpe = self.transformer["wte"], self.transformer["wpe"]
        p = self.config.embd_pdrop
        if self.config.fused:  # ids were checked (or deliberately not) in forward
            out = embedding(
                input_ids, wte.weight, pos_weight=wpe.weight, dropout=p, training=self.training, check_ids=False,
                seed=seed, return_table=tied_head,
            )  # fmt: skip
            return out if tied_head else (out, self.lm_head.weight)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return F.dropout(wte(input_ids) + wpe(positions), p, self.training), self.lm_head.weight

    def _check_inputs(self, input_ids, labels, attention_mask, check_ids: bool | None) -> None:
        check_input_ids("GPT2", input_ids, "n_positions", self.config.n_positions)
        check_shaped_like_input_ids("GPT2", input_ids, (("labels", labels), ("attention_mask", attention_mask)))
        check_integer("GPT2", (("labels", labels),))
        if not should_check_ids(check_ids, input_ids):
            return
        vocab = self.config.vocab_size
        check_ids_in_range("GPT2", "input_ids", input_ids, vocab, table="vocabulary")
        check_ids_in_range("GPT2", "labels", labels, vocab, ignore=IGNORE_INDEX, table="vocabulary")

    @classmethod
    def from_pretrained(cls, path: str | Path, device=None, dtype=None, **overrides) -> GPT2:
        """Load a Hugging Face GPT-2 checkpoint from a local directory.

        Reads ``config.json`` and ``model.safetensors`` (or the shards listed in
        ``model.safetensors.index.json``) as ``GPT2LMHeadModel.save_pretrained`` writes
        them; keys with or without the ``transformer.`` prefix (older checkpoints), HF's
        causal-mask buffers ignored, Conv1D weights transposed to torch's layout. Nothing
        is downloaded: fetch a hub model first (``huggingface_hub.snapshot_download``).

        Args:
            path: the directory.
            device, dtype: of the model (default torch's; the checkpoint's tensors are
                converted).
            **overrides: config fields to set, e.g. ``fused=False`` or ``resid_pdrop=0.0``.

        Returns:
            The model in eval mode, as HF returns it (call ``.train()`` to fine-tune).

        Raises:
            FileNotFoundError: ``path`` is not a directory holding those files.
            ValueError: an unsupported config (see :meth:`GPT2Config.from_hf_dict`), or
                tensors missing, unexpected or of the wrong shape, or an LM head that is
                not the token embedding.
        """
        hf_config, tensors = read_checkpoint(path, "GPT2.from_pretrained")
        model = cls(GPT2Config.from_hf_dict(hf_config, **overrides), device=device, dtype=dtype)
        model.load_state_dict(_from_hf_tensors(tensors, model))
        return model.eval()

    def save_pretrained(self, path: str | Path) -> None:
        """Write the model as Hugging Face's ``GPT2LMHeadModel.save_pretrained`` does.

        ``config.json`` (model_type "gpt2") and ``model.safetensors``: Conv1D weights in
        HF's ``[in, out]`` layout, the tied LM head stored once (as ``transformer.wte``),
        tensors in the parameters' dtype. ``transformers.GPT2LMHeadModel.from_pretrained``
        and :meth:`from_pretrained` read it.

        Args:
            path: a directory, created if needed.
        """
        tensors = {
            key: value.t() if key.endswith(_CONV1D) else value
            for key, value in self.state_dict().items()
            if key != "lm_head.weight"
        }
        write_checkpoint(path, self.config.to_hf_dict(), tensors)


def _from_hf_tensors(tensors: dict[str, torch.Tensor], model: GPT2) -> dict[str, torch.Tensor]:
    """HF checkpoint tensors -> ``model``'s state_dict: prefixed keys, torch's Linear layout."""
    state = {}
    for key, value in tensors.items():
        if key.endswith(".attn.masked_bias") or (key.endswith(".attn.bias") and value.dim() > 1):
            continue  # HF's mask buffers of older checkpoints (a 0-d masked_bias), not weights
        key = key if key.startswith(("transformer.", "lm_head.")) else f"transformer.{key}"
        state[key] = value.t() if key.endswith(_CONV1D) else value
    wte = state.get("transformer.wte.weight")
    head = state.pop("lm_head.weight", None)
    if head is not None and wte is not None and not torch.equal(head, wte):
        raise ValueError("GPT2.from_pretrained: lm_head.weight differs from transformer.wte.weight (untied head)")
    if wte is not None:
        state["lm_head.weight"] = wte
    check_state_fits("GPT2.from_pretrained", model, state)
    return state
