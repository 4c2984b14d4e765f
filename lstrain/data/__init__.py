"""Training data: corpora, tokenizers, token shards, packed and shuffled batches, MLM masking.

``build_data(DataConfig(...), seq_len=..., seed=..., mlm=False)`` returns the tokenizer and
the train and validation streams; ``stream.batch(step, batch_size, rank, world_size)`` is a
pure function of its arguments, so resuming needs only the step.
"""

from lstrain.data.build import Data, DataConfig, build_data
from lstrain.data.stream import IGNORE_INDEX, TokenStream, mask_tokens, mask_tokens_fixed
from lstrain.data.tokenizer import BPETokenizer, ByteTokenizer, IdsTokenizer, Tokenizer

__all__ = [
    "IGNORE_INDEX",
    "BPETokenizer",
    "ByteTokenizer",
    "Data",
    "DataConfig",
    "IdsTokenizer",
    "TokenStream",
    "Tokenizer",
    "build_data",
    "mask_tokens",
    "mask_tokens_fixed",
]
