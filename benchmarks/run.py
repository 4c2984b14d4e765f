"""Benchmark runner: lstrain beside eager PyTorch, torch.compile and Liger-Kernel.

    python -m benchmarks.run --out bench-out                 # every op, every implementation
    python -m benchmarks.run --quick --out bench-out         # the same GPU times, host time over fewer calls
    python -m benchmarks.run --op layer_norm --lstrain-only  # one op, lstrain's implementations only
    python -m benchmarks.report bench-out/results.json       # BENCHMARKS.md from the run

First it measures the device's copy bandwidth (a 4 GiB device-to-device copy, bytes read
plus written) and its bf16 GEMM rate (an 8192 x 8192 x 8192 ``torch.matmul``), which the
report relates every row to. Then for every case and implementation, on one GPU:
  * GPU time of forward+backward: ``torch.autograd.grad(f(*inputs), inputs, dy)``
    captured once in a CUDA graph, the graph replayed under ``triton.testing.do_bench``
    (L2 flushed, median) -- kernels only, no Python;
  * time per ordinary call (``y = f(...); y.backward(dy)``, grads reset to None) under do_bench;
  * host microseconds per ordinary call, two ways: the median over 200 calls of one
    call's wall time, each started on an idle GPU (what the call itself costs the CPU),
    and perf_counter over 200 back-to-back calls, no sync inside (which
    turns into GPU time once the launch queue fills, i.e. whenever the GPU is the slower);
  * peak memory during one call above the inputs (+MiB), and above the inputs and the
    gradients the call leaves behind (+MiB transient: what competitors' reports quote);
  * GB/s on the minimal-bytes model and % of the device copy bandwidth measured here
    (from the per-call time where an implementation cannot be captured), and TFLOP/s
    for GEMM-bound cases.
Forward-only cases (GEMMs, the optimizer step) are timed the same way without backward.
torch.compile uses ``dynamic=False`` and is reset for every case; compile time is excluded.

Wall time: a full run on one H200 from a fresh machine was estimated (not measured) at
7-8 minutes: about 2.5 minutes in the host-time loops (400 calls per implementation; the
long ones dominate: linear + cross-entropy at 40-55 ms a call, the SwiGLU MLP at 20 ms),
about 3 minutes compiling (torch.compile's 16 cases, lstrain's and Liger's Triton
kernels), under a minute in do_bench. ``--quick`` times the host over 20 calls instead of
200 (about 2 minutes less); every GPU time, per-call time and memory figure is measured
exactly as in a full run. Each row records its wall time (``wall_s``), the run its total.

Writes ``results.json`` under ``--out`` after every case (a run stopped part-way keeps its
figures) and ``results.md``, the report ``python -m benchmarks.report`` makes of it. JSON
layout: ``{"format": 2, "meta": {...}, "rows": [...]}``, the fields in ``run_meta`` and
``make_row``; a failed case is listed in ``meta["failures"]`` and costs no other case.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from benchmarks import report
from benchmarks.specs import REGISTRY, STEP_REGISTRY, TITLES, BenchCase, StepCase

FORMAT = 2  # the JSON layout's version; benchmarks.report also reads the unversioned earlier ones
HOST_CALLS = 200
QUICK_HOST_CALLS = 20
GEMM_SIZE = 8192


def copy_bandwidth_gbs(gib: int = 4) -> float:
    """Device-to-device copy of ``gib`` GiB; bytes read plus written over the median time."""
    src = torch.empty(gib * 2**30, dtype=torch.uint8, device="cuda")
    src.random_(0, 255)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * gib * 2**30 / (ms * 1e-3) / 1e9


def gemm_tflops(size: int = GEMM_SIZE) -> float:
    """bf16 TFLOP/s of a ``size`` x ``size`` x ``size`` ``torch.matmul`` (cuBLAS), median under do_bench."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.empty(size, size, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: torch.matmul(a, b, out=out), warmup=50, rep=300, return_mode="median")
    return 2 * size**3 / (ms * 1e-3) / 1e12


def git_commit() -> str | None:
    """The checkout's short commit, ``-dirty`` appended where tracked files differ from it;
    None outside a git checkout (the device machine may get the files without ``.git``)."""
    repo = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=30
        )
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=repo, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("-dirty" if status.returncode == 0 and status.stdout.strip() else "")


def liger_version() -> str | None:
    """Liger-Kernel's installed version, None where it is not installed."""
    try:
        return importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return None


