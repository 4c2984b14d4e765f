"""Property checks of every fused op: the registry behind ``lstrain check`` and the tests.

Each :class:`OpCheck` draws cases from a hypothesis strategy, builds the inputs on a
device, runs the op and its ``*_ref`` under :func:`lstrain.testing.check_function`, and
reports which backend ran.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from lstrain import _backend
from lstrain.ops import (
    add_rms_norm,
    add_rms_norm_ref,
    attention_softmax,
    attention_softmax_ref,
    bias_act_dropout,
    bias_act_dropout_ref,
    bias_dropout_residual,
    bias_dropout_residual_ref,
    cross_entropy,
    cross_entropy_ref,
    dropout_add_layer_norm,
    dropout_add_layer_norm_ref,
    dropout_mask,
    embedding,
    embedding_ref,
    gemm,
    gemm_ref,
    layer_norm,
    layer_norm_ref,
    linear_add_rms_norm_swiglu,
    linear_add_rms_norm_swiglu_ref,
    linear_cross_entropy,
    linear_cross_entropy_ref,
    qkv_attention,
    qkv_attention_ref,
    qkv_projection,
    qkv_projection_ref,
    rms_norm,
    rms_norm_ref,
    rope,
    rope_qkv,
    rope_qkv_ref,
    rope_ref,
    silu_mul,
    silu_mul_linear,
    silu_mul_linear_ref,
    silu_mul_ref,
    swiglu_mlp,
    swiglu_mlp_ref,
)
from lstrain.ops.rms_norm import default_eps
from lstrain.testing.compare import DEFAULT_ATOL, Comparison, check_function
from lstrain.testing.strategies import (
    FLOAT_DTYPES,
    GEMM_CPU_DTYPES,
    attention_softmax_cases,
    bias_dropout_cases,
    cross_entropy_cases,
    dropout_add_layer_norm_cases,
    embedding_cases,
    gemm_cases,
    layer_norm_cases,
    linear_add_rms_norm_swiglu_cases,
    linear_cross_entropy_cases,
    qkv_attention_cases,
    qkv_projection_cases,
    rms_norm_cases,
    rope_cases,
    rope_qkv_cases,
    silu_mul_cases,
    silu_mul_linear_cases,
    swiglu_cases,
)

__all__ = ["OP_CHECKS", "CheckResult", "OpCheck"]


@dataclass(frozen=True)
class CheckResult:
    comparisons: list[Comparison]
    backends: list[str]


@dataclass(frozen=True)
class OpCheck:
    """How to property-check one op: its case strategy and a runner for one case."""

    name: str
    cases: Callable[[str, torch.dtype | None], st.SearchStrategy[dict]]
    run: Callable[[dict, str], CheckResult]
    cpu_dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    gpu_dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    sizes: Callable[[dict], tuple[int, ...]] = lambda case: case["shape"]

    def dtypes(self, device: str) -> tuple[torch.dtype, ...]:
        """The dtypes worth checking on ``device``."""
        return self.cpu_dtypes if device == "cpu" else self.gpu_dtypes

    def describe(self, case: dict) -> str:
        """The case's sizes, e.g. ``4x1024`` (the table of ``lstrain check``)."""
        return "x".join(str(n) for n in self.sizes(case))


def _atol(dtype: torch.dtype, device: str) -> float:
    """The tolerance rule's atol, plus one bf16 ulp where Triton's CPU interpreter runs:
    it converts fp32 to bf16 by truncation (seen with triton 3.9), where the GPU rounds to
    nearest, so its bf16 stores may be a whole ulp off instead of half of one."""
    atol = DEFAULT_ATOL[dtype]
    if dtype == torch.bfloat16 and _backend.backend_for(torch.empty(0, device=device)) == "interpreter":
        atol += 2.0**-7
    return atol


def _randn(shape, generator, device, dtype=torch.float32, *, mean=0.0):
    return (torch.randn(shape, generator=generator) + mean).to(device=device, dtype=dtype)


