"""The learning-rate schedules at their key steps."""

import math

import pytest

from lstrain.train import LRSchedulerConfig, lr_factor


def _factors(decay_type, steps=110, warmup=10, floor=0.1, **extra):
    config = LRSchedulerConfig(warmup_steps=warmup, decay_type=decay_type, min_lr_factor=floor, **extra)
    return [lr_factor(s, steps, config) for s in range(steps)]


@pytest.mark.parametrize("decay_type", ["cosine", "linear", "constant", "warmup_stable_decay"])
def test_warmup_is_linear_and_never_zero(decay_type):
    f = _factors(decay_type)
    assert f[:10] == pytest.approx([(s + 1) / 11 for s in range(10)])
    assert f[10] == 1.0  # the first step after warmup runs at the peak


def test_cosine_halfway_and_end():
    f = _factors("cosine")
    assert f[60] == pytest.approx(0.1 + 0.9 * 0.5)  # progress 1/2
    assert f[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 99 / 100)))
    assert all(a >= b for a, b in zip(f[10:], f[11:], strict=False))  # non-increasing after warmup


def test_linear_and_constant():
    assert _factors("linear")[60] == pytest.approx(1 - 0.9 * 0.5)
    assert _factors("linear")[-1] == pytest.approx(1 - 0.9 * 0.99)
    assert set(_factors("constant")[10:]) == {1.0}


def test_warmup_stable_decay():
    f = _factors("warmup_stable_decay", decay_ratio=0.2)
    assert set(f[10:90]) == {1.0}  # stable for the first 80% of the post-warmup steps
    assert f[95] == pytest.approx(1 - 0.9 * (0.85 - 0.8) / 0.2)
    assert f[-1] > 0.1


def test_no_warmup_starts_at_the_peak_and_bad_steps_raise():
    assert _factors("cosine", warmup=0)[0] == 1.0
    with pytest.raises(ValueError, match="step 5 outside"):
        lr_factor(5, 5, LRSchedulerConfig())
    with pytest.raises(ValueError, match="decay_type must be one of"):
        LRSchedulerConfig(decay_type="exponential")
