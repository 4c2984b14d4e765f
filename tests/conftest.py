"""One test tree for the CPU (Triton interpreter) and a GPU.

Without CUDA the Triton interpreter is switched on here, before any lstrain kernel is
defined, so the CPU tests run the real kernels. Tests marked ``gpu`` skip without CUDA.
"""

import contextlib
import os
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from filelock import FileLock  # noqa: E402
from hypothesis import settings  # noqa: E402

from lstrain.testing import register_profiles  # noqa: E402

register_profiles()
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE", "lstrain-gpu" if torch.cuda.is_available() else "lstrain-cpu")
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXPECTED_BACKEND = "triton" if torch.cuda.is_available() else "interpreter"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(autouse=True)
def _gpu_memory_shared_by_workers(request):
    """Tests marked ``large_memory`` (~40 GB of the GPU each) take a lock shared by all
    processes of the run, so that parallel workers (``pytest -n 8``) run them one at a
    time instead of two of them exhausting an 80 GB GPU, and the tests beside them too.
    Every CUDA test gives its cached blocks back when it ends, so that what a worker holds
    between tests is what it keeps alive, not its largest test's peak."""
    if not torch.cuda.is_available():
        yield
        return
    lock = FileLock(os.path.join(tempfile.gettempdir(), "lstrain-tests-large-memory.lock"))
    with lock if "large_memory" in request.keywords else contextlib.nullcontext():
        try:
            yield
        finally:  # before the lock goes: a worker's cached blocks would starve the next large test
            torch.cuda.empty_cache()
