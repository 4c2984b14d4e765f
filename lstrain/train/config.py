"""The training loop's own Config dataclasses, one per recipe section.

:mod:`lstrain.config` reads a recipe's TOML into these (and into ``lstrain.data.DataConfig``
and the model's config); every check of a value's range lives here, in ``__post_init__``,
so that a recipe and a program building the dataclasses directly get the same errors.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lstrain.train.families import FAMILIES, Family

if TYPE_CHECKING:
    from lstrain.data import DataConfig

__all__ = [
    "CheckpointConfig",
    "EvalConfig",
    "LRSchedulerConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RunConfig",
    "SampleConfig",
    "TrainingConfig",
]

PRECISIONS = ("bf16", "fp16", "fp32")
DECAY_TYPES = ("cosine", "linear", "constant", "warmup_stable_decay")


def _positive_int(owner: str, name: str, value: Any, *, zero: bool = False) -> None:
    low = 0 if zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = "a non-negative int" if zero else "a positive int"
        raise ValueError(f"{owner}: {name} must be {kind}, got {value!r}")


def _number(owner: str, name: str, value: Any, low: float, high: float, *, open_low: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if ok:
        ok = (value > low if open_low else value >= low) and value <= high
    if not ok:
        bracket = "(" if open_low else "["
        raise ValueError(f"{owner}: {name} must be a number in {bracket}{low}, {high}], got {value!r}")


def _bool(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}: {name} must be a bool, got {value!r}")


def _folder(owner: str, value: Any) -> str:
    """``value`` as a non-empty path string (a ``pathlib.Path`` is taken as its string)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{owner}: folder must be a non-empty path, got {value!r}")
    return value


