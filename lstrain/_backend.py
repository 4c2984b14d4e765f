"""Where an lstrain op runs.

One rule, applied per call from the device of the op's main input:

* CUDA tensor -> ``"triton"``: the compiled Triton kernels.
* CPU tensor with the Triton interpreter active -> ``"interpreter"``: the same Triton
  kernels, executed by Triton's CPU interpreter (slow, but the real kernel code paths).
* CPU tensor otherwise -> ``"reference"``: the op's plain-PyTorch ``*_ref``.

Triton decides whether a kernel is interpreted when the kernel is *defined*, from the
environment variable ``TRITON_INTERPRET``. So the interpreter has to be switched on before
any lstrain submodule is imported: ``TRITON_INTERPRET=1 python ...``, or
``os.environ["TRITON_INTERPRET"] = "1"`` first thing in a program (``lstrain check`` does
that on a machine with no GPU).

Tests ask which backend ran with :func:`record_backends`.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator

import numpy
import torch
import triton
import triton.language as tl

__all__ = [
    "Backend",
    "backend_for",
    "dependent_launch",
    "interpreter_active",
    "interpreter_version_problem",
    "note",
    "record_backends",
    "wait_for_producers",
]

Backend = str  # "triton" | "interpreter" | "reference"

_recorded: list[tuple[str, Backend]] | None = None


@triton.jit
def _probe_kernel():
    pass


# Triton fixes a kernel's mode when it is defined, and lstrain's kernels are defined
# right after this module is imported, under the same environment.
_INTERPRETED = type(_probe_kernel).__name__ == "InterpretedFunction"


def interpreter_active() -> bool:
    """True when lstrain's Triton kernels were defined for the CPU interpreter."""
    return _INTERPRETED


def backend_for(tensor: torch.Tensor) -> Backend:
    """The backend an op whose main input is ``tensor`` runs on.

    Raises:
        RuntimeError: the interpreter is active under a Triton and numpy that cannot run
            lstrain's kernels together (:func:`interpreter_version_problem`).
    """
    if interpreter_active():
        if _INTERPRETER_PROBLEM is not None:
            raise RuntimeError(_INTERPRETER_PROBLEM)
        return "interpreter"
    return "triton" if tensor.is_cuda else "reference"


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def interpreter_version_problem(triton_version: str, numpy_version: str) -> str | None:
    """Why the CPU interpreter cannot run kernels whose loop bounds come from
    ``tl.program_id``, if it cannot: before Triton 3.7 it turns such a bound into a Python
    int with ``int()`` of a one-element array, which numpy 2.4 made an error
    (triton-lang/triton#9171).

    Args:
        triton_version: ``triton.__version__``.
        numpy_version: ``numpy.__version__``.

    Returns:
        The message naming both fixes for Triton before 3.7 with numpy 2.4 or later, else None.
    """
    if _major_minor(triton_version) < (3, 7) and _major_minor(numpy_version) >= (2, 4):
        return (
            f"Triton {triton_version}'s CPU interpreter cannot run lstrain's kernels with numpy {numpy_version}: "
            "numpy 2.4 stopped converting one-element arrays to ints, which that interpreter does for loop "
            "bounds (triton-lang/triton#9171, fixed in Triton 3.7). Install triton>=3.7 or numpy<2.4."
        )
    return None


# Decided once here: torch.compile traces backend_for, and torch 2.11's dynamo cannot trace
# the version parsing.
_INTERPRETER_PROBLEM = interpreter_version_problem(triton.__version__, numpy.__version__)


def note(op: str, backend: Backend) -> None:
    """Record that ``op`` ran on ``backend`` while :func:`record_backends` is open."""
    if _recorded is not None:
        _recorded.append((op, backend))


@contextlib.contextmanager
def record_backends() -> Iterator[list[tuple[str, Backend]]]:
    """Collect ``(op, backend)`` for every lstrain op called inside the block.

    Example::

        with record_backends() as ran:
            lstrain.ops.layer_norm(x, (64,))
        assert ran == [("layer_norm", "interpreter")]
    """
    global _recorded
    outer, _recorded = _recorded, []
    try:
        yield _recorded
    finally:
        _recorded = outer


@functools.cache
def multiprocessor_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (a handful for the interpreter)."""
    if device_index < 0:
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Shared memory per program on an H100 / H200 (227 KiB), which the interpreter reports
HOPPER_SHARED_MEMORY = 232448


@functools.cache
def shared_memory_per_program(device_index: int) -> int:
    """Bytes of shared memory one program may use on a CUDA device (the opt-in maximum
    Triton checks a launch against: 227 KiB on an H100 / H200, 163 on an A100, 99 on
    sm_86 / sm_89 parts such as the A10, L4 or RTX 4090); for the interpreter, an H200's."""
    if device_index < 0:
        return HOPPER_SHARED_MEMORY
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


@functools.cache
def has_tma(device_index: int) -> bool:
    """Whether a CUDA device has the Tensor Memory Accelerator (Hopper, sm_90, or newer);
    the interpreter runs the TMA code paths too."""
    return device_index < 0 or torch.cuda.get_device_capability(device_index)[0] >= 9


@functools.cache
def has_async_copy(device_index: int) -> bool:
    """Whether a CUDA device copies global to shared memory asynchronously (cp.async:
    Ampere, sm_80, or newer), which Gluon kernels use; False for the interpreter, which
    runs no Gluon."""
    return device_index >= 0 and torch.cuda.get_device_capability(device_index)[0] >= 8


def device_index(tensor: torch.Tensor) -> int:
    """CUDA device index of ``tensor``, or -1 for a CPU tensor."""
    return tensor.device.index if tensor.is_cuda else -1


@functools.cache
def _launch_options(device_index: int) -> dict[str, bool]:
    on = not _INTERPRETED and device_index >= 0 and torch.cuda.get_device_capability(device_index)[0] >= 9
    return {"PDL": on, "launch_pdl": on}


def dependent_launch(tensor: torch.Tensor) -> dict[str, bool]:
    """Launch options for a kernel over ``tensor``'s device: on Hopper or newer, a
    programmatic dependent launch (PDL), whose programs the GPU schedules while the kernel
    before it drains, instead of after (in a CUDA graph of 16 MB copies: 7.5 against 8.1 us
    a kernel, H100); never under the interpreter, which runs no ``griddepcontrol``. The
    kernel must take ``PDL: tl.constexpr`` and call :func:`wait_for_producers` before it
    touches memory. One cached lookup per launch (launchers are hot).

    Args:
        tensor: the kernel's main input (its device decides).

    Returns:
        ``{"PDL": on, "launch_pdl": on}``, shared between calls: pass it as ``**options``
        to the launch, never modify it.
    """
    return _launch_options(tensor.get_device())


@triton.jit
def wait_for_producers(PDL: tl.constexpr):
    """A kernel's first statement: under a dependent launch, wait until the kernels before
    it have finished and their writes are visible (it neither reads their outputs nor
    overwrites their inputs before that)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
