import pytest

from lstrain import cli
from lstrain.testing import Comparison
from lstrain.testing.checks import OP_CHECKS, CheckResult, OpCheck


def test_check_prints_a_table_and_passes(capsys):
    assert cli.main(["check", "layer_norm", "--examples", "3"]) == 0
    out = capsys.readouterr().out
    for dtype in ("float32", "float16", "bfloat16"):
        assert f"layer_norm           {dtype}" in out
    assert "all checks passed" in out


def test_a_failing_check_exits_1(capsys, monkeypatch):
    def broken(case, device):
        return CheckResult([Comparison("output", 1.0, 0.1, 0.05, (0,), 2.0, 1.0)], ["interpreter"])

    monkeypatch.setitem(OP_CHECKS, "broken", OpCheck("broken", OP_CHECKS["layer_norm"].cases, broken))
    assert cli.main(["check", "broken", "--examples", "2", "--jobs", "1"]) == 1  # in this process: the patch holds
    out = capsys.readouterr().out
    assert "FAIL" in out and "FAILED" in out


def test_rows_checked_in_parallel_print_the_same_table(capsys):
    """Worker processes (spawned: each defines the kernels afresh) check the same fixed
    examples as one process, and the rows come out in the table's order."""

    def table(jobs):
        assert cli.main(["check", "layer_norm", "bias_act_dropout", "--examples", "2", "--jobs", jobs]) == 0
        out = capsys.readouterr().out
        return [line[:95] for line in out.splitlines() if line.startswith(("layer_norm ", "bias_act_dropout "))]

    serial, parallel = table("1"), table("3")
    assert len(serial) == 6 and parallel == serial


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
