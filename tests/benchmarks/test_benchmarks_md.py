"""BENCHMARKS.md is the report of the runs stored beside the runner, never a hand edit."""

import json
from pathlib import Path

from benchmarks import report

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"


# later runs of some ops (results-<what>.json), the e2e runs (e2e-<what>.json), the
# recipe runs (train-<what>.json) and step profiles (profile-<workload>-<variant>.txt),
# in name order
LATER_OPS = sorted(RESULTS.glob("results-*.json"))
E2E = sorted(RESULTS.glob("e2e*.json"))
TRAIN = sorted(RESULTS.glob("train*.json"))
PROFILES = sorted(RESULTS.glob("profile-*.txt"))


def test_benchmarks_md_is_the_report_of_the_stored_runs():
    def load(paths):
        return [json.loads(path.read_text()) for path in paths]

    main = json.loads((RESULTS / "results.json").read_text())
    text = report.render(main, load(E2E), load(TRAIN), load(LATER_OPS), [p.read_text() for p in PROFILES])
    inputs = {"later-ops": LATER_OPS, "e2e": E2E, "train": TRAIN, "profile": PROFILES}
    flags = [f"--{flag} benchmarks/results/{path.name}" for flag, paths in inputs.items() for path in paths]
    assert (REPO / "BENCHMARKS.md").read_text() == text, (
        "BENCHMARKS.md differs from its JSON: regenerate it with `python -m benchmarks.report "
        f"benchmarks/results/results.json {' '.join(flags)}`"
    )
    assert text.count("\n") <= report.MAX_LINES
