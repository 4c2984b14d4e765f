"""Launch-plan sweep: times lstrain's kernels under alternative plans on this GPU.

    python -m benchmarks.sweep [--quick] [--op cross_entropy --op dropout ...]

Evidence for the constants of the plan functions (``layer_norm_fwd_plan``,
``layer_norm_bwd_plan``, ``attention_softmax_plan``, ``cross_entropy_plan``,
``gemm_plan``), and where the time of the dropout ops and of the SwiGLU MLP's GEMMs goes
(beside cuBLAS doing the same products), and issue 33's pattern A against the unfused path
(``--op norm_epilogue``, forward kernels and a whole decoder layer), and ``qkv_attention``'s tiles
per kernel, its dropout mask stored as bits against drawn again, and cuDNN's SDPA on the same
projection (``--op qkv_attention``): each kernel alone, one launch
captured in a CUDA graph and replayed under ``do_bench`` (L2 flushed, median), at the
shapes of the targets. Prints the best plans first for each kernel and shape.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
from triton.testing import do_bench

from lstrain._backend import shared_memory_per_program
from lstrain.layers import DecoderLayer, rotary_cos_sin
from lstrain.ops._lib.dropout import ElementwisePlan, elementwise_plan, new_seed
from lstrain.ops.add_rms_norm import add_rms_norm_fwd
from lstrain.ops.attention_softmax import (
    AttentionSoftmaxPlan,
    attention_softmax_bwd,
    attention_softmax_fwd,
    attention_softmax_plan,
)
from lstrain.ops.bias_dropout_residual import bias_dropout_residual_fwd, dropout_bwd
from lstrain.ops.cross_entropy import CrossEntropyPlan, cross_entropy_fwd, cross_entropy_plan, scale_gradient_
from lstrain.ops.embedding import embedding_bwd, embedding_fwd
from lstrain.ops.gemm import GemmPlan, gemm_fwd, gemm_plan
from lstrain.ops.layer_norm import (
    LayerNormPlan,
    layer_norm_bwd,
    layer_norm_bwd_plan,
    layer_norm_fwd,
    layer_norm_fwd_plan,
)
from lstrain.ops.linear_add_rms_norm_swiglu import linear_add_rms_norm_fwd
from lstrain.ops.qkv_attention import AttentionPlan, attention_plan, qkv_attention_bwd, qkv_attention_fwd
from lstrain.ops.swiglu import swiglu_act, swiglu_act_bwd, swiglu_fwd


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


def sweep_cross_entropy(quick: bool) -> None:
    for tokens, vocab in ((16384, 50257), (8192, 128256)):
        gen = torch.Generator(device="cuda").manual_seed(0)
        logits = torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16, generator=gen)
        target = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
        grad = torch.empty_like(logits)
        valid = (target >= 0).sum()
        for write_grad in (True, False):
            shared_memory = shared_memory_per_program(0) if write_grad else 0
            default = cross_entropy_plan(vocab, 2, "loss_and_gradient" if write_grad else "loss", True, shared_memory)
            # the two-sweep kernel's grid, and the resident plan where the row fits
            grid = [
                CrossEntropyPlan(block, warps)
                for block, warps in itertools.product((2048, 4096, 8192, 16384, 32768), (4, 8, 16, 32))
                if 4 <= block // (warps * 32) <= 64
            ]
            results = []
            for plan in grid + ([default] if default.resident else []):
                if quick and plan != default:
                    continue
                run = functools.partial(
                    cross_entropy_fwd, logits, target, 0.1, -100, 0.0,
                    "mean" if write_grad else None, grad if write_grad else None, valid, plan=plan,
                )  # fmt: skip
                results.append((graph_us(run), plan))
            what = "loss + gradient" if write_grad else "loss only"
            report(f"cross_entropy fwd {tokens}x{vocab} bf16, {what}", results, default)
        scale = functools.partial(scale_gradient_, grad, torch.tensor(0.5, device="cuda"))
        print(f"== scale_gradient_ {tokens}x{vocab}: {graph_us(scale):8.2f} us")
        del logits, grad


def time_dropout_kernels() -> None:
    rows, cols = 16384, 4096
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    seed = new_seed("cuda")
    for p in (0.0, 0.1):
        fwd = functools.partial(bias_dropout_residual_fwd, x, bias, residual, seed, p, p > 0)
        bwd = functools.partial(dropout_bwd, x, seed, p, p > 0, True, torch.bfloat16)
        print(f"== bias_dropout_residual {rows}x{cols} dropout {p}: fwd {graph_us(fwd):8.2f} us, "
              f"bwd (+ dbias) {graph_us(bwd):8.2f} us")  # fmt: skip
    results = []
    for block_rows, warps, per_sm, stages in itertools.product((1, 4), (4, 8), (2, 4, 8), (1, 3)):
        plan = ElementwisePlan(block_rows, 1024, warps, per_sm, stages)
        results.append((graph_us(functools.partial(dropout_bwd, x, seed, 0.1, True, True, torch.bfloat16, plan)), plan))
    report(f"dropout bwd (+ dbias) {rows}x{cols} dropout 0.1", results, elementwise_plan(cols))
    vocab, dim, tokens, seq = 50257, 1024, 16384, 2048
    ids = torch.randint(0, vocab, (tokens // seq, seq), device="cuda")
    weight = torch.randn(vocab, dim, device="cuda", dtype=torch.bfloat16)
    pos_weight = torch.randn(seq, dim, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens // seq, seq, dim, device="cuda", dtype=torch.bfloat16)
    fwd = functools.partial(embedding_fwd, ids, weight, pos_weight, None, 32.0, -1, seed, 0.1, True)
    print(f"== embedding V {vocab} D {dim}, {tokens} tokens, dropout 0.1: fwd (+ counts) {graph_us(fwd):8.2f} us")
    _, counts = fwd()
    for deterministic in (False, True):
        for weight_grad, pos_grad in ((True, False), (False, True), (True, True)):
            bwd = functools.partial(
                embedding_bwd, dy, ids, counts, vocab, torch.bfloat16, seq, torch.bfloat16, None, 32.0, -1, seed, 0.1,
                deterministic, weight_grad, pos_grad,
            )  # fmt: skip
            print(f"   bwd deterministic={deterministic} weight={weight_grad} positions={pos_grad}: "
                  f"{graph_us(bwd):8.2f} us")  # fmt: skip


def _gemm_plans(quick: bool, default: GemmPlan) -> list[GemmPlan]:
    """Tile shapes x (persistent at 3 stages, a program per tile at 4), and the default tile
    under other program groupings (which decide how long A's and B's tiles stay in L2);
    --quick: the default tile only."""
    plans = [
        GemmPlan(block_m, block_n, 64, 8, num_warps=8, num_stages=3 if persistent else 4, persistent=persistent)
        for (block_m, block_n), persistent in itertools.product(((128, 256), (256, 128)), (True, False))
    ]
    plans += [GemmPlan(128, 256, 64, group_m, num_warps=8, num_stages=3, persistent=True) for group_m in (4, 16)]
    return [p for p in plans if not quick or (p.block_m, p.block_n, p.group_m) == (default.block_m, default.block_n, 8)]


def sweep_gemm(quick: bool) -> None:
    # N = 11008: the GEMM; N = 22016: the SwiGLU forward's x @ w_gate_up
    for m, k, n in ((16384, 4096, 11008), (16384, 4096, 22016)):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) * k**-0.5
        flops = 2 * m * k * n
        default = gemm_plan(m, n, k, 2)
        results = [
            (graph_us(functools.partial(gemm_fwd, a, b, None, None, 1.0, 0.0, -1, torch.bfloat16, plan)), plan)
            for plan in _gemm_plans(quick, default)
        ]
        report(f"gemm {m}x{k}x{n} bf16", results, default)
        cublas = graph_us(lambda a=a, b=b: a @ b)
        print(f"   cuBLAS (torch.matmul): {cublas:8.2f} us = {flops / cublas / 1e6:.1f} TFLOP/s")
        del a, b


def time_swiglu_kernels() -> None:
    tokens, dim, hidden = 16384, 4096, 11008
    x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)
    w_gate_up = torch.randn(dim, 2 * hidden, device="cuda", dtype=torch.bfloat16) * dim**-0.5
    w_down = torch.randn(hidden, dim, device="cuda", dtype=torch.bfloat16) * hidden**-0.5
    dy = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)
    a, h = swiglu_fwd(x, w_gate_up)
    dh = torch.randn_like(h)
    gate_up_flops, down_flops = 2 * tokens * dim * 2 * hidden, 2 * tokens * dim * hidden
    timings = (
        ("forward GEMM + SwiGLU epilogue", gate_up_flops, lambda: swiglu_fwd(x, w_gate_up)),
        ("cuBLAS x @ w_gate_up + SwiGLU pass", gate_up_flops, lambda: swiglu_act(x @ w_gate_up)),
        ("cuBLAS x @ w_gate_up", gate_up_flops, lambda: x @ w_gate_up),
        ("cuBLAS dy @ w_down^T + dgate/dup/a pass", down_flops, lambda: swiglu_act_bwd(dy @ w_down.t(), h, True)),
        ("cuBLAS dy @ w_down^T", down_flops, lambda: dy @ w_down.t()),
        ("cuBLAS dW_down = a^T @ dy", down_flops, lambda: a.t() @ dy),
    )
    print(f"== SwiGLU MLP {tokens}x{dim}x{hidden} bf16 kernels")
    for name, flops, fn in timings:
        us = graph_us(fn)
        print(f"   {name:<36} {us:9.1f} us = {flops / us / 1e6:6.1f} TFLOP/s")
    # The forward kernel under the GEMM plans that keep a 256-wide tile (one pair block).
    default = gemm_plan(tokens, 2 * hidden, dim, 2)
    plans = [p for p in _gemm_plans(False, default) if p.block_n == 256]
    results = [(graph_us(functools.partial(swiglu_fwd, x, w_gate_up, plan)), plan) for plan in plans]
    report(f"SwiGLU forward {tokens}x{dim}x{2 * hidden} bf16", results, default)
    # The MLP's other four products, cuBLAS beside lstrain's GEMM (no epilogue).
    products = (
        ("y = a @ w_down", a, w_down),
        ("dW_down = a^T @ dy", a.t(), dy),
        ("dx = dh @ w_gate_up^T", dh, w_gate_up.t()),
        ("dW_gate_up = x^T @ dh", x.t(), dh),
    )
    for name, left, right in products:
        flops = 2 * left.shape[0] * left.shape[1] * right.shape[1]
        cublas = graph_us(lambda left=left, right=right: left @ right)
        ours = graph_us(lambda left=left, right=right: gemm_fwd(left, right, None, None, 1.0, 0.0, -1, torch.bfloat16))
        print(
            f"   {name:<24} cuBLAS {cublas:8.1f} us = {flops / cublas / 1e6:6.1f} TFLOP/s, "
            f"lstrain gemm {ours:8.1f} us = {flops / ours / 1e6:6.1f}"
        )


def time_norm_epilogue() -> None:
    """Issue 33's pattern A (:func:`lstrain.ops.linear_add_rms_norm_swiglu`) against the
    unfused path at LLaMA-0.75B's shapes (8192 tokens, D 2048, F 5632, bf16): the forward
    kernels of o_proj + residual add + RMSNorm + SwiGLU MLP, then a whole decoder layer's
    forward and backward with ``norm_in_epilogue`` and without (recomputed norms either
    way), each captured in a CUDA graph."""
    m, d, f, heads = 8192, 2048, 5632, 16
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    x, w_o, residual = randn(m, d), randn(d, d, scale=d**-0.5), randn(m, d)
    norm_weight, w_gate_up, w_down = randn(d) + 1, randn(d, 2 * f, scale=d**-0.5), randn(f, d, scale=f**-0.5)

    def unfused():
        normed, _, _ = add_rms_norm_fwd(torch.mm(x, w_o.t()), residual, (d,), norm_weight, 1e-6)
        torch.mm(swiglu_act(normed @ w_gate_up), w_down)

    def fused():
        _, scaled, squares = linear_add_rms_norm_fwd(x, w_o, None, residual, norm_weight)
        a, _ = swiglu_fwd(scaled, w_gate_up, row_squares=squares, eps=1e-6)
        torch.mm(a, w_down)

    print(f"== pattern A forward, o_proj {m}x{d}x{d} + add + RMSNorm + SwiGLU {d}->{f}->{d}")
    print(f"   unfused (cuBLAS, add_rms_norm, cuBLAS + swiglu_act, cuBLAS) {graph_us(unfused):8.1f} us")
    print(f"   fused (linear_add_rms_norm_fwd, row-scaled swiglu_fwd, cuBLAS) {graph_us(fused):8.1f} us")
    print(f"== decoder layer forward + backward, batch 4 x 2048, D {d}, {heads} heads, F {f}")
    for on in (False, True):
        print(f"   norm_in_epilogue={on} {_decoder_layer_us(on, d, heads, f):8.1f} us")


def _decoder_layer_us(norm_in_epilogue: bool, dim: int, heads: int, features: int) -> float:
    torch.manual_seed(0)
    layer = DecoderLayer(dim, heads, heads, dim // heads, features, device="cuda", dtype=torch.bfloat16)
    layer.norm_in_epilogue = norm_in_epilogue
    x = torch.randn(4, 2048, dim, device="cuda", dtype=torch.bfloat16)
    stream = torch.randn_like(x).requires_grad_()
    cos, sin = rotary_cos_sin(torch.arange(2048, device="cuda"), dim // heads, 10000.0, torch.bfloat16)
    grads = (torch.randn_like(x), torch.randn_like(x))

    def step():
        torch.autograd.backward(layer(x, cos, sin, residual=stream), grads)

    step()  # the parameters' .grad exist before capture: captured steps add into them
    return graph_us(step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="only vary the pipelining depth of the default plans")
    choices = (
        "layer_norm", "attention_softmax", "cross_entropy", "dropout", "gemm", "swiglu_mlp", "norm_epilogue",
        "qkv_attention",
    )  # fmt: skip
    parser.add_argument("--op", action="append", choices=choices)
    args = parser.parse_args()
    ops = args.op or choices
    if "gemm" in ops:
        sweep_gemm(args.quick)
    if "swiglu_mlp" in ops:
        time_swiglu_kernels()
    if "norm_epilogue" in ops:
        time_norm_epilogue()
    if "cross_entropy" in ops:
        sweep_cross_entropy(args.quick)
    if "dropout" in ops:
        time_dropout_kernels()
    if "layer_norm" in ops:
        sweep_layer_norm(args.quick)
    if "attention_softmax" in ops:
        sweep_attention_softmax(args.quick)
    if "qkv_attention" in ops:
        sweep_qkv_attention(args.quick)


def sweep_layer_norm(quick: bool) -> None:
    dtype = torch.bfloat16
    for cols in (1024, 4096, 8192):
        rows = 16384
        x = torch.randn(rows, cols, device="cuda", dtype=dtype)
        w = torch.randn(cols, device="cuda", dtype=dtype)
        b = torch.randn(cols, device="cuda", dtype=dtype)
        dy = torch.randn_like(x)
        _, stats = layer_norm_fwd(x, (cols,), w, b, 1e-5)
        results = []
        for block_rows, warps in [] if quick else itertools.product((1, 2, 4, 8), (2, 4, 8)):
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
            if quick and not near_default:
                continue
            run = functools.partial(layer_norm_bwd, dy, x, w, stats, (cols,), True, True, None, plan=plan)
            results.append((graph_us(run), plan))
        report(f"layer_norm bwd {rows}x{cols}", results, default)
        del x, dy


def sweep_attention_softmax(quick: bool) -> None:
    dtype = torch.bfloat16
    scores = torch.randn(8, 16, 1024, 1024, device="cuda", dtype=dtype)
    y = attention_softmax_fwd(scores, None, None, 0.125, True)
    dy = torch.randn_like(y)
    fwd, bwd = [], []
    for block_rows, warps in itertools.product((1,) if quick else (1, 2, 4), (1, 2, 4, 8)):
        if block_rows * 1024 // (warps * 32) < 4:
            continue
        plan = AttentionSoftmaxPlan(block_rows, 1024, warps)
        fwd.append(
            (graph_us(functools.partial(attention_softmax_fwd, scores, None, None, 0.125, True, plan=plan)), plan)
        )
        bwd.append((graph_us(functools.partial(attention_softmax_bwd, dy, y, 0.125, True, plan=plan)), plan))
    report("attention_softmax fwd 8x16x1024x1024 causal", fwd, attention_softmax_plan(1024))
    report("attention_softmax bwd 8x16x1024x1024 causal", bwd, attention_softmax_plan(1024, backward=True))


# (query rows, key rows, warps, stages) of each qkv_attention kernel; causal masking needs the
# inner loop's tile to divide the outer one's (AttentionPlan)
_QKV_ATTENTION_TILES = {  # the default first, then the other warp count: --quick times the two
    "fwd": [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4), (128, 32, 4, 4), (128, 64, 4, 2),
            (64, 32, 4, 3), (128, 64, 8, 2)],
    "dkdv": [(32, 128, 4, 3), (32, 128, 8, 3), (64, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 4), (64, 128, 4, 2),
             (16, 128, 4, 4), (64, 64, 4, 2), (32, 64, 4, 2)],
    "dq": [(128, 32, 8, 3), (128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4), (128, 16, 4, 4),
           (64, 32, 4, 2), (128, 64, 8, 2)],
}  # fmt: skip


def sweep_qkv_attention(quick: bool) -> None:
    """qkv_attention at GPT-2 medium's and BERT-large's attention (bf16, dropout 0.1): each
    kernel's tiles (forward alone; backward, the delta, dK / dV and dQ kernels, varying one
    kernel's tiles at a time), the mask stored as bits against drawn again in backward, and
    cuDNN's SDPA forward + backward on views of the same projection."""
    for name, batch, seq, heads, causal in (("gpt2-medium", 8, 1024, 16, True), ("bert-large", 16, 512, 16, False)):
        _sweep_qkv_attention_at(name, batch, seq, heads, causal, quick)


