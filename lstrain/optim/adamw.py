"""FusedAdamW: Adam(W) over flat buffers, one kernel launch per parameter dtype.

Parameters live in :class:`~lstrain.optim.flat.FlatParameters` buffers. Each 16-bit
buffer gets an fp32 master copy; the Adam moments are fp32. One launch per dtype reads
grad, master and moments once, applies the global grad-norm clip factor, updates them,
and writes the master and the model's own (bf16/fp16/fp32) parameters. The learning
rates, betas, eps, weight decays and the step counter are device tensors, so a step
never synchronises with the host and can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import triton
import triton.language as tl

from lstrain.optim.flat import BLOCK, FlatParameters

__all__ = ["FusedAdamW"]


@triton.jit
def _adamw_kernel(
    param_ptr,
    grad_ptr,
    master_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    block_group_ptr,
    hyper_ptr,
    step_ptr,
    grad_factor_ptr,
    skip_ptr,
    groups,
    HAS_MASTER: tl.constexpr,
    DECOUPLED: tl.constexpr,
    HAS_FACTOR: tl.constexpr,
    CAN_SKIP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    group = tl.load(block_group_ptr + pid)
    # hyper: [5, groups] fp32 = lr, beta1, beta2, eps, weight_decay
    lr = tl.load(hyper_ptr + group)
    beta1 = tl.load(hyper_ptr + groups + group)
    beta2 = tl.load(hyper_ptr + 2 * groups + group)
    eps = tl.load(hyper_ptr + 3 * groups + group)
    weight_decay = tl.load(hyper_ptr + 4 * groups + group)
    step = tl.load(step_ptr).to(tl.float32)
    offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(grad_ptr + offsets).to(tl.float32)
    if HAS_FACTOR:  # loss-scale inverse times the clip factor
        g *= tl.load(grad_factor_ptr)
    # An overflowing step writes nothing: parameters and moments stay as they are.
    skipped = tl.zeros([BLOCK], dtype=tl.float32)
    if CAN_SKIP:
        skipped += tl.load(skip_ptr)
    write = skipped == 0.0
    if HAS_MASTER:
        w = tl.load(master_ptr + offsets)
    else:
        w = tl.load(param_ptr + offsets).to(tl.float32)
    if DECOUPLED:
        w = w * (1.0 - lr * weight_decay)
    else:
        g = g + weight_decay * w
    m = tl.load(exp_avg_ptr + offsets)
    v = tl.load(exp_avg_sq_ptr + offsets)
    m = m + (1.0 - beta1) * (g - m)  # torch's lerp for weights below 0.5
    v = v * beta2 + (1.0 - beta2) * g * g
    bias_correction1 = 1.0 - tl.exp2(step * tl.log2(beta1))
    bias_correction2 = 1.0 - tl.exp2(step * tl.log2(beta2))
    denom = tl.sqrt(v) / tl.sqrt(bias_correction2) + eps
    w = w - (lr / bias_correction1) * (m / denom)
    tl.store(exp_avg_ptr + offsets, m, mask=write)
    tl.store(exp_avg_sq_ptr + offsets, v, mask=write)
    if HAS_MASTER:
        tl.store(master_ptr + offsets, w, mask=write)
    tl.store(param_ptr + offsets, w.to(param_ptr.dtype.element_ty), mask=write)


_HYPER = ("lr", "beta1", "beta2", "eps", "weight_decay")


class FusedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, or plain Adam with ``decoupled=False``) over flat buffers.

    Constructor arguments as :class:`torch.optim.AdamW`, per-group ``lr``, ``betas``,
    ``eps`` and ``weight_decay`` included (e.g. no decay for norms and biases), plus:

    Args:
        max_grad_norm: clip the global L2 norm of all gradients to this (None: no clipping);
            the norm is one reduction per dtype and the factor is applied inside the update.
        decoupled: False gives Adam with L2 weight decay added to the gradient.

    The parameters are moved into flat buffers when the optimizer is built (their
    ``.data`` and ``.grad`` become views); the model behaves exactly as before. Use this
    optimizer's :meth:`zero_grad`, which zeroes the buffers in place.

    Raises:
        ValueError: lr < 0, eps < 0, weight_decay < 0, betas outside [0, 1), a parameter
            that requires grad on another device, or a non-float parameter.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        max_grad_norm: float | None = None,
        decoupled: bool = True,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        for group in self.param_groups:
            _check_hyperparameters(group)
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"FusedAdamW: max_grad_norm must be > 0, got {max_grad_norm}")
        self.max_grad_norm = max_grad_norm
        self.decoupled = decoupled
        self.found_inf: torch.Tensor | None = None  # of the last step, when it was loss-scaled
        self.flat = FlatParameters([group["params"] for group in self.param_groups])
        device = self.flat.device
        self._step = torch.zeros((), dtype=torch.float32, device=device)
        self._hyper = torch.empty((len(_HYPER), len(self.param_groups)), dtype=torch.float32, device=device)
        self._hyper_values: list[tuple[float, ...]] = []
        self._sync_hyperparameters()
        self._masters = [b.data.float() if b.dtype != torch.float32 else None for b in self.flat.buffers]
        self._exp_avg = [torch.zeros_like(b.data, dtype=torch.float32) for b in self.flat.buffers]
        self._exp_avg_sq = [torch.zeros_like(b.data, dtype=torch.float32) for b in self.flat.buffers]
        self._attach_state()

    def _attach_state(self) -> None:
        """Expose per-parameter views of the flat state in torch's ``self.state`` layout."""
        for buffer, master, exp_avg, exp_avg_sq in zip(
            self.flat.buffers, self._masters, self._exp_avg, self._exp_avg_sq, strict=True
        ):
            for p, offset in zip(buffer.params, buffer.offsets, strict=True):
                view = slice(offset, offset + p.numel())
                state = {
                    "step": self._step,
                    "exp_avg": exp_avg[view].view_as(p),
                    "exp_avg_sq": exp_avg_sq[view].view_as(p),
                }
                if master is not None:
                    state["master_param"] = master[view].view_as(p)
                self.state[p] = state

    def _sync_hyperparameters(self) -> None:
        """Copy the groups' hyperparameters to the device when a scheduler changed them
        (a host-to-device write, never a read back)."""
        values = [(g["lr"], g["betas"][0], g["betas"][1], g["eps"], g["weight_decay"]) for g in self.param_groups]
        if values != self._hyper_values:
            for group in self.param_groups:
                _check_hyperparameters(group)
            self._hyper.copy_(torch.tensor(values, dtype=torch.float32).t(), non_blocking=True)
            self._hyper_values = values

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the flat gradient buffers in place (``set_to_none`` must stay False)."""
        if set_to_none:
            raise ValueError("FusedAdamW.zero_grad: set_to_none=True would detach .grad from the flat buffers")
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
        if found_inf is None:
            self._step += 1
        else:
            self._step += 1.0 - found_inf
        groups = len(self.param_groups)
        for buffer, master, exp_avg, exp_avg_sq in zip(
            self.flat.buffers, self._masters, self._exp_avg, self._exp_avg_sq, strict=True
        ):
            blocks = buffer.data.numel() // BLOCK
            if blocks == 0:
                continue
            _adamw_kernel[(blocks,)](
                buffer.data, buffer.grad, master, exp_avg, exp_avg_sq, buffer.block_group,
                self._hyper, self._step, factor, found_inf, groups,
                HAS_MASTER=master is not None,
                DECOUPLED=self.decoupled,
                HAS_FACTOR=factor is not None,
                CAN_SKIP=found_inf is not None,
                BLOCK=BLOCK,
                num_warps=4,
            )  # fmt: skip
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch-convention state (as saved by :meth:`state_dict`) into the flat buffers."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"FusedAdamW.load_state_dict: {len(groups)} groups saved, {len(self.param_groups)} here")
        index_to_param = {}
        for saved, group in zip(groups, self.param_groups, strict=True):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError("FusedAdamW.load_state_dict: a group's parameter count differs")
            index_to_param.update(zip(saved["params"], group["params"], strict=True))
            for key in ("lr", "betas", "eps", "weight_decay"):
                group[key] = saved[key]
        with torch.no_grad():
            for index, saved_state in state_dict["state"].items():
                state = self.state[index_to_param[index]]
                for key in ("exp_avg", "exp_avg_sq", "master_param"):
                    if key in state and key in saved_state:
                        state[key].copy_(saved_state[key])
                self._step.copy_(torch.as_tensor(saved_state["step"]))
        self._sync_hyperparameters()


def _check_hyperparameters(group: dict) -> None:
    lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if not lr >= 0:
        raise ValueError(f"FusedAdamW: lr must be >= 0, got {lr}")
    for name, beta in (("betas[0]", beta1), ("betas[1]", beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"FusedAdamW: {name} must be in [0, 1), got {beta}")
    if not eps >= 0:
        raise ValueError(f"FusedAdamW: eps must be >= 0, got {eps}")
    if not weight_decay >= 0:
        raise ValueError(f"FusedAdamW: weight_decay must be >= 0, got {weight_decay}")
    if math.isinf(lr):
        raise ValueError("FusedAdamW: lr must be finite")
