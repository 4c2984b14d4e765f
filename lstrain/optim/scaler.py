"""Dynamic loss scaling for fp16 training, with the semantics of ``torch.amp.GradScaler``.

The optimizer unscales inside its update kernel and learns of an overflow from the same
gradient-norm reduction, so a step costs no extra pass and no host sync: an overflowing
step changes no parameter and no moment, the scale backs off, and it grows after
``growth_interval`` clean steps.
"""

from __future__ import annotations

import torch

from lstrain.optim.base import FlatOptimizer

__all__ = ["LossScaler"]


class LossScaler:
    """``loss_scaler.scale(loss).backward(); loss_scaler.step(optimizer); loss_scaler.update()``.

    Args:
        init_scale: the first scale.
        growth_factor: multiplies the scale after ``growth_interval`` clean steps.
        backoff_factor: multiplies the scale after an overflow.
        growth_interval: clean steps between growths.
        device: where the scale lives (the parameters' device).

    Raises:
        ValueError: a non-positive scale or interval, growth_factor <= 1 or backoff_factor
            outside (0, 1).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        device: torch.device | str = "cuda",
    ) -> None:
        if not init_scale > 0:
            raise ValueError(f"LossScaler: init_scale must be > 0, got {init_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"LossScaler: growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"LossScaler: backoff_factor must be in (0, 1), got {backoff_factor}")
        if not growth_interval > 0:
            raise ValueError(f"LossScaler: growth_interval must be > 0, got {growth_interval}")
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self._scale = torch.full((), init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self._found_inf: torch.Tensor | None = None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward`` on.

        Args:
            loss: the unscaled loss.

        Returns:
            ``loss * scale`` in the loss's dtype (the scale stays on the device: no sync).
        """
        return loss * self._scale.to(loss.dtype)

    def step(self, optimizer: FlatOptimizer) -> None:
        """Unscale, check for inf/NaN and update, all inside the optimizer's step (a step
        whose gradients overflowed changes nothing).

        Args:
            optimizer: the flat-buffer optimizer whose gradients were scaled by :meth:`scale`.
        """
        optimizer.step(inv_scale=self._scale.reciprocal())
        self._found_inf = optimizer.found_inf

    def update(self) -> None:
        """Back off after an overflowing step, grow after ``growth_interval`` clean ones."""
        if self._found_inf is None:
            raise RuntimeError("LossScaler.update: call step(optimizer) first")
        torch._amp_update_scale_(
            self._scale,
            self._growth_tracker,
            self._found_inf,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )
        self._found_inf = None

    def get_scale(self) -> torch.Tensor:
        """The current scale (a device scalar; reading it on the host synchronises)."""
        return self._scale

    def state_dict(self) -> dict:
        """The scale, the growth tracker and the growth settings, for checkpoints."""
        return {
            "scale": self._scale.clone(),
            "growth_tracker": self._growth_tracker.clone(),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._scale.copy_(state["scale"])
        self._growth_tracker.copy_(state["growth_tracker"])
        self.growth_factor = state["growth_factor"]
        self.backoff_factor = state["backoff_factor"]
        self.growth_interval = state["growth_interval"]
