"""BENCHMARKS.md is the report of the runs stored beside the runner, never a hand edit."""

import json
from pathlib import Path

from benchmarks import report

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"


# the e2e runs, each its own table: e2e-<what>.json of this tree's runs, then e2e.json
E2E = sorted(RESULTS.glob("e2e*.json"))


def test_benchmarks_md_is_the_report_of_the_stored_runs():
    text = report.render(
        json.loads((RESULTS / "results.json").read_text()), [json.loads(path.read_text()) for path in E2E]
    )
    e2e = " ".join(f"--e2e benchmarks/results/{path.name}" for path in E2E)
    assert (REPO / "BENCHMARKS.md").read_text() == text, (
        "BENCHMARKS.md differs from its JSON: regenerate it with `python -m benchmarks.report "
        f"benchmarks/results/results.json {e2e}`"
    )
    assert text.count("\n") <= report.MAX_LINES
