"""The runner's pure parts on the CPU: the registry's targets, the rows it writes, the
report those rows make (every registered case, within the line limit), --lstrain-only."""

import json

from benchmarks import report
from benchmarks.run import FORMAT, implementation_filter, make_row
from benchmarks.specs import REGISTRY, STEP_REGISTRY, TITLES

# The issue's and README's targets (the current ones, as BENCHMARKS.md's tables judge them):
# (op, shape) -> (GPU ms, MiB transient, (competitor, minimum speed ratio)).
TARGETS = {
    ("layer_norm", "16384 x 1024"): (0.050, None, None),
    ("layer_norm", "16384 x 4096"): (0.18, None, None),
    ("layer_norm", "16384 x 8192"): (0.36, None, None),
    ("rms_norm", "16384 x 4096"): (0.184, None, ("torch.compile", 1.25)),
    ("add_rms_norm", "16384 x 4096"): (0.295, None, ("torch.compile", 1.25)),
    ("rope", "4 x 32 x 4096 x 128, q and k"): (0.296, None, ("torch.compile", 1.25)),
    ("attention_softmax", "8 x 16 x 1024 x 1024, scale + causal"): (0.25, None, None),
    ("bias_dropout_residual", "16384 x 4096, dropout 0.1"): (0.21, None, None),
    ("dropout_add_layer_norm", "8192 x 1024, dropout 0.1"): (None, None, ("torch.compile", 1.25)),
    ("dropout_add_layer_norm", "16384 x 4096, dropout 0.1"): (0.332, None, None),
    ("cross_entropy", "16384 x 50257, smoothing 0.1, 5% ignored"): (0.95, None, None),
    ("cross_entropy", "8192 x 128256, smoothing 0.1, 5% ignored"): (1.2, None, None),
    ("embedding", "V 50257, D 1024, 8 x 2048 tokens, dropout 0.1"): (0.15, None, None),
    ("linear_cross_entropy", "8192 x 4096 -> 128256, smoothing 0.1"): (45.0, 600.0, None),
    ("linear_cross_entropy", "8192 x 1024 -> 50257, smoothing 0.1"): (None, None, ("torch.compile", 1.0)),
    ("swiglu_mlp", "16384 x 4096 x 11008"): (19.5, 1204.0, None),
    ("adamw", "GPT-2 medium, 292 tensors"): (2.55, None, None),
    ("gemm", "16384 x 4096 x 11008 bf16"): (None, None, ("cuBLAS (torch.matmul)", 0.9)),
    ("gemm", "16384 x 4096 x 11008 bf16, bias + gelu"): (None, None, ("cuBLAS + eager bias, gelu", 1.0)),
}


def _cases():
    return [case for registry in (REGISTRY, STEP_REGISTRY) for make in registry.values() for case in make()]


def test_every_case_has_the_targets_the_issue_states_and_no_others():
    found = {
        (c.op, c.label): (c.target_ms, c.target_transient_mib, c.target_vs)
        for c in _cases()
        if c.target_ms or c.target_transient_mib or c.target_vs
    }
    assert found == TARGETS


def test_each_case_has_an_lstrain_implementation_first_and_its_relative_target_s_competitor():
    for case in _cases():
        names = list(case.implementations)
        assert report.is_ours(names[0]), (case.op, case.label, names)
        if case.target_vs:
            assert case.target_vs[0] in names and not report.is_ours(case.target_vs[0])


def test_every_op_has_a_title():
    assert set(TITLES) == set(REGISTRY) | set(STEP_REGISTRY)


def _rows():
    """A row per implementation of every registered case, Liger's included where the case
    would have it (as on a machine with Liger installed), as the runner makes them."""
    rows = []
    for case in _cases():
        names = list(case.implementations)
        if (
            case.op
            in ("layer_norm", "rms_norm", "add_rms_norm", "rope", "cross_entropy", "linear_cross_entropy", "swiglu_mlp")
            and "liger" not in names
        ):
            names.append("liger")
        for i, name in enumerate(names):
            not_capturable = name == "liger" and case.op in ("cross_entropy", "linear_cross_entropy")
            gpu = None if not_capturable else 1.0 + i
            host = (None, None) if getattr(case, "capturable", True) is False else (300.0, 250.0)
            rows.append(make_row(case, name, gpu, 1.5 + i, host, (64.0, 32.0), 4257.0, 2.0))
    return rows


