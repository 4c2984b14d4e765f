"""Recipe runs of ``lstrain train`` measured for BENCHMARKS.md: throughput and loss of real training.

    python -m benchmarks.train_run --recipe gpt2-medium --set training.steps=40 \
        --variant cuda_graphs=training.cuda_graphs=true --variant eager=training.cuda_graphs=false
    python -m benchmarks.report RESULTS.json --train bench-out/train/train.json

Each variant runs ``python -m lstrain train RECIPE --no-progress --set ...`` in its own
process, with the common ``--set`` overrides, the variant's own, and its checkpoints and
metrics redirected under ``--out``; the records of its ``metrics.jsonl`` (the loss,
tokens/s and memory of each logged interval) go into ``<out>/train.json`` with the run's
device and versions, beside the exit status and the last lines of its output. The report
judges a variant's steady throughput (the median over the logged intervals after the
first, which holds the compile or capture) against an e2e row when ``--e2e-ref`` names one
(issue 31: within 5% of the e2e benchmark's lstrain variant).
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
from pathlib import Path

import torch

FORMAT = 1  # train.json's layout version
REPO = Path(__file__).resolve().parents[1]


def run_variant(recipe: str, name: str, overrides: list[str], out: Path, timeout_s: float) -> dict:
    """One ``lstrain train`` process and what its metrics say.

    Args:
        recipe: a recipe name or path.
        name: the variant's name (its folder under ``out``).
        overrides: ``section.key=value`` strings, common and the variant's.
        out: the run's output folder.
        timeout_s: seconds before the process is killed.

    Returns:
        ``name``, ``command``, ``returncode`` (None after a timeout), ``wall_s``,
        ``records`` (metrics.jsonl's records, the first one's run config dropped except
        its parameter count) and ``tail`` (the output's last 20 lines).
    """
    folder = out / name
    shown = ["lstrain", "train", recipe, "--no-progress"] + [a for o in overrides for a in ("--set", o)]
    redirected = [f"metrics.folder={folder}", f"checkpoint.folder={folder / 'checkpoints'}"]
    command = [sys.executable, "-m", *shown] + [a for o in redirected for a in ("--set", o)]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        returncode, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout or ""
        returncode, output = None, output.decode(errors="replace") if isinstance(output, bytes) else output
    wall_s = time.perf_counter() - start
    metrics = folder / "metrics.jsonl"
    records = (
        [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    )
    for record in records:
        record.pop("run", None)  # the whole config: the command says it
    return {
        "name": name,
        "command": shlex.join(["python", "-m", *shown]),
        "returncode": returncode,
        "wall_s": wall_s,
        "records": records,
        "tail": output.splitlines()[-20:],
    }


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring).

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        0 when every variant exited 0, else 1 (train.json holds every variant either way).
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True, help="a recipe name (recipes/) or a .toml path")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="for every variant")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=SECTION.KEY=VALUE[,...]",
                        help="a variant and its own overrides (repeatable; default one variant 'default')")  # fmt: skip
    parser.add_argument("--e2e-ref", metavar="WORKLOAD/VARIANT", help="the e2e row the report compares with")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")) / "train")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per variant")
    args = parser.parse_args(argv)
    variants = []
    for spec in args.variant or ["default="]:
        name, _, rest = spec.partition("=")
        if not name:
            parser.error(f"--variant {spec!r}: expected NAME=SECTION.KEY=VALUE[,...]")
        variants.append((name, [o for o in rest.split(",") if o]))

    from benchmarks.run import git_commit  # the op registry's module: imported when needed

    cuda = torch.cuda.is_available()
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": torch.cuda.get_device_name() if cuda else "CPU",
        "torch": torch.__version__,
        "triton": importlib.metadata.version("triton"),
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "recipe": args.recipe,
        "command": shlex.join(["python", "-m", "benchmarks.train_run", *(argv or sys.argv[1:])]),
        "e2e_ref": args.e2e_ref,
    }
    runs = []
    for name, overrides in variants:
        runs.append(run_variant(args.recipe, name, [*args.set, *overrides], args.out, args.timeout))
        print(f"{name}: exit {runs[-1]['returncode']} in {runs[-1]['wall_s']:.0f} s", flush=True)
        (args.out / "train.json").write_text(json.dumps({"format": FORMAT, "meta": meta, "runs": runs}, indent=2))
    return 0 if all(r["returncode"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
