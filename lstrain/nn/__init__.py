"""torch.nn-compatible modules over lstrain.ops (drop-in signatures)."""

from lstrain.nn.add_rms_norm import AddRMSNorm
from lstrain.nn.attention_softmax import AttentionSoftmax
from lstrain.nn.bias_dropout import BiasActDropout, BiasDropoutResidual
from lstrain.nn.cross_entropy import CrossEntropyLoss
from lstrain.nn.embedding import TransformerEmbedding, sinusoidal_positions
from lstrain.nn.layer_norm import LayerNorm
from lstrain.nn.linear import Linear
from lstrain.nn.linear_cross_entropy import LinearCrossEntropyLoss
from lstrain.nn.rms_norm import RMSNorm
from lstrain.nn.swiglu import SwiGLUMLP

__all__ = [
    "AddRMSNorm",
    "AttentionSoftmax",
    "BiasActDropout",
    "BiasDropoutResidual",
    "CrossEntropyLoss",
    "LayerNorm",
    "Linear",
    "LinearCrossEntropyLoss",
    "RMSNorm",
    "SwiGLUMLP",
    "TransformerEmbedding",
    "sinusoidal_positions",
]