def _run_layer_norm(case: dict, device: str) -> CheckResult:
    gen = torch.Generator().manual_seed(case["seed"])
    dtype, shape = case["dtype"], case["normalized_shape"]
    inputs = {"x": _randn(case["shape"], gen, device, dtype, mean=case["mean"])}
    if case["weight"]:
        inputs["weight"] = _randn(shape, gen, device, dtype, mean=1.0)
    if case["bias"]:
        inputs["bias"] = _randn(shape, gen, device, dtype)

    def run(fn):
        return lambda **kw: fn(kw["x"], shape, kw.get("weight"), kw.get("bias"), case["eps"])

    with _backend.record_backends() as ran:
        comparisons = check_function(
            run(layer_norm), run(layer_norm_ref), inputs, atol=_atol(dtype, device), generator=gen
        )
    return CheckResult(comparisons, [b for _, b in ran])


def _run_rms_norm(case: dict, device: str) -> CheckResult:
    gen = torch.Generator().manual_seed(case["seed"])
    dtype, shape = case["dtype"], case["normalized_shape"]
    inputs = {"x": _randn(case["shape"], gen, device, dtype) * case["scale"]}
    if case["weight"]:
        inputs["weight"] = _randn(shape, gen, device, dtype, mean=1.0)
    # The op takes eps None as is; the reference gets the number it stands for, since it
    # also runs on fp64 copies, whose own default would differ.
    eps = default_eps(dtype) if case["eps"] is None else case["eps"]

    def op(**kw):
        return rms_norm(kw["x"], shape, kw.get("weight"), case["eps"])

    def reference(**kw):
        return rms_norm_ref(kw["x"], shape, kw.get("weight"), eps)

    with _backend.record_backends() as ran:
        comparisons = check_function(op, reference, inputs, atol=_atol(dtype, device), generator=gen)
    return CheckResult(comparisons, [b for _, b in ran])


def _run_add_rms_norm(case: dict, device: str) -> CheckResult:
    gen = torch.Generator().manual_seed(case["seed"])
    dtype, shape = case["dtype"], case["normalized_shape"]
    inputs = {
        "x": _randn(case["shape"], gen, device, dtype) * case["scale"],
        "residual": _randn(case["shape"], gen, device, dtype) * case["scale"],
    }
    if case["weight"]:
        inputs["weight"] = _randn(shape, gen, device, dtype, mean=1.0)
    eps = default_eps(dtype) if case["eps"] is None else case["eps"]

    # both outputs, each judged at its own scale (the stream may be far smaller than the norm)
    def op(**kw):
        return add_rms_norm(kw["x"], kw["residual"], shape, kw.get("weight"), case["eps"])

    def reference(**kw):
        return add_rms_norm_ref(kw["x"], kw["residual"], shape, kw.get("weight"), eps)

    with _backend.record_backends() as ran:
        comparisons = check_function(op, reference, inputs, atol=_atol(dtype, device), generator=gen)
    return CheckResult(comparisons, [b for _, b in ran])


