import ast
import re
from pathlib import Path

import pytest
import torch

import lstrain
from lstrain import _backend
from lstrain.ops import layer_norm
from tests.conftest import DEVICE, EXPECTED_BACKEND


def test_the_interpreter_runs_cpu_tensors_when_there_is_no_gpu():
    assert _backend.interpreter_active() == (not torch.cuda.is_available())
    assert _backend.backend_for(torch.zeros(1, device=DEVICE)) == EXPECTED_BACKEND


def test_an_interpreter_that_cannot_run_the_kernels_is_refused(monkeypatch):
    problem = _backend.interpreter_version_problem("3.6.0", "2.4.1")
    assert re.search(r"Triton 3.6.0's CPU interpreter .* numpy 2.4.1.*triton>=3.7 or numpy<2.4", problem)
    for triton_version, numpy_version in (("3.6.0", "2.3.5"), ("3.7.0", "2.4.1"), ("3.9.0+git1a2b", "2.10.0")):
        assert _backend.interpreter_version_problem(triton_version, numpy_version) is None
    if _backend.interpreter_active():
        monkeypatch.setattr(_backend, "_INTERPRETER_PROBLEM", problem)
        with pytest.raises(RuntimeError, match="Install triton>=3.7 or numpy<2.4"):
            _backend.backend_for(torch.zeros(1))


def test_record_backends_collects_and_nests():
    x = torch.randn(2, 8, device=DEVICE)
    with _backend.record_backends() as outer:
        layer_norm(x, 8)
        with _backend.record_backends() as inner:
            layer_norm(x, 8)
        layer_norm(x, 8)
    assert inner == [("layer_norm", EXPECTED_BACKEND)]
    assert outer == [("layer_norm", EXPECTED_BACKEND)] * 2
    layer_norm(x, 8)  # nothing recorded outside a block
    assert outer == [("layer_norm", EXPECTED_BACKEND)] * 2


def test_device_limits():
    """The interpreter reports an H200's shared memory and TMA but no asynchronous copies
    (it runs no Gluon); a GPU its own (Triton checks launches against the same opt-in maximum)."""
    index = _backend.device_index(torch.zeros(1, device=DEVICE))
    if index < 0:
        assert _backend.shared_memory_per_program(index) == _backend.HOPPER_SHARED_MEMORY
        assert _backend.has_tma(index)
        assert not _backend.has_async_copy(index)
    else:
        assert 48 * 1024 <= _backend.shared_memory_per_program(index) <= _backend.HOPPER_SHARED_MEMORY
        assert _backend.has_tma(index) == (torch.cuda.get_device_capability(index)[0] >= 9)
        assert _backend.has_async_copy(index) == (torch.cuda.get_device_capability(index)[0] >= 8)


def _kernel_defs_and_launches() -> tuple[dict[str, ast.FunctionDef], list[tuple[str, str, bool]]]:
    """Every ``*_kernel`` definition in lstrain, and every launch ``NAME[grid](...)``
    as (file:line, NAME, whether it passes ``**_backend.dependent_launch(...)``)."""
    defs, launches = {}, []
    for path in sorted(Path(lstrain.__file__).parent.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                # launches are matched to definitions by name: two kernels of one name could hide a race
                assert node.name not in defs, f"two kernels named {node.name}: {path.name}"
                defs[node.name] = node
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                name = getattr(node.func.value, "id", "")
                if name.endswith("_kernel"):
                    dependent = any(k.arg is None and "dependent_launch" in ast.unparse(k.value) for k in node.keywords)
                    launches.append((f"{path.name}:{node.lineno}", name, dependent))
    return defs, launches


def _waits_first(kernel: ast.FunctionDef) -> bool:
    body = kernel.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return ast.unparse(body[0]) == "wait_for_producers(PDL)"


def test_dependent_launches_wait_before_touching_memory():
    """A kernel launched as a programmatic dependent may start while the kernel before it
    still writes: it must wait first (``wait_for_producers``), or it races. Every Triton
    launch in lstrain is dependent (the Gluon cross-entropy kernel aside, launched plainly)."""
    defs, launches = _kernel_defs_and_launches()
    assert len(launches) > 30
    plain = [(where, name) for where, name, dependent in launches if not dependent]
    assert plain == [(where, name) for where, name in plain if name == "_cross_entropy_resident_kernel"]
    racing = sorted({name for _, name, dependent in launches if dependent and not _waits_first(defs[name])})
    assert racing == []


def test_dependent_launch_only_where_the_gpu_has_it():
    options = _backend.dependent_launch(torch.zeros(1, device=DEVICE))
    index = _backend.device_index(torch.zeros(1, device=DEVICE))
    expected = not _backend.interpreter_active() and index >= 0 and torch.cuda.get_device_capability(index)[0] >= 9
    assert options == {"PDL": expected, "launch_pdl": expected}
