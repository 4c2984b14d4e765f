"""Dynamic loss scaling for fp16 training, with the semantics of ``torch.amp.GradScaler``.

A flat-buffer optimizer unscales inside its update kernel and learns of an overflow from
the same gradient-norm reduction, so a step costs no extra pass and no host sync: an
overflowing step changes no parameter and no moment, the scale backs off, and it grows
after ``growth_interval`` clean steps. Any other ``torch.optim`` optimizer is served as
GradScaler serves it: the gradients are unscaled and checked in place, and the step is
skipped on an overflow (which reads the flag back to the host, as GradScaler does).
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
        device: where the scale lives (the parameters' device); default: the current CUDA
            device when CUDA is available, else the CPU.

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
        device: torch.device | str | None = None,
    ) -> None:
        if not init_scale > 0:
            raise ValueError(f"LossScaler: init_scale must be > 0, got {init_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"LossScaler: growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"LossScaler: backoff_factor must be in (0, 1), got {backoff_factor}")
        if not growth_interval > 0:
            raise ValueError(f"LossScaler: growth_interval must be > 0, got {growth_interval}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
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
            ``loss * scale`` with torch's type promotion against the fp32 scale, as
            GradScaler: a 0-d fp16 loss gives an fp32 product (casting the scale to fp16
            first would make 2**16 an inf); the scale stays on the device: no sync.
        """
        return loss * self._scale

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale, check for inf/NaN and update; a step whose gradients overflowed changes
        nothing.

        Args:
            optimizer: the optimizer whose gradients were scaled by :meth:`scale`. A
                flat-buffer one does it all inside its step, on the device; any other
                ``torch.optim.Optimizer`` gets its gradients unscaled in place and its
                ``step()`` called only without an overflow (one host read of the flag).

        Raises:
            ValueError: the optimizer's parameters are on another device than the scale.
        """
        inv_scale = self._scale.reciprocal()
        if isinstance(optimizer, FlatOptimizer):
            if optimizer.flat.device != self._scale.device:
                raise ValueError(
                    f"LossScaler.step: the scale is on {self._scale.device}, the optimizer's parameters on "
                    f"{optimizer.flat.device}: pass device= to LossScaler"
                )
            optimizer.step(inv_scale=inv_scale)
            self._found_inf = optimizer.found_inf
            return
        self._found_inf = self._unscale(optimizer, inv_scale)
        if not self._found_inf.item():
            optimizer.step()

    def _unscale(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor) -> torch.Tensor:
        """Unscale every gradient in place, one fused call per (device, dtype) as GradScaler
        does; the overflow flag (1.0 when some gradient is not finite) on the scale's device."""
        grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grads.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        found_inf = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        with torch.no_grad():
            for (device, _), tensors in grads.items():
                flag = torch.zeros((), dtype=torch.float32, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, inv_scale.to(device))
                found_inf += flag.to(found_inf.device)
        return (found_inf > 0).to(torch.float32)

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
        """torch.amp.GradScaler's state dict (its keys, Python numbers), so either loads it.

        Returns:
            ``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
            ``_growth_tracker`` (reading the scale back synchronises, as GradScaler's does).
        """
        return {
            "scale": self._scale.item(),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": int(self._growth_tracker.item()),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` or ``torch.amp.GradScaler.state_dict`` returned
        (the scale as a number or a tensor; the tracker as ``_growth_tracker`` or ``growth_tracker``).

        Args:
            state: the saved state.

        Raises:
            ValueError: a key is missing (an empty dict is what a disabled GradScaler saves).
        """
        tracker = "_growth_tracker" if "_growth_tracker" in state else "growth_tracker"
        missing = [
            key for key in ("scale", "growth_factor", "backoff_factor", "growth_interval", tracker) if key not in state
        ]
        if missing:
            raise ValueError(f"LossScaler.load_state_dict: missing {missing} (saved by a disabled GradScaler?)")
        self._scale.copy_(torch.as_tensor(state["scale"], dtype=torch.float32))
        self._growth_tracker.copy_(torch.as_tensor(state[tracker], dtype=torch.int32))
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
