"""ZeRO-1: AdamW whose master weights and moments are sharded over a process group.

:class:`ZeroAdamW` is :class:`~lstrain.optim.FusedAdamW` whose flat buffers are padded to a
multiple of ``world size * BLOCK`` elements and split into equal, block-aligned shards,
one per rank. Every rank keeps the whole 16-bit parameters and gradients (ZeRO stage 1);
the optimizer state (master weights, ``exp_avg``, ``exp_avg_sq``) exists for its own shard only,
1/world of the total. A step:

1. divides the local gradients by the world size and reduce-scatters each flat gradient
   buffer in place (``reduce_scatter_single``: the rank's shard of the buffer receives the
   averaged shard);
2. when clipping or loss-scaling, computes the per-block sums of squares of its shard (the
   kernel FusedAdamW uses) and all-gathers them, so every rank sums the very same partials
   as one process would: the clip factor and the overflow flag agree across ranks (and
   with one process) bit for bit, on the device, without a host sync;
3. runs FusedAdamW's update kernel over the shard's blocks only (the same kernel, launched
   on slices of the buffers);
4. all-gathers the updated parameters in place (``all_gather_single``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from lstrain import _backend
from lstrain.optim.adamw import FusedAdamW, _adamw_kernel
from lstrain.optim.base import reconcile_master, sum_squares
from lstrain.optim.distributed import _global_rank, broadcast_flat, check_process_group
from lstrain.optim.flat import BLOCK, FlatParameters

__all__ = ["ZeroAdamW"]

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_FORMAT = "lstrain.ZeroAdamW/1"


class ZeroAdamW(FusedAdamW):
    """FusedAdamW with its fp32 state sharded over ``process_group`` (ZeRO-1).

    Arguments as :class:`~lstrain.optim.FusedAdamW`, plus:

    Args:
        process_group: the ``torch.distributed`` group the state is sharded over (default:
            the world). Every rank builds the optimizer over the same model.
        broadcast_from: the rank whose parameters every rank starts from (one broadcast per
            flat buffer), or None.

    ``step()`` reduces the gradients itself: do not all-reduce them before (no
    DataParallel); gradient accumulation is plain local accumulation. Every trainable
    parameter takes every step on every rank, with zero for a rank on which it got no
    gradient (unused, or ``.grad`` None after ``zero_grad(set_to_none=True)``), so that the
    ranks' step counts agree. The parameter set is
    fixed when it is built (no ``add_param_group``, no unfreezing later). ``self.state[p]``
    holds only each parameter's ``step``: the moments are shards of flat buffers
    (:attr:`shards`), not per-parameter tensors.

    State dicts: :meth:`state_dict` saves this rank's shards (the default, every rank its
    own file), which :meth:`load_state_dict` restores bit for bit at the same world size
    and rank; ``state_dict(gathered=True)`` (a collective: every rank calls it) returns on
    the group's rank 0 the whole state in torch's AdamW layout (None elsewhere), which
    ``torch.optim.AdamW``, FusedAdamW and a ZeroAdamW of any world size load.

    Raises:
        ValueError: as FusedAdamW, or parameters on a device the group cannot reduce.
        RuntimeError: torch.distributed is not initialized.
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
        master_weights: bool = True,
        state_dtype: torch.dtype = torch.float32,
        rounding_seed: int = 0,
        process_group=None,
        broadcast_from: int | None = 0,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ZeroAdamW: torch.distributed is not initialized: call init_process_group first")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self._reduced = False
        super().__init__(
            params, lr, betas, eps, weight_decay, max_grad_norm=max_grad_norm, decoupled=decoupled,
            master_weights=master_weights, state_dtype=state_dtype, rounding_seed=rounding_seed,
        )  # fmt: skip
        if broadcast_from is not None:
            broadcast_flat(self.flat, broadcast_from, process_group)
            self.reseed_masters()

    @torch.no_grad()
    def reseed_masters(self) -> None:
        """FlatOptimizer's, for this rank's shard of each flat buffer (its masters' range)."""
        for master, buffer, (start, end) in zip(self._masters, self.flat.buffers, self.shards, strict=True):
            if master is not None:
                master.copy_(buffer.data[start:end])

    # -- layout ------------------------------------------------------------------------

    def _flatten(self) -> None:
        name = type(self).__name__
        if "flat" in self.__dict__:
            raise RuntimeError(
                f"{name}: the parameter set is fixed when the optimizer is built (add_param_group, or a parameter "
                "that was frozen then and trains now, would reshard the state): build it over every parameter "
                "that will train"
            )
        groups = [[p for p in g["params"] if p.requires_grad] for g in self.param_groups]
        devices = {p.device for group in groups for p in group}
        if len(devices) > 1:
            raise ValueError(f"{name}: parameters are on several devices: {sorted(map(str, devices))}")
        check_process_group(name, next(iter(devices)), self.process_group)
        if len(devices) == 1 and _backend.backend_for(torch.empty(0, device=next(iter(devices)))) == "reference":
            raise ValueError(
                f"{name}: parameters on {next(iter(devices))} need the Triton interpreter (TRITON_INTERPRET=1 "
                "before importing lstrain) or a CUDA device; the update is a Triton kernel"
            )
        self._check_dtypes(groups)
        self.flat = FlatParameters(groups, pad_to=self.world_size * BLOCK)
        self.generation = 0
        self.shards: list[tuple[int, int]] = []  # (start, end) of this rank's shard of each buffer
        self._used_blocks: list[int] = []  # blocks before the padding, as one process's FusedAdamW has
        for buffer in self.flat.buffers:
            shard = buffer.data.numel() // self.world_size
            self.shards.append((self.rank * shard, (self.rank + 1) * shard))
            last = buffer.params[-1]
            self._used_blocks.append(-(-(buffer.offsets[-1] + last.numel()) // BLOCK))
        self._allocate_state(self.shards)
        self._forget_versions()
        self._attach_state()
        self._check_params()

    def _attach_state(self) -> None:
        for index, buffer in enumerate(self.flat.buffers):
            for slot, p in enumerate(buffer.params):
                self.state[p] = {"step": self._steps[index][slot]}

    def _overlap(self, index: int, span: slice) -> tuple[slice, slice] | None:
        """(the part of a parameter's flat range ``span`` in this rank's shard, relative to the
        parameter, and the same part relative to the shard), or None if they do not meet."""
        start, end = self.shards[index]
        lo, hi = max(span.start, start), min(span.stop, end)
        if lo >= hi:
            return None
        return slice(lo - span.start, hi - span.start), slice(lo - start, hi - start)

    def state_numel(self) -> int:
        """Elements of optimizer state on this rank (master weights and moments)."""
        tensors = [t for key in self.STATE for t in self._buffers[key]] + [m for m in self._masters if m is not None]
        return sum(t.numel() for t in tensors)

    # -- what FlatOptimizer's step calls -----------------------------------------------

    def _reseed_changed(self) -> None:
        """A parameter written in place from outside: its shard of the master weights follows."""
        for index, buffer in enumerate(self.flat.buffers):
            master, versions = self._masters[index], self._versions[index]
            for slot, p in enumerate(buffer.params):
                if p._version != versions[slot]:
                    versions[slot] = p._version
                    parts = self._overlap(index, self._locate(p)[2])
                    if master is not None and parts is not None:
                        reconcile_master(master[parts[1]], p.detach().reshape(-1)[parts[0]])

    def _check_params(self) -> None:
        self._reseed_changed()
        with torch.no_grad():
            for buffer in self.flat.buffers:
                for p, view in zip(buffer.params, buffer.grad_views, strict=True):
                    if p.grad is None and p.requires_grad:
                        # no gradient on this rank (unused, or set_to_none): it adds zero, and the
                        # parameter steps on every rank (another may have one), as under DataParallel
                        view.zero_()
                        p.grad = view
        super()._check_params()

    def _restore(self, p: torch.nn.Parameter, state: dict | None) -> None:
        """This rank's part of a parameter's state from torch's layout (None: fresh)."""
        index, slot, span = self._locate(p)
        state = state or {}
        self._steps[index][slot].copy_(torch.as_tensor(state.get("step", 0.0)))
        parts = self._overlap(index, span)
        if parts is None:
            return
        mine, there = parts
        for key in self.STATE:
            value = state.get(key)
            target = self._buffers[key][index][there]
            if value is None:
                target.zero_()
            else:
                target.copy_(value.reshape(-1)[mine])
        master = self._masters[index]
        if master is not None:
            saved = state.get("master_param")  # reconciled with the parameter at the next step
            master[there].copy_((p.detach() if saved is None else saved).reshape(-1)[mine])

    def _reduce_gradients(self) -> None:
        """Average the gradients: each rank's shard of each flat gradient buffer receives the
        mean over the group (divided before the sum, as DDP, so that fp16 stays in range)."""
        for buffer, (start, end) in zip(self.flat.buffers, self.shards, strict=True):
            buffer.grad.div_(self.world_size)
            _reduce_scatter(buffer.grad[start:end], buffer.grad, group=self.process_group)
        self._reduced = True

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the averaged gradients (a device scalar, the same on every
        rank). A collective: every rank calls it; it reduces the gradients, which the next
        ``step()`` then uses as they are.

        Returns:
            A device scalar.
        """
        self._check_params()
        if not self._reduced:
            self._reduce_gradients()
        return self._grad_norm()

    def _grad_norm(self) -> torch.Tensor:
        start_block, used = 0, []
        for index, buffer in enumerate(self.flat.buffers):
            blocks = buffer.data.numel() // BLOCK
            partials = self._partials[start_block : start_block + blocks]
            shard_blocks = blocks // self.world_size
            b0 = self.rank * shard_blocks
            mine = partials[b0 : b0 + shard_blocks]
            start, end = self.shards[index]
            sum_squares(buffer.grad[start:end], buffer.block_slot[b0 : b0 + shard_blocks], self._active[index], mine)
            _all_gather(partials, mine, group=self.process_group)
            used.append(partials[: self._used_blocks[index]])
            start_block += blocks
        # the partials one process would sum, in its order: the same norm bit for bit
        return (used[0] if len(used) == 1 else torch.cat(used)).sum().sqrt()

    def _grad_factor(self, inv_scale):
        if not self._reduced:
            self._reduce_gradients()
        self._reduced = False  # the next step reduces its own gradients
        return super()._grad_factor(inv_scale)

    def _launch(self, index, factor, found_inf) -> None:
        buffer, master = self.flat.buffers[index], self._masters[index]
        start, end = self.shards[index]
        b0, b1 = start // BLOCK, end // BLOCK
        _adamw_kernel[(b1 - b0,)](
            buffer.data[start:end], buffer.grad[start:end], None, None, None, master, self._buffers["exp_avg"][index],
            self._buffers["exp_avg_sq"][index], buffer.block_slot[b0:b1], self._active[index], self._scalars(index),
            len(buffer.params), self._steps[index], factor, found_inf,
            HAS_MASTER=master is not None,
            HAS_FACTOR=factor is not None,
            CAN_SKIP=found_inf is not None,
            GRAD_TABLE=False,
            BLOCK=BLOCK,
            num_warps=4,
            **self._rounding[index],
            **_backend.dependent_launch(buffer.data),
        )  # fmt: skip
        _all_gather(buffer.data, buffer.data[start:end], group=self.process_group)
        # the gather writes the parameters in place: not a write from outside
        self._versions[index] = [p._version for p in buffer.params]

    # -- state dicts -------------------------------------------------------------------

    def _layout(self) -> dict:
        return {
            "format": _FORMAT,
            "world_size": self.world_size,
            "rank": self.rank,
            "numels": [buffer.data.numel() for buffer in self.flat.buffers],
            "dtypes": [str(buffer.dtype) for buffer in self.flat.buffers],
        }

    def state_dict(self, *, gathered: bool = False) -> dict | None:
        """The optimizer state.

        Args:
            gathered: False (default): this rank's shards (``"zero"``: the layout, the step
                counts, and per flat buffer the shard of ``exp_avg``, ``exp_avg_sq`` and
                ``master_param``), live tensors as torch's state dicts hold; every rank
                saves its own. True: a collective (every rank calls it): the whole state in
                torch's AdamW layout (as FusedAdamW's ``state_dict``) on the group's rank 0,
                None on the others.

        Returns:
            A dict (None on ranks other than 0 when gathered).
        """
        packed = torch.optim.Optimizer.state_dict(self)
        steps = [s.cpu() for s in self._steps]
        if not gathered:
            zero = self._layout()
            zero["step"] = [s.clone() for s in steps]
            for key in self.STATE:
                zero[key] = list(self._buffers[key])
            zero["master_param"] = list(self._masters)
            return {"param_groups": packed["param_groups"], "state": {}, "zero": zero}
        root = self.rank == 0
        full: dict[str, list[torch.Tensor | None]] = {key: [] for key in (*self.STATE, "master_param")}
        for index, buffer in enumerate(self.flat.buffers):
            shards = [(key, self._buffers[key][index]) for key in self.STATE]
            shards.append(("master_param", self._masters[index]))
            for key, shard in shards:
                if shard is None:
                    full[key].append(None)
                    continue
                out = torch.empty(buffer.data.numel(), dtype=shard.dtype, device=shard.device) if root else None
                chunks = list(out.chunk(self.world_size)) if root else None
                dist.gather(shard, chunks, dst=_global_rank(self.process_group, 0), group=self.process_group)
                full[key].append(out.cpu() if root else None)
        if not root:
            return None
        state = {}
        for saved_group, group in zip(packed["param_groups"], self.param_groups, strict=True):
            for number, p in zip(saved_group["params"], group["params"], strict=True):
                if id(p) not in self._where:
                    continue
                index, slot, span = self._locate(p)
                step = steps[index][slot].clone()
                if step.item() == 0:
                    continue  # torch keeps no state for a parameter that never took a step
                entry = {"step": step}
                for key, tensors in full.items():
                    if tensors[index] is not None:
                        entry[key] = tensors[index][span].view(p.shape)
                state[number] = entry
        return {"param_groups": packed["param_groups"], "state": state}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load :meth:`state_dict`'s per-rank shards (the same world size and rank), or a
        state in torch's AdamW layout (``state_dict(gathered=True)``, FusedAdamW's or
        ``torch.optim.AdamW``'s, saved at any world size: each rank takes its shard).

        Args:
            state_dict: what :meth:`state_dict` returned, per rank or gathered.

        Raises:
            ValueError: per-rank shards saved at another world size or rank or over other
                flat buffers (a clear message; save with ``gathered=True`` to change the
                world size), or what FusedAdamW's ``load_state_dict`` raises.
        """
        name = type(self).__name__
        zero = state_dict.get("zero")
        if zero is None:
            super().load_state_dict(state_dict)
            return
        if zero.get("format") != _FORMAT:
            raise ValueError(f"{name}.load_state_dict: unknown per-rank format {zero.get('format')!r}")
        here = self._layout()
        if (zero["world_size"], zero["rank"]) != (here["world_size"], here["rank"]):
            raise ValueError(
                f"{name}.load_state_dict: these shards were saved by rank {zero['rank']} of world size "
                f"{zero['world_size']}; this is rank {here['rank']} of world size {here['world_size']}: load each "
                "rank's own file at the same world size, or save with state_dict(gathered=True) to change it"
            )
        if (zero["numels"], zero["dtypes"]) != (here["numels"], here["dtypes"]):
            saved = list(zip(zero["dtypes"], zero["numels"], strict=False))
            mine = list(zip(here["dtypes"], here["numels"], strict=True))
            raise ValueError(
                f"{name}.load_state_dict: the shards are of flat buffers {saved} (dtype, elements), this "
                f"optimizer's are {mine}: another model"
            )
        super().load_state_dict({"param_groups": state_dict["param_groups"], "state": {}})  # groups, checked
        with torch.no_grad():
            for index in range(len(self.flat.buffers)):
                self._steps[index].copy_(zero["step"][index])
                for key in self.STATE:
                    self._buffers[key][index].copy_(zero[key][index])
                if self._masters[index] is not None:
                    self._masters[index].copy_(zero["master_param"][index])
