"""Hypothesis strategies for shapes, dtypes and op flags, and the shared test profiles.

Shapes lean on the cases kernels get wrong: one row, odd and non-power-of-two widths,
widths one past a power of two, and (where the profile allows) rows longer than one
register tile.

The ``*_cases`` strategies share one signature: ``layer_norm_cases(device="cpu",
dtype=None)`` is a strategy of dicts (shapes, dtype, flags and a ``seed`` for the
values), sized by :func:`size_limits` of ``device``; ``dtype`` pins the dtype, else
fp32, fp16 and bf16 are drawn (the GEMM cases draw no bf16 on the CPU). Each op's
check (``lstrain.testing.checks.OP_CHECKS``) turns a case into tensors and compares.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

__all__ = [
    "FLOAT_DTYPES",
    "GEMM_CPU_DTYPES",
    "attention_softmax_cases",
    "bias_dropout_cases",
    "cross_entropy_cases",
    "dropout_add_layer_norm_cases",
    "dtypes",
    "embedding_cases",
    "gemm_cases",
    "layer_norm_cases",
    "linear_cross_entropy_cases",
    "qkv_projection_cases",
    "register_profiles",
    "rms_norm_cases",
    "rope_cases",
    "rope_qkv_cases",
    "row_widths",
    "seeds",
    "silu_mul_cases",
    "silu_mul_linear_cases",
    "swiglu_cases",
    "linear_add_rms_norm_swiglu_cases",
    "size_limits",
]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GEMM_CPU_DTYPES = (torch.float32, torch.float16)  # the interpreter's bf16 tl.dot is wrong


def register_profiles() -> None:
    """Register the hypothesis profiles ``lstrain-cpu`` and ``lstrain-gpu``.

    ``lstrain-cpu``: few examples, no deadline (the Triton interpreter is slow), and the
    same examples on every run, for CI.
    ``lstrain-gpu``: many examples and larger shapes, for a GPU machine.
    Tests read ``max_cols`` etc. from :func:`size_limits` to match the profile.
    """
    common = dict(
        deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], print_blob=True
    )
    settings.register_profile("lstrain-cpu", max_examples=40, derandomize=True, **common)
    settings.register_profile("lstrain-gpu", max_examples=60, **common)


def size_limits(device: str) -> dict[str, int]:
    """Largest sizes worth drawing on ``device``.

    Args:
        device: ``"cpu"`` (the interpreter: small) or a GPU device.

    Returns:
        ``rows``, ``cols``, ``long_cols``, ``k_len``, ``long_k``, ``vocab`` and
        ``long_vocab`` upper bounds.
    """
    if device == "cpu":
        return {
            "rows": 12,
            "cols": 1200,
            "long_cols": 20000,
            "k_len": 300,
            "long_k": 5000,
            "vocab": 3000,
            "long_vocab": 40000,
        }
    return {
        "rows": 4096,
        "cols": 8192,
        "long_cols": 65536,
        "k_len": 4096,
        "long_k": 16384,
        "vocab": 32768,
        "long_vocab": 262144,
    }


def dtypes() -> st.SearchStrategy[torch.dtype]:
    """fp32, fp16 or bf16."""
    return st.sampled_from(FLOAT_DTYPES)


def seeds() -> st.SearchStrategy[int]:
    """Seeds for the tensors' random values (shrinks to 0)."""
    return st.integers(0, 2**31 - 1)


def row_widths(max_cols: int) -> st.SearchStrategy[int]:
    """Row widths: 1, small odd ones, powers of two and their neighbours, anything up to max_cols.

    Args:
        max_cols: the widest row to draw.

    Returns:
        A strategy of ints in [1, max_cols].
    """
    powers = [2**k for k in range(max_cols.bit_length()) if 2**k <= max_cols]
    near_powers = sorted({n + d for n in powers for d in (-1, 0, 1) if 1 <= n + d <= max_cols})
    return st.one_of(st.sampled_from(near_powers), st.integers(1, max_cols))