def test_rows_keep_the_earlier_fields_and_serialize_without_nan():
    rows = _rows()
    earlier = {"op", "shape", "impl", "gpu_ms", "call_ms", "host_us", "host_us_back_to_back", "peak_mib",
               "transient_mib", "gbs", "pct_copy_bw", "min_bytes", "target_ms", "tflops"}  # fmt: skip
    assert all(earlier <= set(r) for r in rows)
    json.dumps(rows, allow_nan=False)
    gemm = next(r for r in rows if r["op"] == "gemm")
    assert gemm["tflops"] == 2 * 16384 * 4096 * 11008 / 1e-3 / 1e12 and gemm["flops"] == 2 * 16384 * 4096 * 11008
    assert gemm["target_vs_impl"] == "cuBLAS (torch.matmul)" and gemm["target_vs_ratio"] == 0.9
    liger = next(r for r in rows if r["op"] == "cross_entropy" and r["impl"] == "liger")
    assert liger["gpu_ms"] is None and liger["gbs"] == liger["min_bytes"] / (liger["call_ms"] * 1e-3) / 1e9
    adamw = next(r for r in rows if r["op"] == "adamw")
    assert adamw["host_us"] is None


def test_a_full_run_s_report_fits_within_the_line_limit():
    meta = {"device": "NVIDIA H200", "copy_bandwidth_gbs": 4257.0, "gemm_tflops": 760.0, "titles": TITLES}
    text = report.render({"format": FORMAT, "meta": meta, "rows": _rows()})
    assert text.count("\n") <= report.MAX_LINES
    headings = [line for line in text.splitlines() if line.startswith("## ")][1:]
    assert headings == [f"## {TITLES[op]} (`--op {op}`)" for op in [*REGISTRY, *STEP_REGISTRY]]
    assert "not judged" not in text  # every relative target's competitor ran


def test_lstrain_only_selects_every_lstrain_implementation():
    names = ["lstrain", "lstrain deterministic", "lstrain epilogue", "lstrain bf16 + fp32 master", "eager", "liger"]
    assert [n for n in names if implementation_filter(None, False)(n)] == names
    assert [n for n in names if implementation_filter(None, True)(n)] == names[:4]
    assert [n for n in names if implementation_filter(["eager"], False)(n)] == ["eager"]
    assert [n for n in names if implementation_filter(["eager"], True)(n)] == names[:5]


def test_main_end_to_end_with_the_cuda_calls_stubbed(tmp_path, monkeypatch):
    """The runner's whole flow on the CPU: toy cases (one failing), the CUDA calls and the
    timers stubbed; results.json and results.md after it, the failure recorded."""
    import torch

    from benchmarks import run
    from benchmarks.specs import BenchCase, StepCase

    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda: None)
    for name in ("memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "Toy GPU")
    monkeypatch.setattr(run, "copy_bandwidth_gbs", lambda: 4000.0)
    monkeypatch.setattr(run, "gemm_tflops", lambda: 700.0)
    monkeypatch.setattr(run, "graph_replay_ms", lambda step: (step(), 1.0)[1])
    monkeypatch.setattr(run, "do_bench", lambda fn, **kwargs: (fn(), 2.0)[1])

    def inputs():
        return {"x": torch.randn(4, 8, requires_grad=True)}

    def broken():
        raise RuntimeError("no\nsuch | case")

    double = {"lstrain": lambda x: 2 * x, "eager": lambda x: x + x, "liger": lambda x: x * 2}
    toy = [
        BenchCase("toy", "4 x 8", inputs, ["x"], double, 100, 1.5, host_syncing=("liger",)),
        BenchCase("toy", "broken", broken, ["x"], double, 100),
    ]
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    matmul = {"lstrain": lambda make: lambda: a @ b, "cuBLAS": lambda make: lambda: a @ b}
    step = StepCase("toy_gemm", "8 x 8 x 8", lambda dtype: [], matmul, 384, flops=1024, capturable=True)
    step.target_vs = ("cuBLAS", 0.9)
    monkeypatch.setattr(run, "REGISTRY", {"toy": lambda: toy})
    monkeypatch.setattr(run, "STEP_REGISTRY", {"toy_gemm": lambda: [step]})

    run.main(["--quick", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    meta, rows = results["meta"], results["rows"]
    assert results["format"] == FORMAT and meta["device"] == "Toy GPU" and meta["host_calls"] == 20
    assert meta["command"] == f"python -m benchmarks.run --quick --out {tmp_path}"
    assert meta["failures"] == [{"op": "toy", "shape": "broken", "error": "RuntimeError: no such | case"}]
    assert [(r["op"], r["impl"], r["gpu_ms"]) for r in rows] == [
        ("toy", "lstrain", 1.0), ("toy", "eager", 1.0), ("toy", "liger", None),
        ("toy_gemm", "lstrain", 1.0), ("toy_gemm", "cuBLAS", 1.0),
    ]  # fmt: skip
    assert rows[2]["call_ms"] == 2.0 and rows[3]["tflops"] == 1024 / 1e-3 / 1e12
    text = (tmp_path / "results.md").read_text()
    assert text == report.render(results)
    assert "<= 1.5 ms: **met**" in text and ">= 90% of cuBLAS's speed: 100.0%, **met**" in text

    run.main(["--lstrain-only", "--op", "toy_gemm", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["impl"] for r in rows] == ["lstrain"] and rows[0]["host_us"] is not None
