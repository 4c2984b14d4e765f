"""benchmarks.e2e and its report section on the CPU: the workloads and targets the issue
states, the FLOP count, the measurement loop on a toy model, the rows a parent makes of its
children's logs (a row, a crash, a timeout), a child killed at its timeout, the report's
end-to-end tables and verdicts on synthetic runs, and the tiny workload end to end in
subprocesses (torch-eager and lstrain-eager; the others skipped without CUDA)."""

import copy
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import e2e, report
from tests.conftest import DEVICE

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def test_workloads_are_the_issues():
    def shape(w):
        return w.n_layer, w.n_embd, w.n_head, w.vocab_size, w.seq, w.batch, w.dropout, w.bf16

    medium, small, tiny = (e2e.WORKLOADS[n] for n in ("gpt2-medium", "gpt2-small", "tiny"))
    assert shape(medium) == (24, 1024, 16, 50257, 1024, 8, 0.1, True) and medium.preset == "medium"
    assert shape(small) == (12, 768, 12, 50257, 1024, 16, 0.1, True) and small.preset == "small"
    assert shape(tiny)[:6] == (2, 64, 4, 1000, 32, 2) and not tiny.bf16
    assert (medium.target_tokens_per_s, medium.target_speedup, medium.target_peak_vs) == (200e3, 1.25, "torch-compile")
    assert (small.target_tokens_per_s, small.target_speedup, small.target_peak_vs) == (None, 1.25, None)
    assert (tiny.target_tokens_per_s, tiny.target_speedup, tiny.target_peak_vs) == (None, None, None)
    assert e2e.DEFAULT_WORKLOADS == ("gpt2-medium", "gpt2-small")
    assert (medium.warmup, medium.steps) == (small.warmup, small.steps) == (10, 20)
    assert medium.config_fields() == {
        "vocab_size": 50257, "n_positions": 1024, "n_embd": 1024, "n_layer": 24, "n_head": 16,
        "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
    }  # fmt: skip


def test_flops_per_token_is_6n_plus_12ltd():
    medium, small = e2e.WORKLOADS["gpt2-medium"], e2e.WORKLOADS["gpt2-small"]
    # HF's parameter counts (tied head) less the position table: N is non-embedding + LM head
    assert medium.flop_params == 354_823_168 - 1024 * 1024
    assert small.flop_params == 124_439_808 - 1024 * 768
    assert medium.flops_per_token == 6 * medium.flop_params + 12 * 24 * 1024 * 1024
    assert round(medium.flops_per_token * medium.tokens_per_step / 1e12, 1) == 19.9  # ANCHORS.md's step
    described = medium.describe(warmup=3, steps=7)
    assert (described["warmup"], described["steps"], described["tokens_per_step"]) == (3, 7, 8192)
    assert described["target_peak_vs"] == "torch-compile" and described["flops_per_token"] == medium.flops_per_token


