"""Where the host time of one lstrain fwd+bwd call goes, beside eager PyTorch's.

python -m benchmarks.host_profile

Every figure is the median over calls each started on an idle GPU (the CPU cost of the
call, not the GPU's), lstrain and eager interleaved round by round in one process: host
time on a shared machine drifts by tens of percent between processes. A backward is split
at the edges of the op's ``autograd.Function.backward``: the autograd engine handing the
call to its device thread, the body (launchers and their Triton launches), and the engine
handing the gradients back to the caller.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import triton

from lstrain.ops import bias_dropout_residual, gemm, layer_norm
from lstrain.ops.bias_dropout_residual import BiasDropoutResidualFunction
from lstrain.ops.gemm import GemmFunction
from lstrain.ops.layer_norm import LayerNormFunction

ROUNDS = 5
CALLS_PER_ROUND = 60


@triton.jit
def _noop_kernel(x_ptr):
    pass


@contextlib.contextmanager
def stamped_backward(function: type[torch.autograd.Function], stamps: list[float]) -> Iterator[None]:
    """Append ``time.perf_counter()`` on entry to and on exit from ``function.backward``
    while the block runs (the class is restored afterwards)."""
    original = function.__dict__["backward"]

    def backward(ctx, *grads):
        stamps.append(time.perf_counter())
        try:
            return original.__func__(ctx, *grads)
        finally:
            stamps.append(time.perf_counter())

    function.backward = staticmethod(backward)
    try:
        yield
    finally:
        function.backward = original


def call_us(fn: Callable[[], object]) -> float:
    """Host microseconds of one ``fn()`` started on an idle GPU."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def backward_us(forward: Callable[[], torch.Tensor], dy: torch.Tensor, stamps: list[float]) -> dict[str, float]:
    """Host microseconds of one forward and of its ``.backward(dy)`` (each started on an idle
    GPU), the backward split at ``stamps`` when the op's Function filled them."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    y = forward()
    built = time.perf_counter()
    torch.cuda.synchronize()
    stamps.clear()
    called = time.perf_counter()
    y.backward(dy)
    done = time.perf_counter()
    times = {"forward": built - start, "backward()": done - called}
    if len(stamps) == 2:
        times |= {"engine in": stamps[0] - called, "body": stamps[1] - stamps[0], "engine out": done - stamps[1]}
    return {k: v * 1e6 for k, v in times.items()}


def cases() -> dict[str, tuple[type[torch.autograd.Function], Callable, Callable, torch.Tensor, list[torch.Tensor]]]:
    """name -> (lstrain's Function, lstrain forward, eager forward, dy, leaves to reset)."""
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    x = torch.randn(16384, 1024, **bf16, requires_grad=True)
    w = torch.randn(1024, **bf16, requires_grad=True)
    b = torch.randn(1024, **bf16, requires_grad=True)
    residual = torch.randn(16384, 1024, **bf16, requires_grad=True)
    a = torch.randn(4096, 1024, **bf16, requires_grad=True)
    weight = torch.randn(4096, 1024, **bf16, requires_grad=True)
    bias = torch.randn(4096, **bf16, requires_grad=True)
    return {
        "layer_norm 16384 x 1024": (
            LayerNormFunction,
            lambda: layer_norm(x, 1024, w, b),
            lambda: torch.nn.functional.layer_norm(x, (1024,), w, b),
            torch.randn_like(x),
            [x, w, b],
        ),
        "bias_dropout_residual 16384 x 1024, p 0.1": (
            BiasDropoutResidualFunction,
            lambda: bias_dropout_residual(x, b, residual, dropout=0.1),
            lambda: torch.nn.functional.dropout(x + b, 0.1) + residual,
            torch.randn_like(x),
            [x, b, residual],
        ),
        "linear + gelu 4096 x 1024 -> 4096": (
            GemmFunction,
            lambda: gemm(a, weight.t(), bias=bias, activation="gelu"),
            lambda: torch.nn.functional.gelu(torch.nn.functional.linear(a, weight, bias)),
            torch.randn(4096, 4096, **bf16),
            [a, weight, bias],
        ),
    }


def main() -> None:
    x = torch.empty(1, device="cuda")
    print(f"empty Triton launch {statistics.median(call_us(lambda: _noop_kernel[(1,)](x)) for _ in range(200)):.1f} us")
    stamps: list[float] = []
    for name, (function, ours, eager, dy, leaves) in cases().items():
        samples: dict[str, dict[str, list[float]]] = {"lstrain": {}, "eager": {}}
        for _ in range(ROUNDS):
            for impl, forward in (("lstrain", ours), ("eager", eager)):
                with stamped_backward(function, stamps):
                    for _ in range(CALLS_PER_ROUND):
                        for leaf in leaves:
                            leaf.grad = None
                        for part, us in backward_us(forward, dy, stamps).items():
                            samples[impl].setdefault(part, []).append(us)
        print(f"== {name}: host us per call, median of {ROUNDS * CALLS_PER_ROUND}")
        for impl, parts in samples.items():
            print(f"  {impl:8s}" + "".join(f"  {part} {statistics.median(v):7.1f}" for part, v in parts.items()))


if __name__ == "__main__":
    main()
