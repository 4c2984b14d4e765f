"""Every ```python block of README.md runs as written, each in a fresh namespace.

On the CPU the snippets' ops run through the Triton interpreter (conftest.py switches it
on), so their shapes are small; a snippet that calls lstrain's ops must have run them on
this machine's kernel backend, not on the plain-PyTorch reference.
"""

import inspect
import pathlib
import re

import pytest
import torch

import lstrain
from lstrain import _backend
from tests.conftest import EXPECTED_BACKEND

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def _snippets() -> list[tuple[int, str]]:
    """(line number, code) of each python block of the README."""
    text = README.read_text()
    return [(text.count("\n", 0, match.start()) + 2, match.group(1)) for match in _BLOCK.finditer(text)]


# Until LossScaler defaults to a device that exists (the current one, else the CPU), its
# snippet cannot run without CUDA; the mark lifts itself once the default changes.
_SCALER_NEEDS_CUDA = pytest.mark.xfail(
    not torch.cuda.is_available()
    and inspect.signature(lstrain.optim.LossScaler).parameters["device"].default == "cuda",
    reason="LossScaler() defaults to device='cuda'",
    raises=AssertionError,
    strict=True,
)


def _params() -> list:
    return [
        pytest.param(line, code, id=f"README.md:{line}", marks=[_SCALER_NEEDS_CUDA] if "LossScaler()" in code else [])
        for line, code in _snippets()
    ]


def test_the_readme_has_snippets():
    assert len(_snippets()) >= 5


@pytest.mark.parametrize("line, code", _params())
def test_snippet_runs(line, code):
    with _backend.record_backends() as ran:
        exec(compile(code, f"{README}:{line}", "exec"), {"__name__": "readme_snippet"})
    assert {backend for _, backend in ran} <= {EXPECTED_BACKEND}
    if re.search(r"lstrain\.(ops|nn)\.", code):
        assert ran, "the snippet ran none of lstrain's ops"