@st.composite
def _normalized_shapes(draw, device: str) -> dict:
    """``shape`` and ``normalized_shape`` of a norm's case: one row in ten longer than a tile
    (few rows then), up to two leading dims, sometimes two normalised dims."""
    limits = size_limits(device)
    long_row = draw(st.integers(0, 9)) == 0
    cols = draw(st.integers(limits["cols"] + 1, limits["long_cols"])) if long_row else draw(row_widths(limits["cols"]))
    leading = draw(st.lists(st.integers(1, 4), min_size=0, max_size=2))
    rows = draw(st.integers(1, limits["rows"] if not long_row else 3))
    normalized = (cols,)
    if cols % 2 == 0 and cols > 2 and draw(st.booleans()):
        normalized = (2, cols // 2)
    return {"shape": (*leading, rows, *normalized), "normalized_shape": normalized}


@st.composite
def layer_norm_cases(draw, device: str = "cpu", dtype: torch.dtype | None = None) -> dict:
    """A LayerNorm case: shapes, dtype (any, or the one given), affine flags, eps and a seed."""
    return {
        **draw(_normalized_shapes(device)),
        "dtype": dtype or draw(dtypes()),
        "weight": draw(st.booleans()),
        "bias": draw(st.booleans()),
        "eps": draw(st.sampled_from([1e-5, 1e-6, 1e-3])),
        "mean": draw(st.sampled_from([0.0, 0.0, 3.0])),
        "seed": draw(seeds()),
    }


@st.composite
def rms_norm_cases(draw, device: str = "cpu", dtype: torch.dtype | None = None) -> dict:
    """An RMSNorm case: shapes, dtype (any, or the one given), weight flag, eps and a seed.

    ``eps`` None is torch's default; ``scale`` shrinks some inputs until eps matters.
    """
    return {
        **draw(_normalized_shapes(device)),
        "dtype": dtype or draw(dtypes()),
        "weight": draw(st.booleans()),
        "eps": draw(st.sampled_from([None, 1e-5, 1e-6])),
        "scale": draw(st.sampled_from([1.0, 1.0, 1e-3])),
        "seed": draw(seeds()),
    }


def _rope_tables(draw, small: bool) -> dict:
    """What RoPE's rotation and tables look like: style, batch layout of cos/sin, values."""
    return {
        "head_dim": 2 * draw(st.sampled_from([1, 2, 3, 4, 32, 40, 64]) | st.integers(1, 64 if small else 128)),
        "interleaved": draw(st.booleans()),
        # cos/sin [seq, d], [1, seq, d] or [batch, seq, d]
        "table_batch": draw(st.sampled_from(["shared", "one", "per_batch"])),
        # "hf": LlamaRotaryEmbedding's tables at random position ids; "random": any values,
        # so that the formula is checked in full (halves or pair entries not equal)
        "tables": draw(st.sampled_from(["hf", "random"])),
    }


@st.composite
def rope_cases(draw, device: str = "cpu", dtype: torch.dtype | None = None) -> dict:
    """A RoPE case: [batch, heads, seq, head_dim] (head_dim even), layout, tables, style, seed.

    ``layout`` "hf" is Hugging Face's ``view(b, s, h, d).transpose(1, 2)`` of a projection.
    """
    small = device == "cpu"
    return {
        "shape": (
            draw(st.integers(1, 3)),
            draw(st.integers(1, 4 if small else 16)),
            draw(st.integers(1, 24 if small else 512)),
        ),
        **_rope_tables(draw, small),
        "layout": draw(st.sampled_from(["contiguous", "hf"])),
        "dtype": dtype or draw(dtypes()),
        "seed": draw(seeds()),
    }


@st.composite
def rope_qkv_cases(draw, device: str = "cpu", dtype: torch.dtype | None = None) -> dict:
    """A packed-QKV RoPE case: batch, seq, kv heads and query heads per kv head (GQA), tables, style, seed."""
    small = device == "cpu"
    kv_heads = draw(st.integers(1, 3 if small else 8))
    return {
        "shape": (draw(st.integers(1, 3)), draw(st.integers(1, 24 if small else 512))),
        "num_kv_heads": kv_heads,
        "num_heads": kv_heads * draw(st.sampled_from([1, 2, 3] if small else [1, 4, 8])),
        **_rope_tables(draw, small),
        "dtype": dtype or draw(dtypes()),
        "seed": draw(seeds()),
    }


@st.composite
def qkv_projection_cases(draw, device: str = "cpu", dtype: torch.dtype | None = None) -> dict:
    """A packed QKV projection case: batch, seq, input width, heads, head_dim, bias, seed."""
    small = device == "cpu"
    return {
        "shape": (draw(st.integers(1, 3)), draw(st.integers(1, 24 if small else 512))),
        "in_features": draw(st.integers(1, 40 if small else 1024)),
        "heads": draw(st.integers(1, 4 if small else 16)),
        "head_dim": draw(st.sampled_from([1, 3, 8, 16] if small else [8, 64, 80, 128])),
        "bias": draw(st.booleans()),
        "dtype": dtype or draw(dtypes()),
        "seed": draw(seeds()),
    }


@st.composite
def qkv_attention_cases(draw, device: str = "cpu", dtype: torch.dtype | None = None) -> dict:
    """A self-attention case over a packed projection: batch, seq, input width, heads,
    head_dim, causal, attention dropout, bias, seed (the dropout seed too)."""
    small = device == "cpu"
    return {
        "shape": (draw(st.integers(1, 2)), draw(st.integers(1, 24 if small else 300))),
        "in_features": draw(st.integers(1, 16 if small else 256)),
        "heads": draw(st.integers(1, 2 if small else 8)),
        "head_dim": draw(st.sampled_from([16] if small else [16, 32, 64, 128])),
        "causal": draw(st.booleans()),
        "dropout_p": draw(st.sampled_from([0.0, 0.1, 0.5])),
        "bias": draw(st.booleans()),
        "dtype": dtype or draw(dtypes()),
        "seed": draw(seeds()),
    }


@st.composite
def attention_softmax_cases(draw, device: str = "cpu", dtype: torch.dtype | None = None) -> dict:
    """An attention-softmax case: [B, H, Q, K], dtype (any, or the one given), scale, masks, causal, seed."""
    limits = size_limits(device)
    long_row = draw(st.integers(0, 9)) == 0
    k_len = draw(st.integers(limits["k_len"] + 1, limits["long_k"])) if long_row else draw(row_widths(limits["k_len"]))
    q_len = draw(st.integers(1, 3 if long_row else 24))
    batch = draw(st.integers(1, 3))
    heads = draw(st.integers(1, 3))
    mask_shape = None
    if draw(st.booleans()):
        mask_shape = tuple(draw(st.sampled_from([n, 1])) for n in (batch, heads, q_len, k_len))
        mask_shape = mask_shape[draw(st.integers(0, 3)) :]
    return {
        "shape": (batch, heads, q_len, k_len),
        "dtype": dtype or draw(dtypes()),
        "scale": draw(st.sampled_from([1.0, 0.125, 0.7, -1.5])),
        "causal": draw(st.booleans()),
        "padding": draw(st.sampled_from([None, 0.3, 1.0])),
        "mask_shape": mask_shape,
        "mask_grad": mask_shape is not None and draw(st.booleans()),
        "seed": draw(seeds()),
    }


@st.composite
def cross_entropy_cases(draw, device: str = "cpu", dtype: torch.dtype | None = None) -> dict:
    """A cross-entropy case: [tokens, V] or [batch, seq, V], smoothing, ignored rows, reduction, z-loss."""
    limits = size_limits(device)
    long_row = draw(st.integers(0, 9)) == 0
    vocab = (
        draw(st.integers(limits["vocab"] + 1, limits["long_vocab"])) if long_row else draw(row_widths(limits["vocab"]))
    )
    tokens = draw(st.integers(1, 4 if long_row else 24))
    shape = (tokens, vocab)
    if tokens % 2 == 0 and draw(st.booleans()):
        shape = (2, tokens // 2, vocab)
    return {
        "shape": shape,
        "dtype": dtype or draw(dtypes()),
        "label_smoothing": draw(st.sampled_from([0.0, 0.1, 0.5, 1.0])),
        "ignored": draw(st.sampled_from([0.0, 0.05, 0.3, 1.0])),
        "reduction": draw(st.sampled_from(["mean", "sum", "none"])),
        "z_loss": draw(st.sampled_from([0.0, 0.0, 1e-4, 0.1])),
        "scale": draw(st.sampled_from([1.0, 4.0, 20.0])),
        "seed": draw(seeds()),
    }


@st.composite
def linear_cross_entropy_cases(draw, device: str = "cpu", dtype: torch.dtype | None = None) -> dict:
    """A linear + cross-entropy case: tokens, hidden size, V, bias, chunking and CE options."""
    small = device == "cpu"
    tokens = draw(st.integers(1, 40 if small else 600))
    vocab = draw(row_widths(400 if small else 50000))
    return {
        "tokens": tokens,
        "hidden": draw(st.sampled_from([8, 24, 64] if small else [64, 256, 1024])),
        "vocab": vocab,
        "dtype": dtype or draw(dtypes()),
        "bias": draw(st.booleans()),
        "chunk_rows": draw(st.sampled_from([1, 7, 64])),
        "label_smoothing": draw(st.sampled_from([0.0, 0.1])),
        "ignored": draw(st.sampled_from([0.0, 0.1, 1.0])),
        "reduction": draw(st.sampled_from(["mean", "sum", "none"])),
        "z_loss": draw(st.sampled_from([0.0, 1e-3])),
        "seed": draw(seeds()),
    }


@st.composite
def bias_dropout_cases(draw, device: str = "cpu", dtype: torch.dtype | None = None) -> dict:
    """A bias + dropout case: [*, H], bias, dropout rate, training flag, activation, seed."""
    limits = size_limits(device)
    cols = draw(row_widths(limits["cols"]))
    leading = draw(st.lists(st.integers(1, 5), min_size=0, max_size=2))
    return {
        "shape": (*leading, draw(st.integers(1, limits["rows"])), cols),
        "dtype": dtype or draw(dtypes()),
        "bias": draw(st.booleans()),
        "dropout": draw(st.sampled_from([0.0, 0.1, 0.5, 0.9])),
        "training": draw(st.booleans()),
        "activation": draw(st.sampled_from(["gelu", "gelu_tanh", "relu", "silu"])),
        "seed": draw(seeds()),
    }


@st.composite
def dropout_add_layer_norm_cases(draw, device: str = "cpu", dtype: torch.dtype | None = None) -> dict:
    """A dropout + residual add + LayerNorm case: :func:`bias_dropout_cases`' shape, dtype,
    x bias, rate, training flag and seed; the LayerNorm's affine flags and eps; and whether
    the new residual is used too (pre-LN) or only the normalised output (post-LN)."""
    case = draw(bias_dropout_cases(device, dtype))
    del case["activation"]
    case["weight"] = draw(st.booleans())
    case["norm_bias"] = draw(st.booleans())
    case["eps"] = draw(st.sampled_from([1e-5, 1e-6, 1e-3]))
    case["prenorm"] = draw(st.booleans())
    return case


@st.composite
def silu_mul_cases(draw, device: str = "cpu", dtype: torch.dtype | None = None) -> dict:
    """A silu(gate) * up case: [*, F], whether gate and up are column halves of one packed
    tensor (strided rows), a scale of the values (large ones saturate the sigmoid), seed."""
    limits = size_limits(device)
    # one leading dim at most: the check holds fp64 copies of gate, up and their gradients,
    # which at 5 x 5 x rows x cols ran a GPU worker out of memory
    leading = draw(st.lists(st.integers(1, 3), min_size=0, max_size=1))
    return {
        "shape": (*leading, draw(st.integers(1, limits["rows"])), draw(row_widths(limits["cols"]))),
        "dtype": dtype or draw(dtypes()),
        "packed": draw(st.booleans()),
        "scale": draw(st.sampled_from([1.0, 1.0, 30.0])),
        "seed": draw(seeds()),
    }


@st.composite
def silu_mul_linear_cases(draw, device: str = "cpu", dtype: torch.dtype | None = None) -> dict:
    """A silu(gate) * up + down projection case: :func:`silu_mul_cases`' fields, the
    projection's output width and whether it has a bias."""
    case = draw(silu_mul_cases(device, dtype))
    case["out_features"] = draw(st.integers(1, 48 if device == "cpu" else 256))
    case["bias"] = draw(st.booleans())
    return case


@st.composite
def embedding_cases(draw, device: str = "cpu", dtype: torch.dtype | None = None) -> dict:
    """An embedding case: token shape, table sizes, positions, scale, dropout, padding, mode."""
    small = device == "cpu"
    seq = draw(st.integers(1, 20 if small else 512))
    return {
        "tokens": (draw(st.integers(1, 4 if small else 16)), seq),
        "vocab": draw(st.integers(1, 60 if small else 50257)),
        "dim": draw(row_widths(300 if small else 2048)),
        "max_positions": seq + draw(st.integers(0, 5)),
        "dtype": dtype or draw(dtypes()),
        "positions": draw(st.sampled_from([None, "learned", "explicit"])),
        "scale": draw(st.sampled_from([1.0, 2.0, 0.5])),
        "dropout": draw(st.sampled_from([0.0, 0.1, 0.5])),
        "padding": draw(st.booleans()),
        "deterministic": draw(st.booleans()),
        "seed": draw(seeds()),
    }


@st.composite
def gemm_cases(draw, device: str = "cpu", dtype: torch.dtype | None = None) -> dict:
    """A GEMM case: M, N, K, transposed operands, every epilogue combination.

    bf16 only on a GPU: Triton's CPU interpreter computes tl.dot on bf16 inputs wrongly
    (seen with triton 3.9), so CPU runs draw from ``GEMM_CPU_DTYPES``.
    """
    small = device == "cpu"
    if dtype is None:
        dtype = draw(st.sampled_from(GEMM_CPU_DTYPES if small else FLOAT_DTYPES))
    size = st.integers(1, 96 if small else 1024)
    return {
        "mnk": (draw(size), draw(size), draw(size)),
        "dtype": dtype,
        "transpose_a": draw(st.booleans()),
        "transpose_b": draw(st.booleans()),
        "c": draw(st.booleans()),
        "bias": draw(st.booleans()),
        "alpha": draw(st.sampled_from([1.0, 0.5, -2.0])),
        "beta": draw(st.sampled_from([0.0, 1.0, 0.3])),
        "activation": draw(st.sampled_from([None, "relu", "gelu", "gelu_tanh", "silu"])),
        "seed": draw(seeds()),
    }


@st.composite
def swiglu_cases(draw, device: str = "cpu", dtype: torch.dtype | None = None) -> dict:
    """A SwiGLU MLP case: tokens, hidden size D, intermediate size F (fp32/fp16 on the CPU)."""
    small = device == "cpu"
    size = st.integers(1, 80 if small else 768)
    return {
        "tokens": draw(size),
        "hidden": draw(size),
        "intermediate": draw(size),
        "dtype": dtype or draw(st.sampled_from(GEMM_CPU_DTYPES if small else FLOAT_DTYPES)),
        "seed": draw(seeds()),
    }


@st.composite
def linear_add_rms_norm_swiglu_cases(draw, device: str = "cpu", dtype: torch.dtype | None = None) -> dict:
    """An output projection + residual + RMSNorm + SwiGLU MLP case: tokens, the projection's
    inputs K, the model width D, the MLP's width F, a bias or not; fp32 (and bf16 on a GPU:
    the op refuses fp16, the interpreter's bf16 dot is wrong)."""
    small = device == "cpu"
    size = st.integers(1, 80 if small else 640)
    return {
        "tokens": draw(size),
        "in_features": draw(size),
        "hidden": draw(size),
        "intermediate": draw(size),
        "bias": draw(st.booleans()),
        "dtype": dtype or draw(st.sampled_from((torch.float32,) if small else (torch.float32, torch.bfloat16))),
        "seed": draw(seeds()),
    }
