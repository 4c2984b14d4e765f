"""A whole training step in one CUDA graph: captured once, replayed every step.

A step of a Transformer is hundreds of kernel launches; replaying them from a CUDA graph
costs one launch of host time, so the step runs at the GPU's speed at any batch size.
:class:`CapturedStep` wraps a user's step function (forward, backward, clipping, the
optimizer step, the loss scaler) and handles what capturing by hand gets wrong: the static
input buffers each batch is copied into, warm-up steps on a side stream that do not count
as training, dropout seeds that advance per replay, learning-rate schedules that change
without a re-capture, and clear errors for what a graph cannot hold (a host sync, a new
shape, an optimizer whose buffers were rebuilt).
"""

from __future__ import annotations

import numbers
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from lstrain.optim.base import FlatOptimizer

__all__ = ["CaptureError", "CapturedStep"]

_SYNC_HINT = (
    "a graph replays device work only and cannot wait for the host: remove .item(), .cpu(), "
    "print() or bool() of a CUDA tensor, torch.nonzero and boolean-mask indexing from the step "
    "(log a returned loss outside it), or run the step eagerly"
)


class CaptureError(RuntimeError):
    """The step cannot be captured in, or replayed from, a CUDA graph (a host sync in it,
    a batch of another shape, state reallocated since the capture)."""


def _describe(path: tuple) -> str:
    return "batch" + pytree.keystr(path) if path else "batch"


def _cpu_copy(state: Any) -> Any:
    """A host copy of a state dict (tensors copied, containers rebuilt, the rest shared)."""
    return pytree.tree_map(
        lambda value: value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value, state
    )


def snapshot(objects: Sequence[Any]) -> tuple:
    """Host copies of the objects' state dicts and of torch's RNG states, for :func:`rewind`.

    Args:
        objects: models, optimizers, loss scalers (anything with ``state_dict``).

    Returns:
        An opaque snapshot.
    """
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return [_cpu_copy(item.state_dict()) for item in objects], torch.get_rng_state(), cuda


def rewind(objects: Sequence[Any], saved: tuple) -> None:
    """Load a :func:`snapshot` back (in place: parameters and flat buffers keep their memory).

    Args:
        objects: the objects given to :func:`snapshot`, in the same order.
        saved: what it returned.

    Raises:
        ValueError: ``objects`` is not as long as the list ``saved`` was taken of.
    """
    states, cpu_rng, cuda_rng = saved
    pairs = list(zip(objects, states, strict=True))
    # optimizers last: loading a model writes its parameters, which an lstrain optimizer
    # would take for an outside write and copy over its fp32 master weights
    pairs.sort(key=lambda pair: isinstance(pair[0], torch.optim.Optimizer))
    for item, state in pairs:
        item.load_state_dict(state)
    torch.set_rng_state(cpu_rng)
    if cuda_rng:
        torch.cuda.set_rng_state_all(cuda_rng)


