"""``lstrain.nn.Linear``: ``torch.nn.Linear`` with an optional activation in the GEMM's epilogue."""

from __future__ import annotations

import torch

from lstrain.ops._lib.activations import activation_index
from lstrain.ops.gemm import gemm

__all__ = ["Linear"]


class Linear(torch.nn.Linear):
    """``act(x @ weight^T + bias)`` in one lstrain GEMM: bias and activation are applied to
    the fp32 accumulator, and the output is rounded once.

    A drop-in for ``torch.nn.Linear`` (same constructor, parameters and state_dict keys
    ``weight`` / ``bias``), and with ``activation`` for ``torch.nn.Linear`` followed by
    the activation module (e.g. ``nn.Sequential(nn.Linear(d, 4 * d), nn.GELU())`` becomes
    ``Linear(d, 4 * d, activation="gelu")``, whose checkpoint keys drop the ``0.``).
    The weight enters the GEMM as ``weight.t()``, a view (:func:`lstrain.ops.gemm` takes
    any strides). Backward uses cuBLAS for the gradients; without an activation it is
    torch.nn.Linear's backward. With one, the forward also stores the pre-activation (as
    torch keeps ``nn.Linear``'s output for the activation module after it; relu needs
    only the output) and one pass forms its gradient.

    Args:
        in_features, out_features, bias, device, dtype: as for ``torch.nn.Linear``.
        activation: None, ``"relu"``, ``"gelu"`` (erf), ``"gelu_tanh"`` or ``"silu"``.

    Raises:
        ValueError: an unknown activation; in forward, an input whose last dimension is not
            ``in_features``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        activation: str | None = None,
    ) -> None:
        activation_index(activation, "Linear")  # reject a bad name at construction
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"Linear: x must end in in_features={self.in_features}, got shape {tuple(x.shape)}")
        rows = x.reshape(x.shape[:-1].numel(), self.in_features)  # not -1: ambiguous for in_features = 0
        y = gemm(rows, self.weight.t(), bias=self.bias, activation=self.activation)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation}"
