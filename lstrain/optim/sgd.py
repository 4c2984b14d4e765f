"""FusedSGD: SGD with momentum over flat buffers, one kernel launch per parameter dtype."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import triton
import triton.language as tl

from lstrain import _backend
from lstrain._backend import wait_for_producers
from lstrain.optim.base import (
    FlatOptimizer,
    GradTable,
    gradient_pointers,
    load_gradient_and_weight,
    store_state,
    store_weight,
)
from lstrain.optim.flat import BLOCK
from lstrain.optim.rounding import rounding_key

__all__ = ["FusedSGD"]


# The seed is a value, never a constant: Triton would make a seed of 1 (a second buffer's,
# from the default 0) a constexpr, with no .to() for the Philox key.
@triton.jit(do_not_specialize=["seed", "rng_offset"])
def _sgd_kernel(
    param_ptr,
    grad_ptr,
    grad_table_ptr,
    slot_start_ptr,
    slot_size_ptr,
    master_ptr,
    momentum_ptr,
    block_group_ptr,
    block_slot_ptr,
    active_ptr,
    hyper_ptr,
    step_ptr,
    momentum_steps_ptr,
    grad_factor_ptr,
    skip_ptr,
    groups,
    seed,
    rng_offset,
    HAS_MASTER: tl.constexpr,
    HAS_FACTOR: tl.constexpr,
    CAN_SKIP: tl.constexpr,
    GRAD_TABLE: tl.constexpr,
    ROUND_WEIGHT: tl.constexpr,
    ROUND_STATE: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_producers(PDL)
    pid = tl.program_id(0)
    group = tl.load(block_group_ptr + pid)
    slot = tl.load(block_slot_ptr + pid)
    # hyper: [5, groups] fp64 = lr, momentum, dampening, weight_decay, nesterov (0 or 1),
    # rounded to fp32 as torch rounds its Python-float options in the kernels
    lr = tl.load(hyper_ptr + group).to(tl.float32)
    momentum = tl.load(hyper_ptr + groups + group).to(tl.float32)
    one_minus_dampening = (1.0 - tl.load(hyper_ptr + 2 * groups + group)).to(tl.float32)
    weight_decay = tl.load(hyper_ptr + 3 * groups + group).to(tl.float32)
    nesterov = tl.load(hyper_ptr + 4 * groups + group)
    step = tl.load(step_ptr + slot)
    # the buffer is made at a parameter's first step with momentum, as torch makes it
    fresh_buffer = tl.load(momentum_steps_ptr + slot) == 1.0
    active = tl.load(active_ptr + slot)
    offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    grad_pointers, grad_exists = gradient_pointers(
        grad_ptr, grad_table_ptr, slot_start_ptr, slot_size_ptr, slot, offsets, GRAD_TABLE
    )
    g, w, write = load_gradient_and_weight(
        param_ptr, grad_pointers, grad_exists, master_ptr, grad_factor_ptr, skip_ptr, active, offsets, HAS_MASTER,
        HAS_FACTOR, CAN_SKIP, BLOCK,
    )  # fmt: skip
    g = g + weight_decay * w
    # torch: the buffer starts as the first gradient, then buf = momentum * buf + (1 - dampening) * g;
    # without momentum it is neither used nor written (a later momentum continues it)
    buf = tl.load(momentum_ptr + offsets, mask=write, other=0.0).to(tl.float32)
    buf = tl.where(fresh_buffer, g, momentum * buf + one_minus_dampening * g)
    update = tl.where(nesterov != 0.0, g + momentum * buf, buf)
    update = tl.where(momentum == 0.0, g, update)
    w = w - lr * update
    key = rounding_key(seed, step)
    first = rng_offset + pid.to(tl.int64) * BLOCK
    keeps_buffer = (tl.zeros([BLOCK], dtype=tl.float32) + momentum) != 0.0
    store_state(momentum_ptr, offsets, buf, write & keeps_buffer, key, first, 1, ROUND_STATE, BLOCK)
    store_weight(param_ptr, master_ptr, offsets, w, write, key, first, HAS_MASTER, ROUND_WEIGHT, BLOCK)


class FusedSGD(FlatOptimizer):
    """SGD with momentum (torch.optim.SGD's algorithm) over flat buffers.

    Constructor arguments as :class:`torch.optim.SGD` (per-group ``lr``, ``momentum``,
    ``dampening``, ``weight_decay`` and ``nesterov``), plus ``max_grad_norm`` as in
    :class:`~lstrain.optim.FusedAdamW`, whose notes on moved models, parameters without
    gradients and ``zero_grad`` hold here too. 16-bit parameters get fp32 master weights;
    the momentum buffer is fp32. ``master_weights``, ``state_dtype`` (the momentum
    buffer's), ``rounding_seed`` and ``flat_grads`` as in FusedAdamW: bf16 without masters,
    rounded stochastically; the gradients in a flat buffer or autograd's own. The state
    dict is torch's (``momentum_buffer`` per parameter that has taken a step with momentum;
    as in torch, a group whose momentum goes from 0 to nonzero starts its buffers from the
    gradient, and one whose momentum is 0 for a while leaves them untouched).
    ``self.state[p]`` also holds ``step`` and ``momentum_steps`` (steps taken with
    momentum) as device scalars.

    Raises:
        ValueError: lr < 0, momentum or dampening outside [0, 1], weight_decay < 0,
            nesterov without momentum or with dampening, maximize / differentiable, a bad
            ``master_weights`` / ``state_dtype`` / ``rounding_seed`` / ``flat_grads``, fp16 parameters without
            master weights, bad parameters, or no parameter that requires grad.
    """

    HYPER = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
    STATE = ("momentum_buffer",)

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        max_grad_norm: float | None = None,
        master_weights: bool = True,
        state_dtype: torch.dtype = torch.float32,
        rounding_seed: int = 0,
        flat_grads: bool = True,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
        }
        super().__init__(
            params, defaults, max_grad_norm, master_weights=master_weights, state_dtype=state_dtype,
            rounding_seed=rounding_seed, flat_grads=flat_grads,
        )  # fmt: skip

    def _hyper_of(self, group: dict) -> tuple[float, ...]:
        return (group["lr"], group["momentum"], group["dampening"], group["weight_decay"], float(group["nesterov"]))

    def _check_group(self, group: dict) -> None:
        self._check_unsupported(group)
        if not 0 <= group["lr"] < math.inf:
            raise ValueError(f"FusedSGD: lr must be >= 0 and finite, got {group['lr']}")
        for key in ("momentum", "dampening"):
            if not 0.0 <= group[key] <= 1.0:
                raise ValueError(f"FusedSGD: {key} must be in [0, 1], got {group[key]}")
        if not group["weight_decay"] >= 0:
            raise ValueError(f"FusedSGD: weight_decay must be >= 0, got {group['weight_decay']}")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("FusedSGD: nesterov needs momentum > 0 and dampening 0")

    def _allocate_state(self, spans: list[tuple[int, int]]) -> None:
        super()._allocate_state(spans)
        # per parameter, the steps taken with momentum: 0 means no momentum buffer yet
        self._momentum_steps = [torch.zeros_like(steps) for steps in self._steps]

    def _restore(self, p: torch.nn.Parameter, state: dict | None) -> None:
        super()._restore(p, state)
        index, slot, _ = self._locate(p)
        self._momentum_steps[index][slot].copy_(torch.as_tensor((state or {}).get("momentum_steps", 0.0)))

    def _attach_state(self) -> None:
        super()._attach_state()
        for index, buffer in enumerate(self.flat.buffers):
            for slot, p in enumerate(buffer.params):
                self.state[p]["momentum_steps"] = self._momentum_steps[index][slot]

    def _import_state(self, saved: dict, group: dict) -> dict:
        buffer = saved.get("momentum_buffer")
        # torch keeps no step for SGD: a saved momentum buffer means the first step is behind
        started = 0.0 if buffer is None else 1.0
        step = saved.get("step", started)
        state = {
            "step": torch.as_tensor(step, dtype=torch.float32).reshape(()),
            "momentum_steps": torch.as_tensor(saved.get("momentum_steps", started), dtype=torch.float32).reshape(()),
        }
        if buffer is not None:
            state["momentum_buffer"] = buffer
        if saved.get("master_param") is not None:
            state["master_param"] = saved["master_param"]
        return state

    def _export_state(self, state: dict, step: torch.Tensor, group: dict) -> dict | None:
        if step.item() == 0:
            return None
        entry = {}
        if "momentum_buffer" in state and state["momentum_steps"].item() > 0:
            entry["momentum_buffer"] = state["momentum_buffer"]
        if "master_param" in state:
            entry["master_param"] = state["master_param"]
        return entry or None

    def _launch(self, index, factor, found_inf) -> None:
        buffer, master, table = self.flat.buffers[index], self._masters[index], self._grad_tables[index]
        # count this step for the parameters that take it with momentum (device ops: no sync)
        with_momentum = self._active[index] * (self._hyper[1].index_select(0, buffer.slot_group) != 0)
        if found_inf is not None:
            with_momentum = with_momentum * (1.0 - found_inf)
        self._momentum_steps[index].add_(with_momentum)
        _sgd_kernel[(buffer.data.numel() // BLOCK,)](
            buffer.data, buffer.grad if table is None else buffer.data, *GradTable.arguments(table), master,
            self._buffers["momentum_buffer"][index], buffer.block_group, buffer.block_slot, self._active[index],
            self._hyper, self._steps[index], self._momentum_steps[index], factor, found_inf, len(self.param_groups),
            HAS_MASTER=master is not None,
            HAS_FACTOR=factor is not None,
            CAN_SKIP=found_inf is not None,
            GRAD_TABLE=table is not None,
            BLOCK=BLOCK,
            num_warps=4,
            **self._rounding[index],
            **_backend.dependent_launch(buffer.data),
        )  # fmt: skip
