"""What the flat-buffer optimizers share: buffers, device-side hyperparameters and step
counter, fp32 master weights, state in torch's layout, and the fused clip / overflow factor."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import triton
import triton.language as tl

from lstrain import _backend
from lstrain.optim.flat import BLOCK, FlatBuffer, FlatParameters

__all__ = ["FlatOptimizer", "load_gradient_and_weight", "store_weight"]


@triton.jit
def load_gradient_and_weight(
    param_ptr,
    grad_ptr,
    master_ptr,
    grad_factor_ptr,
    skip_ptr,
    offsets,
    HAS_MASTER: tl.constexpr,
    HAS_FACTOR: tl.constexpr,
    CAN_SKIP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """(gradient times the clip / loss-scale factor, fp32 weight, store mask) of one block.

    The store mask is all False on an overflowing step, which then changes nothing.
    """
    g = tl.load(grad_ptr + offsets).to(tl.float32)
    if HAS_FACTOR:
        g *= tl.load(grad_factor_ptr)
    skipped = tl.zeros([BLOCK], dtype=tl.float32)
    if CAN_SKIP:
        skipped += tl.load(skip_ptr)
    if HAS_MASTER:
        w = tl.load(master_ptr + offsets)
    else:
        w = tl.load(param_ptr + offsets).to(tl.float32)
    return g, w, skipped == 0.0


@triton.jit
def store_weight(param_ptr, master_ptr, offsets, w, write, HAS_MASTER: tl.constexpr):
    """Write the fp32 weight to the master copy (if any) and, rounded, to the parameter."""
    if HAS_MASTER:
        tl.store(master_ptr + offsets, w, mask=write)
    tl.store(param_ptr + offsets, w.to(param_ptr.dtype.element_ty), mask=write)


class FlatOptimizer(torch.optim.Optimizer):
    """Base of :class:`~lstrain.optim.FusedAdamW` and :class:`~lstrain.optim.FusedSGD`.

    Subclasses name their per-group hyperparameters (``HYPER``, read from a group by
    :meth:`_hyper_of`), their fp32 per-element state (``STATE``), check a group
    (:meth:`_check_group`) and launch their update kernel (:meth:`_launch`), one launch per
    parameter dtype.
    """

    HYPER: tuple[str, ...] = ()
    STATE: tuple[str, ...] = ()

    def __init__(self, params: Iterable, defaults: dict, max_grad_norm: float | None) -> None:
        super().__init__(params, defaults)
        name = type(self).__name__
        for group in self.param_groups:
            self._check_group(group)
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"{name}: max_grad_norm must be > 0, got {max_grad_norm}")
        self.max_grad_norm = max_grad_norm
        self.found_inf: torch.Tensor | None = None  # of the last step, when it was loss-scaled
        # Parameters that do not require grad are left where they are and never updated, as
        # torch's optimizers skip a parameter without a gradient (weight decay included).
        trainable = [[p for p in group["params"] if p.requires_grad] for group in self.param_groups]
        if not any(trainable):
            raise ValueError(f"{name}: no parameter requires grad")
        self.flat = FlatParameters(trainable)
        device = self.flat.device
        if _backend.backend_for(torch.empty(0, device=device)) == "reference":
            raise ValueError(
                f"{name}: parameters on {device} need the Triton interpreter (TRITON_INTERPRET=1 before "
                "importing lstrain) or a CUDA device; the update is a Triton kernel"
            )
        self._step = torch.zeros((), dtype=torch.float32, device=device)
        self._hyper = torch.empty((len(self.HYPER), len(self.param_groups)), dtype=torch.float32, device=device)
        self._hyper_values: list[tuple[float, ...]] = []
        self._sync_hyperparameters()
        self._masters = [b.data.float() if b.dtype != torch.float32 else None for b in self.flat.buffers]
        self._buffers = {
            key: [torch.zeros_like(b.data, dtype=torch.float32) for b in self.flat.buffers] for key in self.STATE
        }
        self._attach_state()

    def _hyper_of(self, group: dict) -> tuple[float, ...]:
        raise NotImplementedError

    def _check_group(self, group: dict) -> None:
        raise NotImplementedError

    def _launch(self, buffer: FlatBuffer, master, state: dict, factor, found_inf) -> None:
        raise NotImplementedError

    def _attach_state(self) -> None:
        """Expose per-parameter views of the flat state in torch's ``self.state`` layout."""
        for index, buffer in enumerate(self.flat.buffers):
            master = self._masters[index]
            for p, offset in zip(buffer.params, buffer.offsets, strict=True):
                view = slice(offset, offset + p.numel())
                state = {"step": self._step}
                state.update({key: self._buffers[key][index][view].view_as(p) for key in self.STATE})
                if master is not None:
                    state["master_param"] = master[view].view_as(p)
                self.state[p] = state

    def _sync_hyperparameters(self) -> None:
        """Copy the groups' hyperparameters to the device when a scheduler changed them
        (a host-to-device write, never a read back)."""
        values = [self._hyper_of(group) for group in self.param_groups]
        if values != self._hyper_values:
            for group in self.param_groups:
                self._check_group(group)
            self._hyper.copy_(torch.tensor(values, dtype=torch.float32).t(), non_blocking=True)
            self._hyper_values = values

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the flat gradient buffers in place (``set_to_none`` must stay False)."""
        if set_to_none:
            raise ValueError(f"{type(self).__name__}.zero_grad: set_to_none=True would detach .grad from the buffers")
        self.flat.zero_grad()

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of all (possibly loss-scaled) gradients, fp32, on the device."""
        norms = [torch.linalg.vector_norm(b.grad, dtype=torch.float32) for b in self.flat.buffers]
        return torch.linalg.vector_norm(torch.stack(norms))

    def _grad_factor(self, inv_scale: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(factor the kernel multiplies gradients by, overflow flag), both device scalars or None.

        One reduction serves both: the norm is not finite exactly when some gradient is not.
        """
        if self.max_grad_norm is None and inv_scale is None:
            return None, None
        norm = self.grad_norm()
        found_inf = (~torch.isfinite(norm)).to(torch.float32) if inv_scale is not None else None
        factor = inv_scale
        if self.max_grad_norm is not None:
            unscaled = norm if inv_scale is None else norm * inv_scale
            clip = torch.clamp(self.max_grad_norm / (unscaled + 1e-6), max=1.0)
            factor = clip if factor is None else factor * clip
        return factor, found_inf

    @torch.no_grad()
    def step(self, closure=None, *, inv_scale: torch.Tensor | None = None) -> torch.Tensor | None:
        """One update of every parameter: one kernel launch per parameter dtype.

        Args:
            closure: re-evaluates the loss, as for torch optimizers.
            inv_scale: 1 / loss scale (a device scalar) when the gradients are loss-scaled;
                then a step whose gradients hold an inf or NaN changes nothing. Normally
                passed by :class:`lstrain.optim.LossScaler`.

        Returns:
            The closure's loss, if any.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hyperparameters()
        factor, found_inf = self._grad_factor(inv_scale)
        self.found_inf = found_inf
        self._step += 1.0 if found_inf is None else 1.0 - found_inf
        for index, buffer in enumerate(self.flat.buffers):
            if buffer.data.numel() // BLOCK:
                state = {key: self._buffers[key][index] for key in self.STATE}
                self._launch(buffer, self._masters[index], state, factor, found_inf)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch-convention state (as saved by :meth:`state_dict`) into the flat buffers."""
        name = type(self).__name__
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"{name}.load_state_dict: {len(groups)} groups saved, {len(self.param_groups)} here")
        index_to_param = {}
        for saved, group in zip(groups, self.param_groups, strict=True):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"{name}.load_state_dict: a group's parameter count differs")
            index_to_param.update(zip(saved["params"], group["params"], strict=True))
            group.update({key: value for key, value in saved.items() if key != "params"})
        with torch.no_grad():
            for index, saved_state in state_dict["state"].items():
                state = self.state[index_to_param[index]]
                for key in (*self.STATE, "master_param"):
                    if key in state and key in saved_state:
                        state[key].copy_(saved_state[key])
                self._step.copy_(torch.as_tensor(saved_state["step"]))
        self._sync_hyperparameters()
