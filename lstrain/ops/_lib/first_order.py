"""lstrain's backward passes are kernels: differentiable once, and free to reuse what forward
saved only when the graph goes with them."""

from __future__ import annotations

import torch

__all__ = ["differentiated", "graph_freed_after_backward", "refuse_create_graph"]


def refuse_create_graph(op: str) -> None:
    """Raise when a backward runs with ``create_graph=True`` (grad mode on), in eager mode.

    The gradients would come out of kernels with no graph behind them, so a second
    derivative through the op (a gradient penalty, MAML, Hessian-vector products) would
    silently lose its terms; ``torch.autograd.function.once_differentiable`` does not
    catch the usual case, where the incoming gradient does not require grad.

    Args:
        op: the op's name, for the message.

    Raises:
        RuntimeError: grad mode is on inside the backward.
    """
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError(
            f"{op}: second derivatives are not supported (backward ran with create_graph=True); "
            "use the plain PyTorch op where a gradient must be differentiated again"
        )


def differentiated(*inputs: torch.Tensor | None) -> bool:
    """Whether autograd will record a call on ``inputs``: grad mode is on and one of them
    requires grad. Ops run without an autograd Function otherwise (inference, no_grad),
    which spares its host cost and what it would keep for backward."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)


def graph_freed_after_backward() -> bool:
    """Whether the backward now running frees the graph when it ends (``retain_graph``
    False, the usual case): only then may it write gradients over tensors its forward
    saved, since no later backward will read them. False where this torch cannot tell
    (the engine's query is private), which keeps the saved tensors intact. Call it only
    inside an eager backward.
    """
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return keep_graph is not None and not keep_graph()
