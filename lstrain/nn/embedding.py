"""``lstrain.nn.TransformerEmbedding``: token + position embedding, scale and dropout fused."""

from __future__ import annotations

import math

import torch

from lstrain.ops._lib.options import float_option
from lstrain.ops.embedding import embedding

__all__ = ["TransformerEmbedding", "sinusoidal_positions"]


def sinusoidal_positions(max_positions: int, dim: int, device=None, dtype=None) -> torch.Tensor:
    """The fixed sin/cos table of "Attention Is All You Need", computed in fp64.

    Args:
        max_positions: rows of the table.
        dim: columns: sines in the even ones, cosines in the odd ones.
        device: where to build it.
        dtype: of the result (default torch's default dtype).

    Returns:
        A ``[max_positions, dim]`` tensor (empty when either is 0, as torch's factories).

    Raises:
        ValueError: a negative or non-integer ``max_positions`` or ``dim``.
    """
    for name, value in (("max_positions", max_positions), ("dim", dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"sinusoidal_positions: {name} must be an int >= 0, got {value!r}")
    if dim == 0:  # no columns, and no frequencies to divide by dim
        return torch.zeros(max_positions, 0, device=device, dtype=dtype or torch.get_default_dtype())
    position = torch.arange(max_positions, dtype=torch.float64, device=device)[:, None]
    frequency = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64, device=device) * (-math.log(10000.0) / dim))
    table = torch.zeros(max_positions, dim, dtype=torch.float64, device=device)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency[: dim // 2])
    return table.to(dtype or torch.get_default_dtype())


class TransformerEmbedding(torch.nn.Module):
    """``dropout(scale * token_table[tokens] + position_table[positions])``.

    Args:
        vocab_size, dim: the token table's shape.
        max_positions: rows of the position table.
        padding_idx: tokens with this id give zero rows and no gradient (their table row
            starts at zero, as in ``torch.nn.Embedding``).
        dropout: drop probability in [0, 1), applied in training mode.
        scale: multiplies the token rows; None means sqrt(dim), 1.0 disables it.
        learned_positions: a trained position table (``position_weight``) or the fixed
            sinusoidal one (a buffer).

    ``forward(tokens, positions=None)``; positions default to 0..seq_len-1 along the last dim.
    """

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        max_positions: int,
        padding_idx: int | None = None,
        dropout: float = 0.0,
        scale: float | None = None,
        learned_positions: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.padding_idx = padding_idx
        self.dropout = float_option("TransformerEmbedding", "dropout", dropout, 0, 1, high_open=True)
        self.scale = math.sqrt(dim) if scale is None else float_option("TransformerEmbedding", "scale", scale)
        self.weight = torch.nn.Parameter(torch.randn(vocab_size, dim, device=device, dtype=dtype) * dim**-0.5)
        if padding_idx is not None:
            with torch.no_grad():
                self.weight[padding_idx].zero_()
        if learned_positions:
            self.position_weight = torch.nn.Parameter(
                torch.randn(max_positions, dim, device=device, dtype=dtype) * 0.02
            )
        else:
            self.register_buffer("position_weight", sinusoidal_positions(max_positions, dim, device, dtype))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return embedding(
            tokens,
            self.weight,
            pos_weight=self.position_weight,
            positions=positions,
            scale=self.scale,
            dropout=self.dropout,
            padding_idx=self.padding_idx,
            training=self.training,
        )

    def extra_repr(self) -> str:
        vocab, dim = self.weight.shape
        positions = self.position_weight.shape[0]
        return f"{vocab}, {dim}, max_positions={positions}, scale={self.scale:.4g}, dropout={self.dropout}"