def test_variants_and_what_they_need():
    assert list(e2e.VARIANTS) == [
        "torch-eager", "torch-compile", "hf-eager", "hf-compile", "hf-liger",
        "lstrain-patch", "lstrain-patch-captured", "lstrain-patch-captured-sr", "lstrain-eager", "lstrain-captured",
        "lstrain-captured-sr", "lstrain-compile",
    ]  # fmt: skip
    cpu_ones = [v.name for v in e2e.VARIANTS.values() if not v.needs_cuda]
    assert cpu_ones == ["torch-eager", "lstrain-eager"]
    assert [n for n in e2e.VARIANTS if report.is_ours(n)] == [
        "lstrain-patch", "lstrain-patch-captured", "lstrain-patch-captured-sr", "lstrain-eager", "lstrain-captured",
        "lstrain-captured-sr", "lstrain-compile",
    ]  # fmt: skip
    patched_captured = e2e.VARIANTS["lstrain-patch-captured"]
    assert patched_captured.precision(e2e.WORKLOADS["gpt2-medium"]) == "bf16 params, fp32 master weights"
    every = lambda name: True  # noqa: E731
    none = lambda name: False  # noqa: E731
    liger = e2e.VARIANTS["hf-liger"]
    assert e2e.skip_reason(liger, cuda=False, importable=every) == "needs CUDA"
    assert e2e.skip_reason(liger, cuda=True, importable=none) == "transformers, liger_kernel not installed"
    assert e2e.skip_reason(liger, cuda=True, importable=lambda n: n == "transformers") == "liger_kernel not installed"
    assert e2e.skip_reason(e2e.VARIANTS["torch-eager"], cuda=False, importable=none) is None
    tiny, medium = e2e.WORKLOADS["tiny"], e2e.WORKLOADS["gpt2-medium"]
    assert e2e.VARIANTS["lstrain-eager"].precision(medium) == "bf16 params, fp32 master weights"
    assert e2e.VARIANTS["hf-compile"].precision(medium) == "fp32 params, bf16 autocast"
    assert e2e.VARIANTS["torch-eager"].precision(tiny) == "fp32"
    llama = e2e.WORKLOADS["llama-0.75b"]
    assert e2e.VARIANTS["hf-liger"].precision(llama) == "bf16 params, no master weights"
    assert e2e.VARIANTS["lstrain-patch"].precision(medium) == "fp32 params, bf16 autocast"
    rounded = "bf16 params and moments, stochastic rounding, no master weights"
    assert e2e.VARIANTS["lstrain-captured-sr"].precision(llama) == rounded
    assert e2e.VARIANTS["lstrain-patch-captured-sr"].precision(llama) == rounded


def test_llama_and_bert_workloads_are_the_issues():
    """Issue 33's LLaMA-style 0.75B and issue 30's BERT-large MLM, in their HF config names."""
    llama, bert = e2e.WORKLOADS["llama-0.75b"], e2e.WORKLOADS["bert-large"]
    assert llama.config_fields() == {
        "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 12,
        "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    }  # fmt: skip
    assert (llama.batch, llama.seq, llama.target_tokens_per_s, llama.torch_bf16_params) == (4, 2048, 135e3, True)
    assert llama.target_peak_gib == pytest.approx(9.313, abs=1e-3)  # 10 GB
    # 12 x (q, o 2 x 2048^2 + k, v 2 x 2048^2 + MLP 3 x 2048 x 5632 + 2 norms) + final norm + untied head
    assert llama.flop_params == 12 * (4 * 2048**2 + 3 * 2048 * 5632 + 2 * 2048) + 2048 + 32000 * 2048
    assert bert.config_fields()["hidden_dropout_prob"] == 0.1 and (bert.batch, bert.seq, bert.masked) == (16, 512, 0.15)
    # the MLM head (transform + LayerNorm + decoder) runs on the masked rows only
    head = 6 * (1024**2 + 3 * 1024 + 30522 * 1024)
    assert bert.predictions == 77
    assert bert.flops_per_token == pytest.approx(6 * bert.flop_params + 12 * 24 * 512 * 1024 + 77 / 512 * head)
    ids, labels, positions, masked_labels = e2e.make_batches(dataclasses.replace(bert, batch=4, seq=256), 1, CPU)[0]
    assert positions.shape == masked_labels.shape == (4, 38)  # round(0.15 x 256) per sequence
    assert int((labels != -100).sum()) == 4 * 38 and torch.equal(ids.gather(1, positions), masked_labels)
    assert torch.equal(labels.gather(1, positions), masked_labels)


class _Output:
    def __init__(self, loss):
        self.loss = loss


class _Toy(torch.nn.Module):
    """A bigram model with the GPT-2 call convention: labels shifted inside, ``.loss`` out."""

    def __init__(self, vocab_size, width=16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, width)
        self.head = torch.nn.Linear(width, vocab_size)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.embed(input_ids))[:, :-1]
        return _Output(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten()))


