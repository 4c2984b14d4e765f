"""What the flat-buffer optimizers share: buffers, device-side hyperparameters and step
counts, fp32 master weights (or none, with stochastic rounding into bf16: ``rounding.py``),
state in torch's layout, the fused clip / overflow factor, and the host-side checks that
keep the buffers and the model in step.

Every ``step()`` first walks the parameters on the host (identity and pointer checks, no
device sync): a ``.grad`` that autograd put in a new tensor (after ``model.zero_grad()`` or
``p.grad = None``) is copied into the flat buffer and the view re-attached (without a flat
gradient buffer, ``flat_grads=False``, each ``.grad``'s address goes into the table the
kernels read instead: :class:`GradTable`); a parameter
whose ``.grad`` is None or that no longer requires grad is skipped as torch's optimizers
skip a parameter without a gradient; a parameter moved, cast
or re-pointed since the optimizer was built is an error; where a 16-bit parameter was written
in place from outside (``model.load_state_dict``, before or after the optimizer's), its fp32
master copy takes the parameter's values (:func:`reconcile_master`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary

from lstrain import _backend
from lstrain._backend import wait_for_producers
from lstrain.optim.flat import BLOCK, FlatBuffer, FlatParameters, adopt_grads
from lstrain.optim.rounding import random_halves, round_to_bf16

__all__ = ["FlatOptimizer", "GradTable", "gradient_pointers", "load_gradient_and_weight", "store_state", "store_weight"]

_MAX_SEED = 2**31 - 2**10  # a rounding seed plus a buffer index stays a 32-bit Philox key half

# The optimizer whose flat buffers hold each parameter now, so that an optimizer whose
# parameters were taken by a later one over the same parameters can say so.
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


@triton.jit
def gradient_pointers(grad_ptr, grad_table_ptr, slot_start_ptr, slot_size_ptr, slot, offsets, GRAD_TABLE: tl.constexpr):
    """(pointers, which exist) of the gradient elements at flat offsets ``offsets`` of
    parameter ``slot``: in the flat gradient buffer ``grad_ptr`` (all exist: its padding is
    zero), or with ``GRAD_TABLE`` in the parameter's own ``.grad``, whose address is
    ``grad_table[slot]`` (``grad_ptr`` then only gives the dtype), below its size."""
    if GRAD_TABLE:
        local = offsets - tl.load(slot_start_ptr + slot)
        base = tl.load(grad_table_ptr + slot).to(tl.pointer_type(grad_ptr.dtype.element_ty))
        pointers, exist = base + local, local < tl.load(slot_size_ptr + slot)
    else:
        pointers, exist = grad_ptr + offsets, offsets >= 0
    return pointers, exist


@triton.jit
def load_gradient_and_weight(
    param_ptr,
    grad_pointers,
    grad_exists,
    master_ptr,
    grad_factor_ptr,
    skip_ptr,
    active,
    offsets,
    HAS_MASTER: tl.constexpr,
    HAS_FACTOR: tl.constexpr,
    CAN_SKIP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """(gradient times the clip / loss-scale factor, fp32 weight, store mask) of one block,
    the gradient at ``grad_pointers`` where ``grad_exists`` (:func:`gradient_pointers`), 0
    elsewhere.

    The store mask is all False for a parameter without a gradient (``active`` 0) and on
    an overflowing step, which then changes nothing; the loads are masked alike, so that
    skipped blocks cost no memory traffic (nor read a gradient that is not there).
    """
    off = tl.zeros([BLOCK], dtype=tl.float32) + (1.0 - active)
    if CAN_SKIP:
        off += tl.load(skip_ptr)
    write = off == 0.0
    g = tl.load(grad_pointers, mask=write & grad_exists, other=0.0).to(tl.float32)
    if HAS_FACTOR:
        g *= tl.load(grad_factor_ptr)
    if HAS_MASTER:
        w = tl.load(master_ptr + offsets, mask=write, other=0.0)
    else:
        w = tl.load(param_ptr + offsets, mask=write, other=0.0).to(tl.float32)
    return g, w, write


@triton.jit
def store_weight(
    param_ptr,
    master_ptr,
    offsets,
    w,
    write,
    key,
    first,
    HAS_MASTER: tl.constexpr,
    ROUND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Write the fp32 weight to the master copy (if any) and, rounded, to the parameter:
    stochastically (random stream 0) where ``ROUND`` (a bf16 parameter without a master)."""
    if HAS_MASTER:
        tl.store(master_ptr + offsets, w, mask=write)
    if ROUND:
        tl.store(param_ptr + offsets, round_to_bf16(w, random_halves(key, first, 0, BLOCK)), mask=write)
    else:
        tl.store(param_ptr + offsets, w.to(param_ptr.dtype.element_ty), mask=write)


