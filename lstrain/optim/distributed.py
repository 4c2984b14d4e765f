"""Data parallelism over the flat gradient buffers: bucketed all-reduces that overlap backward.

:class:`DataParallel` splits each flat gradient buffer (:class:`~lstrain.optim.FlatParameters`)
into a few contiguous buckets (about ``bucket_mib`` each, at parameter boundaries, the last
parameters first, as backward produces them) and all-reduces a bucket asynchronously
(``torch.distributed.all_reduce(async_op=True)``) as soon as backward has accumulated the
gradient of each of its parameters (``register_post_accumulate_grad_hook``, a count per
bucket). :meth:`DataParallel.finish` launches what backward left (the buckets of parameters
that got no gradient) and waits: every rank then holds the same averaged gradients.

Buckets are launched in one fixed order on every rank (a bucket whose parameters are ready
waits for the buckets before it), as torch DDP does, so that the collectives pair up even
when ranks see different parameters used. The clip norm and the loss scaler's overflow flag
need no collective of their own: after the all-reduce every rank holds bit-identical
gradients and computes the same norm with the same deterministic kernel, and an inf or NaN
on one rank reaches every rank through the sum.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lstrain.optim.base import FlatOptimizer
from lstrain.optim.flat import FlatParameters, adopt_grads

__all__ = ["DataParallel", "check_process_group"]


def check_process_group(name: str, device: torch.device, process_group) -> int:
    """The group's world size, after checking that the group exists and can reduce tensors on
    ``device`` (NCCL: the current CUDA device; gloo: the CPU or CUDA).

    Args:
        name: the caller, for the messages (``"DataParallel"``, ``"ZeroAdamW"``).
        device: where the parameters are.
        process_group: the group (None: the default group).

    Returns:
        The group's world size.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: the parameters' device does not suit the group's backend.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{name}: torch.distributed is not initialized: call init_process_group first")
    backend = str(dist.get_backend(process_group)).lower()
    if "nccl" in backend:
        if device.type != "cuda":
            raise ValueError(f"{name}: the parameters are on {device}; the NCCL process group reduces CUDA tensors")
        if device.index is not None and device.index != torch.cuda.current_device():
            raise ValueError(
                f"{name}: the parameters are on {device}, the current CUDA device is "
                f"cuda:{torch.cuda.current_device()}: call torch.cuda.set_device(local_rank) before building the model"
            )
    elif "gloo" in backend and device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: the parameters are on {device}; the gloo process group reduces CPU or CUDA tensors")
    return dist.get_world_size(process_group)


def _global_rank(process_group, group_rank: int) -> int:
    return group_rank if process_group is None else dist.get_global_rank(process_group, group_rank)


def broadcast_flat(flat: FlatParameters, src: int, process_group=None) -> None:
    """Overwrite every rank's parameters with rank ``src``'s (one broadcast per flat buffer,
    in place). A flat optimizer's fp32 master weights must then be re-seeded by the caller:
    a write into the buffer does not bump the parameters' version counters.

    Args:
        flat: the flat parameters, the same layout on every rank.
        src: the rank, within ``process_group``, whose values every rank takes.
        process_group: the group (None: the default group).
    """
    for buffer in flat.buffers:
        dist.broadcast(buffer.data, src=_global_rank(process_group, src), group=process_group)


@dataclass
class _Bucket:
    grad: torch.Tensor  # a contiguous range of one flat gradient buffer
    params: list[tuple[torch.nn.Parameter, torch.Tensor]] = field(default_factory=list)  # (parameter, grad view)


