"""Launch-plan sweep: times lstrain's kernels under alternative plans on this GPU.

    python -m benchmarks.sweep [--quick]

Evidence for the constants of the plan functions (``layer_norm_fwd_plan``,
``layer_norm_bwd_plan``, ``attention_softmax_plan``): each kernel alone, one launch
captured in a CUDA graph and replayed under ``do_bench`` (L2 flushed, median), at the
shapes of the targets. Prints the best plans first for each kernel and shape.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
from triton.testing import do_bench

from lstrain.ops.attention_softmax import (
    AttentionSoftmaxPlan,
    attention_softmax_bwd,
    attention_softmax_fwd,
    attention_softmax_plan,
)
from lstrain.ops.layer_norm import (
    LayerNormPlan,
    layer_norm_bwd,
    layer_norm_bwd_plan,
    layer_norm_fwd,
    layer_norm_fwd_plan,
)


def graph_us(fn) -> float:
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return 1e3 * do_bench(graph.replay, warmup=10, rep=60, return_mode="median")


def report(name: str, results: list[tuple[float, object]], default) -> None:
    results.sort(key=lambda r: r[0])
    default_us = next((us for us, plan in results if plan == default), None)
    print(f"== {name}: default {default} -> {default_us if default_us is None else round(default_us, 2)} us")
    for us, plan in results[:5]:
        print(f"   {us:8.2f} us  {plan}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="only vary the pipelining depth of the default plans")
    args = parser.parse_args()
    dtype = torch.bfloat16
    for cols in (1024, 4096, 8192):
        rows = 16384
        x = torch.randn(rows, cols, device="cuda", dtype=dtype)
        w = torch.randn(cols, device="cuda", dtype=dtype)
        b = torch.randn(cols, device="cuda", dtype=dtype)
        dy = torch.randn_like(x)
        _, stats = layer_norm_fwd(x, (cols,), w, b, 1e-5)
        results = []
        for block_rows, warps in [] if args.quick else itertools.product((1, 2, 4, 8), (2, 4, 8)):
            if block_rows * cols > 16384 or block_rows * cols // (warps * 32) < 8:
                continue
            plan = LayerNormPlan(block_rows, cols, warps, True)
            results.append((graph_us(functools.partial(layer_norm_fwd, x, (cols,), w, b, 1e-5, plan=plan)), plan))
        report(f"layer_norm fwd {rows}x{cols}", results, layer_norm_fwd_plan(cols))
        results = []
        default = layer_norm_bwd_plan(cols)
        for block_rows, warps, per_sm, stages in itertools.product((1, 2, 4), (4, 8, 16), (1, 2, 4), (1, 2, 3, 4)):
            if block_rows * cols > 8192 or block_rows * cols // (warps * 32) < 4 or warps * per_sm > 32:
                continue
            plan = LayerNormPlan(block_rows, cols, warps, True, per_sm, stages)
            near_default = (block_rows, warps, per_sm) == (
                default.block_rows,
                default.num_warps,
                default.programs_per_sm,
            )
            if args.quick and not near_default:
                continue
            run = functools.partial(layer_norm_bwd, dy, x, w, stats, (cols,), True, True, None, plan=plan)
            results.append((graph_us(run), plan))
        report(f"layer_norm bwd {rows}x{cols}", results, default)
        del x, dy
    scores = torch.randn(8, 16, 1024, 1024, device="cuda", dtype=dtype)
    y = attention_softmax_fwd(scores, None, None, 0.125, True)
    dy = torch.randn_like(y)
    fwd, bwd = [], []
    for block_rows, warps in itertools.product((1,) if args.quick else (1, 2, 4), (1, 2, 4, 8)):
        if block_rows * 1024 // (warps * 32) < 4:
            continue
        plan = AttentionSoftmaxPlan(block_rows, 1024, warps)
        fwd.append(
            (graph_us(functools.partial(attention_softmax_fwd, scores, None, None, 0.125, True, plan=plan)), plan)
        )
        bwd.append((graph_us(functools.partial(attention_softmax_bwd, dy, y, 0.125, True, plan=plan)), plan))
    report("attention_softmax fwd 8x16x1024x1024 causal", fwd, attention_softmax_plan(1024))
    report("attention_softmax bwd 8x16x1024x1024 causal", bwd, attention_softmax_plan(1024, backward=True))


if __name__ == "__main__":
    main()
