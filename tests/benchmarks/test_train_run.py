"""benchmarks.train_run and its report section: a micro recipe run in a subprocess, the
section's steady throughput and its check against an e2e row."""

import json

from benchmarks import report, train_run

RECIPE = """
[model]
n_layer = 1
n_embd = 32
n_head = 2
n_positions = 32
fused = false

[data]
source = "{source}"
tokenizer = "byte"
cache_dir = "{cache}"

[training]
local_batch_size = 2
seq_len = 16
steps = 4
mixed_precision = "fp32"

[metrics]
log_freq = 2

[eval]
steps = 1
"""


def test_a_recipe_variant_runs_and_keeps_its_metrics(tmp_path):
    (tmp_path / "corpus.txt").write_text("def f(x):\n    return x + 1\n\n" * 200)
    recipe = tmp_path / "micro.toml"
    recipe.write_text(RECIPE.format(source=tmp_path / "corpus.txt", cache=tmp_path / "cache"))
    out = tmp_path / "out"
    assert train_run.main(["--recipe", str(recipe), "--variant", "short=training.steps=2", "--out", str(out)]) == 0
    data = json.loads((out / "train.json").read_text())
    (run,) = data["runs"]
    assert data["format"] == train_run.FORMAT and run["name"] == "short" and run["returncode"] == 0
    assert [r["step"] for r in run["records"] if "loss" in r] == [2]
    assert "--set training.steps=2" in run["command"] and "metrics.folder" not in run["command"]
    assert all("run" not in r for r in run["records"])


def _train_json(rates, ref="gpt2-medium/lstrain-captured"):
    records = [
        {"step": 10 * (i + 1), "loss": 9.0 - i, "tokens_per_s": rate, "memory_mib": 100.0}
        for i, rate in enumerate(rates)
    ]
    meta = {"device": "H200", "date": "2026-12-01", "commit": "abc", "command": "c", "e2e_ref": ref}
    run = {"name": "cuda_graphs", "returncode": 0, "records": records}
    return {"format": 1, "meta": meta, "runs": [run]}


def test_the_section_judges_steady_throughput_against_the_e2e_row():
    assert report.steady_tokens_per_s([{"tokens_per_s": r} for r in (30.0, 156.0, 158.0, 157.0)]) == 157.0
    assert report.steady_tokens_per_s([{"tokens_per_s": 5.0}]) == 5.0
    assert report.steady_tokens_per_s([]) is None
    e2e = {"format": 1, "meta": {}, "rows": [
        {"workload": "gpt2-medium", "variant": "lstrain-captured", "status": "ok", "tokens_per_s": 160e3}
    ]}  # fmt: skip
    lines = report.render_train([_train_json([34e3, 156e3, 157e3, 156e3])], [e2e])
    row = next(line for line in lines if line.startswith("| `cuda_graphs`"))
    assert "9.000 -> 6.000" in row and "156.0k" in row and "0.975 of gpt2-medium/lstrain-captured (within 5%)" in row
    slow = report.render_train([_train_json([34e3, 140e3, 141e3])], [e2e])
    assert "(beyond 5%)" in next(line for line in slow if line.startswith("| `cuda_graphs`"))
    assert "vs e2e" in lines[-3] and report.render_train([_train_json([1.0], ref=None)], [])[-1].endswith("|  |")
