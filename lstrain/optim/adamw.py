"""FusedAdamW: Adam(W) over flat buffers, one kernel launch per parameter dtype.

Parameters live in :class:`~lstrain.optim.flat.FlatParameters` buffers. Each 16-bit
buffer gets an fp32 master copy; the Adam moments are fp32. One launch per dtype reads
grad, master and moments once, applies the global grad-norm clip factor, updates them,
and writes the master and the model's own (bf16/fp16/fp32) parameters. With
``master_weights=False`` and ``state_dtype=torch.bfloat16`` a bf16 parameter costs 8 bytes
of weight, gradient and state instead of 16, and a step moves half the bytes: the update
is computed in fp32 and rounded stochastically into the bf16 weight and moments
(:mod:`lstrain.optim.rounding`). The learning
rates, betas, eps, weight decays and each parameter's step count and "has a gradient" flag
are device tensors, so a step never synchronises with the host and can be captured in a
CUDA graph.
"""

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

__all__ = ["FusedAdamW"]


# One parameter's per-step scalars, rows of the [SCALARS, slots] fp32 table the update reads.
SCALARS = 8  # step size, sqrt(bias correction 2), shrink, coupled decay, 1 - beta1, 1 - beta2, beta2, eps


@triton.jit
def _adamw_scalars_kernel(
    hyper_ptr,
    step_ptr,
    slot_group_ptr,
    scalars_ptr,
    slots,
    groups,
    BLOCK_SLOTS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Each parameter's per-step scalars from its group's hyperparameters and its step count.

    fp64 and rounded once, as torch computes them on the host in Python floats: 1 - beta2**step
    from an fp32 beta2 and an fp32 exp2 / log2 pair is off by about 1e-4 of itself in the first
    steps. Once per parameter here, not in each of the update's threads, whose fp64 work
    otherwise bounds the update (the fp64 pipe runs at half the fp32 rate).
    """
    wait_for_producers(PDL)
    slot = tl.program_id(0) * BLOCK_SLOTS + tl.arange(0, BLOCK_SLOTS)
    ok = slot < slots
    group = tl.load(slot_group_ptr + slot, mask=ok, other=0)
    # hyper: [6, groups] fp64 = lr, beta1, beta2, eps, weight_decay, decoupled (0 or 1)
    lr = tl.load(hyper_ptr + group, mask=ok, other=0.0)
    beta1 = tl.load(hyper_ptr + groups + group, mask=ok, other=0.0)
    beta2 = tl.load(hyper_ptr + 2 * groups + group, mask=ok, other=0.0)
    eps = tl.load(hyper_ptr + 3 * groups + group, mask=ok, other=0.0)
    weight_decay = tl.load(hyper_ptr + 4 * groups + group, mask=ok, other=0.0)
    decoupled = tl.load(hyper_ptr + 5 * groups + group, mask=ok, other=0.0)
    step = tl.load(step_ptr + slot, mask=ok, other=0.0).to(tl.float64)
    out = scalars_ptr + slot
    tl.store(out, (lr / (1.0 - tl.exp(step * tl.log(beta1)))).to(tl.float32), mask=ok)
    tl.store(out + slots, tl.sqrt(1.0 - tl.exp(step * tl.log(beta2))).to(tl.float32), mask=ok)
    tl.store(out + 2 * slots, (1.0 - decoupled * lr * weight_decay).to(tl.float32), mask=ok)
    tl.store(out + 3 * slots, ((1.0 - decoupled) * weight_decay).to(tl.float32), mask=ok)
    tl.store(out + 4 * slots, (1.0 - beta1).to(tl.float32), mask=ok)
    tl.store(out + 5 * slots, (1.0 - beta2).to(tl.float32), mask=ok)
    tl.store(out + 6 * slots, beta2.to(tl.float32), mask=ok)
    tl.store(out + 7 * slots, eps.to(tl.float32), mask=ok)


# The seed is a value, never a constant: Triton would make a seed of 1 (a second buffer's,
# from the default 0) a constexpr, with no .to() for the Philox key.
@triton.jit(do_not_specialize=["seed", "rng_offset"])
def _adamw_kernel(
    param_ptr,
    grad_ptr,
    grad_table_ptr,
    slot_start_ptr,
    slot_size_ptr,
    master_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    block_slot_ptr,
    active_ptr,
    scalars_ptr,
    slots,
    step_ptr,
    grad_factor_ptr,
    skip_ptr,
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
    slot = tl.load(block_slot_ptr + pid)
    step_size = tl.load(scalars_ptr + slot)
    bias_correction2_sqrt = tl.load(scalars_ptr + slots + slot)
    shrink = tl.load(scalars_ptr + 2 * slots + slot)
    coupled_decay = tl.load(scalars_ptr + 3 * slots + slot)
    one_minus_beta1 = tl.load(scalars_ptr + 4 * slots + slot)
    one_minus_beta2 = tl.load(scalars_ptr + 5 * slots + slot)
    beta2 = tl.load(scalars_ptr + 6 * slots + slot)
    eps = tl.load(scalars_ptr + 7 * slots + slot)
    step = tl.load(step_ptr + slot)
    active = tl.load(active_ptr + slot)
    offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    grad_pointers, grad_exists = gradient_pointers(
        grad_ptr, grad_table_ptr, slot_start_ptr, slot_size_ptr, slot, offsets, GRAD_TABLE
    )
    g, w, write = load_gradient_and_weight(
        param_ptr, grad_pointers, grad_exists, master_ptr, grad_factor_ptr, skip_ptr, active, offsets, HAS_MASTER,
        HAS_FACTOR, CAN_SKIP, BLOCK,
    )  # fmt: skip
    # AdamW shrinks the weight, Adam adds the decay to the gradient (one of the two terms is 0)
    g = g + coupled_decay * w
    w = w * shrink
    m = tl.load(exp_avg_ptr + offsets, mask=write, other=0.0).to(tl.float32)
    v = tl.load(exp_avg_sq_ptr + offsets, mask=write, other=0.0).to(tl.float32)
    m = m + one_minus_beta1 * (g - m)  # torch's lerp for weights below 0.5
    v = v * beta2 + one_minus_beta2 * g * g
    if ROUND_WEIGHT:
        # Triton's approximate sqrt and divisions (within 2 fp32 units): rounded stochastically
        # to bf16, 2**16 fp32 units apart, the update cannot tell them apart, and the kernel
        # is bound by instruction issue as much as by memory (ncu: 76% and 76%)
        w = w - step_size * (m / (tl.sqrt(v) / bias_correction2_sqrt + eps))
    else:
        # correctly rounded sqrt and divisions, as torch's (Triton's defaults approximate them)
        denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
        w = w - step_size * tl.div_rn(m, denom)
    key = rounding_key(seed, step)
    first = rng_offset + pid.to(tl.int64) * BLOCK
    store_state(exp_avg_ptr, offsets, m, write, key, first, 1, ROUND_STATE, BLOCK)
    store_state(exp_avg_sq_ptr, offsets, v, write, key, first, 2, ROUND_STATE, BLOCK)
    store_weight(param_ptr, master_ptr, offsets, w, write, key, first, HAS_MASTER, ROUND_WEIGHT, BLOCK)


class FusedAdamW(FlatOptimizer):
    """AdamW (decoupled weight decay, or plain Adam with ``decoupled=False``) over flat buffers.

    Constructor arguments as :class:`torch.optim.AdamW`, per-group ``lr``, ``betas``,
    ``eps``, ``weight_decay`` and ``decoupled_weight_decay`` included (e.g. no decay for
    norms and biases), plus:

    Args:
        max_grad_norm: clip the global L2 norm of all gradients to this (None: no clipping);
            the norm is one reduction per dtype and the factor is applied inside the update.
        decoupled: False gives Adam with L2 weight decay added to the gradient (the groups'
            default ``decoupled_weight_decay``).
        master_weights: True (default): an fp32 master copy of each bf16 / fp16 parameter
            takes the update, and the parameter is its rounding to nearest. False: no copy
            (4 bytes per parameter less); the fp32 update of a bf16 parameter is rounded
            stochastically into it, so that updates below half a bf16 unit are kept on
            average instead of lost (torch's AdamW on bf16 parameters loses them); fp16
            parameters are refused.
        state_dtype: the moments' dtype: torch.float32 (default) or torch.bfloat16
            (4 bytes per parameter less; rounded stochastically: under rounding to nearest
            a bf16 second moment does not decay by beta2 = 0.999 at all).
        rounding_seed: the seed of the stochastic rounding's random numbers (an int in
            [0, 2**31 - 1024)), together with each parameter's step count; the same on
            every rank that updates a replica (the default, 0, is).
        flat_grads: True (default): the gradients live in one flat buffer per dtype,
            allocated for good, which backward writes into (what :class:`DataParallel`'s
            bucketed all-reduce reads). False: each ``.grad`` stays autograd's own tensor,
            allocated as backward makes it and freed by ``zero_grad(set_to_none=True)``, as
            with torch's optimizers; the update still reads them all in one launch per
            dtype, through a table of their addresses. The peak of a step whose memory
            peaks at the start of backward (most Transformers) drops by about the
            gradients' size.

    The parameters are moved into flat buffers when the optimizer is built (their
    ``.data`` and ``.grad`` become views); the model behaves exactly as before. Build the
    optimizer after moving or casting the model: a step after ``model.to(...)`` raises.
    A parameter takes a step when it requires grad and its ``.grad`` is not None, with its
    own step count, as in torch; others are left alone (weight decay and moments
    included). This optimizer's :meth:`zero_grad` zeroes the buffers in place and keeps
    the ``.grad`` views, so a trainable parameter that backward gives no gradient then
    takes the step with a zero gradient (torch's ``zero_grad(set_to_none=False)``), and so
    does one that never had a gradient, whose ``.grad`` is its zero view from the start
    (weight decay shrinks it): ``zero_grad(set_to_none=True)`` skips it, as torch does.
    ``model.zero_grad()`` and ``zero_grad(set_to_none=True)`` work too, at the cost of one
    copy of each new gradient into the flat buffer in ``step()``. With master weights,
    write parameters in place as torch does (``model.load_state_dict``, ``p.copy_`` under
    ``torch.no_grad()``), before or after loading the optimizer's state: each fp32 master
    follows its parameter where they differ. A write through ``.data`` is the exception: it
    has its own version counter, invisible here, and the next step writes the old weight
    back. The state (``state_dict``)
    is torch's, so that ``torch.optim.AdamW`` loads it and this class loads torch's.

    Raises:
        ValueError: lr < 0, eps < 0, weight_decay < 0, betas outside [0, 1),
            max_grad_norm <= 0, amsgrad / maximize / differentiable, a bad
            ``master_weights`` / ``state_dtype`` / ``rounding_seed`` / ``flat_grads``, fp16
            parameters without
            master weights, parameters on several devices, a non-float parameter, or no
            parameter that requires grad.
    """

    HYPER = ("lr", "beta1", "beta2", "eps", "weight_decay", "decoupled_weight_decay")
    STATE = ("exp_avg", "exp_avg_sq")
    UNSUPPORTED = ("amsgrad", "maximize", "differentiable")

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
        master_weights: bool = True,
        state_dtype: torch.dtype = torch.float32,
        rounding_seed: int = 0,
        flat_grads: bool = True,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "decoupled_weight_decay": decoupled,
        }
        super().__init__(
            params, defaults, max_grad_norm, master_weights=master_weights, state_dtype=state_dtype,
            rounding_seed=rounding_seed, flat_grads=flat_grads,
        )  # fmt: skip

    @staticmethod
    def _betas(group: dict) -> tuple[float, float]:
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"FusedAdamW: betas must be a pair (beta1, beta2), got {betas!r}")
        return betas[0], betas[1]

    def _hyper_of(self, group: dict) -> tuple[float, ...]:
        beta1, beta2 = self._betas(group)
        return (group["lr"], beta1, beta2, group["eps"], group["weight_decay"], float(group["decoupled_weight_decay"]))

    def _check_group(self, group: dict) -> None:
        self._check_unsupported(group)
        lr, (beta1, beta2), eps, weight_decay = group["lr"], self._betas(group), group["eps"], group["weight_decay"]
        if not 0 <= lr < math.inf:
            raise ValueError(f"FusedAdamW: lr must be >= 0 and finite, got {lr}")
        for name, beta in (("betas[0]", beta1), ("betas[1]", beta2)):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"FusedAdamW: {name} must be in [0, 1), got {beta}")
        if not eps >= 0:
            raise ValueError(f"FusedAdamW: eps must be >= 0, got {eps}")
        if not weight_decay >= 0:
            raise ValueError(f"FusedAdamW: weight_decay must be >= 0, got {weight_decay}")

    def _import_state(self, saved: dict, group: dict) -> dict:
        state = {"step": torch.as_tensor(saved.get("step", 0.0), dtype=torch.float32).reshape(())}
        for key in (*self.STATE, "master_param"):
            if saved.get(key) is not None:
                state[key] = saved[key]
        return state

    def _export_state(self, state: dict, step: torch.Tensor, group: dict) -> dict | None:
        if step.item() == 0:
            return None  # torch keeps no state for a parameter that never took a step
        entry = {"step": step}
        entry.update({key: state[key] for key in (*self.STATE, "master_param") if key in state})
        return entry

    def _scalars(self, index: int) -> torch.Tensor:
        """Buffer ``index``'s [SCALARS, slots] per-parameter scalars of this step (one small launch)."""
        buffer = self.flat.buffers[index]
        slots = len(buffer.params)
        scalars = torch.empty(SCALARS, slots, dtype=torch.float32, device=buffer.data.device)
        _adamw_scalars_kernel[(triton.cdiv(slots, 128),)](
            self._hyper, self._steps[index], buffer.slot_group, scalars, slots, len(self.param_groups),
            BLOCK_SLOTS=128, num_warps=4,
            **_backend.dependent_launch(self._hyper),
        )  # fmt: skip
        return scalars

    def _launch(self, index, factor, found_inf) -> None:
        buffer, master, table = self.flat.buffers[index], self._masters[index], self._grad_tables[index]
        _adamw_kernel[(buffer.data.numel() // BLOCK,)](
            buffer.data, buffer.grad if table is None else buffer.data, *GradTable.arguments(table), master,
            self._buffers["exp_avg"][index], self._buffers["exp_avg_sq"][index],
            buffer.block_slot, self._active[index], self._scalars(index), len(buffer.params), self._steps[index],
            factor, found_inf,
            HAS_MASTER=master is not None,
            HAS_FACTOR=factor is not None,
            CAN_SKIP=found_inf is not None,
            GRAD_TABLE=table is not None,
            BLOCK=BLOCK,
            num_warps=4,
            **self._rounding[index],
            **_backend.dependent_launch(buffer.data),
        )  # fmt: skip
