"""The ``lstrain`` command.

``lstrain check``: property-based gradient checks of every fused op on this machine's
device (the GPU if there is one, else the Triton interpreter on the CPU), printed as a
table; exit code 1 if any check fails.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
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

    try:
        run()
    except AssertionError:
        pass  # the last (shrunk) failure is in tally.failure
    return tally


def _shape_summary(shapes: list[str]) -> str:
    if not shapes:
        return "-"
    sizes = sorted(shapes, key=lambda s: math.prod(int(n) for n in s.split("x")))
    return f"{len(shapes)} ({sizes[0]} .. {sizes[-1]})"


def _check(args: argparse.Namespace) -> int:
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined
        # numpy's float warnings from the interpreter (e.g. -inf - -inf in masked lanes)
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
    from lstrain import _backend
    from lstrain.testing.checks import OP_CHECKS

    if device == "cpu" and not _backend.interpreter_active():
        print("lstrain check: lstrain.ops was imported before the interpreter could be enabled", file=sys.stderr)
        return 2
    unknown = sorted(set(args.ops) - set(OP_CHECKS))
    if unknown:
        print(f"lstrain check: unknown op(s) {', '.join(unknown)}; known: {', '.join(OP_CHECKS)}", file=sys.stderr)
        return 2
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"
    print(
        f"lstrain check on {where}: {args.examples} hypothesis examples per op and dtype, "
        "tolerance rule of lstrain.testing"
    )
    header = f"{'op':<20} {'dtype':<9} {'backend':<12} {'shapes tried':<34} {'max error':>10} {'allowed':>10}  result"
    print(header)
    print("-" * len(header))
    failed = False
    for name in args.ops or OP_CHECKS:
        start = time.perf_counter()
        for dtype in OP_CHECKS[name].dtypes(device):
            t = _check_op(OP_CHECKS[name], device, dtype, args.examples, not args.random)
            failed |= t.failure is not None
            print(
                f"{name:<20} {str(dtype).removeprefix('torch.'):<9} {','.join(sorted(t.backends)) or '-':<12} "
                f"{_shape_summary(t.shapes):<34} {t.worst_error:>10.3g} {t.worst_allowed:>10.3g}  "
                f"{'FAIL' if t.failure else 'pass'}"
            )
            if t.failure:
                print(f"    {t.failure}")
        print(f"    ({name}: {time.perf_counter() - start:.1f} s)")
    print("FAILED" if failed else "all checks passed")
    return 1 if failed else 0


def _examples(text: str) -> int:
    """``--examples``: a whole number of at least 1 (hypothesis draws at least one)."""
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
    check.add_argument("--examples", type=_examples, default=os.environ.get("LSTRAIN_CHECK_EXAMPLES", "40"),
                       help="hypothesis examples per op and dtype (default 40)")  # fmt: skip
    check.add_argument("--random", action="store_true", help="draw new examples (default: the same ones every run)")
    check.add_argument("--cpu", action="store_true", help="check the CPU interpreter path even if a GPU is present")
    args = parser.parse_args(argv)
    return _check(args)


if __name__ == "__main__":
    sys.exit(main())