def test_batches_are_fixed_and_labels_are_the_inputs():
    tiny = e2e.WORKLOADS["tiny"]
    first, again = e2e.make_batches(tiny, 3, CPU), e2e.make_batches(tiny, 3, CPU)
    assert len(first) == 3 and all(ids.shape == (2, 32) and ids.dtype == torch.int64 for ids, _ in first)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[0], a[1]) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0][0], first[1][0]) and int(first[0][0].max()) < tiny.vocab_size


def test_measure_and_summarize_a_toy_step(capsys):
    tiny = e2e.WORKLOADS["tiny"]
    torch.manual_seed(0)
    step = e2e.torch_step(_Toy(tiny.vocab_size), tiny, CPU, compiled=False)
    timing = e2e.measure(step, e2e.make_batches(tiny, 5, CPU), warmup=2, steps=3, device=CPU)
    phases = [line for line in capsys.readouterr().out.splitlines() if line.startswith(e2e.PHASE_PREFIX)]
    assert phases == [e2e.PHASE_PREFIX + p for p in ("first step", "warm-up", "timed steps")]
    assert len(timing["step_ms"]) == 3 and all(ms > 0 for ms in timing["step_ms"])
    assert len(timing["losses"]) == 3 and 0 < timing["compile_s"] <= timing["warmup_s"]
    row = e2e.summarize(timing, tiny)
    assert row["ms_per_step"] == sorted(timing["step_ms"])[1]
    assert row["tokens_per_s"] == pytest.approx(64 / (row["ms_per_step"] * 1e-3))
    assert row["tflops"] == pytest.approx(tiny.flops_per_token * row["tokens_per_s"] / 1e12)
    assert row["ms_per_step_min"] <= row["ms_per_step"] <= row["ms_per_step_max"]
    assert row["final_loss"] == timing["losses"][-1] and row["loss_ok"]
    with pytest.raises(ValueError, match="warmup"):
        e2e.measure(step, e2e.make_batches(tiny, 5, CPU), warmup=0, steps=3, device=CPU)
    with pytest.raises(ValueError, match="4 batches"):
        e2e.measure(step, e2e.make_batches(tiny, 4, CPU), warmup=2, steps=3, device=CPU)


def test_a_loss_is_sane_when_finite_and_near_ln_v():
    ln_v = math.log(1000)
    assert e2e.loss_is_sane([ln_v + 0.3, ln_v - 0.9], 1000)
    assert not e2e.loss_is_sane([ln_v, ln_v - 1.1], 1000)
    assert not e2e.loss_is_sane([float("nan"), ln_v], 1000)


def test_the_profile_lists_the_step_s_operators(tmp_path):
    tiny = e2e.WORKLOADS["tiny"]
    step = e2e.torch_step(_Toy(tiny.vocab_size), tiny, CPU, compiled=False)
    batch = e2e.make_batches(tiny, 1, CPU)[0]
    step(*batch)
    e2e.write_profile(step, batch, CPU, tmp_path / "profile.txt", "tiny: toy")
    text = (tmp_path / "profile.txt").read_text()
    assert text.startswith("tiny: toy\n") and "Self CPU" in text and "aten::" in text


def test_rows_from_a_child_s_log():
    row = {"workload": "tiny", "variant": "torch-eager", "status": "ok", "tokens_per_s": 1.0}
    log = f"{e2e.PHASE_PREFIX}build\nsome warning\n{e2e.ROW_PREFIX}{json.dumps(row)}\n"
    assert e2e.row_from_log("tiny", "torch-eager", log, 0, 60) == row
    assert e2e.row_from_log("tiny", "torch-eager", log, None, 60) == row  # hung on its way out: the row stands
    crashed = f"{e2e.PHASE_PREFIX}build\n{e2e.PHASE_PREFIX}first step\nTraceback ...\nRuntimeError: CUDA error\n\n"
    failed = e2e.row_from_log("gpt2-small", "lstrain-captured", crashed, -11, 60)
    assert failed["status"] == "error" and failed["error"] == "exited with status -11: RuntimeError: CUDA error"
    assert failed["setup"] == e2e.VARIANTS["lstrain-captured"].setup
    hung = e2e.row_from_log("gpt2-small", "lstrain-compile", crashed, None, 240)
    assert hung["error"] == "timed out after 240 s in first step"
    early = e2e.row_from_log("tiny", "hf-eager", "", None, 0.5)
    assert early["error"] == "timed out after 0.5 s before its first phase"


