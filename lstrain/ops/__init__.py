"""Fused ops: each a Triton forward/backward pair behind a functional entry."""

from lstrain.ops._lib.dropout import dropout_mask, dropout_seeds
from lstrain.ops.add_rms_norm import add_rms_norm, add_rms_norm_ref
from lstrain.ops.attention_softmax import attention_softmax, attention_softmax_ref
from lstrain.ops.bias_act_dropout import bias_act_dropout, bias_act_dropout_ref
from lstrain.ops.bias_dropout_residual import bias_dropout_residual, bias_dropout_residual_ref
from lstrain.ops.cross_entropy import cross_entropy, cross_entropy_ref
from lstrain.ops.dropout_add_layer_norm import dropout_add_layer_norm, dropout_add_layer_norm_ref
from lstrain.ops.embedding import embedding, embedding_ref
from lstrain.ops.gemm import gemm, gemm_ref
from lstrain.ops.layer_norm import layer_norm, layer_norm_ref
from lstrain.ops.linear import linear, linear_ref
from lstrain.ops.linear_add_rms_norm_swiglu import linear_add_rms_norm_swiglu, linear_add_rms_norm_swiglu_ref
from lstrain.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_ref
from lstrain.ops.qkv_attention import qkv_attention, qkv_attention_ref
from lstrain.ops.qkv_projection import qkv_projection, qkv_projection_ref
from lstrain.ops.rms_norm import rms_norm, rms_norm_ref
from lstrain.ops.rope import rope, rope_qkv, rope_qkv_ref, rope_ref
from lstrain.ops.shared_input_linear import shared_input_linear, shared_input_linear_ref
from lstrain.ops.silu_mul import silu_mul, silu_mul_linear, silu_mul_linear_ref, silu_mul_ref
from lstrain.ops.swiglu import swiglu_mlp, swiglu_mlp_ref

__all__ = [
    "add_rms_norm",
    "add_rms_norm_ref",
    "attention_softmax",
    "attention_softmax_ref",
    "bias_act_dropout",
    "bias_act_dropout_ref",
    "bias_dropout_residual",
    "bias_dropout_residual_ref",
    "cross_entropy",
    "cross_entropy_ref",
    "dropout_add_layer_norm",
    "dropout_add_layer_norm_ref",
    "dropout_mask",
    "dropout_seeds",
    "embedding",
    "embedding_ref",
    "gemm",
    "gemm_ref",
    "layer_norm",
    "layer_norm_ref",
    "linear",
    "linear_add_rms_norm_swiglu",
    "linear_add_rms_norm_swiglu_ref",
    "linear_ref",
    "linear_cross_entropy",
    "linear_cross_entropy_ref",
    "qkv_attention",
    "qkv_attention_ref",
    "qkv_projection",
    "qkv_projection_ref",
    "rms_norm",
    "rms_norm_ref",
    "rope",
    "rope_qkv",
    "rope_qkv_ref",
    "rope_ref",
    "shared_input_linear",
    "shared_input_linear_ref",
    "silu_mul",
    "silu_mul_linear",
    "silu_mul_linear_ref",
    "silu_mul_ref",
    "swiglu_mlp",
    "swiglu_mlp_ref",
]