def _rope_cos_sin(case: dict, batch: int, seq: int, generator, device: str, dtype: torch.dtype):
    """cos and sin for a RoPE case, in ``dtype`` as LlamaRotaryEmbedding returns them: its
    tables at random position ids (base 10000), or random values; shared or per batch."""
    head_dim = case["head_dim"]
    table_batch = {"shared": (), "one": (1,), "per_batch": (batch,)}[case["table_batch"]]
    if case["tables"] == "random":
        cos, sin = (torch.randn((*table_batch, seq, head_dim), generator=generator) for _ in range(2))
    else:
        inv_freq = 10000.0 ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        positions = torch.randint(0, 8192, (*table_batch, seq), generator=generator).double()
        freqs = positions[..., None] * inv_freq
        angles = freqs.repeat_interleave(2, -1) if case["interleaved"] else torch.cat((freqs, freqs), -1)
        cos, sin = angles.cos(), angles.sin()
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def _run_rope(case: dict, device: str) -> CheckResult:
    gen = torch.Generator().manual_seed(case["seed"])
    batch, heads, seq = case["shape"]
    dtype, head_dim = case["dtype"], case["head_dim"]
    x = _randn((batch, seq, heads, head_dim), gen, device, dtype)
    x = x.transpose(1, 2) if case["layout"] == "hf" else x.transpose(1, 2).contiguous()
    cos, sin = _rope_cos_sin(case, batch, seq, gen, device, dtype)

    def run(fn):
        return lambda x, cos, sin: fn(x, cos, sin, interleaved=case["interleaved"])

    with _backend.record_backends() as ran:
        comparisons = check_function(
            run(rope), run(rope_ref), {"x": x, "cos": cos, "sin": sin}, grad_inputs=["x"],
            atol=_atol(dtype, device), generator=gen,
        )  # fmt: skip
    return CheckResult(comparisons, [b for _, b in ran])


def _run_rope_qkv(case: dict, device: str) -> CheckResult:
    gen = torch.Generator().manual_seed(case["seed"])
    batch, seq = case["shape"]
    dtype, head_dim = case["dtype"], case["head_dim"]
    heads, kv_heads = case["num_heads"], case["num_kv_heads"]
    qkv = _randn((batch, seq, (heads + 2 * kv_heads) * head_dim), gen, device, dtype)
    cos, sin = _rope_cos_sin(case, batch, seq, gen, device, dtype)

    # q, k and v side by side along the heads, for the tolerance rule's one tensor
    def run(fn):
        return lambda qkv, cos, sin: torch.cat(
            fn(qkv, cos, sin, heads, kv_heads, interleaved=case["interleaved"]), dim=1
        )

    with _backend.record_backends() as ran:
        comparisons = check_function(
            run(rope_qkv), run(rope_qkv_ref), {"qkv": qkv, "cos": cos, "sin": sin}, grad_inputs=["qkv"],
            atol=_atol(dtype, device), generator=gen,
        )  # fmt: skip
    return CheckResult(comparisons, [b for _, b in ran])


def _packed_projection_inputs(case: dict, device: str, gen: torch.Generator) -> dict:
    """x, the packed weight and (if the case has one) the bias of a QKV projection case."""
    batch, seq = case["shape"]
    dtype, width = case["dtype"], case["in_features"]
    dim = case["heads"] * case["head_dim"]
    inputs = {
        "x": _randn((batch, seq, width), gen, device, dtype),
        "weight": _randn((3 * dim, width), gen, device, dtype) * width**-0.5,
    }
    if case["bias"]:
        inputs["bias"] = _randn((3 * dim,), gen, device, dtype)
    return inputs


def _run_qkv_projection(case: dict, device: str) -> CheckResult:
    gen = torch.Generator().manual_seed(case["seed"])
    dtype, heads = case["dtype"], case["heads"]
    inputs = _packed_projection_inputs(case, device, gen)

    # q, k and v side by side along the heads, for the tolerance rule's one tensor; their
    # gradients then come as strided views of one, as attention's backward may leave them
    def run(fn):
        return lambda x, weight, bias=None: torch.cat(fn(x, weight, bias, heads), dim=1)

    with _backend.record_backends() as ran:
        comparisons = check_function(
            run(qkv_projection), run(qkv_projection_ref), inputs, atol=_atol(dtype, device), generator=gen
        )
    return CheckResult(comparisons, [b for _, b in ran])


def _run_qkv_attention(case: dict, device: str) -> CheckResult:
    gen = torch.Generator().manual_seed(case["seed"])
    dtype, heads = case["dtype"], case["heads"]
    inputs = _packed_projection_inputs(case, device, gen)
    # one mask for the op and both reference runs
    seed = torch.tensor([case["seed"]], dtype=torch.int64, device=device)
    options = {"causal": case["causal"], "dropout_p": case["dropout_p"], "seed": seed}

    def run(fn):
        return lambda x, weight, bias=None: fn(x, weight, bias, heads, **options)

    with _backend.record_backends() as ran:
        comparisons = check_function(
            run(qkv_attention), run(qkv_attention_ref), inputs, atol=_atol(dtype, device), generator=gen
        )
    return CheckResult(comparisons, [b for _, b in ran])


