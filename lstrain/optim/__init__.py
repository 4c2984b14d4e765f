"""Contiguous-buffer optimizers: flat parameter/gradient buffers, one update kernel per dtype."""

from lstrain.optim.adamw import FusedAdamW
from lstrain.optim.distributed import DataParallel
from lstrain.optim.flat import FlatParameters
from lstrain.optim.scaler import LossScaler
from lstrain.optim.sgd import FusedSGD
from lstrain.optim.zero import ZeroAdamW

__all__ = ["DataParallel", "FlatParameters", "FusedAdamW", "FusedSGD", "LossScaler", "ZeroAdamW"]