class DataParallel:
    """Average the flat gradients over a process group, overlapping backward.

    Use::

        optimizer = FusedAdamW(model.parameters(), max_grad_norm=1.0)
        ddp = DataParallel(optimizer)  # after the optimizer built its flat buffers
        for step in ...:
            optimizer.zero_grad()
            for micro in range(accumulation):
                with ddp.no_sync() if micro < accumulation - 1 else contextlib.nullcontext():
                    loss_scaler.scale(loss(micro) / accumulation).backward()
            ddp.finish()  # optional before a FlatOptimizer's step(), which calls it
            loss_scaler.step(optimizer); loss_scaler.update()

    Gradients are divided by the world size before the sum (as DDP's default hook), so that
    an fp16 sum stays in range. Under :meth:`no_sync` backward only accumulates locally; the
    last micro-batch's backward (outside it) launches the buckets. A parameter that no
    backward gave a gradient on this rank (unused in the forward, or its ``.grad`` None
    after ``zero_grad(set_to_none=True)``) keeps its bucket from completing during
    backward; :meth:`finish` launches that bucket and the ones after it, with zero for the
    missing gradients, so every rank sums the same ranges in the same order. After
    :meth:`finish` every parameter of the flat buffers has its ``.grad`` (its view) and
    takes the step on every rank: the averaged gradient, zero where no rank had one, as
    ``zero_grad(set_to_none=False)`` does in one process.

    Args:
        target: a :class:`~lstrain.optim.base.FlatOptimizer` (FusedAdamW, FusedSGD), whose
            ``step()`` then calls :meth:`finish` if it was not called, or a
            :class:`~lstrain.optim.FlatParameters` (for another optimizer over the flat
            buffers: call :meth:`finish` before its step).
        process_group: the ``torch.distributed`` group (default: the world).
        bucket_mib: the bucket size cap in MiB (DDP's 25 by default); a parameter larger
            than the cap gets a bucket of its own.
        broadcast_from: the rank of the group whose parameters every rank starts from (one
            broadcast per flat buffer, as DDP does when it is built), or None.

    Raises:
        TypeError: ``target`` is neither, or is a :class:`~lstrain.optim.ZeroAdamW` (which
            reduce-scatters its gradients itself).
        ValueError: ``bucket_mib`` <= 0, or parameters on a device the group cannot reduce.
        RuntimeError: torch.distributed is not initialized, or ``target`` has no flat
            gradient buffers (``flat_grads=False``).
    """

    def __init__(self, target, process_group=None, bucket_mib: float = 25.0, broadcast_from: int | None = 0) -> None:
        from lstrain.optim.zero import ZeroAdamW

        if isinstance(target, ZeroAdamW):
            raise TypeError("DataParallel: a ZeroAdamW reduce-scatters its own gradients; step it without DataParallel")
        if isinstance(target, FlatOptimizer):
            self.optimizer: FlatOptimizer | None = target
            flat = target.flat
        elif isinstance(target, FlatParameters):
            self.optimizer, flat = None, target
        else:
            kind = type(target).__name__
            raise TypeError(f"DataParallel: target must be a FlatOptimizer or FlatParameters, got {kind}")
        if not (isinstance(bucket_mib, (int, float)) and bucket_mib > 0):
            raise ValueError(f"DataParallel: bucket_mib must be > 0, got {bucket_mib!r}")
        flat.require_grad_buffers("DataParallel (its buckets are slices of them)")
        self.process_group = process_group
        self.world_size = check_process_group("DataParallel", flat.device, process_group)
        self.bucket_bytes = int(bucket_mib * 2**20)
        self.overlapped = 0  # buckets of the last reduction launched during backward (the rest by finish())
        self._sync = True
        self._finished = False
        self._hooks: list = []
        self._build(flat)
        if broadcast_from is not None:
            broadcast_flat(flat, broadcast_from, process_group)
            if self.optimizer is not None:
                self.optimizer.reseed_masters()
        if self.optimizer is not None:
            self._hooks.append(self.optimizer.register_step_pre_hook(self._before_step))
            self._hooks.append(self.optimizer.register_step_post_hook(self._after_step))

    @property
    def num_buckets(self) -> int:
        """How many buckets (all-reduces) one reduction launches."""
        return len(self._buckets)

    def _current_flat(self) -> FlatParameters:
        return self.optimizer.flat if self.optimizer is not None else self._flat

    def _build(self, flat: FlatParameters) -> None:
        """Buckets over ``flat`` (the last parameters first) and a gradient hook per parameter."""
        for handle in getattr(self, "_param_hooks", []):
            handle.remove()
        self._flat = flat
        self._buckets: list[_Bucket] = []
        for buffer in flat.buffers:
            end, start, params = buffer.grad.numel(), 0, []
            size = buffer.grad.element_size()
            for p, view, offset in reversed(list(zip(buffer.params, buffer.grad_views, buffer.offsets, strict=True))):
                if params and (end - offset) * size > self.bucket_bytes:
                    self._buckets.append(_Bucket(buffer.grad[start:end], params))
                    end, params = start, []
                params.append((p, view))
                start = offset
            if params:
                self._buckets.append(_Bucket(buffer.grad[start:end], params))
        self._param_hooks = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, index))
            for index, bucket in enumerate(self._buckets)
            for p, _ in bucket.params
        ]
        self._reset()

    def _reset(self) -> None:
        self._pending = [len(bucket.params) for bucket in self._buckets]
        self._fired: set[int] = set()
        self._next = 0
        self._works: list = []

    def _on_grad(self, index: int, p: torch.nn.Parameter) -> None:
        self._finished = False
        if not self._sync or self._current_flat() is not self._flat:
            return  # accumulating locally; or the buffers were rebuilt: finish() reduces them all
        if id(p) in self._fired:
            raise RuntimeError(
                "DataParallel: a parameter got a second gradient since its bucket was reduced: run every "
                "backward of a step but the last under no_sync(), and call finish() / step() before the next"
            )
        if not self._fired:
            self.overlapped = 0  # the first gradient of a reduction
        self._fired.add(id(p))
        self._pending[index] -= 1
        while self._next < len(self._buckets) and self._pending[self._next] == 0:
            self._launch()
            self.overlapped += 1

    def _launch(self) -> None:
        bucket = self._buckets[self._next]
        with torch.no_grad():
            strays = []  # autograd made new tensors: copied into the flat buffer
            for p, view in bucket.params:
                grad = p.grad
                if grad is None:
                    view.zero_()  # no gradient on this rank: it adds zero (the view may hold an old one)
                    p.grad = view
                elif grad is not view:
                    strays.append((p, view))
            adopt_grads(strays)
            bucket.grad.div_(self.world_size)
        self._works.append(dist.all_reduce(bucket.grad, group=self.process_group, async_op=True))
        self._next += 1

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside accumulates into the flat buffers without reducing (all micro-batches
        of a step but the last, as DDP's ``no_sync``)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def finish(self) -> None:
        """Launch the buckets backward did not complete, in order, and wait for all of them
        (on CUDA the wait orders the current stream after NCCL's: no host sync). Every rank
        then holds the average gradients. Calling it again before the next backward does
        nothing.

        Raises:
            RuntimeError: a parameter that was frozen when the optimizer was built has a
                gradient now (its optimizer would rebuild its buffers in ``step()``, after
                the reduction): build the optimizer with it trainable.
        """
        if self._finished:
            return
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    if p.requires_grad and p.grad is not None and id(p) not in self.optimizer._where:
                        raise RuntimeError(
                            "DataParallel.finish: a parameter that was frozen when the optimizer was built has a "
                            "gradient now; its gradient would not be reduced: build the optimizer (and "
                            "DataParallel) with it trainable"
                        )
        flat = self._current_flat()
        if flat is not self._flat:  # add_param_group rebuilt the buffers: new buckets, all reduced here
            for work in self._works:
                work.wait()
            self._build(flat)
        if self._next == 0:
            self.overlapped = 0
        while self._next < len(self._buckets):
            self._launch()
        for work in self._works:
            work.wait()
        self._reset()
        self._finished = True

    def _before_step(self, optimizer, args, kwargs) -> None:
        self.finish()

    def _after_step(self, optimizer, args, kwargs) -> None:
        self._finished = False  # the next step reduces again, even without a backward in between

    def remove(self) -> None:
        """Remove the gradient and step hooks (the parameters stay in the flat buffers)."""
        for handle in [*self._param_hooks, *self._hooks]:
            handle.remove()
        self._param_hooks, self._hooks = [], []
