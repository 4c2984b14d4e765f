import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.kernel_audit import SHARED_MEMORY, _aligned, _compile_in_child, resident_cross_entropy_launches

REPO = Path(__file__).resolve().parents[2]


def test_aligned_means_every_pointer_and_integer_is_a_multiple_of_16():
    launch = {"signature": {"x": "*bf16", "n": "i32", "eps": "fp32", "BLOCK": "constexpr"}, "divisible": [0, 1]}
    assert _aligned(launch)
    assert not _aligned(launch | {"divisible": [0]})  # n = 1000 + 1, say


@pytest.mark.skipif(torch.cuda.is_available(), reason="an audit for machines without a GPU (it drives the interpreter)")
def test_compiles_for_sm90_what_a_test_launches():
    """The audit runs a test through the interpreter and compiles its launches for sm_90
    with the installed Triton (no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernel_audit", "--jobs", "1", "tests/ops/test_layer_norm.py", "-k",
         "zero_rows or fp32_weight"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "_layer_norm_fwd_kernel" in run.stdout and " 0 failed to compile" in run.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="an audit for machines without a GPU (it drives the interpreter)")
def test_compiles_for_another_architecture_with_its_shared_memory():
    """--arch 86: the tests plan their launches as on an sm_86 device (99 KiB of shared
    memory, no TMA) and the audit compiles them for sm_86 and checks them against it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernel_audit", "--jobs", "1", "--arch", "86", "tests/ops/test_gemm.py", "-k",
         "beta_zero"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "compiling for sm_86" in run.stdout and "_gemm_kernel" in run.stdout and " 0 failed" in run.stdout


@pytest.mark.parametrize("arch", [80, 90])
def test_compiles_the_gluon_kernels_the_interpreter_cannot_run(arch, monkeypatch):
    """Cross-entropy's Gluon kernel, which no CPU test can launch, compiled by the installed
    Triton (Gluon's API moves between releases) at every kind of resident plan the device
    gets: within its shared memory, no spills beyond the one register Triton 3.6 spills in
    the fp32 one-row plan for sm_90 (docs/notes/cross_entropy.md, Open)."""
    launches = resident_cross_entropy_launches(arch)
    plans = {(launch["constexprs"]["NUM_WARPS"], launch["constexprs"]["HELD"] > 0) for launch in launches}
    assert plans == ({(8, False), (16, False), (16, True)} if arch == 90 else {(8, False), (16, False)})
    monkeypatch.chdir(REPO)
    for launch, result in zip(launches, _compile_in_child(launches, None, arch), strict=True):
        assert "error" not in result, (launch["signature"]["logits_ptr"], launch["constexprs"], result["error"])
        spilled = result["spill_bytes"] or 0  # sm_80 compiles report no count
        assert result["shared"] <= SHARED_MEMORY[arch] and spilled <= 4, (launch["constexprs"], result)


def test_plan_grid_collects_every_op():
    """benchmarks/plan_grid.py (run by hand through the audit) imports and names a call of
    every op, so that it does not rot outside the test suite."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "benchmarks/plan_grid.py"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    for op in ("gemm", "swiglu", "layer_norm", "attention_softmax", "cross_entropy", "linear_cross_entropy",
               "dropout_family", "embedding"):  # fmt: skip
        assert f"plan_grid.py::test_{op}[" in run.stdout
