"""Several ``F.linear`` of one input (q / k / v, gate / up), with one input gradient.

Written as separate projections (Hugging Face's ``q_proj``, ``k_proj``, ``v_proj``), each
backward makes its own input gradient and autograd adds them: two [tokens, D] adds for q /
k / v and one for gate / up in every layer, a read of three tensors and a write each. Here
the backward sums the input gradient inside the GEMMs instead (``addmm`` with beta = 1
into the first one's output: one rounding, where autograd rounds each product and then
the sum), and writes each weight gradient into its flat-buffer place as
:func:`lstrain.ops.linear` does. The GEMMs are cuBLAS's, as torch's; the weights stay
separate parameters, so nothing is copied or re-laid out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from lstrain import _backend
from lstrain.ops._lib.autocast import autocast_inputs
from lstrain.ops._lib.first_order import differentiated, refuse_create_graph
from lstrain.ops._lib.layout import as_rows, matmul_like
from lstrain.ops._lib.linear_checks import check_projection
from lstrain.ops._lib.options import check_tensors

__all__ = ["SharedInputLinearFunction", "shared_input_linear", "shared_input_linear_ref"]


class SharedInputLinearFunction(torch.autograd.Function):
    """Autograd for :func:`shared_input_linear`: ``apply(x, count, *weights, *biases)``;
    saves the input and the weights, as torch's linears would."""

    @staticmethod
    def forward(ctx, x, count, *parameters):
        weights, biases = parameters[:count], parameters[count:]
        ctx.save_for_backward(x, *weights)
        ctx.has_bias = [b is not None for b in biases]
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases, strict=True))

    @staticmethod
    def backward(ctx, *dys):
        refuse_create_graph("shared_input_linear")
        x, *weights = ctx.saved_tensors
        count = len(weights)
        need_x, need_parameters = ctx.needs_input_grad[0], ctx.needs_input_grad[2:]
        x2d = as_rows(x, x.shape[-1])
        dy2ds = [as_rows(dy, dy.shape[-1]) for dy in dys]
        dx = None
        if need_x:
            dx = dy2ds[0] @ weights[0]
            for dy2d, weight in zip(dy2ds[1:], weights[1:], strict=True):
                dx.addmm_(dy2d, weight)
            dx = dx.view(x.shape)
        dweights = [
            matmul_like(dy2d.t(), x2d, weight) if need else None
            for dy2d, weight, need in zip(dy2ds, weights, need_parameters[:count], strict=True)
        ]
        dbiases = [
            dy2d.sum(0) if need and has_bias else None
            for dy2d, need, has_bias in zip(dy2ds, need_parameters[count:], ctx.has_bias, strict=True)
        ]
        return dx, None, *dweights, *dbiases


def shared_input_linear(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, ...]:
    """``tuple(F.linear(x, w, b) for w, b in zip(weights, biases))``, whose backward sums
    the input gradient inside its GEMMs and writes the weight gradients straight into a
    flat gradient buffer where it can (see the module's docstring). Under
    ``torch.autocast`` the inputs are first cast to its dtype, as ``F.linear``'s would be.

    Args:
        x: ``[*, in]``.
        weights: one or more ``[out_i, in]`` weights (torch's Linear layout; a sequence, or
            one ``[n, out, in]`` tensor stacking n of them), x's dtype and
            device.
        biases: None (no biases), or one ``[out_i]`` bias or None per weight.

    Returns:
        A tuple of ``[*, out_i]`` tensors in x's dtype, one per weight.

    Raises:
        ValueError: one weight or bias where a sequence belongs, no weights, a biases list of
            another length, x or a weight / bias that is no tensor, x a scalar, or a weight /
            bias whose shape, dtype or device does not fit (named by its position).
    """
    for name, value, dims in (("weights", weights, 3), ("biases", biases, 2)):
        # one weight (or bias) where a sequence belongs: list() would split it into rows
        if isinstance(value, torch.Tensor) and value.dim() < dims:
            raise ValueError(
                f"shared_input_linear: {name} must be a sequence of them (a list, or one tensor stacking them), "
                f"got one tensor of shape {tuple(value.shape)}"
            )
    weights = list(weights)
    if not weights:
        raise ValueError("shared_input_linear: weights must hold at least one weight, got none")
    biases = [None] * len(weights) if biases is None else list(biases)
    if len(biases) != len(weights):
        raise ValueError(
            f"shared_input_linear: biases must hold one bias (or None) per weight: "
            f"got {len(biases)} for {len(weights)} weights"
        )
    check_tensors(
        "shared_input_linear",
        {"x": x, **{f"weights[{i}]": w for i, w in enumerate(weights)}},
        {f"biases[{i}]": b for i, b in enumerate(biases)},
    )
    x, *parameters = autocast_inputs(x, *weights, *biases)
    weights, biases = parameters[: len(weights)], parameters[len(weights) :]
    if x.dim() == 0:
        raise ValueError("shared_input_linear: x must have at least one dim, got a scalar")
    for i, (weight, bias) in enumerate(zip(weights, biases, strict=True)):
        check_projection(f"shared_input_linear (weights[{i}], biases[{i}])", "x", x, weight, bias)
    backend = _backend.backend_for(x)
    _backend.note("shared_input_linear", backend)
    if backend == "reference" or not differentiated(x, *weights, *biases):
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases, strict=True))
    return SharedInputLinearFunction.apply(x, len(weights), *weights, *biases)


def shared_input_linear_ref(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Plain PyTorch: one ``F.linear`` per weight (autograd adds their input gradients).

    Args:
        x, weights, biases: as for :func:`shared_input_linear`.

    Returns:
        ``tuple(F.linear(x, w, b) for w, b in zip(weights, biases))``.
    """
    biases = [None] * len(weights) if biases is None else biases
    return tuple(F.linear(x, w, b) for w, b in zip(weights, biases, strict=True))