def test_a_child_past_its_timeout_is_killed_and_becomes_an_error_row(tmp_path):
    tiny = e2e.WORKLOADS["tiny"]
    row = e2e.run_variant(tiny, e2e.VARIANTS["torch-eager"], 1, 1, timeout_s=0.3, out=tmp_path)
    assert row["status"] == "error" and row["error"].startswith("timed out after 0.3 s")
    assert row["wall_s"] < 30 and (tmp_path / row["log"]).is_file()


def test_mfu_is_the_model_rate_over_the_gemm_rate():
    assert e2e.add_mfu({"tflops": 395.0}, 790.0)["mfu"] == 0.5
    assert e2e.add_mfu({"tflops": 395.0}, None)["mfu"] is None
    assert e2e.add_mfu({"status": "skipped"}, 790.0)["mfu"] is None


@pytest.mark.gpu
def test_a_captured_step_replays_the_eager_steps():
    """The capture's three side-stream warm-up steps and its replay are steps 1-4 on the first
    batch; an eager twin taking the same steps gives the same losses."""
    tiny, cuda = e2e.WORKLOADS["tiny"], torch.device("cuda")
    batches = e2e.make_batches(tiny, 3, cuda)
    torch.manual_seed(0)
    eager = e2e.lstrain_step(_Toy(tiny.vocab_size), tiny, cuda, compiled=False)
    torch.manual_seed(0)
    captured = e2e.VARIANTS["lstrain-captured"].make_step(_Toy(tiny.vocab_size), tiny, cuda)
    expected = [eager(*batches[0]) for _ in range(e2e.CAPTURE_WARMUP + 1)][-1:] + [eager(*b) for b in batches[1:]]
    got = [captured(*b) for b in batches]
    torch.testing.assert_close(torch.stack(got), torch.stack(expected), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the report's section


def _e2e_row(workload, variant, tokens_per_s=None, peak_gib=None, **fields):
    if tokens_per_s is None:
        return {"workload": workload, "variant": variant, "setup": "s", **fields}
    ms = 8192 / tokens_per_s * 1e3
    return {
        "workload": workload, "variant": variant, "status": "ok", "setup": "s", "precision": "p",
        "tokens_per_s": tokens_per_s, "ms_per_step": ms, "peak_gib": peak_gib, "mfu": 0.4, "compile_s": 41.5,
        "final_loss": 10.93, "loss_ok": True,
    } | fields  # fmt: skip


def _e2e_run():
    medium, small = e2e.WORKLOADS["gpt2-medium"], e2e.WORKLOADS["gpt2-small"]
    rows = [
        _e2e_row("gpt2-medium", "torch-eager", 98.6e3, 16.5),
        _e2e_row("gpt2-medium", "torch-compile", 159.1e3, 14.2),
        _e2e_row("gpt2-medium", "hf-eager", 65.3e3, 26.2),
        _e2e_row("gpt2-medium", "hf-liger", status="skipped", reason="Liger-Kernel 0.8.5 has no GPT-2 patch"),
        _e2e_row("gpt2-medium", "lstrain-eager", 118.4e3, 12.1),
        _e2e_row("gpt2-medium", "lstrain-captured", 126.2e3, 12.3),
        _e2e_row("gpt2-medium", "lstrain-compile", status="error", error="in first step: Unsupported: a | b"),
        _e2e_row("gpt2-small", "torch-compile", 300e3, 9.0),
        _e2e_row("gpt2-small", "lstrain-eager", 420e3, 8.0),
        _e2e_row("gpt2-small", "lstrain-captured", 500e3, 8.0, final_loss=float("nan"), loss_ok=False),
    ]
    meta = {
        "device": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0", "transformers": "5.17.0",
        "liger": None, "date": "2026-12-02", "command": "python -m benchmarks.e2e", "commit": "0123456789ab",
        "gemm_tflops": 790.0, "gemm_shape": "8192 x 8192 x 8192 bf16 torch.matmul", "wall_s": 431.0,
        "workloads": {w.name: w.describe(w.warmup, w.steps) for w in (medium, small)},
    }  # fmt: skip
    return json.loads(json.dumps({"format": e2e.FORMAT, "meta": meta, "rows": rows}))  # as read back from the file


def _op_run():
    row = {
        "op": "layer_norm",
        "shape": "16384 x 1024",
        "impl": "lstrain",
        "gpu_ms": 0.05,
        "call_ms": 0.1,
        "target_ms": 0.06,
    }
    return {"format": 2, "meta": {"device": "NVIDIA H200"}, "rows": [row]}


def _e2e_table(text, title_start):
    """The rows of the end-to-end table under the bold title starting with ``title_start``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"**{title_start}"))
    table = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return table[0], table[2:], lines[start + 2 + len(table) + 1]


def test_the_e2e_section_comes_first_with_a_table_per_workload():
    text = report.render(_op_run(), [_e2e_run()])
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings[0] == "## End-to-end training steps (`python -m benchmarks.e2e`)"
    assert headings[1:] == ["## Targets", "## layer_norm (`--op layer_norm`)"]
    assert "- Run: NVIDIA H200, 2026-12-02, commit `0123456789ab`; torch 2.11.0+cu130" in text
    assert "Liger-Kernel not installed" in text and "bf16 GEMM rate **790 TFLOP/s**" in text
    columns, rows, targets = _e2e_table(text, "GPT-2 medium")
    assert columns[:4] == ["variant", "setup", "tokens/s", "ms/step"] and "peak GiB" in columns
    assert "10 warm-up + 20 timed steps, 2.42 GFLOP per token" in text
    assert [r[0] for r in rows] == ["torch-eager", "torch-compile", "hf-eager", "hf-liger", "lstrain-eager",
                                    "**lstrain-captured**", "lstrain-compile"]  # fmt: skip
    captured = rows[5]
    assert captured[2] == "**126.2k**" and captured[columns.index("MFU")] == "40.0%"
    assert captured[columns.index("vs best competitor")] == f"{126.2 / 159.1:.2f}x vs torch-compile"
    assert rows[0][columns.index("vs best competitor")] == ""  # competitors carry none
    assert rows[3][2] == "skipped: Liger-Kernel 0.8.5 has no GPT-2 patch"
    assert rows[6][2] == "error: in first step: Unsupported: a \\| b"  # the pipe escaped, the table intact
    assert len({len(r) for r in rows}) == 1
    assert targets == (
        "Targets (on lstrain-captured): >= 200k tokens/s: 126.2k, missed by 36.9%; "
        f">= 1.25x the best competitor: {126.2 / 159.1:.2f}x torch-compile, missed by "
        f"{100 * (1 - 126.2 / 159.1 / 1.25):.1f}%; peak memory <= torch-compile's: 12.30 vs 14.20 GiB, **met**"
    )
    columns, rows, targets = _e2e_table(text, "GPT-2 small")
    assert [r[0] for r in rows] == ["torch-compile", "**lstrain-eager**", "lstrain-captured"]
    assert rows[2][columns.index("final loss")] == "nan (not sane)"  # faster, but its NaN judges nothing
    assert rows[2][2] == "500.0k" and rows[2][columns.index("vs best competitor")] == "1.67x vs torch-compile"
    assert targets == "Targets (on lstrain-eager): >= 1.25x the best competitor: 1.40x torch-compile, **met**"


def test_several_rounds_give_the_median_run_and_the_range():
    runs = [
        _e2e_row("gpt2-medium", "lstrain-captured", 100e3, 9.0),
        _e2e_row("gpt2-medium", "lstrain-captured", status="error", error="timed out"),
        _e2e_row("gpt2-medium", "lstrain-captured", 120e3, 9.0),
        _e2e_row("gpt2-medium", "lstrain-captured", 110e3, 9.5),
    ]
    row = e2e.median_round(runs)
    assert row["tokens_per_s"] == 110e3 and row["peak_gib"] == 9.5  # the median run whole, not a mix
    assert row["rounds_tokens_per_s"] == [100e3, None, 120e3, 110e3]
    assert e2e.median_round(runs[:1] + runs[2:3])["tokens_per_s"] == 100e3  # even: the lower middle
    failed = e2e.median_round(runs[1:2] * 2)
    assert failed["status"] == "error" and failed["rounds_tokens_per_s"] == [None, None]
    run = _e2e_run()
    run["meta"]["rounds"] = 4
    captured = next(r for r in run["rows"] if r["variant"] == "lstrain-captured")
    captured["rounds_tokens_per_s"] = [120e3, None, 126.2e3, 124e3]
    text = report.render(_op_run(), [run])
    assert "each row the median of 4 runs, in alternating order" in text
    columns, rows, _ = _e2e_table(text, "GPT-2 medium")
    assert rows[5][2] == "**126.2k** (120.0-126.2k in 3; 1 failed)" and len({len(r) for r in rows}) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--rounds", "2", "--profile", "torch-eager"], "--profile profiles one run"),
    ],
)
def test_rounds_are_checked(capsys, argv, message):
    with pytest.raises(SystemExit):
        e2e.main(argv)
    assert message in capsys.readouterr().err


def test_e2e_targets_not_judged_without_their_rows():
    run = _e2e_run()
    run["rows"] = [r for r in run["rows"] if report.is_ours(r["variant"]) or r["variant"] == "hf-liger"]
    medium = run["meta"]["workloads"]["gpt2-medium"]
    best, verdicts = report.e2e_verdicts(medium, [r for r in run["rows"] if r["workload"] == "gpt2-medium"])
    assert best["variant"] == "lstrain-captured"
    assert [(v.met, v.outcome) for v in verdicts[1:]] == [
        (None, "not judged: no competitor ran"),
        (None, "not judged: no torch-compile peak in this run"),
    ]
    best, verdicts = report.e2e_verdicts(medium, [_e2e_row("gpt2-medium", "torch-compile", 1e5, 1.0)])
    assert best is None and {v.outcome for v in verdicts} == {"not judged: no lstrain variant ran with a sane loss"}
    assert report.e2e_verdicts({}, run["rows"])[1] == []  # a workload without targets
    with pytest.raises(ValueError, match="e2e"):
        report.render(_op_run(), [{"rows": []}])


def test_report_main_takes_e2e_files_within_the_line_limit(tmp_path):
    results, first, second, out = (tmp_path / n for n in ("results.json", "a.json", "b.json", "BENCHMARKS.md"))
    results.write_text(json.dumps(_op_run()))
    first.write_text(json.dumps(_e2e_run()))
    later = copy.deepcopy(_e2e_run())
    later["meta"]["date"] = "2026-12-03"
    second.write_text(json.dumps(later))
    assert report.main([str(results), "--e2e", str(first), "--e2e", str(second), "--out", str(out)]) == 0
    text = out.read_text()
    assert text == report.render(_op_run(), [_e2e_run(), later]) and text.count("\n") <= report.MAX_LINES
    assert text.count("**GPT-2 medium") == 2 and "2026-12-03" in text
    assert report.render(_op_run()) == report.render(_op_run(), [])  # without --e2e: the report as before


# ----------------------------------------------------------------------------- the tiny workload, end to end


def _run_e2e(*args, timeout=180):
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.e2e", "--workload", "tiny", *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_tiny_workload_end_to_end(tmp_path):
    pytest.importorskip("lstrain.models")
    variants = ["torch-eager", "lstrain-eager", "lstrain-captured", "hf-eager"]
    done = _run_e2e(*(a for v in variants for a in ("--variant", v)), "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((tmp_path / "e2e.json").read_text())
    meta, rows = data["meta"], data["rows"]
    assert data["format"] == e2e.FORMAT and meta["workloads"]["tiny"]["steps"] == 2
    assert meta["command"].startswith("python -m benchmarks.e2e --workload tiny")
    by_name = {r["variant"]: r for r in rows}
    assert list(by_name) == variants
    tiny = e2e.WORKLOADS["tiny"]
    for name in ("torch-eager", "lstrain-eager"):
        row = by_name[name]
        assert row["status"] == "ok", (row, (tmp_path / row["log"]).read_text()[-3000:])
        assert row["loss_ok"] and abs(row["final_loss"] - math.log(1000)) < 1.0
        assert row["tokens_per_s"] > 0 and row["steps"] == 2 and row["warmup"] == 1
        # the tied GPT-2 layout: the FLOP count's parameters plus the position table
        assert row["params"] == tiny.flop_params + tiny.seq * tiny.n_embd
    if not torch.cuda.is_available():
        assert by_name["lstrain-captured"] == {
            "workload": "tiny", "variant": "lstrain-captured", "setup": e2e.VARIANTS["lstrain-captured"].setup,
            "status": "skipped", "reason": "needs CUDA", "mfu": None,
        }  # fmt: skip
        assert by_name["hf-eager"]["reason"] == "needs CUDA"
        assert by_name["torch-eager"]["peak_gib"] is None and meta["gemm_tflops"] is None
    else:
        assert by_name["lstrain-captured"]["status"] == "ok" and by_name["lstrain-captured"]["loss_ok"]
    text = report.render(_op_run(), [data])
    _, table, _ = _e2e_table(text, "tiny GPT-2")
    assert [r[0].strip("*") for r in table] == variants
    assert [r[0] for r in table if r[0].startswith("**")] in (["**lstrain-eager**"], ["**lstrain-captured**"])


def test_tiny_profile_writes_the_tables_and_no_json(tmp_path):
    pytest.importorskip("lstrain.models")
    done = _run_e2e("--profile", "torch-eager", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    text = (tmp_path / "profile-tiny-torch-eager.txt").read_text()
    assert text.startswith("tiny GPT-2") and "Self CPU" in text
    assert not (tmp_path / "e2e.json").exists()


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_each_family_s_models_take_a_step(family):
    """Shrunk to a few thousand parameters: lstrain's fused model and its twin, and HF's
    model (patched by lstrain too), each take a step on the workload's batches."""
    pytest.importorskip("transformers")
    base = {"gpt2": "gpt2-small", "llama": "llama-0.75b", "bert": "bert-large"}[family]
    tiny = dataclasses.replace(
        e2e.WORKLOADS[base], n_layer=1, n_embd=32, n_head=2, n_kv_head=1 if family == "llama" else None,
        n_inner=64, vocab_size=101, seq=16, batch=2, bf16=False,
    )  # fmt: skip
    device = torch.device(DEVICE)  # the fused kernels: the GPU's, or the CPU's interpreter
    batch = e2e.make_batches(tiny, 1, device)[0]
    steps = [
        e2e.lstrain_step(e2e._lstrain_model(tiny, fused=True), tiny, device, compiled=False),
        e2e.lstrain_step(e2e._lstrain_model(tiny, fused=True), tiny, device, compiled=False, rounded=True),
        e2e.torch_step(e2e._lstrain_model(tiny, fused=False), tiny, device, compiled=False),
        e2e.torch_step(e2e._hf_model(tiny), tiny, device, compiled=False),
        e2e.torch_step(e2e._hf_patched(tiny), tiny, device, compiled=False),
    ]
    if family != "bert":  # lstrain-patch-captured's step, uncaptured: the patched model on FusedAdamW
        steps.append(e2e.lstrain_step(e2e._hf_patched(tiny), tiny, device, compiled=False))
    losses = [float(step(*batch)) for step in steps]
    assert all(abs(loss - math.log(101)) < 1.0 for loss in losses), losses
