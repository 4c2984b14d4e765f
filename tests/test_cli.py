import importlib.metadata
import subprocess
import sys

import pytest
import torch

import lstrain
from lstrain import cli
from lstrain.testing import Comparison
from lstrain.testing.checks import OP_CHECKS, CheckResult, OpCheck

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU checks every dtype: no row is skipped")


def _passing(case, device):
    return CheckResult([Comparison("output", 0.01, 0.1, 0.05, (0,), 1.0, 1.0)], ["interpreter"])


def _rows(out: str, *names: str) -> list[list[str]]:
    """The table's rows of ``names``, split into columns."""
    return [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0] in names]


def test_check_prints_a_table_and_passes(capsys):
    assert cli.main(["check", "layer_norm", "--examples", "3"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out, "layer_norm")
    assert [row[1] for row in rows] == ["float32", "float16", "bfloat16"]
    assert all(row[-1] == "pass" for row in rows)
    assert "all checks passed" in out


def test_a_failing_check_exits_1(capsys, monkeypatch):
    def broken(case, device):
        return CheckResult([Comparison("output", 1.0, 0.1, 0.05, (0,), 2.0, 1.0)], ["interpreter"])

    monkeypatch.setitem(OP_CHECKS, "broken", OpCheck("broken", OP_CHECKS["layer_norm"].cases, broken))
    assert cli.main(["check", "broken", "--examples", "2", "--jobs", "1"]) == 1  # in this process: the patch holds
    out = capsys.readouterr().out
    assert "FAIL" in out and "FAILED" in out


def test_the_columns_fit_the_longest_op_name(capsys, monkeypatch):
    long_name = "an_op_name_longer_than_any_real_one"
    monkeypatch.setitem(OP_CHECKS, long_name, OpCheck(long_name, OP_CHECKS["layer_norm"].cases, _passing))
    monkeypatch.setitem(OP_CHECKS, "ln", OpCheck("ln", OP_CHECKS["layer_norm"].cases, _passing))
    assert cli.main(["check", long_name, "ln", "--examples", "1", "--jobs", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("op "))
    dtype_column = header.index("dtype")
    assert dtype_column == len(long_name) + 1
    rows = [line for line in lines if line.startswith((long_name, "ln "))]
    dtypes = [line[dtype_column - 1 :].split(maxsplit=1)[0] for line in rows]
    assert dtypes == ["float32", "float16", "bfloat16"] * 2


@cpu_only
def test_rows_skipped_on_the_cpu_say_why(capsys, monkeypatch):
    """A dtype the CPU leaves out (the GEMM ops' bf16) is a row that says so, not a gap."""
    cases = OP_CHECKS["layer_norm"].cases
    monkeypatch.setitem(OP_CHECKS, "fp32_only", OpCheck("fp32_only", cases, _passing, cpu_dtypes=(torch.float32,)))
    assert cli.main(["check", "fp32_only", "--examples", "1", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out, "fp32_only")
    assert [row[1] for row in rows] == ["float32", "float16", "bfloat16"]
    assert rows[0][-1] == "pass"
    for row in rows[1:]:
        assert row[2:6] == ["-"] * 4 and row[6] == "skipped:" and "bf16 tl.dot" in " ".join(row[7:])
    assert "all checks passed (2 skipped)" in out


def test_rows_checked_in_parallel_print_the_same_table(capsys):
    """Worker processes (spawned: each defines the kernels afresh) check the same fixed
    examples as one process, and the rows come out in the table's order."""

    def table(jobs):
        assert cli.main(["check", "layer_norm", "bias_act_dropout", "--examples", "2", "--jobs", jobs]) == 0
        return _rows(capsys.readouterr().out, "layer_norm", "bias_act_dropout")

    serial, parallel = table("1"), table("3")
    assert len(serial) == 6 and parallel == serial


def test_help_lists_every_op_and_the_cpu_skips(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["check", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # help text is wrapped to the terminal
    assert all(name in out for name in OP_CHECKS)
    assert "gemm bfloat16; swiglu_mlp bfloat16" in out


def test_unknown_op_is_an_error(capsys):
    assert cli.main(["check", "nope"]) == 2
    assert "unknown op(s) nope" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--examples", "--jobs"])
@pytest.mark.parametrize("value", ["0", "-1", "many"])
def test_counts_must_be_positive_whole_numbers(capsys, option, value):
    with pytest.raises(SystemExit):
        cli.main(["check", "layer_norm", option, value])
    assert option in capsys.readouterr().err


def test_no_command_is_a_usage_error():
    with pytest.raises(SystemExit):
        cli.main([])


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"lstrain {lstrain.__version__}\n"


def test_the_installed_version_is_the_package_s():
    """pyproject.toml reads its version from lstrain.__version__ (one source)."""
    try:
        installed = importlib.metadata.version("lstrain")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("lstrain is not installed (pip install -e .)")
    assert installed == lstrain.__version__


def test_python_dash_m_runs_the_command_without_importing_torch():
    """``python -m lstrain`` is the console script; the dispatch imports no torch (so
    ``check`` can switch the interpreter on before any kernel is defined)."""
    code = "import runpy, sys; sys.argv = ['lstrain', '--version']\n"
    code += "try:\n    runpy.run_module('lstrain', run_name='__main__')\n"
    code += "except SystemExit:\n    print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["lstrain", lstrain.__version__, "False"]
