"""One way to declare a kernel launcher as a ``torch.library`` custom op.

Under ``torch.compile`` a launcher must be an opaque custom op (the tracer cannot follow
Triton launches, and the op's fake kernel gives Inductor its outputs' shapes); in eager
mode the dispatcher costs host time for nothing, so the launcher is called directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["kernel_op"]


def kernel_op(name: str, launcher: Callable, *, mutates_args: Sequence[str] = ()) -> Callable[[Callable], Callable]:
    """Decorator that registers ``launcher`` as the custom op ``lstrain::<name>``.

    The decorated function describes the op: its annotated signature is the op's schema
    (the launcher takes the same leading positional arguments) and its body is the fake
    kernel, which returns empty tensors of the outputs' shapes, dtypes and devices. The
    decorator returns the callable the op's autograd Function uses: the launcher itself
    in eager mode, the registered custom op while ``torch.compile`` traces.

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
        op.register_fake(fake)

        def call(*args):
            if torch.compiler.is_compiling():
                return op(*args)
            return launcher(*args)

        call.__name__ = call.__qualname__ = fake.__name__
        call.__doc__ = f"``{launcher.__name__}`` in eager mode, the custom op ``lstrain::{name}`` under torch.compile."
        call.op = op
        return call

    return register
