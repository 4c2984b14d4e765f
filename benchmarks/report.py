"""BENCHMARKS.md from the benchmark runner's JSON, and before/after comparisons of runs.

    python -m benchmarks.report                                  # bench-out/results.json -> BENCHMARKS.md
    python -m benchmarks.report RESULTS.json --out FILE
    python -m benchmarks.report --compare BEFORE.json AFTER.json [--threshold 0.03]
    python -m benchmarks.report RESULTS.json --e2e E2E.json [--e2e E2E-2.json]  # + whole training steps
    python -m benchmarks.report RESULTS.json --e2e E2E.json --train TRAIN.json    # + recipe runs
    python -m benchmarks.report RESULTS.json --later-ops NEW-OPS.json            # + ops measured later
    python -m benchmarks.report RESULTS.json --profile PROFILE.txt               # + a step's top kernels

The report is a pure function of the JSON (no clock, no device, no path in it), so the
same run always gives the same file: BENCHMARKS.md is regenerated, never edited. It
holds the run's device, versions, date, command, the copy bandwidth and bf16 GEMM rate
measured in that run, a summary of the targets, and one table per op: every
implementation's GPU time, % of the copy bandwidth (TFLOP/s and % of the GEMM rate where
the case counts flops), memory, the target and its verdict, and lstrain's ratio against
the fastest competitor. With ``--e2e`` (the e2e.json of ``python -m benchmarks.e2e``, one
per run) an "End-to-end training steps" section comes first: per workload every variant's
tokens/s, ms per step, MFU, peak memory, first-step time and loss, lstrain's fastest variant
judged against the workload's targets. The report must fit in ``MAX_LINES`` lines; ``main``
refuses to write a longer one.

``--compare`` prints, for every lstrain implementation of every case present in either
run, the GPU time before and after and their ratio, flagging ratios beyond the noise
threshold: how a refactor shows that it left every kernel's time as it was.

Reads the runner's layout (``{"format": 2, "meta": {...}, "rows": [...]}``), the earlier
``{"meta": {...}, "rows": [...]}`` and a bare list of rows; fields a row lacks are left
blank. Standard library only: no GPU, torch or triton needed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

MAX_LINES = 470  # four model families with their e2e runs (and the HF side by side of lstrain.patch), the ops
OURS = "lstrain"  # implementations whose name starts with it are lstrain's
NOISE = 0.03  # relative GPU-time difference that --compare flags
PROFILE_KERNELS = 12  # kernels of a profile the report shows


def is_ours(impl: str) -> bool:
    """Whether an implementation's name marks it as lstrain's.

    Args:
        impl: the implementation's name in the registry (``"lstrain"``, ``"lstrain epilogue"``, ...).

    Returns:
        True for lstrain's implementations, False for the competitors'.
    """
    return impl.startswith(OURS)


def parse(data: dict | list) -> tuple[dict, list[dict]]:
    """Split the runner's JSON into its metadata and its rows, whatever the layout.

    Args:
        data: the decoded JSON: a dict with ``rows`` (and ``meta``), or a bare list of rows.

    Returns:
        ``(meta, rows)``; ``meta`` is empty for a bare list.

    Raises:
        ValueError: if ``data`` is neither layout.
    """
    if isinstance(data, list):
        return {}, data
    if isinstance(data, dict) and isinstance(data.get("rows"), list):
        return data.get("meta") or {}, data["rows"]
    raise ValueError(
        f"not the benchmark runner's JSON: expected a list of rows or a dict with 'rows', got {data!r:.80}"
    )


def _num(value) -> float | None:
    """A figure, or None where the row has none (missing, null, or the old layout's NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return float(value)


def time_ms(row: dict) -> tuple[float | None, bool]:
    """The time a row is judged and compared on: its GPU time, else its per-call time.

    Args:
        row: one runner row.

    Returns:
        ``(ms, per_call)``: ``per_call`` is True where the implementation could not be
        captured in a CUDA graph and the per-call time stands in for the GPU time.
    """
    gpu = _num(row.get("gpu_ms"))
    if gpu is not None:
        return gpu, False
    return _num(row.get("call_ms")), True


@dataclass
class Case:
    """The rows of one benchmark case (op and shape), in the runner's order."""

    op: str
    shape: str
    rows: list[dict] = field(default_factory=list)

    @property
    def judged(self) -> dict | None:
        """The row the targets judge: the case's first lstrain implementation."""
        return next((r for r in self.rows if is_ours(r["impl"])), None)

    @property
    def competitors(self) -> list[dict]:
        """The rows of the other implementations (eager, torch.compile, Liger, cuBLAS, ...)."""
        return [r for r in self.rows if not is_ours(r["impl"])]


def group(rows: list[dict]) -> dict[str, list[Case]]:
    """Rows grouped by op, then by case, both in the order of their first row.

    Args:
        rows: the runner's rows.

    Returns:
        op -> its cases.
    """
    ops: dict[str, dict[str, Case]] = {}
    for row in rows:
        cases = ops.setdefault(row["op"], {})
        cases.setdefault(row["shape"], Case(row["op"], row["shape"])).rows.append(row)
    return {op: list(cases.values()) for op, cases in ops.items()}


@dataclass(frozen=True)
class Verdict:
    """One target of a case and how the judged row did against it.

    ``met`` is None where the target could not be judged; ``outcome`` then says why, else
    by how much it was missed; ``measured`` is the figure judged where the table's own
    columns do not show it (a relative speed).
    """

    target: str
    met: bool | None
    outcome: str
    measured: str = ""

    def text(self) -> str:
        """The table cell: ``"<= 0.18 ms: **met**"``, ``">= 90% of X's speed: 98.9%, **met**"``."""
        measured = f"{self.measured}, " if self.measured else ""
        return f"{self.target}: {measured}" + ("**met**" if self.met else self.outcome)


def _missed_by(value: float, limit: float) -> str:
    return f"missed by {100 * (value / limit - 1):.1f}%"


def verdicts(case: Case) -> list[Verdict]:
    """Judge a case's targets on its first lstrain row.

    A GPU-time target is met when the time is at most the target; a memory target when
    the transient memory is at most the target; a relative target ``(competitor, ratio)``
    when the competitor's time over lstrain's is at least the ratio (0.9: at least 90% of
    its speed; 1.0: at least as fast).

    Args:
        case: the case's rows (targets are read from the judged row).

    Returns:
        One verdict per target the case has, in the order GPU time, memory, relative.
    """
    row = case.judged
    if row is None:
        return []
    out = []
    ms, _ = time_ms(row)
    target_ms = _num(row.get("target_ms"))
    if target_ms is not None:
        if ms is None:
            out.append(Verdict(f"<= {target_ms:g} ms", None, "not measured"))
        else:
            out.append(Verdict(f"<= {target_ms:g} ms", ms <= target_ms, _missed_by(ms, target_ms)))
    target_mib = _num(row.get("target_transient_mib"))
    if target_mib is not None:
        transient = _num(row.get("transient_mib"))
        label = f"<= {target_mib:g} MiB transient"
        if transient is None:
            out.append(Verdict(label, None, "not measured"))
        else:
            out.append(Verdict(label, transient <= target_mib, _missed_by(transient, target_mib)))
    other_name = row.get("target_vs_impl")
    if other_name:
        ratio = float(row["target_vs_ratio"])
        label = f">= {100 * ratio:g}% of {other_name}'s speed"
        other = next((r for r in case.rows if r["impl"] == other_name), None)
        other_ms = time_ms(other)[0] if other else None
        if other_ms is None:
            out.append(Verdict(label, None, f"not judged: no {other_name} time in this run"))
        elif ms is None:
            out.append(Verdict(label, None, "not measured"))
        else:
            speed = other_ms / ms
            missed = f"missed by {100 * (1 - speed / ratio):.1f}%"
            out.append(Verdict(label, speed >= ratio, missed, f"{100 * speed:.1f}%"))
    return out


def best_competitor(case: Case, row: dict) -> str:
    """lstrain's ratio against the case's fastest competitor, as a table cell.

    Args:
        case: the case.
        row: one of its lstrain rows.

    Returns:
        ``"1.38x vs torch.compile"`` (the competitor's time over this row's: above 1 lstrain
        is faster), ``(per call)`` added where the competitor could not be captured; empty
        where either time is missing.
    """
    ms, _ = time_ms(row)
    timed = [(time_ms(r), r["impl"]) for r in case.competitors]
    timed = [((t, per_call), name) for (t, per_call), name in timed if t is not None]
    if ms is None or not timed:
        return ""
    (best, per_call), name = min(timed, key=lambda item: item[0][0])
    return f"{best / ms:.2f}x vs {name}" + (" (per call)" if per_call else "")


def _fmt(value, spec: str) -> str:
    value = _num(value)
    return "" if value is None else format(value, spec)


def _table(cases: list[Case], meta: dict) -> list[str]:
    """One op's table: a row per implementation of each case."""
    rows = [r for c in cases for r in c.rows]
    gemm_bound = any(_num(r.get("tflops")) for r in rows)
    bandwidth_bound = any(not _num(r.get("tflops")) for r in rows)
    gemm_rate = _num(meta.get("gemm_tflops"))
    columns = ["shape", "impl", "GPU ms", "per call ms", "host us/call"]
    if bandwidth_bound:
        columns += ["GB/s", "% of copy BW"]
    if gemm_bound:
        columns += ["TFLOP/s", "% of GEMM rate"]
    columns += ["+MiB", "+MiB transient", "target", "vs fastest other"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for case in cases:
        judged = case.judged
        targets = "; ".join(v.text() for v in verdicts(case))
        for i, r in enumerate(case.rows):
            is_judged = r is judged
            gpu = _fmt(r.get("gpu_ms"), ".4f") or "not capturable"
            cells = [
                case.shape if i == 0 else "",
                f"**{r['impl']}**" if is_judged else r["impl"],
                f"**{gpu}**" if is_judged else gpu,
                _fmt(r.get("call_ms"), ".4f"),
                _fmt(r.get("host_us"), ".0f"),
            ]
            tflops = _num(r.get("tflops"))
            if bandwidth_bound:
                cells += [_fmt(r.get("gbs"), ".0f"), _fmt(r.get("pct_copy_bw"), ".1f")] if not tflops else ["", ""]
            if gemm_bound:
                pct_gemm = f"{100 * tflops / gemm_rate:.1f}" if tflops and gemm_rate else ""
                cells += [_fmt(tflops, ".0f"), pct_gemm]
            cells += [
                _fmt(r.get("peak_mib"), ".1f"),
                _fmt(r.get("transient_mib"), ".1f"),
                targets if is_judged else "",
                best_competitor(case, r) if is_ours(r["impl"]) else "",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _header(meta: dict, judged: list[tuple[Case, list[Verdict]]]) -> list[str]:
    versions = f"torch {meta.get('torch', '?')}, triton {meta.get('triton', '?')}, " + (
        f"Liger-Kernel {meta['liger']}" if meta.get("liger") else "Liger-Kernel not installed"
    )
    when = meta.get("date", "?") + (f", commit `{meta['commit']}`" if meta.get("commit") else "")
    copy_bw = _num(meta.get("copy_bandwidth_gbs"))
    gemm_rate = _num(meta.get("gemm_tflops"))
    lines = [
        "# lstrain benchmarks",
        "",
        "Generated by `python -m benchmarks.report` from the JSON of `python -m benchmarks.run`: do not edit",
        "by hand, rerun and regenerate (the run below; an op measured in a later run says so above its",
        "table). Investigations, the history behind these figures and why a target is missed:",
        "[docs/notes/](docs/notes/).",
        "",
        f"- **Device**: {meta.get('device', '?')}" + (f", CUDA {meta['cuda']}" if meta.get("cuda") else ""),
        f"- **Versions**: {versions}",
        f"- **Date**: {when}",
        f"- **Command**: `{meta.get('command', '?')}`"
        + (f" ({meta['wall_s']:.0f} s of wall time)" if _num(meta.get("wall_s")) else ""),
        "- **Copy bandwidth** measured in this run (4 GiB device-to-device copy, bytes read + written): "
        + (f"**{copy_bw:.0f} GB/s**" if copy_bw else "not recorded"),
    ]
    if gemm_rate:
        lines.append(
            f"- **bf16 GEMM rate** measured in this run ({meta.get('gemm_shape', 'torch.matmul')}): "
            f"**{gemm_rate:.0f} TFLOP/s**"
        )
    every = [v for _, vs in judged for v in vs]
    scored = [v for v in every if v.met is not None]
    unjudged = f", {len(every) - len(scored)} not judged" if len(scored) < len(every) else ""
    lines.append(f"- **Targets**: {sum(v.met for v in scored)} of {len(scored)} met{unjudged}")
    for failure in meta.get("failures") or []:
        lines.append(f"- **Failed**: {failure['op']} {failure['shape']}: {failure['error']}")
    lines += [
        "",
        "*GPU ms*: forward + backward (forward alone for GEMMs, one step for AdamW) captured once in",
        "a CUDA graph and replayed under `triton.testing.do_bench` (L2 flushed, median): kernel time",
        "only, what the targets judge; *not capturable* rows (host syncs) are judged on *per call ms*,",
        "an ordinary call under do_bench. *host us/call*: the median CPU time of one call started on",
        f"an idle GPU ({meta.get('host_calls', 200)} calls). *GB/s* counts the minimal bytes the op must move;",
        "*+MiB* is the peak memory of one call above its inputs, *transient* also above the gradients",
        "it leaves. *vs fastest other*: the fastest competitor's time over lstrain's (above 1: lstrain",
        "is faster). torch.compile: `dynamic=False`, reset per case, compile time excluded.",
    ]
    return lines


def _summary(judged: list[tuple[Case, list[Verdict]]]) -> list[str]:
    lines = ["## Targets", "", "| op | shape | impl | time | target |", "|---|---|---|---|---|"]
    for case, vs in judged:
        ms, per_call = time_ms(case.judged)
        time = "" if ms is None else f"{ms:.4f} ms" + (" per call" if per_call else "")
        targets = "; ".join(v.text() for v in vs)
        lines.append(f"| {case.op} | {case.shape} | {case.judged['impl']} | {time} | {targets} |")
    return lines


# ----------------------------------------------------------------------------- end-to-end training steps


def parse_e2e(data: dict) -> tuple[dict, list[dict]]:
    """Split ``benchmarks.e2e``'s JSON into its metadata and its rows.

    Args:
        data: the decoded e2e.json: ``{"format": 1, "meta": {...}, "rows": [...]}``.

    Returns:
        ``(meta, rows)``.

    Raises:
        ValueError: if ``data`` is not that layout.
    """
    if isinstance(data, dict) and isinstance(data.get("meta"), dict) and isinstance(data.get("rows"), list):
        return data["meta"], data["rows"]
    raise ValueError(f"not benchmarks.e2e's JSON: expected a dict with 'meta' and 'rows', got {data!r:.80}")


def _measured(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("status") == "ok" and _num(r.get("tokens_per_s"))]


def _judgeable(rows: list[dict]) -> list[dict]:
    """Measured rows whose loss is sane: a fast step that computes NaN judges nothing."""
    return [r for r in _measured(rows) if r.get("loss_ok", True)]


def _fastest(rows: list[dict]) -> dict | None:
    return max(rows, key=lambda r: r["tokens_per_s"], default=None)


def _short_by(value: float, limit: float) -> str:
    return f"missed by {100 * (1 - value / limit):.1f}%"


def e2e_verdicts(workload: dict, rows: list[dict]) -> tuple[dict | None, list[Verdict]]:
    """Judge one workload's targets on lstrain's fastest variant.

    A tokens/s target is met when that variant's tokens/s is at least the target; a speedup
    target when its tokens/s over the fastest competitor's is at least the ratio; a memory
    target when its peak memory is at most the named variant's, or at most a bound.

    Args:
        workload: the workload's entry in the run's ``meta["workloads"]`` (its targets:
            ``target_tokens_per_s``, ``target_speedup``, ``target_peak_vs``,
            ``target_peak_gib``, each may be None or absent).
        rows: the workload's rows.

    Returns:
        ``(judged, verdicts)``: lstrain's fastest measured row with a sane loss (None if
        none) and one verdict per target the workload has, in the order tokens/s, speedup,
        memory; rows whose loss is not sane take part neither as lstrain's nor as competitors.
    """
    measured = _judgeable(rows)
    best = _fastest([r for r in measured if is_ours(r["variant"])])
    rival = _fastest([r for r in measured if not is_ours(r["variant"])])
    none_ran = "not judged: no lstrain variant ran with a sane loss"
    out = []
    target = _num(workload.get("target_tokens_per_s"))
    if target is not None:
        label = f">= {target / 1e3:g}k tokens/s"
        if best is None:
            out.append(Verdict(label, None, none_ran))
        else:
            speed = best["tokens_per_s"]
            out.append(Verdict(label, speed >= target, _short_by(speed, target), f"{speed / 1e3:.1f}k"))
    ratio = _num(workload.get("target_speedup"))
    if ratio is not None:
        label = f">= {ratio:g}x the best competitor"
        if best is None or rival is None:
            out.append(Verdict(label, None, none_ran if best is None else "not judged: no competitor ran"))
        else:
            speedup = best["tokens_per_s"] / rival["tokens_per_s"]
            measured_text = f"{speedup:.2f}x {rival['variant']}"
            out.append(Verdict(label, speedup >= ratio, _short_by(speedup, ratio), measured_text))
    other_name = workload.get("target_peak_vs")
    if other_name:
        label = f"peak memory <= {other_name}'s"
        other = next((r for r in measured if r["variant"] == other_name), None)
        other_peak = _num(other.get("peak_gib")) if other else None
        peak = _num(best.get("peak_gib")) if best else None
        if best is None:
            out.append(Verdict(label, None, none_ran))
        elif other_peak is None:
            out.append(Verdict(label, None, f"not judged: no {other_name} peak in this run"))
        elif peak is None:
            out.append(Verdict(label, None, "not measured"))
        else:
            measured_text = f"{peak:.2f} vs {other_peak:.2f} GiB"
            out.append(Verdict(label, peak <= other_peak, _missed_by(peak, other_peak), measured_text))
    bound = _num(workload.get("target_peak_gib"))
    if bound is not None:
        label = f"peak memory <= {bound:.2f} GiB"
        peak = _num(best.get("peak_gib")) if best else None
        if best is None:
            out.append(Verdict(label, None, none_ran))
        elif peak is None:
            out.append(Verdict(label, None, "not measured"))
        else:
            out.append(Verdict(label, peak <= bound, _missed_by(peak, bound), f"{peak:.2f} GiB"))
    return best, out


def _cell(text: str, limit: int = 200) -> str:
    """Free text (an error message) made safe for a Markdown table cell."""
    text = " ".join(str(text).split())
    return (text[: limit - 3] + "..." if len(text) > limit else text).replace("|", "\\|")


def _loss(row: dict) -> str:
    loss = row.get("final_loss")
    if loss is None:
        return ""
    text = f"{loss:.3f}" if math.isfinite(loss) else str(loss)
    return text if row.get("loss_ok", True) else f"{text} (not sane)"


def _rounds(speeds: list[float | None]) -> str:
    """A variant's tokens/s over its rounds, as their range, e.g. ``116.0-119.2k in 3``."""
    measured = [s for s in speeds if _num(s)]
    failed = len(speeds) - len(measured)
    spread = f"{min(measured) / 1e3:.1f}-{max(measured) / 1e3:.1f}k in {len(measured)}"
    return spread + (f"; {failed} failed" if failed else "")


def _e2e_table(rows: list[dict], judged: dict | None) -> list[str]:
    """One workload's table: a row per variant, lstrain's judged one in bold."""
    rival = _fastest([r for r in _judgeable(rows) if not is_ours(r["variant"])])
    columns = ["variant", "setup", "tokens/s", "ms/step", "MFU", "peak GiB", "first step s", "final loss",
               "vs best competitor"]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    measured = {id(r) for r in _measured(rows)}
    for r in rows:
        bold = r is judged
        name = f"**{r['variant']}**" if bold else r["variant"]
        setup = _cell("; ".join(x for x in (r.get("setup"), r.get("precision")) if x))
        if id(r) not in measured:
            status = r.get("status", "?")
            why = r.get("reason") if status == "skipped" else r.get("error")
            lines.append("| " + " | ".join([name, setup, _cell(f"{status}: {why or ''}"), *[""] * 6]) + " |")
            continue
        tokens_per_s = r["tokens_per_s"]
        speed = f"{tokens_per_s / 1e3:.1f}k" if tokens_per_s >= 1e3 else f"{tokens_per_s:.3g}"
        speed = f"**{speed}**" if bold else speed
        if len(r.get("rounds_tokens_per_s") or ()) > 1:
            speed += f" ({_rounds(r['rounds_tokens_per_s'])})"
        mfu = _num(r.get("mfu"))
        versus = ""
        if is_ours(r["variant"]) and rival is not None:
            versus = f"{r['tokens_per_s'] / rival['tokens_per_s']:.2f}x vs {rival['variant']}"
        cells = [
            name,
            setup,
            speed,
            _fmt(r.get("ms_per_step"), ".2f"),
            "" if mfu is None else f"{100 * mfu:.1f}%",
            _fmt(r.get("peak_gib"), ".2f"),
            _fmt(r.get("compile_s"), ".1f"),
            _loss(r),
            versus,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _e2e_run_line(meta: dict) -> str:
    when = meta.get("date", "?") + (f", commit `{meta['commit']}`" if meta.get("commit") else "")
    versions = ", ".join(
        f"{name} {meta[key] or 'not installed'}"
        for name, key in (("torch", "torch"), ("triton", "triton"), ("transformers", "transformers"),
                          ("Liger-Kernel", "liger"))
        if key in meta
    )  # fmt: skip
    wall = f" ({meta['wall_s']:.0f} s of wall time)" if _num(meta.get("wall_s")) else ""
    gemm = _num(meta.get("gemm_tflops"))
    rate = f"; bf16 GEMM rate **{gemm:.0f} TFLOP/s** ({meta.get('gemm_shape', 'torch.matmul')})" if gemm else ""
    rounds = meta.get("rounds")
    median = f"; each row the median of {rounds} runs, in alternating order (their range beside it)" if rounds else ""
    return f"- Run: {meta.get('device', '?')}, {when}; {versions}; `{meta.get('command', '?')}`{wall}{rate}{median}"


def render_e2e(runs: list[dict]) -> list[str]:
    """The "End-to-end training steps" section: per run its device, versions and GEMM rate,
    per workload a table of its variants and the verdicts of its targets.

    Args:
        runs: decoded e2e.json files (one per ``python -m benchmarks.e2e`` run).

    Returns:
        The section's lines.

    Raises:
        ValueError: if one of them is not benchmarks.e2e's JSON.
    """
    lines = [
        "## End-to-end training steps (`python -m benchmarks.e2e`)",
        "",
        "Whole steps (forward, backward, clip at norm 1.0, AdamW), each variant in its own process, side by",
        "side in one run. *ms/step*: the median over the timed steps (CUDA events between steps, after the",
        "warm-up); *tokens/s* from it. *MFU*: 6N + 12LTD FLOPs per token (N: non-embedding parameters plus the",
        "LM head) times tokens/s over the bf16 GEMM rate of the same run. *peak GiB*: max_memory_allocated from",
        "model and optimizer construction on (warm-up and capture included). *first step s*: its wall time",
        "(torch.compile, Triton's JIT, the graph capture), not in ms/step. A sane loss is finite and near ln V",
        "(random tokens); a row without one is neither judged nor compared. The targets judge lstrain's",
        "fastest variant, in bold; *vs best competitor* is its tokens/s over the fastest competitor's.",
    ]
    for data in runs:
        meta, rows = parse_e2e(data)
        lines += ["", _e2e_run_line(meta)]
        workloads = dict(meta.get("workloads") or {})
        for row in rows:
            workloads.setdefault(row.get("workload", "?"), {})
        for name, workload in workloads.items():
            rows_of = [r for r in rows if r.get("workload") == name]
            if not rows_of:
                continue
            judged, verdicts_of = e2e_verdicts(workload, rows_of)
            facts = [f"`--workload {name}`"]
            if workload.get("steps"):
                facts.append(f"{workload.get('warmup')} warm-up + {workload['steps']} timed steps")
            if _num(workload.get("flops_per_token")):
                facts.append(f"{workload['flops_per_token'] / 1e9:.3g} GFLOP per token")
            lines += ["", f"**{workload.get('title', name)}** ({', '.join(facts)})", "", *_e2e_table(rows_of, judged)]
            if verdicts_of:
                on = f"on {judged['variant']}" if judged else "on lstrain's fastest variant"
                lines += ["", f"Targets ({on}): " + "; ".join(v.text() for v in verdicts_of)]
    return lines


def steady_tokens_per_s(records: list[dict]) -> float | None:
    """The median tokens/s of a training run's logged intervals after the first (which
    holds the compile or the capture), or the first's where it is the only one."""
    rates = [r["tokens_per_s"] for r in records if _num(r.get("tokens_per_s"))]
    steady = rates[1:] or rates
    if not steady:
        return None
    steady = sorted(steady)
    middle = len(steady) // 2
    return steady[middle] if len(steady) % 2 else (steady[middle - 1] + steady[middle]) / 2


def render_train(runs: list[dict], e2e: list[dict]) -> list[str]:
    """The "Training runs" section: per ``benchmarks.train_run`` run its device and
    command, per variant the losses, steady tokens/s, memory, and the ratio to the e2e row
    the run names (issue 31's check: within 5%).

    Args:
        runs: decoded train.json files.
        e2e: the report's decoded e2e.json files, where the reference rows are looked up
            (the first run holding the row, in the order given).

    Returns:
        The section's lines.
    """
    rows_of: dict[tuple, tuple[dict, dict]] = {}  # the first e2e run holding the row: the order given
    for data in e2e:
        meta, rows = parse_e2e(data)
        for r in rows:
            rows_of.setdefault((r.get("workload"), r.get("variant")), (r, meta))
    lines = [
        "## Training runs (`python -m benchmarks.train_run`)",
        "",
        "`lstrain train` on a recipe, each variant its own process. *tokens/s*: the median of the logged",
        "intervals after the first (which holds the compile or the capture); *vs e2e*: that over the e2e row",
        "the run names, judged within 5%.",
    ]
    for data in runs:
        meta = data.get("meta", {})
        when = meta.get("date", "?") + (f", commit `{meta['commit']}`" if meta.get("commit") else "")
        lines += ["", f"- Run: {meta.get('device', '?')}, {when}; torch {meta.get('torch', '?')}, triton "
                  f"{meta.get('triton', '?')}; `{meta.get('command', '?')}`"]  # fmt: skip
        reference, ref_meta = rows_of.get(tuple((meta.get("e2e_ref") or "/").split("/", 1)), ({}, {}))
        ref_speed = _num(reference.get("tokens_per_s"))
        ref_name = f"{meta.get('e2e_ref')}" + (f" at `{ref_meta['commit']}`" if ref_meta.get("commit") else "")
        lines += ["", "| variant | exit | steps | loss first -> last | tokens/s | memory MiB | vs e2e |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        for run in data.get("runs", []):
            logged = [r for r in run.get("records", []) if _num(r.get("loss"))]
            speed = steady_tokens_per_s(logged)
            losses = f"{logged[0]['loss']:.3f} -> {logged[-1]['loss']:.3f}" if logged else ""
            memory = max((r["memory_mib"] for r in logged if _num(r.get("memory_mib"))), default=None)
            versus = ""
            if speed and ref_speed:
                ratio = speed / ref_speed
                versus = f"{ratio:.3f} of {ref_name} ({'within' if abs(ratio - 1) <= 0.05 else 'beyond'} 5%)"
            cells = [
                f"`{run.get('name', '?')}`",
                str(run.get("returncode")),
                str(logged[-1]["step"]) if logged else "",
                losses,
                f"{speed / 1e3:.1f}k" if speed else "",
                f"{memory:,.0f}" if memory is not None else "",
                versus,
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def render_profiles(profiles: list[str]) -> list[str]:
    """The "Where a step's GPU time goes" section: the per-kernel table at the top of each
    ``benchmarks.e2e --profile`` file (its title, total and top kernels), verbatim.

    Args:
        profiles: the profile files' texts.

    Returns:
        The section's lines.
    """
    lines = ["## Where a step's GPU time goes (`python -m benchmarks.e2e --profile VARIANT`)"]
    for text in profiles:
        head = text.split("\n\n")[:3]  # the title, the total, the kernel table
        table = head[2].splitlines()[: PROFILE_KERNELS + 1] if len(head) > 2 else []
        totals = "; ".join(head[1].strip().splitlines()) if len(head) > 1 else ""  # busy time, span
        lines += ["", f"**{head[0].strip()}**: {totals}", "", "```", *table, "```"]
    return lines


def render(
    data: dict | list,
    e2e: list[dict] | None = None,
    train: list[dict] | None = None,
    later_ops: list[dict] | None = None,
    profiles: list[str] | None = None,
) -> str:
    """BENCHMARKS.md for one run.

    Args:
        data: the runner's decoded JSON (any layout ``parse`` reads).
        e2e: decoded e2e.json files of ``python -m benchmarks.e2e``; their section comes
            right after the header (whole steps are what judge the toolkit).
        train: decoded train.json files of ``python -m benchmarks.train_run``; their
            section follows the e2e one.
        later_ops: runner JSON of later runs of some ops only (ops added since ``data``'s
            run, or changed): each of their ops' tables replaces ``data``'s and cites its
            run; their targets join the summary.
        profiles: texts of ``benchmarks.e2e --profile`` files: their top kernels follow
            the training runs.

    Returns:
        The Markdown text, ending in a newline.

    Raises:
        ValueError: if ``data`` or a ``later_ops`` entry is not the runner's JSON, or an
            ``e2e`` entry not e2e.json's.
    """
    meta, rows = parse(data)
    sections = {op: (cases, meta) for op, cases in group(rows).items()}
    for later in later_ops or []:
        later_meta, later_rows = parse(later)
        sections |= {op: (cases, later_meta) for op, cases in group(later_rows).items()}
    judged = [(c, verdicts(c)) for cases, _ in sections.values() for c in cases]
    judged = [(c, vs) for c, vs in judged if vs]
    lines = _header(meta, judged)
    if e2e:
        lines += ["", *render_e2e(e2e)]
    if train:
        lines += ["", *render_train(train, e2e or [])]
    if profiles:
        lines += ["", *render_profiles(profiles)]
    if judged:
        lines += ["", *_summary(judged)]
    for op, (cases, run_meta) in sections.items():
        title = (run_meta.get("titles") or {}).get(op, op)
        lines += ["", f"## {title} (`--op {op}`)", ""]
        if run_meta is not meta:
            lines += [_run_line("Measured in a later run", run_meta) + f"; `{run_meta.get('command', '?')}`", ""]
        lines += _table(cases, run_meta)
    return "\n".join(lines) + "\n"


def _run_line(name: str, meta: dict) -> str:
    parts = [meta.get("device", "?"), meta.get("date", "?")]
    if meta.get("commit"):
        parts.append(f"commit {meta['commit']}")
    if _num(meta.get("copy_bandwidth_gbs")):
        parts.append(f"copy bandwidth {meta['copy_bandwidth_gbs']:.0f} GB/s")
    return f"{name}: " + ", ".join(parts)


def compare(before: dict | list, after: dict | list, threshold: float = NOISE) -> tuple[str, int]:
    """Set the lstrain rows of two runs side by side.

    Args:
        before: the earlier run's decoded JSON (any layout).
        after: the later run's.
        threshold: the relative difference of GPU time beyond which a row is flagged.

    Returns:
        ``(text, flagged)``: an aligned table (op, shape, impl, before ms, after ms, after
        over before, a flag) with a summary line, and how many rows differ beyond the
        threshold. A row present in one run only is listed with the other side blank and
        is not counted as flagged.

    Raises:
        ValueError: if either is not the runner's JSON, or ``threshold`` is negative.
    """
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    before_meta, before_rows = parse(before)
    after_meta, after_rows = parse(after)

    def ours(rows):
        return {(r["op"], r["shape"], r["impl"]): r for r in rows if is_ours(r["impl"])}

    old, new = ours(before_rows), ours(after_rows)
    keys = list(old) + [k for k in new if k not in old]
    table = [("op", "shape", "impl", "before ms", "after ms", "ratio", "")]
    flagged = compared = 0
    for key in keys:
        t0, per_call0 = time_ms(old[key]) if key in old else (None, False)
        t1, per_call1 = time_ms(new[key]) if key in new else (None, False)
        ratio = flag = ""
        if t0 is not None and t1 is not None:
            compared += 1
            ratio = f"{t1 / t0:.3f}"
            if abs(t1 / t0 - 1) > threshold:
                flagged += 1
                flag = "<< slower" if t1 > t0 else "<< faster"
        elif key not in old or key not in new:
            flag = "only after" if key not in old else "only before"

        def cell(t, per_call):
            return "" if t is None else f"{t:.4f}" + (" (per call)" if per_call else "")

        table.append((*key, cell(t0, per_call0), cell(t1, per_call1), ratio, flag))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    numeric = {3, 4, 5}
    lines = [_run_line("before", before_meta), _run_line("after ", after_meta), ""]
    for row in table:
        cells = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    lines += [
        "",
        f"{compared} rows compared (GPU ms, lstrain implementations); {flagged} differ by more than "
        f"{100 * threshold:g}%.",
    ]
    return "\n".join(lines) + "\n", flagged


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring).

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0, or 1 where the report would exceed ``MAX_LINES`` (nothing is
        written then).
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", type=Path, default=Path("bench-out/results.json"))
    parser.add_argument("--out", type=Path, default=Path("BENCHMARKS.md"))
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--threshold", type=float, default=NOISE, help="--compare's noise threshold (default 0.03)")
    parser.add_argument("--e2e", action="append", type=Path, default=[], metavar="E2E_JSON",
                        help="benchmarks.e2e's e2e.json: the end-to-end section (repeatable: one per run)")  # fmt: skip
    parser.add_argument("--later-ops", action="append", type=Path, default=[], metavar="RESULTS_JSON",
                        help="a later run of some ops: their tables replace the main run's (repeatable)")  # fmt: skip
    parser.add_argument("--profile", action="append", type=Path, default=[], metavar="PROFILE_TXT",
                        help="benchmarks.e2e --profile's file: its top kernels (repeatable)")  # fmt: skip
    parser.add_argument("--train", action="append", type=Path, default=[], metavar="TRAIN_JSON",
                        help="benchmarks.train_run's train.json: the training-runs section (repeatable)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.compare:
        before, after = (json.loads(path.read_text()) for path in args.compare)
        text, _ = compare(before, after, args.threshold)
        print(text, end="")
        return 0
    text = render(
        json.loads(args.results.read_text()),
        [json.loads(path.read_text()) for path in args.e2e],
        [json.loads(path.read_text()) for path in args.train],
        [json.loads(path.read_text()) for path in args.later_ops],
        [path.read_text() for path in args.profile],
    )
    lines = text.count("\n")
    if lines > MAX_LINES:
        print(f"the report has {lines} lines, more than {MAX_LINES}: not written to {args.out}", file=sys.stderr)
        return 1
    args.out.write_text(text)
    sources = ", ".join(str(p) for p in [args.results, *args.later_ops, *args.e2e, *args.train, *args.profile])
    print(f"{args.out}: {lines} lines from {sources}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