def run_meta(argv: list[str], host_calls: int, quick: bool) -> dict:
    """The run's metadata before any case: device, versions, date, command, the copy
    bandwidth and the bf16 GEMM rate (both measured now, on this GPU).

    Args:
        argv: the runner's arguments (``sys.argv[1:]``), recorded as the command.
        host_calls: calls per host-time measurement.
        quick: whether ``--quick`` was given.

    Returns:
        The ``meta`` dict of results.json: ``device``, ``cuda``, ``torch``, ``triton``,
        ``liger`` (None: not installed), ``date`` (ISO), ``command``, ``commit`` (None outside
        git), ``copy_bandwidth_gbs``, ``gemm_tflops``, ``gemm_shape``, ``quick``,
        ``host_calls``, ``titles`` (op -> section title); ``wall_s`` (seconds so far) and
        ``failures`` (``{op, shape, error}`` per failed case) are kept up to date by ``main``.
    """
    meta = {
        "device": torch.cuda.get_device_name(),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "liger": liger_version(),
        "date": datetime.date.today().isoformat(),
        "command": shlex.join(["python", "-m", "benchmarks.run", *argv]),
        "commit": git_commit(),
        "copy_bandwidth_gbs": copy_bandwidth_gbs(),
    }
    torch.cuda.empty_cache()
    meta |= {
        "gemm_tflops": gemm_tflops(),
        "gemm_shape": f"{GEMM_SIZE} x {GEMM_SIZE} x {GEMM_SIZE} torch.matmul",
        "quick": quick,
        "host_calls": host_calls,
        "titles": TITLES,
        "wall_s": 0.0,
        "failures": [],
    }
    torch.cuda.empty_cache()
    return meta


def _grad_tensors(inputs: dict, names: list[str]) -> list[torch.Tensor]:
    return [inputs[n] for n in names]