def _run_attention_softmax(case: dict, device: str) -> CheckResult:
    gen = torch.Generator().manual_seed(case["seed"])
    batch, _, _, k_len = case["shape"]
    inputs = {"scores": _randn(case["shape"], gen, device, case["dtype"]) * 3}
    options = {"scale": case["scale"], "causal": case["causal"]}
    if case["padding"] is not None:
        inputs["key_padding_mask"] = (torch.rand(batch, k_len, generator=gen) < case["padding"]).to(device)
    if case["mask_shape"] is not None:
        mask = torch.randn(case["mask_shape"], generator=gen)
        mask = mask.masked_fill(torch.rand(case["mask_shape"], generator=gen) < 0.2, float("-inf"))
        inputs["mask"] = mask.to(device=device, dtype=case["dtype"])
    grad_inputs = ["scores", "mask"] if case["mask_grad"] else ["scores"]

    def run(fn):
        return lambda **kw: fn(
            kw["scores"], key_padding_mask=kw.get("key_padding_mask"), mask=kw.get("mask"), **options
        )

    with _backend.record_backends() as ran:
        comparisons = check_function(
            run(attention_softmax),
            run(attention_softmax_ref),
            inputs,
            grad_inputs=grad_inputs,
            atol=_atol(case["dtype"], device),
            generator=gen,
        )
    return CheckResult(comparisons, [b for _, b in ran])


def _run_cross_entropy(case: dict, device: str) -> CheckResult:
    gen = torch.Generator().manual_seed(case["seed"])
    vocab = case["shape"][-1]
    logits = _randn(case["shape"], gen, device, case["dtype"]) * case["scale"]
    target = torch.randint(0, vocab, case["shape"][:-1], generator=gen)
    target = target.masked_fill(torch.rand(target.shape, generator=gen) < case["ignored"], -100).to(device)
    options = {k: case[k] for k in ("label_smoothing", "reduction", "z_loss")}

    def run(fn):
        return lambda logits: fn(logits, target, **options)

    with _backend.record_backends() as ran:
        comparisons = check_function(
            run(cross_entropy),
            run(cross_entropy_ref),
            {"logits": logits},
            atol=_atol(case["dtype"], device),
            generator=gen,
        )
    return CheckResult(comparisons, [b for _, b in ran])


def _run_linear_cross_entropy(case: dict, device: str) -> CheckResult:
    gen = torch.Generator().manual_seed(case["seed"])
    tokens, vocab, dtype = case["tokens"], case["vocab"], case["dtype"]
    inputs = {
        "hidden": _randn((tokens, case["hidden"]), gen, device, dtype),
        "weight": _randn((vocab, case["hidden"]), gen, device, dtype) * case["hidden"] ** -0.5,
    }
    if case["bias"]:
        inputs["bias"] = _randn((vocab,), gen, device, dtype) * 0.1
    target = torch.randint(0, vocab, (tokens,), generator=gen)
    target = target.masked_fill(torch.rand(tokens, generator=gen) < case["ignored"], -100).to(device)
    options = {k: case[k] for k in ("label_smoothing", "reduction", "z_loss")}
    chunk_bytes = case["chunk_rows"] * vocab * inputs["hidden"].element_size()

    def ours(**kw):
        return linear_cross_entropy(
            kw["hidden"], kw["weight"], target, kw.get("bias"), chunk_bytes=chunk_bytes, **options
        )

    def reference(**kw):
        return linear_cross_entropy_ref(kw["hidden"], kw["weight"], target, kw.get("bias"), **options)

    with _backend.record_backends() as ran:
        comparisons = check_function(ours, reference, inputs, atol=_atol(dtype, device), generator=gen)
    return CheckResult(comparisons, [b for _, b in ran])


