"""One way to declare a kernel launcher as a ``torch.library`` custom op.

Under ``torch.compile`` a launcher must be an opaque custom op (the tracer cannot follow
Triton launches, and the op's fake kernel gives Inductor its outputs' shapes); in eager
mode the dispatcher costs host time for nothing, so the launcher is called directly.

Each op also gets an explicit Inductor fallback lowering, the one Inductor would create
implicitly. Without it, Inductor (torch 2.11) formats the op's IR arguments with their
recursive ``__str__`` for a log line at every call site, whatever the log level; in a deep
model that formatting dominated compile time (see docs/notes/compile.md).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence

import torch

__all__ = ["kernel_op"]


def kernel_op(name: str, launcher: Callable, *, mutates_args: Sequence[str] = ()) -> Callable[[Callable], Callable]:
    """Decorator that registers ``launcher`` as the custom op ``lstrain::<name>``.

    The decorated function describes the op: its annotated signature is the op's schema
    (the launcher takes the same leading positional arguments) and its body is the fake
    kernel, which returns empty tensors of the outputs' shapes, dtypes and devices. The
    decorator returns the callable the op's autograd Function uses: the launcher itself
    in eager mode, the registered custom op while ``torch.compile`` traces. Its keyword
    ``into`` goes to the launcher only: tensors (or None) to write parameter gradients
    into (:func:`lstrain.ops._lib.layout.grad_place`), all None while tracing.

    Example::

        @kernel_op("scale_fwd", scale_fwd)
        def scale_fwd_op(x: torch.Tensor, factor: float) -> torch.Tensor:
            return torch.empty_like(x)

    Args:
        name: the op's name in the ``lstrain`` namespace.
        launcher: the function that validates, allocates and launches the kernels.
        mutates_args: names of the arguments the launcher writes in place.

    Returns:
        A decorator taking the fake function and returning the dispatching callable.

    Raises:
        ValueError: from ``torch.library`` when the signature has a type a schema cannot
            hold, or when ``lstrain::<name>`` is already registered.
    """

    def register(fake: Callable) -> Callable:
        schema = torch.library.infer_schema(fake, mutates_args=mutates_args)
        op = torch.library.custom_op(f"lstrain::{name}", launcher, mutates_args=mutates_args, schema=schema)

        @functools.wraps(fake)
        def fake_and_lowering(*args, **kwargs):
            # Fake kernels run only while torch.compile traces, and Inductor imports its
            # lowerings before it traces the joint graph: the lowering is in place before
            # Inductor lowers the graph, and eager mode and other backends never import it.
            if "torch._inductor.lowering" in sys.modules:
                _declare_inductor_fallback(op._opoverload)
            return fake(*args, **kwargs)

        op.register_fake(fake_and_lowering)

        def call(*args, into: Sequence[torch.Tensor | None] = ()):
            # ``into``: places for outputs (parameters' gradients in their flat buffers,
            # lstrain._grad_slots), which only the eager launcher can be handed
            if torch.compiler.is_compiling():
                if any(t is not None for t in into):
                    raise RuntimeError(f"lstrain::{name}: output places are for eager calls only")
                return op(*args)
            return launcher(*args, into=into) if into else launcher(*args)

        call.__name__ = call.__qualname__ = fake.__name__
        call.__doc__ = f"``{launcher.__name__}`` in eager mode, the custom op ``lstrain::{name}`` under torch.compile."
        call.op = op
        return call

    return register


@functools.cache
def _declare_inductor_fallback(overload: torch._ops.OpOverload) -> None:
    """Register ``overload``'s Inductor lowering: a fallback to the op itself, with the layout
    constraint of its tags (Inductor's default: strides fixed as in eager), as Inductor's
    implicit fallback would, minus the eager ``__str__`` of every argument for its log line."""
    from torch._inductor.lowering import lowerings, make_fallback, tag_to_layout_constraint
    from torch._library.utils import get_layout_constraint_tag

    if overload not in lowerings:
        make_fallback(
            overload, layout_constraint=tag_to_layout_constraint(get_layout_constraint_tag(overload, with_default=True))
        )
