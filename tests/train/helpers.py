"""A micro recipe for the training tests: 2 layers x 32 on a byte-level text corpus.

The fused kernels run in Triton's interpreter on the CPU, so the shapes stay tiny: a step
takes a fraction of a second.
"""

from __future__ import annotations

from pathlib import Path

from lstrain.data import DataConfig
from lstrain.train import (
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

# a corpus with structure to learn, long enough for a train and a validation split
TEXT = "".join(f"def f{i % 7}(x):\n    return x * {i % 5} + {i % 3}\n\n" for i in range(400))


def corpus(folder: Path) -> Path:
    """Write the test corpus into ``folder``; its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "corpus.txt"
    if not path.exists():
        path.write_text(TEXT)
    return path


def micro_run(folder: Path, *, steps: int = 4, dropout: float = 0.1, fused: bool = False, **training) -> RunConfig:
    """The micro recipe with its data, checkpoints and metrics under ``folder``.

    Args:
        folder: the run's directory.
        steps: optimizer steps.
        dropout: the model's three dropouts (non-zero: resume must replay the masks).
        fused: lstrain's kernels (in the interpreter: ~2 s a step) or the plain-torch twin;
            FusedAdamW runs either way.
        **training: TrainingConfig fields to override.

    Returns:
        The RunConfig.
    """
    folder = Path(folder)
    fields = {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 32, "fused": fused}
    fields |= {"resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout}
    return RunConfig(
        model=ModelConfig(fields=fields),
        data=DataConfig(source=str(corpus(folder)), tokenizer="byte", cache_dir=str(folder / "cache")),
        training=TrainingConfig(
            **{"local_batch_size": 2, "seq_len": 32, "steps": steps, "mixed_precision": "fp32", **training}
        ),
        optimizer=OptimizerConfig(lr=3e-3),
        lr_scheduler=LRSchedulerConfig(warmup_steps=1),
        checkpoint=CheckpointConfig(folder=str(folder / "checkpoints"), interval=2, keep_latest_k=2),
        metrics=MetricsConfig(log_freq=1, folder=str(folder / "metrics")),
        eval=EvalConfig(freq=2, steps=1),
        sample=SampleConfig(),
    )


def micro_bert_run(
    folder: Path,
    *,
    steps: int = 6,
    dropout: float = 0.1,
    fused: bool = False,
    max_predictions: int | None = 8,
    **training,
) -> RunConfig:
    """A micro BERT (2 layers x 32, MLM on the byte-level test corpus) under ``folder``.

    Args:
        folder: the run's directory.
        steps: optimizer steps.
        dropout: the model's two dropouts.
        fused: lstrain's kernels (in the interpreter) or the plain-torch twin.
        max_predictions: ``[data] max_predictions_per_seq`` (None: HF-style masking, the
            labels-only loss).
        **training: TrainingConfig fields to override.

    Returns:
        The RunConfig.
    """
    folder = Path(folder)
    fields = {
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 32,
        "hidden_dropout_prob": dropout,
        "attention_probs_dropout_prob": dropout,
        "fused": fused,
    }
    data = DataConfig(
        source=str(corpus(folder)),
        tokenizer="byte",
        cache_dir=str(folder / "cache"),
        max_predictions_per_seq=max_predictions,
    )
    return RunConfig(
        model=ModelConfig(name="bert", fields=fields),
        data=data,
        training=TrainingConfig(
            **{"local_batch_size": 4, "seq_len": 32, "steps": steps, "mixed_precision": "fp32", **training}
        ),
        optimizer=OptimizerConfig(lr=3e-3, betas=(0.9, 0.999), weight_decay=0.01),
        lr_scheduler=LRSchedulerConfig(warmup_steps=1, decay_type="linear"),
        checkpoint=CheckpointConfig(folder=str(folder / "checkpoints"), interval=2, keep_latest_k=3),
        metrics=MetricsConfig(log_freq=1, folder=str(folder / "metrics")),
        eval=EvalConfig(freq=2, steps=1),
        sample=SampleConfig(),
    )