def _dropout_inputs(case: dict, device: str):
    gen = torch.Generator().manual_seed(case["seed"])
    shape, dtype = case["shape"], case["dtype"]
    inputs = {"x": _randn(shape, gen, device, dtype)}
    if case["bias"]:
        inputs["bias"] = _randn(shape[-1:], gen, device, dtype)
    seed = torch.tensor([case["seed"]], dtype=torch.int64, device=device)
    active = case["training"] and case["dropout"] > 0
    mask = dropout_mask(seed, shape, case["dropout"]) if active else None
    return gen, inputs, seed, mask, (case["dropout"] if active else 0.0)


def _run_bias_dropout_residual(case: dict, device: str) -> CheckResult:
    gen, inputs, seed, mask, rate = _dropout_inputs(case, device)
    inputs["residual"] = _randn(case["shape"], gen, device, case["dtype"])

    def ours(**kw):
        return bias_dropout_residual(
            kw["x"], kw.get("bias"), kw["residual"], dropout=case["dropout"], training=case["training"], seed=seed
        )

    def reference(**kw):
        return bias_dropout_residual_ref(kw["x"], kw.get("bias"), kw["residual"], dropout=rate, mask=mask)

    with _backend.record_backends() as ran:
        comparisons = check_function(ours, reference, inputs, atol=_atol(case["dtype"], device), generator=gen)
    return CheckResult(comparisons, [b for _, b in ran])


def _run_dropout_add_layer_norm(case: dict, device: str) -> CheckResult:
    gen, inputs, seed, mask, rate = _dropout_inputs(case, device)
    if "bias" in inputs:
        inputs["x_bias"] = inputs.pop("bias")
    dtype, cols = case["dtype"], case["shape"][-1]
    inputs["residual"] = _randn(case["shape"], gen, device, dtype)
    if case["weight"]:
        inputs["weight"] = _randn((cols,), gen, device, dtype, mean=1.0)
    if case["norm_bias"]:
        inputs["bias"] = _randn((cols,), gen, device, dtype)

    # pre-LN uses both outputs (each judged at its own scale); post-LN only the normalised one
    def outputs(pair):
        return tuple(pair) if case["prenorm"] else pair[0]

    def ours(**kw):
        return outputs(
            dropout_add_layer_norm(
                kw["x"], kw.get("x_bias"), kw["residual"], kw.get("weight"), kw.get("bias"),
                eps=case["eps"], dropout=case["dropout"], training=case["training"], seed=seed,
            )
        )  # fmt: skip

    def reference(**kw):
        return outputs(
            dropout_add_layer_norm_ref(
                kw["x"], kw.get("x_bias"), kw["residual"], kw.get("weight"), kw.get("bias"),
                eps=case["eps"], dropout=rate, mask=mask,
            )
        )  # fmt: skip

    with _backend.record_backends() as ran:
        comparisons = check_function(ours, reference, inputs, atol=_atol(dtype, device), generator=gen)
    return CheckResult(comparisons, [b for _, b in ran])


def _run_bias_act_dropout(case: dict, device: str) -> CheckResult:
    gen, inputs, seed, mask, rate = _dropout_inputs(case, device)
    activation = case["activation"]

    def ours(**kw):
        return bias_act_dropout(
            kw["x"],
            kw.get("bias"),
            activation=activation,
            dropout=case["dropout"],
            training=case["training"],
            seed=seed,
        )

    def reference(**kw):
        return bias_act_dropout_ref(kw["x"], kw.get("bias"), activation=activation, dropout=rate, mask=mask)

    with _backend.record_backends() as ran:
        comparisons = check_function(ours, reference, inputs, atol=_atol(case["dtype"], device), generator=gen)
    return CheckResult(comparisons, [b for _, b in ran])


