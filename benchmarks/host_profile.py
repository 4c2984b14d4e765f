"""Where the host time of one lstrain fwd+bwd call goes (cProfile + per-launcher timings).

python -m benchmarks.host_profile
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch
import triton

from lstrain.ops import attention_softmax, bias_dropout_residual, cross_entropy, layer_norm
from lstrain.ops.attention_softmax import attention_softmax_bwd, attention_softmax_fwd
from lstrain.ops.layer_norm import layer_norm_bwd, layer_norm_fwd


@triton.jit
def _noop_kernel(x_ptr):
    pass


def host_us(fn, n: int = 200) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def main() -> None:
    x = torch.randn(16384, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    y, stats = layer_norm_fwd(x.detach(), (1024,), w.detach(), b.detach(), 1e-5)

    def ln_call():
        x.grad = w.grad = b.grad = None
        layer_norm(x, 1024, w, b).backward(dy)

    def eager_call():
        x.grad = w.grad = b.grad = None
        torch.nn.functional.layer_norm(x, (1024,), w, b).backward(dy)

    s = torch.randn(8, 16, 1024, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ds = torch.randn_like(s)

    def sm_call():
        s.grad = None
        attention_softmax(s, scale=0.125, causal=True).backward(ds)

    ys = attention_softmax_fwd(s.detach(), None, None, 0.125, True)
    r = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    residual = torch.randn_like(r, requires_grad=True)
    r_bias = torch.randn(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dr = torch.randn_like(r)

    def bdr_call():
        r.grad = residual.grad = r_bias.grad = None
        bias_dropout_residual(r, r_bias, residual, dropout=0.1).backward(dr)

    def eager_bdr_call():
        r.grad = residual.grad = r_bias.grad = None
        (torch.nn.functional.dropout(r + r_bias, 0.1) + residual).backward(dr)

    logits = torch.randn(1024, 32000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 32000, (1024,), device="cuda")

    def ce_call():
        logits.grad = None
        cross_entropy(logits, target, label_smoothing=0.1).backward()

    def eager_ce_call():
        logits.grad = None
        torch.nn.functional.cross_entropy(logits, target, label_smoothing=0.1).backward()

    timings = {
        "noop triton launch": lambda: _noop_kernel[(1,)](x),
        "torch.empty_like": lambda: torch.empty_like(x),
        "layer_norm_fwd launcher": lambda: layer_norm_fwd(x.detach(), (1024,), w.detach(), b.detach(), 1e-5),
        "layer_norm_bwd launcher": lambda: layer_norm_bwd(dy, x.detach(), w.detach(), stats, (1024,), True, True, None),
        "layer_norm fwd+bwd": ln_call,
        "eager layer_norm fwd+bwd": eager_call,
        "attention_softmax_fwd launcher": lambda: attention_softmax_fwd(s.detach(), None, None, 0.125, True),
        "attention_softmax_bwd launcher": lambda: attention_softmax_bwd(ds, ys, 0.125, True),
        "attention_softmax fwd+bwd": sm_call,
        "bias_dropout_residual fwd+bwd": bdr_call,
        "eager bias_dropout_residual fwd+bwd": eager_bdr_call,
        "cross_entropy fwd+bwd": ce_call,
        "eager cross_entropy fwd+bwd": eager_ce_call,
    }
    for name, fn in timings.items():
        print(f"{name:<34} {host_us(fn):8.1f} us/call (host)")
    for name, fn in (("layer_norm fwd+bwd", ln_call), ("bias_dropout_residual fwd+bwd", bdr_call)):
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(100):
            fn()
        profiler.disable()
        torch.cuda.synchronize()
        print(f"== {name}: 100 calls, by own time")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