@triton.jit
def store_state(
    state_ptr, offsets, value, write, key, first, stream: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr
):
    """Write one fp32 per-element state (a moment): rounded stochastically to bf16 with random
    stream ``stream`` where ``ROUND`` (the state is bf16), else as it is (fp32)."""
    if ROUND:
        value = round_to_bf16(value, random_halves(key, first, stream, BLOCK))
    tl.store(state_ptr + offsets, value, mask=write)


@triton.jit
def _sum_squares_kernel(
    grad_ptr,
    grad_table_ptr,
    slot_start_ptr,
    slot_size_ptr,
    block_slot_ptr,
    active_ptr,
    partial_ptr,
    blocks,
    GRAD_TABLE: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_producers(PDL)
    # One fp32 partial per block, summed by torch afterwards: deterministic, no atomics.
    # Several blocks per program: their loads are in flight together behind one chain of
    # slot -> flag loads (a block per program left the memory system a third idle).
    block = tl.program_id(0) * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
    ok = block < blocks
    slot = tl.load(block_slot_ptr + block, mask=ok, other=0)
    active = tl.load(active_ptr + slot, mask=ok, other=0.0)
    column = tl.arange(0, BLOCK)
    offsets = block.to(tl.int64)[:, None] * BLOCK + column[None, :]
    pointers, exist = gradient_pointers(
        grad_ptr, grad_table_ptr, slot_start_ptr, slot_size_ptr, slot[:, None], offsets, GRAD_TABLE
    )
    g = tl.load(pointers, mask=(active != 0.0)[:, None] & exist, other=0.0)
    g = g.to(tl.float32)
    tl.store(partial_ptr + block, tl.sum(g * g, axis=1), mask=ok)


_SUM_SQUARES_BLOCKS = 4  # blocks per program of the norm's kernel


def sum_squares(
    grad: torch.Tensor,
    block_slot: torch.Tensor,
    active: torch.Tensor,
    partials: torch.Tensor,
    table: GradTable | None = None,
) -> None:
    """``partials[b]`` = the sum of squares of block ``b`` of the flat gradient ``grad`` in
    fp32 (0 for a block whose parameter has no gradient: ``active[block_slot[b]]`` 0); with
    ``table``, of the parameters' own gradients at those blocks (``grad`` is then the flat
    parameter buffer, for its dtype)."""
    blocks = partials.numel()
    _sum_squares_kernel[(triton.cdiv(blocks, _SUM_SQUARES_BLOCKS),)](
        grad,
        *GradTable.arguments(table),
        block_slot,
        active,
        partials,
        blocks,
        GRAD_TABLE=table is not None,
        BLOCK=BLOCK,
        BLOCKS_PER_PROGRAM=_SUM_SQUARES_BLOCKS,
        num_warps=4,
        **_backend.dependent_launch(grad),
    )


class GradTable:
    """Where each parameter's own gradient lies, for an optimizer without a flat gradient
    buffer (``flat_grads=False``): a device table of addresses (0: no gradient) that the
    update and norm kernels read, with each parameter's start and size in the flat
    parameter buffer.

    The table is written only when an address changed: a host-to-device copy, never during
    a CUDA-graph capture (the captured kernels read the table as it is when they are
    replayed; :meth:`FlatOptimizer.before_replay` writes it first). The gradients are the
    parameters' ``.grad``, alive until the update has run: the table never outlives them
    unread.
    """

    def __init__(self, buffer: FlatBuffer) -> None:
        device = buffer.data.device
        self.addresses = torch.zeros(len(buffer.params), dtype=torch.int64, device=device)
        self.starts = torch.tensor(buffer.offsets, dtype=torch.int64).to(device)
        self.sizes = torch.tensor([p.numel() for p in buffer.params], dtype=torch.int64).to(device)
        self.written: list[int] | None = [0] * len(buffer.params)  # None: to write at the next chance

    def update(self, addresses: list[int]) -> None:
        """Make the device table hold ``addresses`` (written unless it does already)."""
        if addresses == self.written:
            return
        if self.addresses.is_cuda and torch.cuda.is_current_stream_capturing():
            self.written = None
            return
        self.addresses.copy_(torch.tensor(addresses, dtype=torch.int64), non_blocking=True)
        self.written = addresses

    @staticmethod
    def arguments(table: GradTable | None) -> tuple:
        """The kernels' (table, starts, sizes) arguments; None for a flat gradient buffer."""
        return (None, None, None) if table is None else (table.addresses, table.starts, table.sizes)


def reconcile_master(master: torch.Tensor, param: torch.Tensor) -> None:
    """Bring an fp32 master copy back in line with its 16-bit parameter, element by element:
    keep each master element that the update's rounding turns into the parameter's, take the
    parameter's value where it differs (written from outside since the last update: a
    ``model.load_state_dict``, a ``p.copy_``, torch.optim, a checkpoint of other weights).

    Args:
        master: the master elements (fp32, 1-D), updated in place.
        param: the parameter's same elements (16-bit, 1-D).
    """
    kept = master.to(param.dtype) == param
    if param.dtype == torch.bfloat16 and _backend.backend_for(param) == "interpreter":
        # Triton's CPU interpreter truncates fp32 -> bf16 where a GPU rounds to nearest
        kept |= (master.view(torch.int32) & -65536).view(torch.float32).to(param.dtype) == param
    master.copy_(torch.where(kept, master, param.float()))


# a parameter version no tensor has: its master is reconciled at the next parameter checks
_UNCHECKED = -1


class FlatOptimizer(torch.optim.Optimizer):
    """Base of :class:`~lstrain.optim.FusedAdamW` and :class:`~lstrain.optim.FusedSGD`.

    Subclasses name their per-group hyperparameters (``HYPER``, read from a group by
    :meth:`_hyper_of`), their per-element state (``STATE``; fp32, or bf16 with
    ``state_dtype``), the torch options they do
    not implement (``UNSUPPORTED``), check a group (:meth:`_check_group`), convert one
    parameter's state from and to torch's layout (:meth:`_import_state`,
    :meth:`_export_state`) and launch their update kernel (:meth:`_launch`), one launch per
    parameter dtype, reading the gradients through :func:`gradient_pointers` (the flat
    gradient buffer, or with ``flat_grads=False`` each parameter's own ``.grad``).

    Parameters that do not require grad when the optimizer is built stay out of the flat
    buffers (no memory for their state); if one later requires grad and has a gradient at a
    step, the buffers are rebuilt around it, keeping every parameter's state (as after
    :meth:`add_param_group`).

    ``generation`` counts the reallocations of the device tensors a step reads (the flat
    buffers, the hyperparameters): a captured CUDA graph of a step is valid while it stays.
    """

    HYPER: tuple[str, ...] = ()
    STATE: tuple[str, ...] = ()
    UNSUPPORTED: tuple[str, ...] = ("maximize", "differentiable")

    def __init__(
        self,
        params: Iterable,
        defaults: dict,
        max_grad_norm: float | None,
        *,
        master_weights: bool = True,
        state_dtype: torch.dtype = torch.float32,
        rounding_seed: int = 0,
        flat_grads: bool = True,
    ) -> None:
        super().__init__(params, defaults)
        name = type(self).__name__
        for group in self.param_groups:
            self._check_group(group)
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"{name}: max_grad_norm must be > 0, got {max_grad_norm}")
        if not isinstance(master_weights, bool):
            raise ValueError(f"{name}: master_weights must be True or False, got {master_weights!r}")
        if not isinstance(flat_grads, bool):
            raise ValueError(f"{name}: flat_grads must be True or False, got {flat_grads!r}")
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"{name}: state_dtype must be torch.float32 or torch.bfloat16 (rounded stochastically), got "
                f"{state_dtype!r}"
            )
        if not (isinstance(rounding_seed, int) and not isinstance(rounding_seed, bool)) or not (
            0 <= rounding_seed < _MAX_SEED
        ):
            raise ValueError(f"{name}: rounding_seed must be an int in [0, {_MAX_SEED}), got {rounding_seed!r}")
        self.master_weights = master_weights
        self.state_dtype = state_dtype
        self.rounding_seed = rounding_seed
        self.flat_grads = flat_grads
        if not any(p.requires_grad for group in self.param_groups for p in group["params"]):
            raise ValueError(f"{name}: no parameter requires grad")
        self.max_grad_norm = max_grad_norm
        self.found_inf: torch.Tensor | None = None  # of the last step, when it was loss-scaled
        self._hyper: torch.Tensor | None = None
        self._hyper_values: list[tuple[float, ...]] = []
        self._flatten()
        self._sync_hyperparameters()

    def _hyper_of(self, group: dict) -> tuple[float, ...]:
        raise NotImplementedError

    def _check_group(self, group: dict) -> None:
        raise NotImplementedError

    def _import_state(self, saved: dict, group: dict) -> dict:
        raise NotImplementedError

    def _export_state(self, state: dict, step: torch.Tensor, group: dict) -> dict | None:
        raise NotImplementedError

    def _launch(self, index: int, factor, found_inf) -> None:
        raise NotImplementedError

    def _check_unsupported(self, group: dict) -> None:
        """Refuse torch options this optimizer would otherwise ignore silently."""
        for key in self.UNSUPPORTED:
            if group.get(key):
                raise ValueError(f"{type(self).__name__}: {key}=True is not supported")

    def _flatten(self) -> None:
        """(Re)build the flat buffers over the parameters that take part in steps: those in
        the buffers already and those that require grad now. Each parameter keeps its state
        (moments, step count, master copy) and its ``.grad``."""
        name = type(self).__name__
        old = self.__dict__.get("flat")
        kept = {id(p) for p in old.parameters()} if old is not None else set()
        groups = [[p for p in g["params"] if p.requires_grad or id(p) in kept] for g in self.param_groups]
        detached = [p for group in groups for p in group if id(p) in kept and p.grad is None]
        saved = {p: dict(self.state[p]) for group in groups for p in group if p in self.state}
        devices = {p.device for group in groups for p in group}
        if len(devices) == 1 and _backend.backend_for(torch.empty(0, device=next(iter(devices)))) == "reference":
            raise ValueError(
                f"{name}: parameters on {next(iter(devices))} need the Triton interpreter (TRITON_INTERPRET=1 "
                "before importing lstrain) or a CUDA device; the update is a Triton kernel"
            )
        self._check_dtypes(groups)
        self.flat = FlatParameters(groups, grads=self.flat_grads)
        self.generation = self.__dict__.get("generation", -1) + 1
        for p in detached:
            p.grad = None  # a parameter without a gradient keeps having none
        self._allocate_state([(0, buffer.data.numel()) for buffer in self.flat.buffers])
        with torch.no_grad():
            for p, state in saved.items():
                self._restore(p, state)
        self._forget_versions()
        self._attach_state()
        self._check_params()

    def _forget_versions(self) -> None:
        """Reconcile every master with its parameter at the next parameter checks (after a
        build or a load: the model's state may still be loaded before the next step)."""
        self._versions = [[_UNCHECKED] * len(buffer.params) for buffer in self.flat.buffers]

    def _check_dtypes(self, groups: list[list[torch.nn.Parameter]]) -> None:
        """Refuse fp16 parameters without master weights: stochastic rounding is to bf16.

        Raises:
            ValueError: an fp16 parameter and ``master_weights=False``.
        """
        if not self.master_weights and any(p.dtype == torch.float16 for group in groups for p in group):
            raise ValueError(
                f"{type(self).__name__}: master_weights=False rounds updates stochastically into bf16 or keeps fp32 "
                "parameters; float16 parameters (5 exponent bits: updates underflow) need master_weights=True"
            )

    def _allocate_state(self, spans: list[tuple[int, int]]) -> None:
        """The state over ``spans``, the ``(start, end)`` this optimizer updates of each flat
        buffer (whole buffers; a ZeRO rank's shards): fp32 masters of 16-bit parameters
        (with ``master_weights``), the ``STATE`` moments in ``state_dtype``, per-parameter
        step counts and "has a gradient" flags, and the parameter lookups."""
        device = self.flat.device
        self._backend = _backend.backend_for(torch.empty(0, device=device))
        self._masters: list[torch.Tensor | None] = []
        self._buffers: dict[str, list[torch.Tensor]] = {key: [] for key in self.STATE}
        self._steps: list[torch.Tensor] = []
        self._active: list[torch.Tensor] = []
        self._active_host: list[list[bool]] = []
        self._grad_tables: list[GradTable | None] = []  # without a flat gradient buffer
        blocks = [buffer.data.numel() // BLOCK for buffer in self.flat.buffers]
        self._partials = torch.zeros(sum(blocks), dtype=torch.float32, device=device)
        for buffer, (start, end) in zip(self.flat.buffers, spans, strict=True):
            has_master = self.master_weights and buffer.dtype != torch.float32
            self._masters.append(buffer.data[start:end].float() if has_master else None)
            for key in self.STATE:
                self._buffers[key].append(torch.zeros(end - start, dtype=self.state_dtype, device=device))
            self._steps.append(torch.zeros(len(buffer.params), dtype=torch.float32, device=device))
            self._active_host.append([False] * len(buffer.params))
            self._active.append(torch.zeros(len(buffer.params), dtype=torch.float32, device=device))
            self._grad_tables.append(None if buffer.grad is not None else GradTable(buffer))
            for p in buffer.params:
                _OWNERS[p] = weakref.ref(self)
        self._where = {id(p): (i, slot) for i, b in enumerate(self.flat.buffers) for slot, p in enumerate(b.params)}
        self._outside = [p for g in self.param_groups for p in g["params"] if id(p) not in self._where]
        # The update kernels' stochastic-rounding arguments per buffer, fixed with the state:
        # the seed (one per buffer), where the launch starts in the buffer (the random
        # counters are the whole buffer's, so a ZeRO shard rounds as one process would), and
        # whether the weights (bf16 without a master) and the state (bf16) are rounded.
        self._rounding = [
            {
                "seed": self.rounding_seed + index,
                "rng_offset": start,
                "ROUND_WEIGHT": self._masters[index] is None and buffer.dtype == torch.bfloat16,
                "ROUND_STATE": self.state_dtype == torch.bfloat16,
            }
            for index, (buffer, (start, _)) in enumerate(zip(self.flat.buffers, spans, strict=True))
        ]

    def _locate(self, p: torch.nn.Parameter) -> tuple[int, int, slice]:
        """(buffer index, slot, flat range) of a parameter in the flat buffers."""
        index, slot = self._where[id(p)]
        offset = self.flat.buffers[index].offsets[slot]
        return index, slot, slice(offset, offset + p.numel())

    def _restore(self, p: torch.nn.Parameter, state: dict | None) -> None:
        """Set a flat parameter's state from internal-layout ``state`` (None: fresh state)."""
        index, slot, span = self._locate(p)
        state = state or {}
        for key in self.STATE:
            value = state.get(key)
            target = self._buffers[key][index][span]
            if value is None:
                target.zero_()
            else:
                target.copy_(value.reshape(-1))
        self._steps[index][slot].copy_(torch.as_tensor(state.get("step", 0.0)))
        master = self._masters[index]
        if master is not None:
            # the saved master as it is: the next step's parameter checks reconcile it with the
            # parameter, which the model's state may still replace before then
            saved_master = state.get("master_param")
            master[span].copy_((p.detach() if saved_master is None else saved_master).reshape(-1))

    def _attach_state(self) -> None:
        """Expose per-parameter views of the flat state in torch's ``self.state`` layout."""
        for index, buffer in enumerate(self.flat.buffers):
            master = self._masters[index]
            for slot, (p, offset) in enumerate(zip(buffer.params, buffer.offsets, strict=True)):
                span = slice(offset, offset + p.numel())
                state = {"step": self._steps[index][slot]}
                state.update({key: self._buffers[key][index][span].view(p.shape) for key in self.STATE})
                if master is not None:
                    state["master_param"] = master[span].view(p.shape)
                self.state[p] = state

    def _moved_message(self, p: torch.nn.Parameter, buffer: FlatBuffer) -> str:
        name = type(self).__name__
        owner = _OWNERS.get(p)
        if owner is not None and owner() is not None and owner() is not self:
            return (
                f"{name}.step: a parameter now lives in the flat buffers of another {type(owner()).__name__} "
                "built over it after this one; step that one (one flat optimizer per parameter)"
            )
        return (
            f"{name}.step: a parameter was moved, cast or re-pointed after the optimizer was built (it is "
            f"{p.dtype} on {p.device}, its flat buffer {buffer.dtype} on {self.flat.device}: model.to() / .half() / "
            ".cuda() / p.data = ...?); the optimizer would update a stale copy: build the optimizer after moving "
            "or casting the model"
        )

    def _check_params(self) -> None:
        """The host-side walk of every ``step()``: no device sync, a few attribute reads and
        identity checks per parameter; device work only when something changed.

        Raises:
            RuntimeError: a parameter was moved, cast or re-pointed since the optimizer was built.
        """
        for p in self._outside:
            if p.requires_grad and p.grad is not None:
                self._flatten()  # a parameter frozen when the optimizer was built trains now
                return
        for index, buffer in enumerate(self.flat.buffers):
            strays = []  # gradients autograd put in new tensors: one copy per buffer (one dtype)
            table = self._grad_tables[index]
            addresses = [] if table is not None else None
            flags = self._active_host[index]
            versions = self._versions[index]
            master = self._masters[index]
            changed = False
            for slot, p in enumerate(buffer.params):
                if p.data_ptr() != buffer.data_ptrs[slot] or p.dtype is not buffer.dtype:
                    raise RuntimeError(self._moved_message(p, buffer))
                grad = p.grad
                active = grad is not None and p.requires_grad
                if table is not None:
                    addresses.append(self._own_gradient(p) if active else 0)
                elif grad is not None and grad is not buffer.grad_views[slot]:
                    strays.append((p, buffer.grad_views[slot]))
                if active is not flags[slot]:
                    flags[slot] = active
                    changed = True
                if master is not None and p._version != versions[slot]:
                    # written in place from outside (model.load_state_dict, p.copy_), or a master
                    # just restored: the master follows the parameter where they differ
                    offset = buffer.offsets[slot]
                    reconcile_master(master[offset : offset + p.numel()], p.detach().reshape(-1))
                    versions[slot] = p._version
            if changed:
                self._active[index].copy_(torch.tensor(flags, dtype=torch.float32), non_blocking=True)
            if table is not None:
                table.update(addresses)
            adopt_grads(strays)
        self.flat.reopen_grad_slots()

    def _own_gradient(self, p: torch.nn.Parameter) -> int:
        """The address of ``p``'s own ``.grad`` (``flat_grads=False``), made contiguous
        first if it is not (the update reads it in the parameter's element order).

        Raises:
            RuntimeError: a sparse gradient, or one on another device than the parameter.
        """
        grad = p.grad
        if grad.layout is not torch.strided or grad.device != p.device:
            raise RuntimeError(
                f"{type(self).__name__}.step: a gradient is {grad.layout} on {grad.device}, its parameter "
                f"{p.layout} on {p.device}; the update reads dense gradients on the parameters' device"
            )
        if not grad.is_contiguous():
            p.grad = grad = grad.contiguous()
        return grad.data_ptr()

    def _sync_hyperparameters(self) -> None:
        """Copy the groups' hyperparameters to the device when a scheduler changed them
        (a host-to-device write, never a read back)."""
        # floats, not the groups' objects: a tensor lr that a scheduler fills in place would
        # compare equal to itself and never reach the device
        values = [tuple(float(value) for value in self._hyper_of(group)) for group in self.param_groups]
        if values != self._hyper_values:
            for group in self.param_groups:
                self._check_group(group)
            shape = (len(self.HYPER), len(self.param_groups))
            if self._hyper is None or tuple(self._hyper.shape) != shape:
                self._hyper = torch.empty(shape, dtype=torch.float64, device=self.flat.device)
                self.generation += 1
            # fp64: the kernels derive their per-step scalars from these as torch derives them
            # from Python floats
            self._hyper.copy_(torch.tensor(values, dtype=torch.float64).t(), non_blocking=True)
            self._hyper_values = values

    def before_replay(self) -> None:
        """What :meth:`step` does on the host before its kernels, for a step replayed from a
        CUDA graph, whose Python code does not run: the parameter checks (a moved parameter
        is an error, a stray ``.grad`` is copied into the flat buffer, a master weight
        follows an in-place write of its parameter) and the hyperparameters' device copy (a
        scheduler's new lr reaches the captured kernels). :class:`lstrain.train.CapturedStep`
        calls it before every replay; :attr:`generation` then tells it whether the device
        tensors the graph reads were reallocated.

        Raises:
            RuntimeError: as :meth:`step`.
        """
        self._check_params()
        self._sync_hyperparameters()

    @torch.no_grad()
    def reseed_masters(self) -> None:
        """Copy the 16-bit parameters into their fp32 master weights: after the flat buffers
        were written where the optimizer cannot see it (a broadcast from another rank), so
        that the next step starts from the parameters as they are now."""
        for master, buffer in zip(self._masters, self.flat.buffers, strict=True):
            if master is not None:
                master.copy_(buffer.data)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (torch's API); after construction the flat buffers are rebuilt to
        include it, every existing parameter keeping its state.

        Args:
            param_group: ``{"params": [...], <hyperparameters>}``.

        Raises:
            ValueError: as torch's (a parameter already in a group), a bad hyperparameter,
                or a parameter on another device than the others; nothing changes then.
        """
        super().add_param_group(param_group)
        if "flat" not in self.__dict__:
            return  # torch's constructor adding the first groups
        try:
            self._check_group(self.param_groups[-1])
            self._flatten()
        except (ValueError, RuntimeError):
            self.param_groups.pop()
            raise
        self._sync_hyperparameters()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradients.

        Args:
            set_to_none: False (the default, unlike torch's): zero the flat gradient buffers
                in place, one fill per dtype; each parameter keeps its ``.grad`` view, so
                backward accumulates straight into the buffers, and takes the next step
                (with a zero gradient if backward gave it none; a ``.grad`` that is None
                stays None, as torch does). True: torch's semantics: every ``.grad``
                becomes None and a parameter that backward gives no gradient is skipped by
                the next step. Backward then writes the gradients lstrain's ops compute
                (weights, biases, norms, embedding tables) straight into the flat buffers
                (:mod:`lstrain._grad_slots`: no fill, no add, no copy); any other gradient is
                a new tensor that ``step()`` copies in (one more read and write of it).
                Unlike torch, a ``.grad`` placed so is a view of the buffer: the next
                backward after ``zero_grad`` or ``step`` writes over it (clone a gradient
                you keep across backwards). Without flat gradient buffers
                (``flat_grads=False``) torch's own: False zeroes each ``.grad`` in place,
                True frees them until backward makes them again.
        """
        self.flat.reopen_grad_slots()
        if set_to_none:
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None
            return
        if not self.flat_grads:
            grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
            for grad in grads:
                grad.detach_()
            if grads:
                torch._foreach_zero_(grads)
            return
        for p in self._outside:
            if p.grad is not None:
                p.grad.detach_()
                p.grad.zero_()
        for buffer in self.flat.buffers:
            for p, view in zip(buffer.params, buffer.grad_views, strict=True):
                if p.grad is not None and p.grad is not view:
                    p.grad = view  # the stray gradient is dropped; the fill below zeroes the view
        self.flat.zero_grad()

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of all (possibly loss-scaled) gradients of the parameters that
        have one, fp32, on the device (one reduction per dtype, no host sync).

        Returns:
            A device scalar.
        """
        self._check_params()
        return self._grad_norm()

    def _grad_norm(self) -> torch.Tensor:
        start = 0
        for index, buffer in enumerate(self.flat.buffers):
            blocks = buffer.data.numel() // BLOCK
            if blocks:
                sum_squares(
                    buffer.data if buffer.grad is None else buffer.grad, buffer.block_slot, self._active[index],
                    self._partials[start : start + blocks], self._grad_tables[index],
                )  # fmt: skip
            start += blocks
        return self._partials.sum().sqrt()

    def _grad_factor(self, inv_scale: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(factor the kernel multiplies gradients by, overflow flag), both device scalars or None.

        One reduction serves both: the norm is not finite exactly when some gradient is not.
        """
        if self.max_grad_norm is None and inv_scale is None:
            return None, None
        norm = self._grad_norm()
        found_inf = (~torch.isfinite(norm)).to(torch.float32) if inv_scale is not None else None
        factor = inv_scale
        if self.max_grad_norm is not None:
            unscaled = norm if inv_scale is None else norm * inv_scale
            clip = torch.clamp(self.max_grad_norm / (unscaled + 1e-6), max=1.0)
            factor = clip if factor is None else factor * clip
        return factor, found_inf

    @torch.no_grad()
    def step(self, closure=None, *, inv_scale: torch.Tensor | None = None) -> torch.Tensor | None:
        """One update of every parameter that has a gradient: one kernel launch per dtype.

        Args:
            closure: re-evaluates the loss, as for torch optimizers.
            inv_scale: 1 / loss scale (a device scalar) when the gradients are loss-scaled;
                then a step whose gradients hold an inf or NaN changes nothing. Normally
                passed by :class:`lstrain.optim.LossScaler`.

        Returns:
            The closure's loss, if any.

        Raises:
            RuntimeError: a parameter was moved, cast or re-pointed since the optimizer was
                built (build it after ``model.to(...)``), or taken by a later optimizer.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_params()
        self._sync_hyperparameters()
        factor, found_inf = self._grad_factor(inv_scale)
        self.found_inf = found_inf
        taken = None if found_inf is None else 1.0 - found_inf
        for index, buffer in enumerate(self.flat.buffers):
            # Each parameter's own step count, as torch keeps one per parameter with a gradient.
            if taken is None:
                self._steps[index].add_(self._active[index])
            else:
                self._steps[index].addcmul_(self._active[index], taken)
            if buffer.data.numel():
                self._launch(index, factor, found_inf)
        _backend.note(type(self).__name__, self._backend)
        return loss

    def state_dict(self) -> dict:
        """torch's layout: the groups, and per parameter that has taken a step its own state
        (for AdamW a CPU float32 ``step`` and the moments; for SGD ``momentum_buffer``), plus
        ``master_param`` for 16-bit parameters with master weights (torch's optimizers
        ignore it). The moments are views of the live buffers (fp32, or bf16 with
        ``state_dtype``), as torch's state dicts hold the live tensors.

        Returns:
            A dict that ``torch.optim.AdamW`` / ``SGD`` and this class load.
        """
        packed = super().state_dict()
        steps = [s.cpu() for s in self._steps]  # one read back per dtype: a checkpoint, not a step
        where = self._where
        state = {}
        for saved_group, group in zip(packed["param_groups"], self.param_groups, strict=True):
            for number, p in zip(saved_group["params"], group["params"], strict=True):
                if id(p) in where:
                    index, slot = where[id(p)]
                    entry = self._export_state(self.state[p], steps[index][slot].clone(), group)
                elif self.state.get(p):
                    entry = self._export_state(self.state[p], self.state[p]["step"].float().cpu(), group)
                else:
                    entry = None
                if entry is not None:
                    state[number] = entry
        packed["state"] = state
        return packed

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict saved by this class or by torch's matching optimizer.

        Everything is checked before anything changes. A parameter without saved state
        starts afresh, as in torch.

        Args:
            state_dict: as :meth:`state_dict` returns.

        Raises:
            ValueError: another number of groups or of parameters in a group, state for a
                parameter no group lists, a state tensor whose shape is not its parameter's
                (named by index, group and shapes), or a bad or unsupported hyperparameter.
        """
        name = type(self).__name__
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"{name}.load_state_dict: {len(groups)} groups saved, {len(self.param_groups)} here")
        index_to_param, index_to_group, merged_groups = {}, {}, []
        for number, (saved, group) in enumerate(zip(groups, self.param_groups, strict=True)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"{name}.load_state_dict: group {number} has {len(saved['params'])} parameters saved, "
                    f"{len(group['params'])} here"
                )
            for index, p in zip(saved["params"], group["params"], strict=True):
                index_to_param[index] = p
                index_to_group[index] = number
            merged = {**group, **{key: value for key, value in saved.items() if key != "params"}}
            try:
                self._check_group(merged)
            except ValueError as error:
                raise ValueError(f"{name}.load_state_dict: group {number}: {error}") from None
            merged_groups.append(merged)
        imported = {}
        for index, saved_state in state_dict["state"].items():
            if index not in index_to_param:
                raise ValueError(f"{name}.load_state_dict: state for parameter {index}, which no group lists")
            p, number = index_to_param[index], index_to_group[index]
            for key, value in saved_state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                if key == "step":
                    if value.numel() != 1:
                        raise ValueError(
                            f"{name}.load_state_dict: step of parameter {index} (group {number}) has shape "
                            f"{tuple(value.shape)}, not a scalar"
                        )
                elif value.shape != p.shape:
                    raise ValueError(
                        f"{name}.load_state_dict: {key} of parameter {index} (group {number}) has shape "
                        f"{tuple(value.shape)}, the parameter {tuple(p.shape)}"
                    )
            imported[p] = self._import_state(saved_state, merged_groups[number])
        for group, merged in zip(self.param_groups, merged_groups, strict=True):
            group.update(merged)
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if id(p) in self._where:
                        self._restore(p, imported.get(p))
                    elif p in imported:
                        self.state[p] = {key: value.to(p.device) for key, value in imported[p].items()}
                    else:
                        self.state.pop(p, None)
        self._forget_versions()
        self._sync_hyperparameters()