def _run_silu_mul(case: dict, device: str) -> CheckResult:
    gen = torch.Generator().manual_seed(case["seed"])
    shape, dtype, scale = case["shape"], case["dtype"], case["scale"]
    if case["packed"]:  # gate and up as the column halves of one projection: rows strided
        packed = _randn((*shape[:-1], 2 * shape[-1]), gen, device, dtype) * scale
        gate, up = packed[..., : shape[-1]], packed[..., shape[-1] :]
    else:
        gate, up = _randn(shape, gen, device, dtype) * scale, _randn(shape, gen, device, dtype)
    with _backend.record_backends() as ran:
        comparisons = check_function(
            silu_mul, silu_mul_ref, {"gate": gate, "up": up}, atol=_atol(dtype, device), generator=gen
        )
    return CheckResult(comparisons, [b for _, b in ran])


def _run_silu_mul_linear(case: dict, device: str) -> CheckResult:
    gen = torch.Generator().manual_seed(case["seed"])
    shape, dtype, out_features = case["shape"], case["dtype"], case["out_features"]
    if case["packed"]:  # gate and up as the column halves of one projection: rows strided
        packed = _randn((*shape[:-1], 2 * shape[-1]), gen, device, dtype)
        gate, up = packed[..., : shape[-1]] * case["scale"], packed[..., shape[-1] :]
    else:
        gate, up = _randn(shape, gen, device, dtype) * case["scale"], _randn(shape, gen, device, dtype)
    weight = _randn((out_features, shape[-1]), gen, device, dtype) * shape[-1] ** -0.5
    inputs = {"gate": gate, "up": up, "weight": weight}
    if case["bias"]:
        inputs["bias"] = _randn((out_features,), gen, device, dtype)

    def run(fn):
        return lambda gate, up, weight, bias=None: fn(gate, up, weight, bias)

    with _backend.record_backends() as ran:
        comparisons = check_function(
            run(silu_mul_linear), run(silu_mul_linear_ref), inputs, atol=_atol(dtype, device), generator=gen
        )
    return CheckResult(comparisons, [b for _, b in ran])


def _run_embedding(case: dict, device: str) -> CheckResult:
    gen = torch.Generator().manual_seed(case["seed"])
    dtype, vocab, dim = case["dtype"], case["vocab"], case["dim"]
    tokens = torch.randint(0, vocab, case["tokens"], generator=gen).to(device)
    padding_idx = int(tokens.view(-1)[0]) if case["padding"] else None
    inputs = {"weight": _randn((vocab, dim), gen, device, dtype)}
    positions = None
    if case["positions"] is not None:
        inputs["pos_weight"] = _randn((case["max_positions"], dim), gen, device, dtype)
    if case["positions"] == "explicit":
        positions = torch.randint(0, case["max_positions"], case["tokens"], generator=gen).to(device)
    seed = torch.tensor([case["seed"]], dtype=torch.int64, device=device)
    options = {"positions": positions, "scale": case["scale"], "padding_idx": padding_idx}
    out_shape = (*case["tokens"], dim)
    mask = dropout_mask(seed, out_shape, case["dropout"]) if case["dropout"] > 0 else None

    def ours(**kw):
        return embedding(
            tokens, kw["weight"], pos_weight=kw.get("pos_weight"), dropout=case["dropout"],
            deterministic=case["deterministic"], seed=seed, **options,
        )  # fmt: skip

    def reference(**kw):
        return embedding_ref(
            tokens, kw["weight"], pos_weight=kw.get("pos_weight"), dropout=case["dropout"], mask=mask, **options
        )

    with _backend.record_backends() as ran:
        comparisons = check_function(ours, reference, inputs, atol=_atol(dtype, device), generator=gen)
    return CheckResult(comparisons, [b for _, b in ran])


