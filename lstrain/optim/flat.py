"""Contiguous parameter and gradient buffers.

:class:`FlatParameters` moves every parameter of a model into one flat buffer per dtype
(``p.data`` becomes a view into it) and gives each parameter a ``.grad`` that is a view
into a matching flat gradient buffer, so backward accumulates straight into it. Each
parameter starts at an aligned offset, and parameters of one optimizer group are
contiguous and padded to whole blocks, so that one kernel can update a dtype's buffer
in one launch whatever the number of tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["FlatBuffer", "FlatParameters"]

ALIGNMENT = 16  # elements: 32-64 bytes, enough for 16-byte vector access of any float dtype
BLOCK = 1024  # a group's segment is padded to whole blocks: one block, one group


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass
class FlatBuffer:
    """One dtype's parameters: flat data and grad, and where each parameter and group lies.

    ``block_group[b]`` is the group index of block ``b`` (``BLOCK`` elements); padding
    elements are zero in both buffers and stay zero under every update.
    """

    dtype: torch.dtype
    data: torch.Tensor
    grad: torch.Tensor
    params: list[torch.nn.Parameter]
    offsets: list[int]
    block_group: torch.Tensor


class FlatParameters:
    """Re-point parameters into flat per-dtype buffers (model behaviour is unchanged).

    Args:
        groups: parameter groups, each a sequence of parameters (all on one device).

    Raises:
        ValueError: parameters on more than one device, a parameter in two groups, or a
            non-floating-point parameter.
    """

    def __init__(self, groups: Sequence[Sequence[torch.nn.Parameter]]) -> None:
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
        self.buffers: list[FlatBuffer] = []
        for dtype in sorted({p.dtype for p in params}, key=str):
            self.buffers.append(self._build(groups, dtype))

    def _build(self, groups, dtype) -> FlatBuffer:
        layout, block_group, size = [], [], 0
        for index, group in enumerate(groups):
            start = size
            for p in group:
                if p.dtype == dtype:
                    layout.append((p, size))
                    size = _round_up(size + p.numel(), ALIGNMENT)
            size = _round_up(size, BLOCK)
            block_group += [index] * ((size - start) // BLOCK)
        data = torch.zeros(size, dtype=dtype, device=self.device)
        grad = torch.zeros(size, dtype=dtype, device=self.device)
        with torch.no_grad():
            for p, offset in layout:
                view = data[offset : offset + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view
                p.grad = grad[offset : offset + p.numel()].view_as(p)
        return FlatBuffer(
            dtype,
            data,
            grad,
            [p for p, _ in layout],
            [o for _, o in layout],
            torch.tensor(block_group, dtype=torch.int32, device=self.device),
        )

    def zero_grad(self) -> None:
        """Zero every flat gradient buffer in place (the ``.grad`` views stay attached)."""
        for buffer in self.buffers:
            buffer.grad.zero_()

    def check_attached(self) -> None:
        """Raise if a parameter's ``.grad`` no longer points into its flat buffer (e.g. after
        ``zero_grad(set_to_none=True)``), which would make a step read stale gradients."""
        for buffer in self.buffers:
            base = buffer.grad.data_ptr()
            element = buffer.grad.element_size()
            for p, offset in zip(buffer.params, buffer.offsets, strict=True):
                if p.grad is None or p.grad.data_ptr() != base + offset * element:
                    raise RuntimeError(
                        "FlatParameters: a parameter's .grad was replaced or set to None "
                        "(zero_grad(set_to_none=True)?); use the optimizer's zero_grad(), which zeroes the "
                        "flat buffers in place"
                    )

    def all_reduce_grads(self, group=None) -> None:
        """Average the gradients over a process group: one all-reduce per flat buffer,
        whatever the number of tensors (for data parallelism without DDP's own buckets).

        Args:
            group: the ``torch.distributed`` process group (default: the world).
        """
        import torch.distributed as dist

        world = dist.get_world_size(group)
        for buffer in self.buffers:
            dist.all_reduce(buffer.grad, group=group)
            buffer.grad.div_(world)

    def parameters(self) -> Iterable[torch.nn.Parameter]:
        """The parameters, each a view into its flat buffer, in buffer order."""
        for buffer in self.buffers:
            yield from buffer.params