def _sweep_qkv_attention_at(name: str, batch: int, seq: int, heads: int, causal: bool, quick: bool) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype, dim, p = torch.bfloat16, heads * 64, 0.1
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(batch, seq, 3 * dim, device="cuda", dtype=dtype, generator=gen)
    dout = torch.randn(batch, seq, dim, device="cuda", dtype=dtype, generator=gen)
    seed = new_seed("cuda")
    default = attention_plan(64, dtype, seq)
    shape = f"{name} {batch}x{heads}x{seq}x64 {'causal' if causal else 'bidirectional'} p={p}"

    def fwd_us(plan, keep_bits=True):
        return graph_us(lambda: qkv_attention_fwd(qkv, seed, heads, causal, p, keep_bits, plan=plan))

    out, lse, bits = qkv_attention_fwd(qkv, seed, heads, causal, p, True)

    def bwd_us(plan, stored=bits):
        return graph_us(
            lambda: qkv_attention_bwd(dout, qkv, out, lse, seed, stored, heads, causal, p, True, dtype, plan=plan)
        )

    def tiles(kernel):
        return _QKV_ATTENTION_TILES[kernel][:2] if quick else _QKV_ATTENTION_TILES[kernel]

    results = [(fwd_us(AttentionPlan(t, default.dkdv, default.dq)), t) for t in tiles("fwd")]
    report(f"qkv_attention fwd {shape}", results, default.fwd)
    fwd = results[0][1]
    results = [(bwd_us(AttentionPlan(fwd, t, default.dq)), t) for t in tiles("dkdv")]
    report(f"qkv_attention bwd (dK/dV tiles) {shape}", results, default.dkdv)
    dkdv = results[0][1]
    results = [(bwd_us(AttentionPlan(fwd, dkdv, t)), t) for t in tiles("dq")]
    report(f"qkv_attention bwd (dQ tiles) {shape}", results, default.dq)
    best = AttentionPlan(fwd, dkdv, results[0][1])
    stored = fwd_us(best) + bwd_us(best)
    drawn = fwd_us(best, keep_bits=False) + bwd_us(best, stored=bits.new_empty(0))
    q, k, v = (t.detach().requires_grad_() for t in qkv.view(batch, seq, 3, heads, 64).permute(2, 0, 3, 1, 4))
    grad = dout.view(batch, seq, heads, 64).transpose(1, 2)

    def sdpa():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)
        torch.autograd.grad(o, (q, k, v), grad)

    print(
        f"== qkv_attention {shape}, best {best}: fwd + bwd {stored:.1f} us with the mask stored as bits, "
        f"{drawn:.1f} us drawn again; cuDNN SDPA fwd + bwd {graph_us(sdpa):.1f} us"
    )


if __name__ == "__main__":
    main()
