"""BENCHMARKS.md is the report of the runs stored beside the runner, never a hand edit."""

import json
from pathlib import Path

from benchmarks import report

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"


def test_benchmarks_md_is_the_report_of_the_stored_runs():
    text = report.render(
        json.loads((RESULTS / "results.json").read_text()), [json.loads((RESULTS / "e2e.json").read_text())]
    )
    assert (REPO / "BENCHMARKS.md").read_text() == text, (
        "BENCHMARKS.md differs from its JSON: regenerate it with `python -m benchmarks.report "
        "benchmarks/results/results.json --e2e benchmarks/results/e2e.json`"
    )
    assert text.count("\n") <= report.MAX_LINES
