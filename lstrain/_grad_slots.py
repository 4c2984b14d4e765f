"""Places in flat gradient buffers that a backward may write a parameter's gradient into.

An optimizer over flat gradient buffers (:class:`lstrain.optim.FlatParameters`) registers
where each parameter's gradient lives; a backward that computes a parameter's gradient (a
weight's GEMM, ``lstrain.ops._lib.layout.matmul_like``; a bias's or a norm's column sum, an
embedding table's rows, ``grad_place``) takes that place and writes the gradient there
instead of into a new tensor. autograd's AccumulateGrad makes a gradient nobody
else holds the parameter's ``.grad`` as it is, so after ``zero_grad(set_to_none=True)``
the flat buffer receives the gradient with neither a copy nor the add into a zeroed buffer
that ``set_to_none=False`` costs (GPT-2 medium: 292 adds and a fill per step).

A place is handed out only while the parameter's ``.grad`` is None and the backward
accumulates into it (not to ``torch.autograd.grad``'s caller), once until the
optimizer reopens its :class:`Places` (its ``zero_grad`` and ``step``: one counter, no walk
over the parameters), with grad mode off (no double
backward) and never while torch.compile traces: a second contribution to one parameter
in a backward (a tied weight) is a new tensor, which autograd adds to the first.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["Places", "take"]


class Places:
    """The places of one set of flat gradient buffers (one :class:`FlatParameters`)."""

    def __init__(self) -> None:
        self.generation = 0  # a place taken in an older generation is open again

    def register(self, param: torch.nn.Parameter, buffer: torch.Tensor, offset: int) -> None:
        """Make ``buffer[offset : offset + param.numel()]`` the place of ``param``'s gradient
        (replacing an earlier registration, this group's or another's).

        Args:
            param: the parameter (contiguous).
            buffer: a flat (1-D, contiguous) gradient buffer of the parameter's dtype and device.
            offset: where the parameter's gradient starts in it.
        """
        _places[param] = _Place(self, weakref.ref(buffer), offset)

    def reopen(self) -> None:
        """Let the next backward take every place of this group again."""
        self.generation += 1


@dataclass(eq=False)
class _Place:
    group: Places
    buffer: weakref.ref  # weakly: the optimizer (or a .grad view) keeps it alive
    offset: int
    taken: int = -1  # the group's generation in which a backward took it


# parameter -> its place
_places: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _parameter_of(like: torch.Tensor) -> torch.Tensor | None:
    """The registered parameter ``like`` is (or a ``.t()`` view of). Under saved-tensor
    hooks a backward gets a new tensor object for a saved parameter (or view), whose
    gradient edge still leads to the parameter's own AccumulateGrad node, directly or
    through the view's node (another leaf over the same memory, a
    ``detach().requires_grad_()`` alias, does not)."""
    base = like if like._base is None else like._base
    if base in _places:
        return base
    if not base.requires_grad:
        return None
    node = torch.autograd.graph.get_gradient_edge(base).node
    if not hasattr(node, "variable") and len(node.next_functions) == 1:
        node = node.next_functions[0][0]  # a saved view of the parameter (w.t()): one step up
    param = getattr(node, "variable", None)
    return param if param is not None and param in _places else None


def take(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The place of the gradient of ``like`` (a registered parameter, or a ``.t()`` view of
    one), as a new tensor of ``like``'s shape and strides, or None (use a new tensor).

    Args:
        like: the tensor the gradient is for, as the backward received it.
        dtype: the gradient's dtype.

    Returns:
        A view of the flat buffer to write the gradient into and return, or None: nothing
        is registered for it, its ``.grad`` is set, its place is taken, the backward is
        not accumulating into ``.grad`` (``torch.autograd.grad``), grad mode is on,
        torch.compile is tracing, or the dtype or layout differs.
    """
    if torch.compiler.is_compiling():  # first: dynamo traces no further (not into the registry)
        return None
    if not _places or torch.is_grad_enabled():
        return None
    param = _parameter_of(like)
    place = None if param is None else _places.get(param)
    if place is None or param.grad is not None or place.taken == place.group.generation:
        return None
    # only a gradient bound for .grad: torch.autograd.grad returns its gradients to the
    # caller, who may keep them past the next backward, which writes over the place
    try:
        if not torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(param).node):
            return None
    except RuntimeError:  # torch raises it for a leaf's node under torch.autograd.grad
        return None
    buffer = place.buffer()
    if buffer is None or buffer.dtype != dtype:
        return None
    slot = buffer[place.offset : place.offset + param.numel()].view(param.shape)
    if like.shape == slot.shape and like.stride() == slot.stride():
        view = slot
    elif like.dim() == 2 and like.shape == slot.t().shape and like.stride() == slot.t().stride():
        view = slot.t()
    else:
        return None
    place.taken = place.group.generation
    return view