def _plain_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each group's non-tensor hyperparameters: baked into a captured graph by torch's optimizers."""
    return [
        {key: value for key, value in group.items() if key != "params" and not isinstance(value, torch.Tensor)}
        for group in optimizer.param_groups
    ]


class CapturedStep:
    """A training step captured whole in one CUDA graph at its first call, replayed after.

    ``step_fn(*batch)`` is the user's eager step: forward, backward, clipping, the optimizer
    step (and the loss scaler's), returning what the caller wants to see (usually the
    detached loss). The first call:

    1. copies the batch (tensors, or lists / tuples / dicts of them) into static buffers on
       the GPU that every later batch is copied into;
    2. saves the state of the objects in ``restore`` (models, optimizers, loss scalers) and
       torch's RNG to host memory, runs ``warmup`` eager steps on a side stream (lazily
       built state then exists and Triton's kernels are compiled: the graph records
       steady-state work; with ``check_sync`` the last warm-up step runs with torch's
       sync check set to raise, so that a host sync is reported at its line before any
       capture is tried: a failed capture can leave the CUDA context unusable), and
       restores them, so warm-up steps
       do not count as training: the first call trains exactly one step, as eager would;
    3. captures one step and replays it.

    Every later call copies its batch into the static buffers, calls each lstrain
    optimizer's :meth:`~lstrain.optim.base.FlatOptimizer.before_replay` (so a changed lr,
    betas or weight decay reaches the captured kernels), checks that torch optimizers'
    Python-number hyperparameters did not change (their graphs hold them as constants) and
    replays. Dropout draws fresh masks per replay: torch's CUDA generator and lstrain's
    dropout seeds (drawn from it) advance their Philox offsets with each replay. A loss
    scaler's skipped steps need nothing: :class:`lstrain.optim.LossScaler` with an lstrain
    optimizer decides on the device.

    Args:
        step_fn: the eager step. It must not synchronise with the host, must take tensors
            of the same shapes and dtypes at every call, and must allocate no state that
            outlives it beyond what the warm-up creates.
        restore: objects with ``state_dict`` / ``load_state_dict`` whose state the warm-up
            steps change (the model, the optimizer, the loss scaler): restored before the
            capture. Pass ``()`` only when warm-up steps may train (a benchmark).
        warmup: eager steps before the capture (>= 1; torch's CUDA-graph docs use 3).
        check_sync: run the last warm-up step under torch's sync check, raising a
            CaptureError at a host sync. False for a step whose host syncs happen only
            outside a capture (Hugging Face's models check their masks on the host unless
            ``torch.cuda.is_current_stream_capturing()``): the capture is then tried as it is.
        pool: a CUDA graph memory pool (``torch.cuda.graph_pool_handle()``) to share with
            other graphs; default a private one.

    Raises:
        ValueError: ``warmup`` < 1, ``check_sync`` not a bool, or an object in ``restore``
            without ``state_dict`` / ``load_state_dict``.

    Example::

        def train_step(input_ids, labels):
            optimizer.zero_grad()
            loss = model(input_ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            return loss.detach()

        step = CapturedStep(train_step, restore=(model, optimizer))
        for input_ids, labels in batches:
            loss = step(input_ids, labels)
    """

    def __init__(
        self,
        step_fn: Callable[..., Any],
        *,
        restore: Sequence[Any],
        warmup: int = 3,
        pool: tuple | None = None,
        check_sync: bool = True,
    ) -> None:
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"CapturedStep: warmup must be an int >= 1, got {warmup!r}")
        if not isinstance(check_sync, bool):
            raise ValueError(f"CapturedStep: check_sync must be a bool, got {check_sync!r}")
        for item in restore:
            if not (callable(getattr(item, "state_dict", None)) and callable(getattr(item, "load_state_dict", None))):
                raise ValueError(
                    f"CapturedStep: restore holds a {type(item).__name__}, which has no state_dict / load_state_dict"
                )
        self.step_fn = step_fn
        self.restore = tuple(restore)
        self.warmup = warmup
        self.pool = pool
        self.check_sync = check_sync
        self.graph: torch.cuda.CUDAGraph | None = None
        self._static: list[Any] = []
        self._spec: pytree.TreeSpec | None = None
        self._output: Any = None
        self._optimizers = [item for item in self.restore if isinstance(item, torch.optim.Optimizer)]
        self._generations: list[int] = []
        self._hyperparameters: list[list[dict]] = []

    @property
    def captured(self) -> bool:
        """Whether the graph exists (after the first call)."""
        return self.graph is not None

    def __call__(self, *batch: Any) -> Any:
        """One training step on ``batch``: copied into the static buffers, the graph replayed
        (captured first, at the first call).

        Args:
            *batch: the step function's arguments: tensors (on any device; copied to the
                GPU), or lists / tuples / dicts of them, and Python values that must equal
                those of the first call.

        Returns:
            What the step function returns, tensors copied out of the graph's memory (the
            next replay overwrites its own).

        Raises:
            CaptureError: a batch of another structure, shape or dtype than the first; the
                step synchronises with the host; an optimizer's buffers were reallocated
                or a torch optimizer's hyperparameter changed since the capture.
            RuntimeError: CUDA is not available.
        """
        if self.graph is None:
            self._capture(batch)
        else:
            self._copy_in(batch)
        # also after the capture: the gradients an optimizer without flat gradient buffers
        # reads through a table of addresses lie in the graph's memory now
        self._before_replay()
        self.graph.replay()
        return pytree.tree_map(lambda value: value.clone() if isinstance(value, torch.Tensor) else value, self._output)

    def _capture(self, batch: tuple) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CapturedStep: CUDA graphs need a CUDA device, and none is available")
        leaves, self._spec = pytree.tree_flatten_with_path(batch)
        device = torch.device("cuda", torch.cuda.current_device())
        self._static = [
            value.detach().to(device, copy=True) if isinstance(value, torch.Tensor) else value for _, value in leaves
        ]
        static_batch = pytree.tree_unflatten(self._static, self._spec)
        saved = snapshot(self.restore)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                for number in range(self.warmup):
                    if self.check_sync and number == self.warmup - 1:
                        self._checked_warmup(static_batch)
                    else:
                        self.step_fn(*static_batch)
        finally:  # a warm-up that raised does not count as training either
            torch.cuda.current_stream().wait_stream(side)
            rewind(self.restore, saved)
        # the host checks' device work (masters following the rewound weights) happens now,
        # outside the graph, not recorded into it to repeat at every replay
        for optimizer in self._optimizers:
            if isinstance(optimizer, FlatOptimizer):
                optimizer.before_replay()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                self._output = self.step_fn(*static_batch)
        except RuntimeError as error:
            if "captur" in str(error).lower() or "synchroniz" in str(error).lower():
                raise CaptureError(f"CapturedStep: the step failed under capture ({error}); {_SYNC_HINT}") from error
            raise
        self.graph = graph
        self._generations = [getattr(optimizer, "generation", 0) for optimizer in self._optimizers]
        self._hyperparameters = [_plain_hyperparameters(optimizer) for optimizer in self._optimizers]

    def _checked_warmup(self, static_batch: tuple) -> None:
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            self.step_fn(*static_batch)
        except RuntimeError as error:
            if "synchroniz" in str(error).lower():
                frames = traceback.extract_tb(error.__traceback__)
                where = next((f for f in reversed(frames) if "/torch/" not in f.filename), frames[-1])
                raise CaptureError(
                    f"CapturedStep: the step synchronises with the host ({error}, at {where.filename}:"
                    f"{where.lineno}: {where.line}); {_SYNC_HINT}. If that code skips the sync under capture "
                    "(Hugging Face's mask builders ask torch.cuda.is_current_stream_capturing()), pass "
                    "check_sync=False"
                ) from error
            raise
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    def _copy_in(self, batch: tuple) -> None:
        leaves, spec = pytree.tree_flatten_with_path(batch)
        if spec != self._spec:
            raise CaptureError(
                f"CapturedStep: the batch's structure changed since the capture (now {spec}, captured "
                f"{self._spec}); a graph replays one structure: build a CapturedStep per kind of batch"
            )
        for static, (path, value) in zip(self._static, leaves, strict=True):
            where = _describe(path)
            if isinstance(static, torch.Tensor):
                if not isinstance(value, torch.Tensor):
                    raise CaptureError(f"CapturedStep: {where} is a {type(value).__name__}, captured as a tensor")
                if value.shape != static.shape or value.dtype != static.dtype:
                    raise CaptureError(
                        f"CapturedStep: {where} has shape {tuple(value.shape)} and dtype {value.dtype}, the "
                        f"captured step {tuple(static.shape)} and {static.dtype}; a graph replays fixed shapes: "
                        "pad or drop a short last batch, or build a CapturedStep per shape"
                    )
                static.copy_(value, non_blocking=True)
            elif isinstance(value, torch.Tensor) or not (
                value == static or (isinstance(value, numbers.Number) and value != value and static != static)
            ):
                raise CaptureError(
                    f"CapturedStep: {where} is {value!r}, captured as {static!r}; Python values are constants "
                    "of the graph: pass a tensor to vary it"
                )

    def _before_replay(self) -> None:
        for number, optimizer in enumerate(self._optimizers):
            name = type(optimizer).__name__
            if isinstance(optimizer, FlatOptimizer):
                optimizer.before_replay()
                if optimizer.generation != self._generations[number]:
                    raise CaptureError(
                        f"CapturedStep: {name}'s flat buffers were rebuilt since the capture (add_param_group, "
                        "or a parameter frozen at construction that trains now); the graph reads the old "
                        "ones: build a new CapturedStep"
                    )
                continue
            now = _plain_hyperparameters(optimizer)
            for group, (before, after) in enumerate(zip(self._hyperparameters[number], now, strict=True)):
                changed = [key for key in before if before[key] != after.get(key)]
                if changed:
                    key = changed[0]
                    raise CaptureError(
                        f"CapturedStep: {name}'s param group {group} {key} changed from {before[key]!r} to "
                        f"{after.get(key)!r} since the capture; torch's optimizers bake Python numbers into the "
                        f"graph: give {key} as a tensor (with capturable=True) or use lstrain.optim"
                    )
