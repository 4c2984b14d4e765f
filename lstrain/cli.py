"""The ``lstrain`` command.

``lstrain check``: property-based gradient checks of every fused op on this machine's
device (the GPU if there is one, else the Triton interpreter on the CPU), printed as a
table; exit code 1 if any check fails. The (op, dtype) rows run in parallel processes:
on a GPU a check is bound by Triton compiling its kernels' variants on one CPU core
(well over 1100 distinct compilations for all rows), so the cores share that work.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing
import os
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

__all__ = ["main"]


@dataclass
class _Tally:
    """What one (op, dtype) row of the check table saw."""

    shapes: list[str] = field(default_factory=list)
    worst_error: float = 0.0
    worst_allowed: float = 0.0
    worst_ratio: float = 0.0
    backends: set[str] = field(default_factory=set)
    failure: str | None = None
    seconds: float = 0.0


def _check_op(op_check, device: str, dtype, examples: int, fixed: bool) -> _Tally:
    from hypothesis import HealthCheck, given, settings

    tally = _Tally()

    @settings(max_examples=examples, deadline=None, database=None, derandomize=fixed,
              suppress_health_check=list(HealthCheck), print_blob=False)  # fmt: skip
    @given(case=op_check.cases(device, dtype))
    def run(case):
        result = op_check.run(case, device)
        tally.shapes.append(op_check.describe(case))
        tally.backends.update(result.backends)
        for c in result.comparisons:
            ratio = float("inf") if not c.passed else c.error / c.allowed if c.allowed > 0 else 0.0
            if ratio >= tally.worst_ratio:
                tally.worst_ratio, tally.worst_error, tally.worst_allowed = ratio, c.error, c.allowed
        bad = [c.message() for c in result.comparisons if not c.passed]
        if bad:
            tally.failure = f"{case}: " + "; ".join(bad)
            raise AssertionError(tally.failure)

    start = time.perf_counter()
    try:
        run()
    except AssertionError:
        pass  # the last (shrunk) failure is in tally.failure
    tally.seconds = time.perf_counter() - start
    return tally


def _use_device(device: str) -> None:
    """Prepare this process for checks on ``device``: on the CPU the interpreter must be
    switched on before any lstrain kernel is defined."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
        # numpy's float warnings from the interpreter (e.g. -inf - -inf in masked lanes)
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")


def _check_row(name: str, dtype_name: str, device: str, examples: int, fixed: bool) -> _Tally:
    """One (op, dtype) row of the table (in this process, or in a worker of the pool)."""
    _use_device(device)
    import torch

    from lstrain.testing.checks import OP_CHECKS

    return _check_op(OP_CHECKS[name], device, getattr(torch, dtype_name), examples, fixed)


def _shape_summary(shapes: list[str]) -> str:
    if not shapes:
        return "-"
    sizes = sorted(shapes, key=lambda s: math.prod(int(n) for n in s.split("x")))
    return f"{len(shapes)} ({sizes[0]} .. {sizes[-1]})"


def _check(args: argparse.Namespace) -> int:
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    _use_device(device)
    from lstrain import _backend
    from lstrain.testing.checks import OP_CHECKS

    if device == "cpu" and not _backend.interpreter_active():
        print("lstrain check: lstrain.ops was imported before the interpreter could be enabled", file=sys.stderr)
        return 2
    unknown = sorted(set(args.ops) - set(OP_CHECKS))
    if unknown:
        print(f"lstrain check: unknown op(s) {', '.join(unknown)}; known: {', '.join(OP_CHECKS)}", file=sys.stderr)
        return 2
    ops = {
        name: [str(d).removeprefix("torch.") for d in OP_CHECKS[name].dtypes(device)] for name in args.ops or OP_CHECKS
    }
    rows = [(name, dtype) for name, dtypes in ops.items() for dtype in dtypes]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    # a worker on a GPU holds a CUDA context (~0.5 GB): at most 8 unless asked
    jobs = min(args.jobs or min(cores, 8 if device == "cuda" else cores), len(rows))
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"
    print(
        f"lstrain check on {where}: {args.examples} hypothesis examples per op and dtype, "
        f"tolerance rule of lstrain.testing; {jobs} process{'es' if jobs > 1 else ''}"
    )
    header = f"{'op':<20} {'dtype':<9} {'backend':<12} {'shapes tried':<34} {'max error':>10} {'allowed':>10}  result"
    print(header)
    print("-" * len(header), flush=True)
    start = time.perf_counter()
    failed = False
    with contextlib.ExitStack() as stack:
        if jobs == 1:
            tallies = (_check_row(name, dtype, device, args.examples, not args.random) for name, dtype in rows)
        else:
            # spawn, not fork: a forked child would inherit this process's CUDA state
            pool = stack.enter_context(ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")))
            futures = [
                pool.submit(_check_row, name, dtype, device, args.examples, not args.random) for name, dtype in rows
            ]
            tallies = (future.result() for future in futures)
        for name, dtypes in ops.items():
            seconds = 0.0
            for dtype in dtypes:
                t = next(tallies)
                failed |= t.failure is not None
                seconds += t.seconds
                print(
                    f"{name:<20} {dtype:<9} {','.join(sorted(t.backends)) or '-':<12} "
                    f"{_shape_summary(t.shapes):<34} {t.worst_error:>10.3g} {t.worst_allowed:>10.3g}  "
                    f"{'FAIL' if t.failure else 'pass'}",
                    flush=True,
                )
                if t.failure:
                    print(f"    {t.failure}")
            print(f"    ({name}: {seconds:.1f} s)")
    print(f"{'FAILED' if failed else 'all checks passed'} in {time.perf_counter() - start:.1f} s")
    return 1 if failed else 0


def _count(text: str) -> int:
    """``--examples``, ``--jobs``: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lstrain`` console script."""
    parser = argparse.ArgumentParser(prog="lstrain", description="Fused Triton kernels for Transformer training.")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="property-check every fused op against PyTorch on this device")
    check.add_argument("ops", nargs="*", help="ops to check (default: all)")
    check.add_argument("--examples", type=_count, default=os.environ.get("LSTRAIN_CHECK_EXAMPLES", "40"),
                       help="hypothesis examples per op and dtype (default 40)")  # fmt: skip
    check.add_argument("--random", action="store_true", help="draw new examples (default: the same ones every run)")
    check.add_argument("--cpu", action="store_true", help="check the CPU interpreter path even if a GPU is present")
    check.add_argument("--jobs", type=_count, default=None,
                       help="processes checking rows at once (default: one per core, at most 8 on a GPU)")  # fmt: skip
    args = parser.parse_args(argv)
    return _check(args)


if __name__ == "__main__":
    sys.exit(main())
