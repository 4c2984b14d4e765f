"""Compile every kernel launch of the CPU test suite for a GPU, without a GPU.

    python -m benchmarks.kernel_audit [pytest args, default: tests/ops]
    python -m benchmarks.kernel_audit --triton-path DIR tests/ops/test_gemm.py
    python -m benchmarks.kernel_audit --arch 86 tests/ops
    python -m benchmarks.kernel_audit benchmarks/plan_grid.py   (the plans only large shapes get)

Runs the tests through the Triton interpreter, records each distinct launch (kernel,
argument types, constexprs, num_warps / num_stages), adds the launches of the Gluon kernels
the interpreter cannot run (cross-entropy's rows held in shared memory, at the plans the
device gets), then compiles each one for sm_90, or
the ``--arch`` given (80, 86, 89, 100, 120), with ``triton.compile`` (another Triton can be put first
on the path, e.g. the GPU machine's version: ``pip install --target DIR triton==3.6.0``).
With ``--arch`` the tests run as on such a device (its shared memory per program and,
before Hopper, no TMA), so that the ops plan the launches it would get. Per launch it
prints: shared memory, flagged when over the device's limit, registers and spills
(ptxas -v), and the 2-byte or 1-byte global loads
and stores in the PTX of launches whose pointers and integers are all multiples of 16,
where 16-byte accesses were likely meant (a causal mask that cut every load to 2 bytes
was found this way), ptxas's C7515, wgmma instructions serialized (which cost the
GEMM with a K-major B 12-22%), and, in aligned launches, wgmma operands that the pipeliner
left as synchronous loads staged through registers (``ttg.local_alloc`` of a loaded tensor
in the TTGIR: a persistent SwiGLU forward with such an operand ran 2.4x slower; operands
whose rows are not 16-byte aligned cannot be copied asynchronously anyway). Exit status 1
when a launch fails to compile or needs more shared memory than the device has.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

_DTYPES = {
    "torch.float32": "fp32",
    "torch.float16": "fp16",
    "torch.bfloat16": "bf16",
    "torch.float64": "fp64",
    "torch.int64": "i64",
    "torch.int32": "i32",
    "torch.int16": "i16",
    "torch.int8": "i8",
    "torch.uint8": "u8",
    "torch.bool": "i1",
}
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "maxnreg")
# Shared memory per program (the opt-in maximum) of a device of each compute capability
SHARED_MEMORY = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


def _describe(kernel, args, kwargs) -> dict:
    """A launch as JSON: the signature, constexprs and divisibility hints Triton's runtime
    would derive from these arguments (ints equal to 1 become constexprs, ints and
    pointers divisible by 16 get the hint; neither for the kernel's ``do_not_specialize``)."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    names = kernel.arg_names
    values = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    constexpr_names = {p for p in names if "constexpr" in str(kernel.fn.__annotations__.get(p, ""))}
    unspecialized = set(kernel.kwargs.get("do_not_specialize") or ())
    signature, constexprs, divisible = {}, {}, []
    for index, name in enumerate(names):
        value = values.get(name)
        plain = name in unspecialized
        if name in constexpr_names or value is None or (isinstance(value, int) and value == 1 and not plain):
            signature[name] = "constexpr"
            constexprs[name] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _DTYPES[str(value.dtype)]
            if value.data_ptr() % 16 == 0:
                divisible.append(index)
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0 and not plain:
                divisible.append(index)
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif isinstance(value, TensorDescriptor):
            block = ", ".join(str(size) for size in value.block_shape)
            signature[name] = f"tensordesc<{_DTYPES[str(value.base.dtype)]}[{block}]>"
        else:
            raise TypeError(f"{kernel.fn.__name__}: cannot describe argument {name} of type {type(value)}")
    options = {k: kwargs[k] for k in _OPTIONS if k in kwargs}
    return {
        "module": kernel.fn.__module__,
        "kernel": kernel.fn.__name__,
        "signature": signature,
        "constexprs": constexprs,
        "divisible": divisible,
        "unspecialized": sorted(names.index(name) for name in unspecialized),
        "options": options,
    }


def record(pytest_args: list[str], arch: int) -> list[dict]:
    """Run pytest in this process under the interpreter, the ops planning their launches as
    on a device of compute capability ``arch``; the distinct launches it made."""
    os.environ["TRITON_INTERPRET"] = "1"
    import pytest
    import triton

    from lstrain import _backend

    # An audit-only stand-in for the device queries (the interpreter reports an H200).
    _backend.shared_memory_per_program = lambda device_index: SHARED_MEMORY[arch]
    _backend.has_tma = lambda device_index: arch >= 90

    launches: dict[str, dict] = {}
    for module_name in ("lstrain.ops", "lstrain.optim"):
        package = importlib.import_module(module_name)
        for entry in os.scandir(os.path.dirname(package.__file__)):
            if not entry.name.endswith(".py") or entry.name.startswith("__"):
                continue
            module = importlib.import_module(f"{module_name}.{entry.name[:-3]}")
            for kernel in vars(module).values():
                if not isinstance(kernel, triton.runtime.interpreter.InterpretedFunction):
                    continue
                if kernel.fn.__module__ != module.__name__ or hasattr(kernel, "_audit_run"):
                    continue

                def recording_run(*args, _kernel=kernel, **kwargs):
                    launch = _describe(_kernel, args, {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")})
                    launches.setdefault(json.dumps(launch, sort_keys=True, default=str), launch)
                    return _kernel._audit_run(*args, **kwargs)

                kernel._audit_run = kernel.run
                kernel.run = recording_run
    status = pytest.main(["-q", "-p", "no:cacheprovider", *pytest_args])
    if status not in (0, 5):
        print(f"kernel_audit: pytest exited with {status}; auditing the launches it made", file=sys.stderr)
    return list(launches.values())


def resident_cross_entropy_launches(arch: int) -> list[dict]:
    """Launches of cross-entropy's Gluon kernel, which the interpreter cannot run (so no test
    launches it on the CPU): the resident plans ``cross_entropy_plan`` gives on a device of
    compute capability ``arch`` for rows of two rows per SM, one, and one with logits held
    in registers, in each dtype, every flag on (the most code); aligned pointers, as the
    launcher requires."""
    from lstrain.ops.cross_entropy import _cross_entropy_resident_kernel as kernel
    from lstrain.ops.cross_entropy import cross_entropy_plan

    names = kernel.arg_names
    unspecialized = sorted(names.index(name) for name in kernel.do_not_specialize)
    launches = []
    for element, size in (("bf16", 2), ("fp16", 2), ("fp32", 4)):
        for vocab in (8193, 20011, 50257, 70001, 128256, 131072):
            plan = cross_entropy_plan(vocab, size, shared_memory=SHARED_MEMORY[arch])
            if not plan.resident:
                continue
            run = 16 // size
            types = {"logits_ptr": f"*{element}", "grad_ptr": f"*{element}", "target_ptr": "*i64", "count_ptr": "*i32"}
            types |= dict.fromkeys(("loss_ptr", "stats_ptr"), "*fp32") | dict.fromkeys(("smoothing", "z_loss"), "fp32")
            types |= dict.fromkeys(("rows", "vocab", "logits_row_stride", "grad_row_stride", "ignore_index"), "i32")
            constexprs = dict.fromkeys(("HAS_SMOOTHING", "HAS_Z_LOSS", "MEAN"), True)
            constexprs |= {"LANES": plan.block // run, "RUN": run, "RESIDENT": plan.resident, "HELD": plan.held // run}
            constexprs |= {"NUM_WARPS": plan.num_warps}
            launches.append({
                "module": kernel.fn.__module__, "kernel": kernel.fn.__name__, "language": "gluon",
                "signature": {name: types.get(name, "constexpr") for name in names}, "constexprs": constexprs,
                "divisible": [names.index("logits_ptr"), names.index("grad_ptr")], "unspecialized": unspecialized,
                "options": {"num_warps": plan.num_warps},
            })  # fmt: skip
    return launches


def compile_one(launch: dict, arch: int) -> dict:
    """Compile one launch for sm_<arch> (in this process: TRITON_INTERPRET must be unset)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    attrs = {(i,): [["tt.divisibility", 16]] for i in launch["divisible"]}
    source_type = GluonASTSource if launch.get("language") == "gluon" else ASTSource
    source = source_type(kernel, launch["signature"], launch["constexprs"], attrs)
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=launch["options"])
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the audit goes on
        return {"error": str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else repr(exc)}
    ptx = compiled.asm["ptx"]
    ttgir = compiled.asm["ttgir"]
    staged = len(re.findall(r"ttg\.local_alloc %", ttgir)) if "warp_group_dot" in ttgir else 0
    narrow = re.findall(r"\b((?:ld|st)\.global(?:\.[a-z0-9_]+)*\.[bsuf](?:8|16))\b", ptx)
    ptxas = os.path.join(
        os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell" if arch >= 100 else "ptxas"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as handle:
        handle.write(ptx)
    report = subprocess.run(
        [ptxas, "-v", "--gpu-name", f"sm_{arch}{'a' if arch >= 90 else ''}", handle.name, "-o", os.devnull],
        capture_output=True,
        text=True,
    ).stderr
    os.unlink(handle.name)
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    return {
        "shared": compiled.metadata.shared,
        "registers": int(registers.group(1)) if registers else None,
        "spill_bytes": int(spills.group(1)) if spills else None,
        "narrow": len(narrow),
        "serialized_wgmma": "C7515" in report,
        "staged_wgmma_operands": staged,
    }


def _aligned(launch: dict) -> bool:
    """Every pointer and integer argument of the launch divisible by 16 (counts the kernel
    does not specialize on aside): 1-2 byte accesses are then a lost vectorisation, not an
    odd shape's due."""
    names = list(launch["signature"])
    runtime = [i for i, name in enumerate(names) if launch["signature"][name] != "constexpr"]
    types = [launch["signature"][name] for name in names]
    scalars = {i for i in runtime if types[i].startswith("fp") or types[i] == "i1"}
    scalars |= set(launch.get("unspecialized", ()))
    return all(i in launch["divisible"] or i in scalars for i in runtime)


def _compile_in_child(launches: list[dict], triton_path: str | None, arch: int) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (triton_path, os.getcwd(), env.get("PYTHONPATH")) if p)
    child = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernel_audit", "--compile", "--arch", str(arch)],
        input=json.dumps(launches), capture_output=True, text=True, env=env,
    )  # fmt: skip
    if child.returncode != 0:
        raise RuntimeError(f"kernel_audit: the compiling process failed:\n{child.stderr[-2000:]}")
    return json.loads(child.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--triton-path", help="a directory holding another triton package to compile with")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiling processes")
    parser.add_argument("--arch", type=int, choices=sorted(SHARED_MEMORY), default=90, help="compute capability")
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args, pytest_args = parser.parse_known_args()
    if args.compile:  # the child: launches on stdin, results on stdout
        import triton

        print(f"compiling with triton {triton.__version__}", file=sys.stderr)
        print(json.dumps([compile_one(launch, args.arch) for launch in json.load(sys.stdin)]))
        return
    launches = record(pytest_args or ["tests/ops"], args.arch) + resident_cross_entropy_launches(args.arch)
    print(f"\n{len(launches)} distinct launches (and Gluon's); compiling for sm_{args.arch} in {args.jobs} processes")
    batches = [launches[i :: args.jobs] for i in range(args.jobs)]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda batch: _compile_in_child(batch, args.triton_path, args.arch), batches))
    failures = 0
    rows = []
    for batch, batch_results in zip(batches, results, strict=True):
        for launch, result in zip(batch, batch_results, strict=True):
            flags = {k: v for k, v in launch["constexprs"].items() if k.isupper()}
            dtype = next((t[1:] for t in launch["signature"].values() if t.startswith("*")), "-")
            name = f"{launch['kernel']} {dtype} {flags} {launch['options']}"
            if "error" in result:
                failures += 1
                rows.append(f"FAILED  {name}: {result['error']}")
                continue
            notes = []
            if result["shared"] > SHARED_MEMORY[args.arch]:
                failures += 1
                notes.append(f"over sm_{args.arch}'s {SHARED_MEMORY[args.arch]} B of shared memory")
            if result["spill_bytes"]:
                notes.append(f"spills {result['spill_bytes']} B")
            if result.get("serialized_wgmma"):
                notes.append("wgmma serialized by ptxas (C7515)")
            if result.get("staged_wgmma_operands") and _aligned(launch):
                notes.append(f"{result['staged_wgmma_operands']} wgmma operand(s) loaded synchronously, not pipelined")
            if result["narrow"] and _aligned(launch):
                notes.append(f"{result['narrow']} 1-2 byte global accesses")
            rows.append(
                f"{'NOTE' if notes else 'ok':8s}{name}: {result['registers']} regs, {result['shared']} B shared"
                + (f"; {', '.join(notes)}" if notes else "")
            )
    for row in sorted(rows):
        print(row)
    print(f"{len(launches)} launches, {failures} failed to compile or exceed the shared memory")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
