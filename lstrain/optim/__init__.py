"""Contiguous-buffer optimizers: flat parameter/gradient buffers, one update kernel per dtype."""

from lstrain.optim.adamw import FusedAdamW
from lstrain.optim.flat import FlatParameters

__all__ = ["FlatParameters", "FusedAdamW"]
