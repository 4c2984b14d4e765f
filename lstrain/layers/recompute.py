"""Norm outputs saved for backward as a way to make them again, not as tensors.

A pre-norm layer's RMSNorm output feeds a projection, which saves it for its weight
gradient: one [tokens, D] tensor per norm, kept from forward to backward (0.78 GiB of
LLaMA-0.75B's 4 x 2048 step). The norm's own backward already keeps its input and the
kernel that made the output is cheap (one read, one write), so inside
:class:`RecomputedNorms` a saved tensor that is a registered norm output is packed as its
recipe and made again, with the same bits, when backward unpacks it. So is a dtype cast of
one (fp32 weights under ``torch.autocast``: the projections save autocast's bf16 copy of
the fp32 output), made again as the output cast again.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch

from lstrain.ops import rms_norm

__all__ = ["RecomputedNorms", "register_norm_output", "remake_rms_norm"]

_active = threading.local()


def _check_version(tensor: torch.Tensor | None, version: int) -> None:
    """Autograd's own check, which it skips for tensors that saved-tensor hooks packed."""
    if tensor is not None and tensor._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{tensor.type()} {list(tensor.shape)}] is at version {tensor._version}; expected version {version} "
            "instead (saved inside lstrain's RecomputedNorms)"
        )


class _Kept:
    """A tensor saved as it is, with its version when saved. Held detached (the same memory
    and version counter; autograd gives the unpacked tensor its node back): a node's own
    output held with its node would be a reference cycle through C++, which the garbage
    collector cannot free when the graph is dropped without a backward."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.version = tensor.detach(), tensor._version

    def unpack(self) -> torch.Tensor:
        _check_version(self.tensor, self.version)
        return self.tensor


class _Recipe:
    """A saved norm output (or a cast of it): the function that makes the whole tensor again,
    the view of it that was saved, and the whole tensor, weakly, with its version then (one
    changed in place afterwards fails backward, as autograd's check would)."""

    __slots__ = ("make", "offset", "shape", "stride", "version", "whole")

    def __init__(self, make: Callable[[], torch.Tensor], saved: torch.Tensor, whole: torch.Tensor) -> None:
        self.make = make
        self.shape, self.stride, self.offset = saved.shape, saved.stride(), saved.storage_offset()
        self.whole, self.version = weakref.ref(whole), whole._version

    def unpack(self) -> torch.Tensor:
        _check_version(self.whole(), self.version)
        return self.make().as_strided(self.shape, self.stride, self.offset)


class RecomputedNorms:
    """Context in which saved tensors that are (views of) registered norm outputs are saved
    as recipes: ``make()`` runs again in backward, wherever autograd unpacks one.

    A registered output is matched by its memory while it is alive and unchanged (held
    weakly: once it is freed, a tensor that takes its memory is not mistaken for it; once
    changed in place, it is saved as it is); (a view of) a whole dtype cast of it
    (``.to(dtype)``, as autocast casts a matmul's input) by the cast's autograd node, whose
    input is the output's. ``make`` must return a new contiguous tensor equal to the output
    (as the norm's forward kernel run again on the norm's saved input does), and hold only
    tensors that backward keeps anyway. A tensor saved in the context and changed in place
    before backward fails backward, as it would without the context (autograd skips its own
    check for tensors that hooks pack).

    Nothing is repacked, and no hooks are installed, without grad mode, under
    ``torch.compile`` (Inductor's partitioner decides what to recompute) or when not
    ``enabled``, and inside other saved-tensor hooks (activation checkpointing's, or
    offloading's), which own what is saved there: only another :class:`RecomputedNorms`
    may be nested in.

    Args:
        enabled: False makes the context and :meth:`register` do nothing.

    Example::

        with RecomputedNorms() as norms:
            normed = norms.register(rms_norm(h, (d,), w), lambda: rms_norm(h, (d,), w))
            y = normed @ weight  # saves a recipe, not normed
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        # storage address -> (the output, weakly; its version when registered; make)
        self._makers: dict[int, tuple[weakref.ref, int, Callable[[], torch.Tensor]]] = {}
        # id of the output's autograd node -> (the node, the output's storage address): casts
        # are found by it. Held, so that the node's Python object, and with it the id, lasts.
        self._nodes: dict[int, tuple[object, int]] = {}
        self._hooks = None

    def register(self, output: torch.Tensor, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Mark ``output`` (contiguous) as made again by ``make`` when saved; returns it.

        An output changed in place afterwards (its version moved) is saved as it is, and so
        is anything but a plain strided, non-empty tensor."""
        if self._hooks is not None and _plain(output):
            address = output.untyped_storage().data_ptr()
            self._makers[address] = (weakref.ref(output), output._version, make)
            if (node := output.grad_fn) is not None:
                self._nodes[id(node)] = (node, address)
        return output

    @staticmethod
    def _pack(saved: torch.Tensor):
        if not _plain(saved):
            return _Kept(saved)
        address = saved.untyped_storage().data_ptr()
        # the innermost context's hooks pack for the outer ones too
        for context in reversed(_active.stack):
            entry = context._makers.get(address)
            output = None if entry is None else entry[0]()
            if output is None:
                continue
            same = output.dtype == saved.dtype and output.device == saved.device
            if same and output._version == entry[1] == saved._version:
                return _Recipe(entry[2], saved, output)
            return _Kept(saved)
        return RecomputedNorms._pack_cast(saved)

    @staticmethod
    def _pack_cast(saved: torch.Tensor):
        """``saved`` as a recipe if it is (a view of) a whole, unchanged dtype cast of a
        registered output (``F.linear`` saves a [tokens, D] view of autocast's cast)."""
        cast = saved._base if saved._is_view() else saved
        node = cast.grad_fn
        # a view that changes the dtype (view_as_complex) is not the cast's bits
        if (
            type(node).__name__ != "ToCopyBackward0"
            or saved.dtype != cast.dtype
            or cast._version
            or cast.storage_offset()
        ):
            return _Kept(saved)
        source, output_nr = node.next_functions[0]
        for context in reversed(_active.stack):
            node, address = context._nodes.get(id(source), (None, None))
            entry = None if node is not source else context._makers.get(address)
            output = None if entry is None else entry[0]()
            if output is None or output.output_nr != output_nr:
                continue
            # the output as registered: its memory (not replaced through .data) and version
            same = output.untyped_storage().data_ptr() == address and output._version == entry[1]
            whole = output.shape == cast.shape and output.device == cast.device and cast.is_contiguous()
            if same and whole:
                return _Recipe(lambda make=entry[2], dtype=cast.dtype: make().to(dtype), saved, cast)
            return _Kept(saved)
        return _Kept(saved)

    @staticmethod
    def _unpack(packed):
        return packed.unpack()

    def __enter__(self) -> RecomputedNorms:
        if self.enabled and torch.is_grad_enabled() and not torch.compiler.is_compiling() and _free_to_hook():
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()
            _active.__dict__.setdefault("stack", []).append(self)
        return self

    def __exit__(self, *exc) -> None:
        if self._hooks is not None:
            _active.stack.pop()
            self._hooks.__exit__(*exc)
            self._hooks = None
        self._makers.clear()
        self._nodes.clear()


def _plain(t: torch.Tensor) -> bool:
    """A tensor with an ordinary storage worth matching: not a subclass (DTensor, float8
    wrappers), sparse, meta or empty (every empty tensor shares the address 0)."""
    return type(t) is torch.Tensor and t.layout is torch.strided and t.device.type != "meta" and t.numel() > 0


def _free_to_hook() -> bool:
    """No saved-tensor hooks are active, or only a RecomputedNorms' own."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top is None or top[0] is RecomputedNorms._pack


def register_norm_output(output: torch.Tensor, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """:meth:`RecomputedNorms.register` on the innermost active context of this thread, if
    any (a norm module whose callers may or may not recompute); returns ``output``.

    Args:
        output: the norm's output (contiguous).
        make: makes it again (see :class:`RecomputedNorms`).

    Returns:
        ``output``.
    """
    if torch.compiler.is_compiling():
        return output
    stack = _active.__dict__.get("stack")
    return stack[-1].register(output, make) if stack else output


def remake_rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A ``make`` for :meth:`RecomputedNorms.register`: ``norm``'s output made again from its
    input ``x`` with the weight it has now (an offload hook may take it away after the
    forward), through the same kernel, so with the same bits.

    Args:
        norm: an RMSNorm (``torch.nn.RMSNorm`` or ``lstrain.nn.RMSNorm``).
        x: the input it normalised (the residual stream, which its backward keeps anyway).

    Returns:
        A function of no arguments returning a new tensor equal to ``norm(x)``.
    """
    weight = None if norm.weight is None else norm.weight.detach()
    return lambda: rms_norm(x.detach(), norm.normalized_shape, weight, norm.eps)
