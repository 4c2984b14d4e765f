"""Benchmark runner: lstrain beside eager PyTorch, torch.compile and Liger-Kernel.

    python -m benchmarks.run --op layer_norm --op attention_softmax --out bench-out

For every case and implementation it measures, on one GPU, in one run:
  * GPU time of forward+backward: ``torch.autograd.grad(f(*inputs), inputs, dy)``
    captured once in a CUDA graph, the graph replayed under ``triton.testing.do_bench``
    (L2 flushed, median) -- kernels only, no Python;
  * time per ordinary call (``y = f(...); y.backward(dy)``, grads reset to None) under do_bench;
  * host microseconds per ordinary call, two ways: the median over 200 calls of one
    call's wall time, each started on an idle GPU (what the call itself costs the CPU),
    and ANCHORS.md's perf_counter over 200 back-to-back calls, no sync inside (which
    turns into GPU time once the launch queue fills, i.e. whenever the GPU is the slower);
  * peak memory during one call above the inputs (+MiB), and above the inputs and the
    gradients the call leaves behind (+MiB transient: what ANCHORS.md reports);
  * GB/s on the minimal-bytes model and % of the device copy bandwidth measured here
    (from the per-call time where an implementation cannot be captured), and TFLOP/s
    for GEMM-bound cases.
torch.compile uses ``dynamic=False`` and is reset for every case; compile time is excluded.
Writes ``results.json`` and ``results.md`` (rows for BENCHMARKS.md) under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
import traceback
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from benchmarks.specs import REGISTRY, STEP_REGISTRY, BenchCase, StepCase


def copy_bandwidth_gbs(gib: int = 4) -> float:
    """Device-to-device copy of ``gib`` GiB; bytes read plus written over the median time."""
    src = torch.empty(gib * 2**30, dtype=torch.uint8, device="cuda")
    src.random_(0, 255)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * gib * 2**30 / (ms * 1e-3) / 1e9


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


def host_us(step) -> tuple[float, float]:
    """Host microseconds per ``step()``: the median of 200 calls each started on an idle
    GPU, and 200 back to back (see the module docstring)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        step()
    back_to_back = (time.perf_counter() - start) / 200 * 1e6
    single = []
    for _ in range(200):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        single.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return sorted(single)[len(single) // 2] * 1e6, back_to_back


def graph_ms(fn, inputs: dict, grad_names: list[str], dy: torch.Tensor) -> float:
    tensors = _grad_tensors(inputs, grad_names)
    return graph_replay_ms(lambda: torch.autograd.grad(fn(**inputs), tensors, dy))


def call_ms_host_us_peak(
    fn, inputs: dict, grad_names: list[str], dy: torch.Tensor
) -> tuple[float, float, float, float, float]:
    tensors = _grad_tensors(inputs, grad_names)

    def call():
        for t in tensors:
            t.grad = None
        fn(**inputs).backward(dy)

    for _ in range(3):
        call()
    ms = do_bench(call, warmup=25, rep=200, grad_to_none=tensors, return_mode="median")
    host, host_back_to_back = host_us(call)
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


def run_case(case: BenchCase, bandwidth: float, only: set[str] | None) -> list[dict]:
    rows = []
    inputs = case.make_inputs()
    reference = None
    for name, fn in case.implementations.items():
        if only and name not in only:
            continue
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
        call, host, host_back_to_back, peak, transient = call_ms_host_us_peak(fn, inputs, case.grad_inputs, dy)
        gbs = case.min_bytes / ((gpu or call) * 1e-3) / 1e9
        rows.append(
            {
                "op": case.op,
                "shape": case.label,
                "impl": name,
                "gpu_ms": gpu,
                "call_ms": call,
                "host_us": host,
                "host_us_back_to_back": host_back_to_back,
                "peak_mib": peak,
                "transient_mib": transient,
                "gbs": gbs,
                "pct_copy_bw": 100 * gbs / bandwidth,
                "min_bytes": case.min_bytes,
                "target_ms": case.target_ms,
                "tflops": case.flops / ((gpu or call) * 1e-3) / 1e12 if case.flops else None,
            }
        )
        r = rows[-1]
        gpu_text = f"{gpu:8.4f} ms" if gpu is not None else "     n/a"
        tflops = f"  {r['tflops']:6.1f} TFLOP/s" if r["tflops"] else ""
        print(
            f"{case.op:<18} {case.label:<36} {name:<14} gpu {gpu_text}  call {call:8.4f} ms  host {host:7.1f} us "
            f"({host_back_to_back:7.1f} back to back)  {gbs:7.0f} GB/s ({r['pct_copy_bw']:5.1f}%)  +{peak:8.1f} MiB "
            f"(transient +{transient:8.1f}){tflops}",
            flush=True,
        )
    return rows


def run_step_case(case: StepCase, bandwidth: float, only: set[str] | None) -> list[dict]:
    """Forward-only work (optimizer steps, GEMMs), each implementation built on fresh inputs:
    do_bench of one call; for capturable cases also the GPU time of a CUDA graph replay and
    the host time per call."""
    rows = []
    for name, build in case.implementations.items():
        if only and name not in only:
            continue
        step = build(case.make)
        step()
        call = do_bench(step, warmup=25, rep=200, return_mode="median")
        ms = graph_replay_ms(step) if case.capturable else call
        host, host_back_to_back = host_us(step) if case.capturable else (float("nan"), float("nan"))
        gbs = case.min_bytes / (ms * 1e-3) / 1e9
        rows.append(
            {
                "op": case.op,
                "shape": case.label,
                "impl": name,
                "gpu_ms": ms,
                "call_ms": call,
                "host_us": host,
                "host_us_back_to_back": host_back_to_back,
                "peak_mib": 0.0,
                "transient_mib": 0.0,
                "gbs": gbs,
                "pct_copy_bw": 100 * gbs / bandwidth,
                "min_bytes": case.min_bytes,
                "target_ms": case.target_ms,
                "tflops": case.flops / (ms * 1e-3) / 1e12 if case.flops else None,
            }
        )
        tflops = f"  {rows[-1]['tflops']:6.1f} TFLOP/s" if case.flops else ""
        print(
            f"{case.op:<18} {case.label:<36} {name:<40} {ms:8.4f} ms (call {call:8.4f})  host {host:7.1f} us  "
            f"{gbs:7.0f} GB/s{tflops}",
            flush=True,
        )
        del step
        torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| op | shape | impl | GPU fwd+bwd ms | per call ms | host us/call | host us, back to back | GB/s "
        "| % of copy BW | +MiB | +MiB transient | TFLOP/s | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        target = ""
        if r["impl"] == "lstrain" and r["target_ms"] and r["gpu_ms"] is not None:
            met = "met" if r["gpu_ms"] <= r["target_ms"] else "missed"
            target = f"<= {r['target_ms']} ms: {met}"
        gpu = f"{r['gpu_ms']:.4f}" if r["gpu_ms"] is not None else "not capturable"
        tflops = f"{r['tflops']:.0f}" if r["tflops"] else ""
        lines.append(
            f"| {r['op']} | {r['shape']} | {r['impl']} | {gpu} | {r['call_ms']:.4f} | {r['host_us']:.0f} | "
            f"{r['host_us_back_to_back']:.0f} | {r['gbs']:.0f} | {r['pct_copy_bw']:.1f} | {r['peak_mib']:.1f} | "
            f"{r['transient_mib']:.1f} | {tflops} | {target} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--op",
        action="append",
        choices=sorted(REGISTRY) + sorted(STEP_REGISTRY),
        help="op to run (repeatable; default all)",
    )
    parser.add_argument("--impl", action="append", help="only these implementations (repeatable)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks need a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    bandwidth = copy_bandwidth_gbs()
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.date.today().isoformat(),
        "copy_bandwidth_gbs": bandwidth,
        "command": "python -m benchmarks.run " + " ".join(f"--op {o}" for o in (args.op or [])),
    }
    print(f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}: copy bandwidth {bandwidth:.0f} GB/s")
    rows = []
    only = set(args.impl) if args.impl else None
    for op in args.op or [*REGISTRY, *STEP_REGISTRY]:
        cases = STEP_REGISTRY[op]() if op in STEP_REGISTRY else REGISTRY[op]()
        run = run_step_case if op in STEP_REGISTRY else run_case
        for case in cases:
            try:
                rows.extend(run(case, bandwidth, only))
            except Exception:  # one broken case must not cost the figures of the others
                traceback.print_exc()
                print(f"{op} {case.label}: failed, see the traceback above", flush=True)
            torch.cuda.empty_cache()
            # Written after every case so that a run stopped part-way still leaves its figures.
            (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
            (args.out / "results.md").write_text(markdown(rows) + "\n")
    print(markdown(rows))


if __name__ == "__main__":
    main()
