"""Imports run one way: each lstrain package imports only from the packages below it.

The order, top to bottom: __main__ -> cli -> testing -> config -> train -> patch -> models -> layers
-> nn -> ops / optim / data -> _backend / _grad_slots. Packages of one layer (ops, optim, data) import
none of each other. A new package takes its place in ``LAYERS`` before it can import
anything.
"""

from __future__ import annotations

import ast
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1] / "lstrain"

# Packages (the first name below lstrain) by layer, lowest first.
LAYERS = [
    {"_backend", "_grad_slots"},
    {"ops", "optim", "data"},
    {"nn"},
    {"layers"},
    {"models"},
    {"patch"},
    {"train"},
    {"config"},
    {"testing"},
    {"cli"},
    {"__main__"},
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _imported_modules(relative: PurePosixPath, text: str) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in the source of ``lstrain/<relative>``."""
    package = ["lstrain", *relative.parts[:-1]]
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if module == "lstrain":  # from lstrain import _backend: the names are the modules
                found += [(node.lineno, f"lstrain.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, module))
    return found


def layering_violations(relative: PurePosixPath, text: str) -> list[str]:
    """What in the source of ``lstrain/<relative>`` imports sideways or upwards."""
    own = relative.parts[0].removesuffix(".py")
    if own not in RANK:
        return [f"lstrain/{own} has no place in tests/test_layering.py's LAYERS"]
    below = ", ".join(sorted(name for name, rank in RANK.items() if rank < RANK[own])) or "nothing"
    problems = []
    for line, module in _imported_modules(relative, text):
        parts = module.split(".")
        if parts[0] != "lstrain" or len(parts) < 2 or parts[1] == own:
            continue
        other = parts[1]
        if other.startswith("__") and other != "__main__":  # lstrain.__version__: the root's own names
            continue
        if RANK.get(other, len(LAYERS)) >= RANK[own]:
            problems.append(f"{relative}:{line} imports {module}: lstrain.{own} may import only from {below}")
    return problems


def _sources() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if p != ROOT / "__init__.py")


@pytest.mark.parametrize("path", _sources(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_imports_run_one_way(path):
    relative = PurePosixPath(path.relative_to(ROOT).as_posix())
    assert layering_violations(relative, path.read_text()) == []


@pytest.mark.parametrize(
    ("relative", "source"),
    [
        ("ops/new_op.py", "from lstrain.nn import Linear"),
        ("ops/new_op.py", "from lstrain.optim.flat import BLOCK"),
        ("ops/_lib/piece.py", "from ...nn.linear import Linear"),
        ("_backend.py", "from lstrain import ops"),
        ("nn/new_module.py", "import lstrain.testing.compare"),
    ],
)
def test_a_sideways_or_upward_import_is_caught(relative, source):
    assert len(layering_violations(PurePosixPath(relative), source)) == 1


def test_a_downward_import_passes():
    source = "from lstrain import _backend\nfrom lstrain.ops import layer_norm\nfrom . import linear\n"
    assert layering_violations(PurePosixPath("nn/new_module.py"), source) == []