def _run_gemm(case: dict, device: str) -> CheckResult:
    gen = torch.Generator().manual_seed(case["seed"])
    m, n, k = case["mnk"]
    dtype = case["dtype"]
    a = _randn((k, m) if case["transpose_a"] else (m, k), gen, device, dtype)
    b = _randn((n, k) if case["transpose_b"] else (k, n), gen, device, dtype)
    inputs = {"a": a.t() if case["transpose_a"] else a, "b": b.t() if case["transpose_b"] else b}
    if case["c"]:
        inputs["c"] = _randn((m, n), gen, device, dtype)
    if case["bias"]:
        inputs["bias"] = _randn((n,), gen, device, dtype)
    options = {k: case[k] for k in ("alpha", "beta", "activation")}

    def run(fn, **overrides):
        return lambda **kw: fn(kw["a"], kw["b"], c=kw.get("c"), bias=kw.get("bias"), **(options | overrides))

    reference = run(gemm_ref)
    if case["activation"] == "relu":
        reference = _relu_reference(run(gemm_ref, activation=None), run(gemm), inputs, _atol(dtype, device))
    with _backend.record_backends() as ran:
        comparisons = check_function(run(gemm), reference, inputs, atol=_atol(dtype, device), generator=gen)
    return CheckResult(comparisons, [b for _, b in ran])


