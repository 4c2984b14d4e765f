"""Every ```python block of README.md runs as written, each in a fresh namespace.

On the CPU the snippets' ops run through the Triton interpreter (conftest.py switches it
on), so their shapes are small; a snippet that calls lstrain's ops must have run them on
this machine's kernel backend, not on the plain-PyTorch reference.
"""

import pathlib
import re

import pytest

from lstrain import _backend
from tests.conftest import EXPECTED_BACKEND

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def _snippets() -> list[tuple[int, str]]:
    """(line number, code) of each python block of the README."""
    text = README.read_text()
    return [(text.count("\n", 0, match.start()) + 2, match.group(1)) for match in _BLOCK.finditer(text)]


SNIPPETS = _snippets()


def test_the_readme_has_snippets():
    assert len(SNIPPETS) >= 5


@pytest.mark.parametrize("line, code", SNIPPETS, ids=[f"README.md:{line}" for line, _ in SNIPPETS])
def test_snippet_runs(line, code):
    with _backend.record_backends() as ran:
        exec(compile(code, f"{README}:{line}", "exec"), {"__name__": "readme_snippet"})
    assert {backend for _, backend in ran} <= {EXPECTED_BACKEND}
    if re.search(r"lstrain\.(ops|nn)\.", code):
        assert ran, "the snippet ran none of lstrain's ops"
