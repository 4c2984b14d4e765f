"""``lstrain check``: property-based gradient checks of every fused op on this machine.

The checks run on this machine's device (the GPU if there is one, else the Triton
interpreter on the CPU) and print a table, one row per (op, dtype); the exit code is 1
if any check fails. The rows run in parallel processes: on a GPU a check is bound by
Triton compiling its kernels' variants on one CPU core (well over 1100 distinct
compilations for all rows), so the cores share that work.
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

__all__ = ["add_parser", "run"]

# The only dtypes the registry leaves out on the CPU are the GEMM ops' bf16 rows
# (lstrain.testing.strategies.GEMM_CPU_DTYPES); the table says why instead of dropping them.
_CPU_SKIP_REASON = "the Triton interpreter's bf16 tl.dot is wrong"


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


def _dtype_names(dtypes) -> list[str]:
    return [str(d).removeprefix("torch.") for d in dtypes]


def _skipped_dtypes(op_check, device: str) -> list[str]:
    """The dtypes a GPU checks that ``device`` does not, in the GPU's order."""
    checked = set(op_check.dtypes(device))
    return _dtype_names(d for d in op_check.dtypes("cuda") if d not in checked)


def run(args: argparse.Namespace) -> int:
    """Run the checks that ``args`` (from :func:`add_parser`'s parser) ask for and print the table.

    Args:
        args: ``ops`` (names; empty for all), ``examples``, ``random``, ``cpu``, ``jobs``.

    Returns:
        0 if every check passed, 1 if one failed, 2 for an unknown op or a CPU check in a
        process that defined lstrain's kernels before the interpreter could be switched on.
    """
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
    names = list(dict.fromkeys(args.ops)) or list(OP_CHECKS)  # an op named twice is checked once
    checked = {name: _dtype_names(OP_CHECKS[name].dtypes(device)) for name in names}
    skipped = {name: _skipped_dtypes(OP_CHECKS[name], device) for name in names}
    rows = [(name, dtype) for name in names for dtype in checked[name]]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    # a worker on a GPU holds a CUDA context (~0.5 GB): at most 8 unless asked
    jobs = min(args.jobs or min(cores, 8 if device == "cuda" else cores), len(rows))
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"
    print(
        f"lstrain check on {where}: {args.examples} hypothesis examples per op and dtype, "
        f"tolerance rule of lstrain.testing; {jobs} process{'es' if jobs > 1 else ''}"
    )
    width = max(len("op"), *map(len, names))
    header = (
        f"{'op':<{width}} {'dtype':<9} {'backend':<12} {'shapes tried':<34} {'max error':>10} {'allowed':>10}  result"
    )
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
        for name in names:
            seconds = 0.0
            for dtype in checked[name]:
                t = next(tallies)
                failed |= t.failure is not None
                seconds += t.seconds
                print(
                    f"{name:<{width}} {dtype:<9} {','.join(sorted(t.backends)) or '-':<12} "
                    f"{_shape_summary(t.shapes):<34} {t.worst_error:>10.3g} {t.worst_allowed:>10.3g}  "
                    f"{'FAIL' if t.failure else 'pass'}",
                    flush=True,
                )
                if t.failure:
                    print(f"    {t.failure}")
            for dtype in skipped[name]:
                blank = "-"
                print(
                    f"{name:<{width}} {dtype:<9} {blank:<12} {blank:<34} {blank:>10} {blank:>10}  "
                    f"skipped: {_CPU_SKIP_REASON}"
                )
            print(f"    ({name}: {seconds:.1f} s)")
    summary = "FAILED" if failed else "all checks passed"
    if skips := sum(map(len, skipped.values())):
        summary += f" ({skips} skipped)"
    print(f"{summary} in {time.perf_counter() - start:.1f} s")
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


class _HelpListingOps(argparse.Action):
    """``lstrain check --help``, with the op names appended.

    Only the check registry knows the names, and importing it defines lstrain's kernels,
    which must wait until the device is known (the interpreter goes on first); help
    exits right after printing, so it alone may import the registry this early.
    """

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from lstrain.testing.checks import OP_CHECKS

        cpu_skips = [
            f"{name} {', '.join(dtypes)}"
            for name, op_check in OP_CHECKS.items()
            if (dtypes := _skipped_dtypes(op_check, "cpu"))
        ]
        parser.epilog = f"ops: {', '.join(OP_CHECKS)}."
        if cpu_skips:
            parser.epilog += f" Skipped on the CPU ({_CPU_SKIP_REASON}): {'; '.join(cpu_skips)}."
        parser.print_help()
        parser.exit()


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``check`` to the ``lstrain`` command's subparsers.

    Args:
        commands: what ``ArgumentParser.add_subparsers`` returned.

    Returns:
        The ``check`` parser; its namespace's ``run`` is :func:`run`.
    """
    check = commands.add_parser(
        "check", help="property-check every fused op against PyTorch on this device", add_help=False
    )
    check.add_argument("-h", "--help", action=_HelpListingOps, help="show this help message (and the ops) and exit")
    check.add_argument("ops", nargs="*", help="ops to check (default: all; the list is at the end)")
    check.add_argument("--examples", type=_count, default=os.environ.get("LSTRAIN_CHECK_EXAMPLES", "40"),
                       help="hypothesis examples per op and dtype (default 40)")  # fmt: skip
    check.add_argument("--random", action="store_true", help="draw new examples (default: the same ones every run)")
    check.add_argument("--cpu", action="store_true", help="check the CPU interpreter path even if a GPU is present")
    check.add_argument("--jobs", type=_count, default=None,
                       help="processes checking rows at once (default: one per core, at most 8 on a GPU)")  # fmt: skip
    check.set_defaults(run=run)
    return check
