"""Tokenizers: byte level, a byte-level BPE trained on the corpus, and the ids of token shards.

All three share one small interface (``encode``, ``decode``, ``vocab_size`` and the special
ids), so the training loop never asks which one it holds. The two that lstrain builds put
their special tokens first, at ids 0, 1 and 2, so a random replacement token of MLM masking
is any id from 3 up.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

__all__ = [
    "EOS_TOKEN",
    "MASK_TOKEN",
    "MIN_BPE_VOCAB",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "BPETokenizer",
    "ByteTokenizer",
    "IdsTokenizer",
    "Tokenizer",
    "train_bpe",
]

EOS_TOKEN = "<|endoftext|>"  # GPT-2's document separator; also serves as bos
PAD_TOKEN = "<pad>"
MASK_TOKEN = "<mask>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, MASK_TOKEN)  # ids 0, 1, 2 in the byte and BPE tokenizers
MIN_BPE_VOCAB = 256 + len(SPECIAL_TOKENS)  # every byte is in the BPE's alphabet


class Tokenizer:
    """The interface every tokenizer of lstrain.data has.

    Attributes:
        kind: ``"byte"``, ``"bpe"`` or ``"ids"`` (token shards without a tokenizer file).
        vocab_size: number of ids; every id is in ``[0, vocab_size)``.
        eos_id: the document separator packed between documents (``bos_id`` is the same id).
        pad_id: the padding id (attention_mask is 0 there), or None.
        mask_id: the MLM mask id, or None.
    """

    kind: str
    vocab_size: int
    eos_id: int | None
    pad_id: int | None
    mask_id: int | None

    @property
    def bos_id(self) -> int | None:
        """The id that starts a document: GPT-2 style, the separator ``eos_id`` itself."""
        return self.eos_id

    @property
    def special_ids(self) -> tuple[int, ...]:
        """The ids MLM masking never selects or draws: eos, pad and mask, where defined."""
        return tuple(sorted({i for i in (self.eos_id, self.pad_id, self.mask_id) if i is not None}))

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; special-token strings in the text are encoded as plain text.

        Args:
            text: any string.

        Returns:
            The ids, with no special token added.
        """
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` of each text (the BPE tokenizer runs them in parallel)."""
        return [self.encode(text) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens appear as their strings, bad UTF-8 as U+FFFD.

        Args:
            ids: ids in ``[0, vocab_size)``.

        Returns:
            The text.

        Raises:
            ValueError: an id outside ``[0, vocab_size)``.
        """
        raise NotImplementedError

    def fingerprint(self) -> str:
        """A sha256 of what the ids mean: the kind, the vocabulary size and the special ids
        (a BPE adds its tokenizer.json: trained on other text, it numbers its merges
        otherwise). What a resumed training run compares."""
        return hashlib.sha256(json.dumps(self._identity()).encode()).hexdigest()

    def _identity(self) -> list:
        return [self.kind, self.vocab_size, self.eos_id, self.pad_id, self.mask_id]

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"ids: {bad[0]} is outside [0, {self.vocab_size}) of this {self.kind} tokenizer")
        return ids


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 3..258 after the three special tokens: vocab_size 259, no training."""

    kind = "byte"
    vocab_size = len(SPECIAL_TOKENS) + 256
    eos_id, pad_id, mask_id = 0, 1, 2

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        """``encode`` as an int64 array, without a Python list (the corpus path)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) + len(SPECIAL_TOKENS)

    def decode(self, ids: Iterable[int]) -> str:
        pieces, run = [], bytearray()
        for i in self._check_ids(ids):
            if i < len(SPECIAL_TOKENS):
                pieces.append(run.decode("utf-8", errors="replace") + SPECIAL_TOKENS[i])
                run = bytearray()
            else:
                run.append(i - len(SPECIAL_TOKENS))
        return "".join(pieces) + run.decode("utf-8", errors="replace")


class BPETokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer`` (lstrain's byte-level BPE, or a shard set's tokenizer.json).

    Args:
        tokenizer: the tokenizers object.
        eos_id: the document separator id, or None to look up ``<|endoftext|>``.
        pad_id: the padding id, or None to look up ``<pad>``.
        mask_id: the mask id, or None to look up ``<mask>``.
    """

    kind = "bpe"

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        eos_id: int | None = None,
        pad_id: int | None = None,
        mask_id: int | None = None,
    ):
        self.hf = tokenizer
        # Text that happens to contain "<|endoftext|>" stays text: the round trip holds and a
        # document cannot end early.
        self.hf.encode_special_tokens = True
        self.vocab_size = tokenizer.get_vocab_size()
        self.eos_id = tokenizer.token_to_id(EOS_TOKEN) if eos_id is None else eos_id
        self.pad_id = tokenizer.token_to_id(PAD_TOKEN) if pad_id is None else pad_id
        self.mask_id = tokenizer.token_to_id(MASK_TOKEN) if mask_id is None else mask_id

    @property
    def special_ids(self) -> tuple[int, ...]:
        """eos, pad and mask, and every token the tokenizer.json marks special ([CLS] and
        [SEP] of a BERT vocabulary): MLM masking never selects or draws them, as Hugging
        Face's collator does not."""
        marked = {i for i, token in self.hf.get_added_tokens_decoder().items() if token.special}
        return tuple(sorted(set(super().special_ids) | marked))

    @classmethod
    def from_file(cls, path: str | Path, **special_ids: int | None) -> BPETokenizer:
        """Load a tokenizer.json.

        Args:
            path: the file.
            **special_ids: ``eos_id``, ``pad_id``, ``mask_id`` overriding the looked-up ones.

        Returns:
            The tokenizer.
        """
        return cls(tokenizers.Tokenizer.from_file(str(path)), **special_ids)

    def save(self, path: str | Path) -> None:
        """Write the tokenizer.json to ``path``."""
        self.hf.save(str(path))

    def _identity(self) -> list:
        return [*super()._identity(), self.hf.to_str()]

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode(self._check_ids(ids), skip_special_tokens=False)


class IdsTokenizer(Tokenizer):
    """The vocabulary of token shards that came without a tokenizer file: ids only, no text.

    Args:
        vocab_size: the shards' vocabulary size.
        eos_id: the document separator id, or None.
        pad_id: the padding id, or None.
        mask_id: the mask id, or None.
    """

    kind = "ids"

    def __init__(self, vocab_size: int, eos_id: int | None, pad_id: int | None, mask_id: int | None):
        self.vocab_size, self.eos_id, self.pad_id, self.mask_id = vocab_size, eos_id, pad_id, mask_id

    def encode(self, text: str) -> list[int]:
        raise ValueError(self._no_text())

    def decode(self, ids: Iterable[int]) -> str:
        raise ValueError(self._no_text())

    @staticmethod
    def _no_text() -> str:
        return 'these token shards have no tokenizer: name a tokenizer.json in meta.json ("tokenizer": "file")'


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    """Train a byte-level BPE (GPT-2's pre-tokenizer and decoder) on ``texts``.

    Every byte is in the initial alphabet, so any text encodes and ``decode(encode(s)) == s``.

    Args:
        texts: the training text, in pieces.
        vocab_size: the most ids, specials and the 256 bytes included; a small corpus can
            stop merging earlier, so read the trained ``vocab_size``.

    Returns:
        The tokenizer, its special tokens at ids 0, 1, 2.

    Raises:
        ValueError: ``vocab_size`` below 256 bytes plus the special tokens.
    """
    if vocab_size < MIN_BPE_VOCAB:
        raise ValueError(f"vocab_size: {vocab_size} is below {MIN_BPE_VOCAB}, the 256 bytes and the special tokens")
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(hf)
