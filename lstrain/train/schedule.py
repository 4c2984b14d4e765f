"""Learning-rate schedules: a pure function of the step, so a resumed run needs no state."""

from __future__ import annotations

import math

from lstrain.train.config import LRSchedulerConfig

__all__ = ["lr_factor"]


def lr_factor(step: int, total_steps: int, config: LRSchedulerConfig) -> float:
    """The multiplier of the peak learning rate at optimizer step ``step`` (0-based).

    Warmup: ``(step + 1) / (warmup_steps + 1)`` for the first ``warmup_steps`` steps (never
    0, so the first step moves). Then ``progress`` runs from 0 at the first step after
    warmup towards 1 at ``total_steps``: cosine ``m + (1 - m) (1 + cos(pi progress)) / 2``,
    linear ``1 - (1 - m) progress``, constant 1, and warmup_stable_decay 1 until the last
    ``decay_ratio`` of the post-warmup steps, which decay linearly to ``m``
    (``m = min_lr_factor``).

    Args:
        step: the optimizer step, 0 to total_steps - 1.
        total_steps: the run's steps.
        config: the schedule.

    Returns:
        The factor, in [min_lr_factor, 1].

    Raises:
        ValueError: step outside [0, total_steps).
    """
    if not 0 <= step < total_steps:
        raise ValueError(f"lr_factor: step {step} outside [0, {total_steps})")
    warmup, floor = config.warmup_steps, config.min_lr_factor
    if step < warmup:
        return (step + 1) / (warmup + 1)
    decay_steps = max(1, total_steps - warmup)
    progress = (step - warmup) / decay_steps
    if config.decay_type == "constant":
        return 1.0
    if config.decay_type == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if config.decay_type == "linear":
        return 1.0 - (1.0 - floor) * progress
    # warmup_stable_decay: the decay phase is the last decay_ratio of the post-warmup steps
    stable = 1.0 - config.decay_ratio
    if progress < stable:
        return 1.0
    return 1.0 - (1.0 - floor) * (progress - stable) / config.decay_ratio
