"""Contiguous-buffer optimizers: flat parameter/gradient buffers, one update kernel per dtype."""

from lstrain.optim.adamw import FusedAdamW
from lstrain.optim.flat import FlatParameters
from lstrain.optim.scaler import LossScaler
from lstrain.optim.sgd import FusedSGD

__all__ = ["FlatParameters", "FusedAdamW", "FusedSGD", "LossScaler"]
