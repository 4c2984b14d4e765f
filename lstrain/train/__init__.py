"""The training loop behind ``lstrain train``: a recipe's configs in, a trained model out.

``train(RunConfig(...))`` trains in this process, or as one rank of a ``torchrun`` job
(data parallel over the flat gradient buffers); :mod:`lstrain.config` builds the
``RunConfig`` from a TOML recipe; ``FAMILIES`` is the table of model families it trains
(``[model] name``: gpt2, bert). ``CapturedStep`` replays any training step from one
CUDA graph.
"""

from lstrain.train.capture import CapturedStep, CaptureError
from lstrain.train.config import (
    CheckpointConfig,
    EvalConfig,
    LRSchedulerConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    RunConfig,
    SampleConfig,
    TrainingConfig,
)
from lstrain.train.families import FAMILIES, Family
from lstrain.train.loop import Summary, train
from lstrain.train.schedule import lr_factor

__all__ = [
    "CaptureError",
    "CapturedStep",
    "CheckpointConfig",
    "EvalConfig",
    "FAMILIES",
    "Family",
    "LRSchedulerConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RunConfig",
    "SampleConfig",
    "Summary",
    "TrainingConfig",
    "lr_factor",
    "train",
]