def _relu_reference(pre_activation: Callable, ours: Callable, inputs: dict, atol: float) -> Callable:
    """relu(pre_activation) whose side of the kink is fixed: where the exact pre-activation
    lies within twice PyTorch's own rounding error (+ atol) of 0, any implementation may
    land on either side and relu's gradient jumps, so there the reference takes the side
    ``ours`` took; elsewhere the exact sign."""
    with torch.no_grad():
        exact = pre_activation(**{k: v.double() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
        band = 2 * (pre_activation(**inputs).double() - exact).abs().max() + atol
        positive = torch.where(exact.abs() <= band, ours(**inputs) > 0, exact > 0)
    return lambda **kw: torch.where(positive, pre_activation(**kw), 0.0)


def _run_swiglu(case: dict, device: str) -> CheckResult:
    gen = torch.Generator().manual_seed(case["seed"])
    m, d, f, dtype = case["tokens"], case["hidden"], case["intermediate"], case["dtype"]
    inputs = {
        "x": _randn((m, d), gen, device, dtype),
        "w_gate_up": _randn((d, 2 * f), gen, device, dtype) * d**-0.5,
        "w_down": _randn((f, d), gen, device, dtype) * f**-0.5,
    }

    def run(fn):
        return lambda **kw: fn(kw["x"], kw["w_gate_up"], kw["w_down"])

    with _backend.record_backends() as ran:
        comparisons = check_function(
            run(swiglu_mlp), run(swiglu_mlp_ref), inputs, atol=_atol(dtype, device), generator=gen
        )
    return CheckResult(comparisons, [b for _, b in ran])


def _run_linear_add_rms_norm_swiglu(case: dict, device: str) -> CheckResult:
    gen = torch.Generator().manual_seed(case["seed"])
    m, k, d, f, dtype = case["tokens"], case["in_features"], case["hidden"], case["intermediate"], case["dtype"]
    inputs = {
        "x": _randn((m, k), gen, device, dtype),
        "weight": _randn((d, k), gen, device, dtype) * k**-0.5,
        "residual": _randn((m, d), gen, device, dtype),
        "norm_weight": _randn((d,), gen, device, dtype, mean=1.0),
        "w_gate_up": _randn((d, 2 * f), gen, device, dtype) * d**-0.5,
        "w_down": _randn((f, d), gen, device, dtype) * f**-0.5,
    }
    if case["bias"]:
        inputs["bias"] = _randn((d,), gen, device, dtype)
    eps = default_eps(dtype)  # the reference's fp64 default would differ

    # both outputs, each judged at its own scale
    def run(fn):
        def both(**kw):
            weights = (kw["norm_weight"], kw["w_gate_up"], kw["w_down"])
            return tuple(fn(kw["x"], kw["weight"], kw["residual"], *weights, bias=kw.get("bias"), eps=eps))

        return both

    with _backend.record_backends() as ran:
        comparisons = check_function(
            run(linear_add_rms_norm_swiglu),
            run(linear_add_rms_norm_swiglu_ref),
            inputs,
            atol=_atol(dtype, device),
            generator=gen,
        )
    return CheckResult(comparisons, [b for _, b in ran])


OP_CHECKS: dict[str, OpCheck] = {
    "layer_norm": OpCheck("layer_norm", layer_norm_cases, _run_layer_norm),
    "rms_norm": OpCheck("rms_norm", rms_norm_cases, _run_rms_norm),
    "add_rms_norm": OpCheck("add_rms_norm", rms_norm_cases, _run_add_rms_norm),
    "rope": OpCheck("rope", rope_cases, _run_rope, sizes=lambda case: (*case["shape"], case["head_dim"])),
    "rope_qkv": OpCheck(
        "rope_qkv",
        rope_qkv_cases,
        _run_rope_qkv,
        sizes=lambda case: (*case["shape"], case["num_heads"] + 2 * case["num_kv_heads"], case["head_dim"]),
    ),
    "qkv_projection": OpCheck(
        "qkv_projection",
        qkv_projection_cases,
        _run_qkv_projection,
        sizes=lambda case: (*case["shape"], case["in_features"], case["heads"], case["head_dim"]),
    ),
    "qkv_attention": OpCheck(
        "qkv_attention",
        qkv_attention_cases,
        _run_qkv_attention,
        cpu_dtypes=GEMM_CPU_DTYPES,
        sizes=lambda case: (*case["shape"], case["in_features"], case["heads"], case["head_dim"]),
    ),
    "attention_softmax": OpCheck("attention_softmax", attention_softmax_cases, _run_attention_softmax),
    "cross_entropy": OpCheck("cross_entropy", cross_entropy_cases, _run_cross_entropy),
    "linear_cross_entropy": OpCheck(
        "linear_cross_entropy",
        linear_cross_entropy_cases,
        _run_linear_cross_entropy,
        sizes=lambda case: (case["tokens"], case["hidden"], case["vocab"]),
    ),
    "bias_dropout_residual": OpCheck("bias_dropout_residual", bias_dropout_cases, _run_bias_dropout_residual),
    "bias_act_dropout": OpCheck("bias_act_dropout", bias_dropout_cases, _run_bias_act_dropout),
    "dropout_add_layer_norm": OpCheck(
        "dropout_add_layer_norm", dropout_add_layer_norm_cases, _run_dropout_add_layer_norm
    ),
    "silu_mul": OpCheck("silu_mul", silu_mul_cases, _run_silu_mul),
    "silu_mul_linear": OpCheck(
        "silu_mul_linear",
        silu_mul_linear_cases,
        _run_silu_mul_linear,
        sizes=lambda case: (*case["shape"], case["out_features"]),
    ),
    "embedding": OpCheck(
        "embedding", embedding_cases, _run_embedding, sizes=lambda case: (*case["tokens"], case["dim"])
    ),
    "gemm": OpCheck("gemm", gemm_cases, _run_gemm, cpu_dtypes=GEMM_CPU_DTYPES, sizes=lambda case: case["mnk"]),
    "swiglu_mlp": OpCheck(
        "swiglu_mlp",
        swiglu_cases,
        _run_swiglu,
        cpu_dtypes=GEMM_CPU_DTYPES,
        sizes=lambda case: (case["tokens"], case["hidden"], case["intermediate"]),
    ),
    "linear_add_rms_norm_swiglu": OpCheck(
        "linear_add_rms_norm_swiglu",
        linear_add_rms_norm_swiglu_cases,
        _run_linear_add_rms_norm_swiglu,
        cpu_dtypes=(torch.float32,),  # no fp16 (refused), and the interpreter's bf16 dot is wrong
        gpu_dtypes=(torch.float32, torch.bfloat16),
        sizes=lambda case: (case["tokens"], case["in_features"], case["hidden"], case["intermediate"]),
    ),
}