def _choice(owner: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{owner}: {name} must be one of {', '.join(choices)}; got {value!r}")


@dataclass
class ModelConfig:
    """``[model]``: which model, and its config's fields.

    Args:
        name: the model family, a key of :data:`lstrain.train.families.FAMILIES`:
            ``"gpt2"`` (``GPT2Config``), ``"bert"`` (``BertConfig``, masked LM) or ``"llama"``
            (``LlamaConfig``).
        preset: one of the family's presets (GPT-2: ``"small"``, ``"medium"``, ``"large"``;
            BERT: ``"base"``, ``"large"``; LLaMA: ``"llama_0_75b"``, ``"llama_1b"``); None
            gives the config's defaults.
        fields: config fields set on top of the preset, e.g. ``{"n_layer": 4}``.
            ``vocab_size`` is not one of them: it comes from the data's tokenizer (and
            BERT's ``pad_token_id`` too, unless set here).

    Raises:
        ValueError: an unknown name or preset, or ``vocab_size`` among the fields.
    """

    name: str = "gpt2"
    preset: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _choice("[model]", "name", self.name, tuple(FAMILIES))
        if self.preset is not None:
            _choice("[model]", "preset", self.preset, self.family.presets)
        if "vocab_size" in self.fields:
            raise ValueError("[model]: vocab_size comes from the data's tokenizer; set the vocabulary in [data]")

    @property
    def family(self) -> Family:
        """The family's entry in the table."""
        return FAMILIES[self.name]

    def build(self, vocab_size: int, pad_id: int | None = None):
        """The model's config for a tokenizer of ``vocab_size`` tokens.

        Args:
            vocab_size: the tokenizer's vocabulary size.
            pad_id: the tokenizer's padding id (BERT's ``pad_token_id``), or None.

        Returns:
            The family's config (``GPT2Config``, ``BertConfig``, ``LlamaConfig``).

        Raises:
            ValueError: a field out of range (the config's own message).
        """
        cls = self.family.config_cls
        make = getattr(cls, self.preset) if self.preset else cls
        return make(**{**self.family.tokenizer_fields(vocab_size, pad_id), **self.fields, "vocab_size": vocab_size})


@dataclass
class TrainingConfig:
    """``[training]``: batch arithmetic, length, precision and the step's switches.

    Tokens per optimizer step = local_batch_size x world size x seq_len x
    gradient_accumulation_steps.

    Args:
        local_batch_size: sequences per rank per micro-batch.
        seq_len: tokens per sequence (at most the model's n_positions).
        gradient_accumulation_steps: micro-batches per optimizer step.
        global_batch_size: sequences per optimizer step over all ranks and micro-batches
            (torchtitan's meaning); when set, it must be a multiple of local_batch_size x
            world size and fixes gradient_accumulation_steps (which must then be left at
            1 or agree).
        steps: optimizer steps of the whole run.
        max_norm: clip the global gradient norm to this; 0 disables clipping.
        mixed_precision: ``"bf16"`` (bf16 parameters, fp32 master weights in FusedAdamW),
            ``"fp16"`` (the same in fp16, with the LossScaler) or ``"fp32"``.
        seed: the model's initialisation, dropout and sampling; the data's shuffling.
        compile: run the forward through ``torch.compile(model)``.
        cuda_graphs: capture the whole step (forward, backward, clip, optimizer) in one
            CUDA graph and replay it; needs CUDA.
        device: ``"auto"`` (CUDA when there is a GPU, else the CPU), ``"cpu"`` or
            ``"cuda"``.

    Raises:
        ValueError: a value out of range; the message names it.
    """

    local_batch_size: int = 8
    seq_len: int = 1024
    gradient_accumulation_steps: int = 1
    global_batch_size: int | None = None
    steps: int = 1000
    max_norm: float = 1.0
    mixed_precision: str = "bf16"
    seed: int = 0
    compile: bool = False
    cuda_graphs: bool = False
    device: str = "auto"

    def __post_init__(self) -> None:
        for name in ("local_batch_size", "seq_len", "gradient_accumulation_steps", "steps"):
            _positive_int("[training]", name, getattr(self, name))
        if self.global_batch_size is not None:
            _positive_int("[training]", "global_batch_size", self.global_batch_size)
        _positive_int("[training]", "seed", self.seed, zero=True)
        _number("[training]", "max_norm", self.max_norm, 0.0, math.inf)
        _choice("[training]", "mixed_precision", self.mixed_precision, PRECISIONS)
        _choice("[training]", "device", self.device, ("auto", "cpu", "cuda"))
        for name in ("compile", "cuda_graphs"):
            _bool("[training]", name, getattr(self, name))

    def accumulation(self, world_size: int) -> int:
        """Micro-batches per optimizer step on ``world_size`` ranks.

        Args:
            world_size: the number of data-parallel ranks.

        Returns:
            gradient_accumulation_steps, or what global_batch_size implies.

        Raises:
            ValueError: global_batch_size is not a multiple of local_batch_size x world
                size, or disagrees with gradient_accumulation_steps.
        """
        if self.global_batch_size is None:
            return self.gradient_accumulation_steps
        per_micro = self.local_batch_size * world_size
        if self.global_batch_size % per_micro:
            raise ValueError(
                f"[training]: global_batch_size {self.global_batch_size} does not divide across {world_size} rank(s) "
                f"of local_batch_size {self.local_batch_size} (a multiple of {per_micro} is needed)"
            )
        steps = self.global_batch_size // per_micro
        if self.gradient_accumulation_steps not in (1, steps):
            raise ValueError(
                f"[training]: global_batch_size {self.global_batch_size} = {self.local_batch_size} x {world_size} "
                f"rank(s) x {steps} accumulation steps, but gradient_accumulation_steps is "
                f"{self.gradient_accumulation_steps}"
            )
        return steps


@dataclass
class OptimizerConfig:
    """``[optimizer]``: AdamW's hyperparameters (weight decay on matrices only).

    Args:
        name: ``"adamw"``, or ``"zero_adamw"`` for ZeRO-1 in a ``torchrun`` job
            (:class:`lstrain.optim.ZeroAdamW`: each rank keeps its shard of the fp32 master
            weights and moments; checkpoints hold them gathered, in torch's AdamW layout).
        lr: the peak learning rate (the schedule scales it).
        betas: Adam's (beta1, beta2).
        eps: Adam's epsilon.
        weight_decay: decoupled weight decay of the weight matrices and embeddings;
            biases and norms get none.
        master_weights: keep fp32 master weights of bf16 parameters (true, the default),
            or round each update stochastically into them (false: 4 bytes per parameter
            less; :class:`lstrain.optim.FusedAdamW`'s ``master_weights``).
        state_dtype: the moments' dtype, ``"float32"`` or ``"bfloat16"`` (rounded
            stochastically; 4 bytes per parameter less).

    Raises:
        ValueError: a value out of range.
    """

    name: str = "adamw"
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    master_weights: bool = True
    state_dtype: str = "float32"

    def __post_init__(self) -> None:
        _choice("[optimizer]", "name", self.name, ("adamw", "zero_adamw"))
        _choice("[optimizer]", "state_dtype", self.state_dtype, ("float32", "bfloat16"))
        _bool("[optimizer]", "master_weights", self.master_weights)
        _number("[optimizer]", "lr", self.lr, 0.0, math.inf)
        _number("[optimizer]", "eps", self.eps, 0.0, math.inf)
        _number("[optimizer]", "weight_decay", self.weight_decay, 0.0, math.inf)
        self.betas = tuple(self.betas)
        if len(self.betas) != 2:
            raise ValueError(f"[optimizer]: betas must be two numbers, got {self.betas!r}")
        for beta in self.betas:
            _number("[optimizer]", "betas", beta, 0.0, 1.0 - 1e-12)


@dataclass
class LRSchedulerConfig:
    """``[lr_scheduler]``: linear warmup, then a decay to ``min_lr_factor`` x lr.

    Args:
        warmup_steps: steps of linear warmup from lr / (warmup_steps + 1) to lr.
        decay_type: ``"cosine"``, ``"linear"``, ``"constant"`` or ``"warmup_stable_decay"``
            (constant, then a linear decay over the last ``decay_ratio`` of the steps
            after warmup).
        min_lr_factor: the final learning rate as a fraction of lr.
        decay_ratio: for warmup_stable_decay only: the fraction that decays.

    Raises:
        ValueError: a value out of range.
    """

    warmup_steps: int = 0
    decay_type: str = "cosine"
    min_lr_factor: float = 0.1
    decay_ratio: float = 0.2

    def __post_init__(self) -> None:
        _positive_int("[lr_scheduler]", "warmup_steps", self.warmup_steps, zero=True)
        _choice("[lr_scheduler]", "decay_type", self.decay_type, DECAY_TYPES)
        _number("[lr_scheduler]", "min_lr_factor", self.min_lr_factor, 0.0, 1.0)
        _number("[lr_scheduler]", "decay_ratio", self.decay_ratio, 0.0, 1.0)


@dataclass
class CheckpointConfig:
    """``[checkpoint]``: where and how often.

    Args:
        folder: the directory of the checkpoints (``step-00000100/`` each); a str or a
            path-like (kept as its str).
        interval: save every this many steps, and at the end; 0 saves only at the end.
        keep_latest_k: checkpoints kept (older ones are deleted after a save).
        enabled: False writes none.

    Raises:
        ValueError: a value out of range.
    """

    folder: str = "checkpoints"
    interval: int = 500
    keep_latest_k: int = 2
    enabled: bool = True

    def __post_init__(self) -> None:
        _positive_int("[checkpoint]", "interval", self.interval, zero=True)
        _positive_int("[checkpoint]", "keep_latest_k", self.keep_latest_k)
        _bool("[checkpoint]", "enabled", self.enabled)
        self.folder = _folder("[checkpoint]", self.folder)


@dataclass
class MetricsConfig:
    """``[metrics]``: the JSON-lines log and the loss-curve PNG.

    Args:
        log_freq: log (and update the progress bar's figures) every this many steps.
        folder: where ``metrics.jsonl`` and ``loss.png`` go (a str or a path-like).

    Raises:
        ValueError: a value out of range.
    """

    log_freq: int = 10
    folder: str = "metrics"

    def __post_init__(self) -> None:
        _positive_int("[metrics]", "log_freq", self.log_freq)
        self.folder = _folder("[metrics]", self.folder)


@dataclass
class EvalConfig:
    """``[eval]``: the validation loss.

    Args:
        freq: evaluate every this many steps, and at the end; 0: only at the end.
        steps: validation batches per evaluation; 0 disables evaluation.

    Raises:
        ValueError: a value out of range.
    """

    freq: int = 100
    steps: int = 10

    def __post_init__(self) -> None:
        _positive_int("[eval]", "freq", self.freq, zero=True)
        _positive_int("[eval]", "steps", self.steps, zero=True)


@dataclass
class SampleConfig:
    """``[sample]``: a short text generated at the end of the run.

    Args:
        max_new_tokens: tokens to generate; 0 prints no sample.
        prompt: the text it continues (empty: the start of a validation sequence).
        temperature: softmax temperature of the sampling; 0 is greedy.

    Raises:
        ValueError: a value out of range.
    """

    max_new_tokens: int = 0
    prompt: str = ""
    temperature: float = 0.8

    def __post_init__(self) -> None:
        _positive_int("[sample]", "max_new_tokens", self.max_new_tokens, zero=True)
        _number("[sample]", "temperature", self.temperature, 0.0, math.inf)


@dataclass
class RunConfig:
    """A whole recipe: one config per section.

    Args:
        model, data, training, optimizer, lr_scheduler, checkpoint, metrics, eval, sample:
            the sections' configs; ``data`` is ``lstrain.data.DataConfig`` (None when the
            caller passes the data to :func:`lstrain.train.train` itself, as tests do).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig | None = None
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)

    def to_dict(self) -> dict:
        """The run as plain data (for the checkpoint and the metrics log).

        Returns:
            ``{section: {key: value}}``.
        """
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
        return out
