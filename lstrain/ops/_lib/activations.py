"""Pointwise activations for kernel epilogues, each with its derivative (fp32 in, fp32 out).

``ACT`` indexes :data:`ACTIVATIONS`: gelu (erf), gelu_tanh, relu, silu.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["ACTIVATIONS", "activation_index", "activation_ref", "apply_activation"]

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")


def activation_index(name: str | None, op: str) -> int:
    """The ``ACT`` constexpr for ``name`` (-1 for None).

    Raises:
        ValueError: an unknown activation, naming the op.
    """
    if name is None:
        return -1
    if name not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be None or one of {ACTIVATIONS}, got {name!r}")
    return ACTIVATIONS.index(name)


def activation_ref(name: str | None, z: torch.Tensor) -> torch.Tensor:
    """The same activation in plain PyTorch."""
    if name is None:
        return z
    if name == "gelu_tanh":
        return torch.nn.functional.gelu(z, approximate="tanh")
    return {"gelu": torch.nn.functional.gelu, "relu": torch.relu, "silu": torch.nn.functional.silu}[name](z)


@triton.jit
def apply_activation(z, ACT: tl.constexpr):
    """(act(z), act'(z)) in fp32; ACT: 0 gelu, 1 gelu_tanh, 2 relu, 3 silu, -1 identity."""
    if ACT == 0:  # 0.5 z (1 + erf(z / sqrt 2)); slope cdf + z * pdf
        cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
        value = z * cdf
        slope = cdf + z * 0.3989422804014327 * tl.exp(-0.5 * z * z)
    elif ACT == 1:  # 0.5 z (1 + tanh(sqrt(2 / pi) (z + 0.044715 z^3)))
        inner = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        # s = sigmoid(2 inner) and 1 - s from one exp and one reciprocal (a backward is as much
        # arithmetic as memory traffic): e = exp(-2 |inner|) <= 1, r = 1 / (1 + e)
        e = tl.exp(-2.0 * tl.abs(inner))
        r = 1.0 / (1.0 + e)
        s = tl.where(inner >= 0.0, r, e * r)
        t = 2.0 * s - 1.0  # tanh(inner)
        value = 0.5 * z * (1.0 + t)
        # 1 - t^2 = 4 s (1 - s) = 4 e r^2: no cancellation where |t| nears 1 (1 - t * t lost
        # up to 5e-7 of the fp32 slope there)
        sech2 = 4.0 * e * r * r
        slope = 0.5 * (1.0 + t) + 0.5 * z * sech2 * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z * z)
    elif ACT == 2:
        value = tl.maximum(z, 0.0, propagate_nan=tl.PropagateNan.ALL)  # relu(NaN) = NaN, as torch's
        # torch's relu backward zeroes the gradient where z <= 0 only: NaN passes it through
        slope = tl.where(z <= 0.0, 0.0, 1.0)
    elif ACT == 3:  # z sigmoid(z)
        s = tl.sigmoid(z)
        value = z * s
        slope = s * (1.0 + z * (1.0 - s))
    else:
        value = z
        slope = tl.full(z.shape, 1.0, tl.float32)
    return value, slope
