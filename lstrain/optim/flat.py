"""Contiguous parameter and gradient buffers.

:class:`FlatParameters` moves every parameter of a model into one flat buffer per dtype
(``p.data`` becomes a view into it) and gives each parameter a ``.grad`` that is a view
into a matching flat gradient buffer, so backward accumulates straight into it. Each
parameter's place in the gradient buffer is registered with :mod:`lstrain._grad_slots`:
after ``zero_grad(set_to_none=True)``, lstrain's backwards write parameter gradients
there directly and autograd makes those writes the ``.grad`` (no copy, no add). Each
parameter starts at a block boundary (``BLOCK`` elements), so that one kernel can update
a dtype's buffer in one launch whatever the number of tensors, and each program reads its
parameter's group, step count and "has a gradient" flag as scalars. The padding costs at
most ``BLOCK - 1`` elements per tensor (under 1M elements for a thousand tensors).

Built with ``grads=False``, there is no gradient buffer: each ``.grad`` stays autograd's
own tensor, allocated as backward makes it and freed with it, and the optimizers read it
where it lies (:class:`lstrain.optim.base.GradTable`). Training's memory peak is usually
at the start of backward, when every activation is saved: a gradient buffer allocated for
good adds its whole size there (1.4 GiB for a 0.75B-parameter bf16 model), gradients made
as backward frees activations add little.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from lstrain import _grad_slots

__all__ = ["FlatBuffer", "FlatParameters", "adopt_grads"]

BLOCK = 1024  # every parameter starts at a block boundary: one block, one parameter


def adopt_grads(pairs: Sequence[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
    """Copy each parameter's ``.grad`` (a tensor autograd made, after ``zero_grad(set_to_none=
    True)``) into its flat view and make the view its ``.grad`` again: one multi-tensor copy
    (torch's fast path takes tensors of one dtype: give one flat buffer's at a time), not a
    launch per parameter.

    A ``.grad`` that already lies in its view's memory (a backward wrote it there through
    :mod:`lstrain._grad_slots`) is not copied: the view just becomes the ``.grad`` again.

    Args:
        pairs: ``(parameter, its view into the flat gradient buffer)``; each ``.grad`` is a
            tensor other than the view.
    """
    copies = [(p, view) for p, view in pairs if not _same_memory(p.grad, view)]
    if copies:
        torch._foreach_copy_([view for _, view in copies], [p.grad for p, _ in copies])
    for p, view in pairs:
        p.grad = view


def _same_memory(grad: torch.Tensor, view: torch.Tensor) -> bool:
    return (
        grad.data_ptr() == view.data_ptr()
        and grad.dtype == view.dtype
        and grad.shape == view.shape
        and grad.stride() == view.stride()
    )


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass
class FlatBuffer:
    """One dtype's parameters: flat data and grad, and where each parameter lies.

    ``block_group[b]`` and ``block_slot[b]`` are the group index and the parameter index
    (its slot in ``params``) of block ``b`` (``BLOCK`` elements), ``slot_group[i]`` the
    group index of parameter ``i``; padding elements are
    zero in both buffers and stay zero under every update. ``grad_views[i]`` is the view
    that parameter ``i``'s ``.grad`` is while attached, ``data_ptrs[i]`` where its data
    lies in ``data``. Without a gradient buffer (``grads=False``) ``grad`` is None and
    ``grad_views`` empty.
    """

    dtype: torch.dtype
    data: torch.Tensor
    grad: torch.Tensor | None
    params: list[torch.nn.Parameter]
    offsets: list[int]
    block_group: torch.Tensor
    block_slot: torch.Tensor
    slot_group: torch.Tensor
    grad_views: list[torch.Tensor]
    data_ptrs: list[int]


class FlatParameters:
    """Re-point parameters into flat per-dtype buffers (model behaviour is unchanged).

    A parameter's current values and gradient (if any) are copied in; a parameter without
    a gradient gets a zero one. A non-contiguous parameter becomes contiguous.

    Args:
        groups: parameter groups, each a sequence of parameters (all on one device).
        pad_to: each buffer's length is rounded up to a multiple of this (a multiple of
            ``BLOCK``), so that it splits into equal block-aligned shards (ZeRO-1: ``world
            size * BLOCK``); the padding blocks belong to the buffer's last parameter and,
            like all padding, stay zero.
        grads: True (default): a flat gradient buffer beside each parameter buffer, whose
            views become the ``.grad``; False: none (the ``.grad`` are left as they are:
            the module docstring says when that saves memory).

    Raises:
        ValueError: parameters on more than one device, a parameter in two groups, a
            non-floating-point parameter, or ``pad_to`` not a positive multiple of ``BLOCK``.
    """

    def __init__(
        self, groups: Sequence[Sequence[torch.nn.Parameter]], *, pad_to: int = BLOCK, grads: bool = True
    ) -> None:
        if not (isinstance(pad_to, int) and pad_to > 0 and pad_to % BLOCK == 0):
            raise ValueError(f"FlatParameters: pad_to must be a positive multiple of {BLOCK}, got {pad_to!r}")
        self.pad_to = pad_to
        self.grads = grads
        params = [p for group in groups for p in group]
        if len({id(p) for p in params}) != len(params):
            raise ValueError("FlatParameters: a parameter appears twice")
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"FlatParameters: parameters are on several devices: {sorted(map(str, devices))}")
        for p in params:
            if not p.is_floating_point():
                raise ValueError(f"FlatParameters: parameter of dtype {p.dtype} is not floating point")
        self.device = next(iter(devices)) if devices else torch.device("cpu")
        self.grad_places = _grad_slots.Places()
        self.buffers: list[FlatBuffer] = []
        for dtype in sorted({p.dtype for p in params}, key=str):
            self.buffers.append(self._build(groups, dtype))

    def _build(self, groups, dtype) -> FlatBuffer:
        layout, size = [], 0
        for index, group in enumerate(groups):
            for p in group:
                if p.dtype == dtype:
                    layout.append((p, size, index))
                    size = _round_up(size + p.numel(), BLOCK)
        padding = _round_up(size, self.pad_to) - size
        size += padding
        data = torch.zeros(size, dtype=dtype, device=self.device)
        grad = torch.zeros(size, dtype=dtype, device=self.device) if self.grads else None
        # Built with device ops, not Python lists: a 2**31-element buffer has 2M blocks.
        blocks = torch.tensor([_round_up(p.numel(), BLOCK) // BLOCK for p, _, _ in layout], dtype=torch.int64)
        if layout:
            blocks[-1] += padding // BLOCK
        block_slot = torch.repeat_interleave(torch.arange(len(layout), dtype=torch.int32), blocks)
        slot_group = torch.tensor([g for _, _, g in layout], dtype=torch.int32)
        block_group = slot_group[block_slot.long()]
        grad_views = []
        with torch.no_grad():
            for p, offset, _ in layout:
                view = data[offset : offset + p.numel()].view(p.shape)
                view.copy_(p)
                p.data = view
                if grad is None:
                    continue
                grad_view = grad[offset : offset + p.numel()].view(p.shape)
                if p.grad is not None:
                    grad_view.copy_(p.grad)
                p.grad = grad_view
                grad_views.append(grad_view)
                self.grad_places.register(p, grad, offset)
        return FlatBuffer(
            dtype,
            data,
            grad,
            [p for p, _, _ in layout],
            [o for _, o, _ in layout],
            block_group.to(self.device),
            block_slot.to(self.device),
            slot_group.to(self.device),
            grad_views,
            [p.data_ptr() for p, _, _ in layout],
        )

    def require_grad_buffers(self, what: str) -> None:
        """Refuse ``what`` (a method that reads the flat gradient buffers) without them.

        Raises:
            RuntimeError: built with ``grads=False``.
        """
        if not self.grads:
            raise RuntimeError(
                f"{what} reads the flat gradient buffers, and these FlatParameters have none (grads=False, an "
                "optimizer's flat_grads=False): build them with grads=True"
            )

    def zero_grad(self) -> None:
        """Zero every flat gradient buffer in place (the ``.grad`` views stay attached).

        Raises:
            RuntimeError: built with ``grads=False``.
        """
        self.require_grad_buffers("FlatParameters.zero_grad")
        for buffer in self.buffers:
            buffer.grad.zero_()

    def reopen_grad_slots(self) -> None:
        """Let the next backward write gradients of parameters whose ``.grad`` is None
        straight into the buffers again (:mod:`lstrain._grad_slots`); the optimizers call it
        in ``zero_grad`` and ``step``."""
        self.grad_places.reopen()

    def attach_grads(self) -> None:
        """Copy each gradient that autograd put in a new tensor (after ``model.zero_grad()``
        or ``p.grad = None``) into the flat buffer and make ``.grad`` its view again; a
        ``.grad`` that is None stays None.

        Raises:
            RuntimeError: built with ``grads=False``.
        """
        self.require_grad_buffers("FlatParameters.attach_grads")
        for buffer in self.buffers:  # one copy per buffer: one dtype, torch's multi-tensor fast path
            adopt_grads(
                [
                    (p, view)
                    for p, view in zip(buffer.params, buffer.grad_views, strict=True)
                    if p.grad is not view and p.grad is not None
                ]
            )

    def check_attached(self) -> None:
        """Raise if a parameter's ``.grad`` no longer is its view into the flat buffer (e.g.
        after ``model.zero_grad()``). The optimizers re-attach by themselves in ``step()``;
        this is for code that reads the flat buffers directly (``all_reduce_grads``).

        Raises:
            RuntimeError: a ``.grad`` was replaced or set to None, or no gradient buffers
                (``grads=False``).
        """
        self.require_grad_buffers("FlatParameters.check_attached")
        for buffer in self.buffers:
            for p, view in zip(buffer.params, buffer.grad_views, strict=True):
                if p.grad is not view:
                    raise RuntimeError(
                        "FlatParameters: a parameter's .grad was replaced or set to None "
                        "(model.zero_grad()?); the flat buffer does not hold its gradient: use the optimizer's "
                        "zero_grad(), which zeroes the flat buffers in place"
                    )

    def all_reduce_grads(self, group=None) -> None:
        """Average the gradients over a process group: one all-reduce per flat buffer,
        whatever the number of tensors (for data parallelism without DDP's own buckets).

        Args:
            group: the ``torch.distributed`` process group (default: the world).

        Gradients that autograd put in new tensors are copied in first (:meth:`attach_grads`).

        Raises:
            RuntimeError: built with ``grads=False``.
        """
        import torch.distributed as dist

        self.attach_grads()
        world = dist.get_world_size(group)
        for buffer in self.buffers:
            dist.all_reduce(buffer.grad, group=group)
            buffer.grad.div_(world)

    def parameters(self) -> Iterable[torch.nn.Parameter]:
        """The parameters, each a view into its flat buffer, in buffer order."""
        for buffer in self.buffers:
            yield from buffer.params