def graph_replay_ms(step) -> float:
    """GPU time of ``step()`` replayed from a CUDA graph (warmed up on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ms = do_bench(graph.replay, warmup=50, rep=300, return_mode="median")
    del graph
    return ms


def host_us(step, calls: int = HOST_CALLS) -> tuple[float, float]:
    """Host microseconds per ``step()``: the median of ``calls`` calls each started on an
    idle GPU, and ``calls`` back to back (see the module docstring)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    back_to_back = (time.perf_counter() - start) / calls * 1e6
    single = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        single.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return sorted(single)[len(single) // 2] * 1e6, back_to_back


def graph_ms(fn, inputs: dict, grad_names: list[str], dy: torch.Tensor) -> float:
    """GPU ms of ``fn``'s forward + backward (``torch.autograd.grad``) from a CUDA graph."""
    tensors = _grad_tensors(inputs, grad_names)
    return graph_replay_ms(lambda: torch.autograd.grad(fn(**inputs), tensors, dy))


def call_ms_host_us_peak(
    fn, inputs: dict, grad_names: list[str], dy: torch.Tensor, host_calls: int
) -> tuple[float, float, float, float, float]:
    """An ordinary call's figures: ms under do_bench, host us (idle-GPU median, back to
    back, over ``host_calls`` calls), +MiB peak and +MiB transient (see the module docstring)."""
    tensors = _grad_tensors(inputs, grad_names)

    def call():
        for t in tensors:
            t.grad = None
        fn(**inputs).backward(dy)

    for _ in range(3):
        call()
    ms = do_bench(call, warmup=25, rep=200, grad_to_none=tensors, return_mode="median")
    host, host_back_to_back = host_us(call, host_calls)
    for t in tensors:
        t.grad = None
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
    grads_mib = sum(t.grad.numel() * t.grad.element_size() for t in tensors if t.grad is not None) / 2**20
    return ms, host, host_back_to_back, peak_mib, peak_mib - grads_mib


def step_peak_mib(step) -> tuple[float, float]:
    """Peak memory of one ``step()`` above what was allocated before it, and above that and
    what the step leaves allocated (its transient memory), MiB."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()  # the result, if any, is dropped here, as a caller that only steps would
    torch.cuda.synchronize()
    peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
    kept_mib = (torch.cuda.memory_allocated() - base) / 2**20
    return peak_mib, peak_mib - kept_mib


def make_row(
    case: BenchCase | StepCase,
    impl: str,
    gpu: float | None,
    call: float,
    host: tuple[float | None, float | None],
    memory: tuple[float, float],
    bandwidth: float,
    wall_s: float,
) -> dict:
    """One implementation's figures for results.json.

    Args:
        case: the case measured.
        impl: the implementation's name.
        gpu: GPU ms from a CUDA graph replay; None where the implementation cannot be captured.
        call: ms per ordinary call under do_bench.
        host: host us per call (idle-GPU median, back to back); None where not measured.
        memory: +MiB peak and +MiB transient.
        bandwidth: the copy bandwidth measured in this run, GB/s.
        wall_s: seconds this implementation's measurements took (compilation included).

    Returns:
        The row: ``op``, ``shape``, ``impl``, ``gpu_ms``, ``call_ms``, ``host_us``,
        ``host_us_back_to_back``, ``peak_mib``, ``transient_mib``, ``gbs``, ``pct_copy_bw``
        (both from the GPU time, else the per-call time), ``min_bytes``, ``target_ms``,
        ``tflops`` (None without flops), then ``flops``, ``target_transient_mib``,
        ``target_vs_impl`` and ``target_vs_ratio`` (see ``BenchCase.target_vs``), ``wall_s``.
    """
    ms = gpu if gpu is not None else call
    gbs = case.min_bytes / (ms * 1e-3) / 1e9
    target_vs_impl, target_vs_ratio = case.target_vs or (None, None)
    return {
        "op": case.op,
        "shape": case.label,
        "impl": impl,
        "gpu_ms": gpu,
        "call_ms": call,
        "host_us": host[0],
        "host_us_back_to_back": host[1],
        "peak_mib": memory[0],
        "transient_mib": memory[1],
        "gbs": gbs,
        "pct_copy_bw": 100 * gbs / bandwidth,
        "min_bytes": case.min_bytes,
        "target_ms": case.target_ms,
        "tflops": case.flops / (ms * 1e-3) / 1e12 if case.flops else None,
        "flops": case.flops or None,
        "target_transient_mib": case.target_transient_mib,
        "target_vs_impl": target_vs_impl,
        "target_vs_ratio": target_vs_ratio,
        "wall_s": wall_s,
    }


def _print_row(r: dict) -> None:
    gpu = f"{r['gpu_ms']:8.4f} ms" if r["gpu_ms"] is not None else "     n/a   "
    host = f"host {r['host_us']:7.1f} us ({r['host_us_back_to_back']:7.1f} back to back)" if r["host_us"] else ""
    tflops = f"  {r['tflops']:6.1f} TFLOP/s" if r["tflops"] else ""
    print(
        f"{r['op']:<18} {r['shape']:<36} {r['impl']:<26} gpu {gpu}  call {r['call_ms']:8.4f} ms  {host}  "
        f"{r['gbs']:7.0f} GB/s ({r['pct_copy_bw']:5.1f}%)  +{r['peak_mib']:8.1f} MiB "
        f"(transient +{r['transient_mib']:8.1f}){tflops}  [{r['wall_s']:.1f} s]",
        flush=True,
    )


def run_case(case: BenchCase, bandwidth: float, wanted: Callable[[str], bool], host_calls: int) -> list[dict]:
    """Forward + backward of each wanted implementation of ``case`` (see the module docstring).

    Args:
        case: the case.
        bandwidth: the copy bandwidth measured in this run, GB/s.
        wanted: which implementations to run, by name.
        host_calls: calls per host-time measurement.

    Returns:
        A row per implementation run (``make_row``).
    """
    rows = []
    inputs = case.make_inputs()
    reference = None
    for name, fn in case.implementations.items():
        if not wanted(name):
            continue
        start = time.perf_counter()
        if name == "torch.compile":
            torch._dynamo.reset()
            fn = torch.compile(fn, dynamic=False)
        out = fn(**inputs)
        dy = torch.ones_like(out) if case.unit_grad_output else torch.randn_like(out)
        if reference is None or not case.same_outputs:
            reference = out.detach().float()
        else:
            diff = (out.detach().float() - reference).abs().max().item()
            if not diff < 0.05:
                print(f"warning: {case.op} {name} differs from the first implementation by {diff}")
        del out
        if name in case.host_syncing:
            print(f"{case.op} {name}: synchronises with the host, not capturable in a CUDA graph")
            gpu = None
        else:
            gpu = graph_ms(fn, inputs, case.grad_inputs, dy)
        call, host, host_back_to_back, peak, transient = call_ms_host_us_peak(
            fn, inputs, case.grad_inputs, dy, host_calls
        )
        wall = time.perf_counter() - start
        rows.append(make_row(case, name, gpu, call, (host, host_back_to_back), (peak, transient), bandwidth, wall))
        _print_row(rows[-1])
    return rows


def run_step_case(case: StepCase, bandwidth: float, wanted: Callable[[str], bool], host_calls: int) -> list[dict]:
    """Forward-only work (optimizer steps, GEMMs), each implementation built on fresh inputs:
    do_bench of one call; for capturable cases also the GPU time of a CUDA graph replay and
    the host time per call; the peak memory of one call.

    Args:
        case: the case.
        bandwidth: the copy bandwidth measured in this run, GB/s.
        wanted: which implementations to run, by name.
        host_calls: calls per host-time measurement.

    Returns:
        A row per implementation run (``make_row``); a case that is not capturable has its
        per-call time as ``gpu_ms`` (what it is judged on) and no host time.
    """
    rows = []
    for name, build in case.implementations.items():
        if not wanted(name):
            continue
        start = time.perf_counter()
        step = build(case.make)
        step()
        call = do_bench(step, warmup=25, rep=200, return_mode="median")
        ms = graph_replay_ms(step) if case.capturable else call
        host = host_us(step, host_calls) if case.capturable else (None, None)
        memory = step_peak_mib(step)
        wall = time.perf_counter() - start
        rows.append(make_row(case, name, ms, call, host, memory, bandwidth, wall))
        _print_row(rows[-1])
        del step
        torch.cuda.empty_cache()
    return rows


def implementation_filter(impls: list[str] | None, lstrain_only: bool) -> Callable[[str], bool]:
    """Which implementations a run measures.

    Args:
        impls: names given with ``--impl`` (exact), or None.
        lstrain_only: ``--lstrain-only``: every implementation whose name starts with ``lstrain``.

    Returns:
        A predicate on implementation names: everything when neither option is given, else
        the union of the two selections.
    """
    names = set(impls or ())
    if not names and not lstrain_only:
        return lambda name: True
    return lambda name: name in names or (lstrain_only and report.is_ours(name))


def main(argv: list[str] | None = None) -> None:
    """The command line (see the module docstring).

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Raises:
        SystemExit: without a CUDA GPU.
    """
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--op",
        action="append",
        choices=sorted(REGISTRY) + sorted(STEP_REGISTRY),
        help="op to run (repeatable; default all)",
    )
    parser.add_argument("--impl", action="append", help="only these implementations, by exact name (repeatable)")
    parser.add_argument(
        "--lstrain-only", action="store_true", help="only lstrain's implementations (names starting with lstrain)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"host time over {QUICK_HOST_CALLS} calls instead of {HOST_CALLS}; GPU times unchanged",
    )
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks need a CUDA GPU")
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    host_calls = QUICK_HOST_CALLS if args.quick else HOST_CALLS
    meta = run_meta(argv, host_calls, args.quick)
    print(
        f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, "
        f"Liger-Kernel {meta['liger'] or 'not installed'}: "
        f"copy bandwidth {meta['copy_bandwidth_gbs']:.0f} GB/s, bf16 GEMM {meta['gemm_tflops']:.0f} TFLOP/s",
        flush=True,
    )
    bandwidth = meta["copy_bandwidth_gbs"]
    wanted = implementation_filter(args.impl, args.lstrain_only)
    rows = []
    for op in args.op or [*REGISTRY, *STEP_REGISTRY]:
        cases = STEP_REGISTRY[op]() if op in STEP_REGISTRY else REGISTRY[op]()
        run = run_step_case if op in STEP_REGISTRY else run_case
        for case in cases:
            try:
                rows.extend(run(case, bandwidth, wanted, host_calls))
            except Exception as error:  # one broken case must not cost the figures of the others
                traceback.print_exc()
                print(f"{op} {case.label}: failed, see the traceback above", flush=True)
                message = " ".join(f"{type(error).__name__}: {error}".split())
                meta["failures"].append({"op": op, "shape": case.label, "error": message[:300]})
            torch.cuda.empty_cache()
            meta["wall_s"] = time.perf_counter() - started
            results = {"format": FORMAT, "meta": meta, "rows": rows}
            # Written after every case so that a run stopped part-way still leaves its figures.
            (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
            (args.out / "results.md").write_text(report.render(results))
    print(
        f"{len(rows)} rows in {meta['wall_s']:.0f} s, failed cases: {len(meta['failures'])}; "
        f"{args.out / 'results.json'}; BENCHMARKS.md: python -m benchmarks.report {args.out / 'results.json'}"
    )


if __name__ == "__main__":
    main()
