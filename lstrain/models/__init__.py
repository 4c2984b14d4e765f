"""Models built from lstrain.layers, each a Config dataclass and one model file.

``GPT2Config`` / ``GPT2``: GPT-2 small, medium and large with Hugging Face's checkpoint
format (``GPT2.from_pretrained`` / ``save_pretrained``) and a ``fused=False`` twin.
``BertConfig`` / ``BertForMaskedLM``: BERT-base and -large with the MLM head, the same way.
``LlamaConfig`` / ``Llama``: LLaMA (GQA, RoPE, RMSNorm, SwiGLU) with ``LlamaForCausalLM``'s
keys and checkpoint format, the same way.
"""

from lstrain.models.bert import BertConfig, BertForMaskedLM, BertOutput
from lstrain.models.gpt2 import GPT2, GPT2Config, GPT2Output
from lstrain.models.llama import Llama, LlamaConfig, LlamaOutput

__all__ = [
    "GPT2",
    "BertConfig",
    "BertForMaskedLM",
    "BertOutput",
    "GPT2Config",
    "GPT2Output",
    "Llama",
    "LlamaConfig",
    "LlamaOutput",
]
