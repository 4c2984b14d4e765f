"""Token shards: nanoGPT's ``.bin`` files of raw uint16 / uint32 ids, memory-mapped.

A source is a shard set when it is a ``.bin`` file or a directory with ``.bin`` files at its
top. A ``meta.json`` beside them gives what raw ids cannot say::

    {"dtype": "uint16", "vocab_size": 50257, "eos_id": 50256}

and optionally ``pad_id``, ``mask_id`` (needed for MLM) and ``tokenizer`` (a tokenizer.json
beside it, for encode / decode). Shards whose names hold the word ``val`` (or ``valid``,
``validation``, ``eval``) between separators are the validation split (nanoGPT's
``train.bin`` / ``val.bin``, ``fineweb_val_000000.bin``); without any, the tail of the
shards is.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lstrain.data.tokenizer import BPETokenizer, IdsTokenizer, Tokenizer

__all__ = ["META_FILE", "ShardSet", "is_shard_source", "open_shards"]

META_FILE = "meta.json"
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_META_KEYS = {"dtype", "vocab_size", "eos_id", "pad_id", "mask_id", "tokenizer"}
# Tokens checked against the vocabulary and the dtype: a sample, so opening a big set stays instant.
_SAMPLE_TOKENS = 1 << 20


@dataclass
class ShardSet:
    """Memory-mapped shards and their tokenizer.

    Attributes:
        train: the training shards' tokens.
        val: the validation shards' tokens, or None when the training tail is to be split off.
        tokenizer: from meta.json.
    """

    train: list[np.ndarray]
    val: list[np.ndarray] | None
    tokenizer: Tokenizer


def is_shard_source(source: str) -> bool:
    """Whether ``source`` is a ``.bin`` file or a directory with ``.bin`` files at its top."""
    path = Path(source).expanduser()
    if path.is_file():
        return path.suffix == ".bin"
    return path.is_dir() and any(path.glob("*.bin"))


_VALIDATION_WORDS = {"val", "valid", "validation", "eval"}


def _is_validation(path: Path) -> bool:
    """Whether a shard's name holds a validation word between separators (``val.bin``,
    ``fineweb_val_000001.bin``; not ``interval_3.bin``)."""
    return any(word in _VALIDATION_WORDS for word in re.split(r"[^a-z0-9]+", path.stem.lower()))


def _read_meta(path: Path) -> dict:
    if not path.is_file():
        example = '{"dtype": "uint16", "vocab_size": 50257, "eos_id": 50256}'
        raise FileNotFoundError(f"token shards need {path} giving their dtype and vocabulary, e.g. {example}")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: expected a JSON object of the shards' dtype and vocabulary, got {meta!r}")
    unknown = sorted(set(meta) - _META_KEYS)
    if unknown:
        raise ValueError(f"{path}: unknown key {unknown[0]!r}; allowed: {', '.join(sorted(_META_KEYS))}")
    if meta.get("dtype") not in DTYPES:
        raise ValueError(f"{path}: dtype {meta.get('dtype')!r} is not one of {', '.join(DTYPES)}")
    vocab_size = meta.get("vocab_size")
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"{path}: vocab_size {vocab_size!r} is not a positive integer")
    if vocab_size > np.iinfo(DTYPES[meta["dtype"]]).max + 1:
        raise ValueError(f"{path}: dtype mismatch: vocab_size {vocab_size} does not fit dtype {meta['dtype']}")
    for key in ("eos_id", "pad_id", "mask_id"):
        value = meta.get(key)
        if value is not None and not (isinstance(value, int) and 0 <= value < vocab_size):
            raise ValueError(f"{path}: {key} {value!r} is not an id in [0, {vocab_size})")
    return meta


def _open_shard(path: Path, dtype: str, vocab_size: int) -> np.ndarray:
    """Memory-map one shard and check a sample of it against the dtype and vocabulary."""
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    size = path.stat().st_size
    if size % itemsize:
        raise ValueError(f"{path}: dtype mismatch: {size} bytes is not a whole number of {dtype} tokens")
    if size == 0:
        return np.zeros(0, dtype=DTYPES[dtype])
    tokens = np.memmap(path, dtype=DTYPES[dtype], mode="r")
    sample = np.asarray(tokens[:_SAMPLE_TOKENS])
    if int(sample.max()) >= vocab_size:
        raise ValueError(
            f"{path}: token {int(sample.max())} >= vocab_size {vocab_size}: dtype mismatch "
            f"{'(written as uint16, read as uint32?) ' if dtype == 'uint32' else ''}or a wrong vocab_size in "
            f"{META_FILE}"
        )
    # uint32 ids read as uint16 leave every odd uint16 (the little-endian high halves) zero.
    if dtype == "uint16" and len(sample) >= 64 and not sample[1::2].any() and sample[0::2].any():
        raise ValueError(f"{path}: dtype mismatch: every other uint16 is 0, as uint32 tokens read as uint16 are")
    return tokens


def open_shards(source: str) -> ShardSet:
    """Open a shard set (see the module docstring for the layout).

    Args:
        source: a ``.bin`` file or a directory with ``.bin`` files.

    Returns:
        The memory-mapped shards and their tokenizer.

    Raises:
        FileNotFoundError: no meta.json, or the tokenizer file it names is missing.
        ValueError: a bad meta.json, or shards that do not match its dtype or vocabulary.
    """
    path = Path(source).expanduser()
    directory = path.parent if path.is_file() else path
    meta = _read_meta(directory / META_FILE)
    files = [path] if path.is_file() else sorted(directory.glob("*.bin"))
    val_files = [f for f in files if _is_validation(f)]
    train_files = [f for f in files if f not in val_files]
    if not train_files:
        raise ValueError(f"source {source!r}: only validation shards ({', '.join(f.name for f in val_files)})")

    def shards(group: list[Path]) -> list[np.ndarray]:
        return [_open_shard(f, meta["dtype"], meta["vocab_size"]) for f in group]

    special = {key: meta.get(key) for key in ("eos_id", "pad_id", "mask_id")}
    if "tokenizer" in meta:
        tokenizer_path = directory / meta["tokenizer"]
        if not tokenizer_path.is_file():
            raise FileNotFoundError(f"{directory / META_FILE}: tokenizer {tokenizer_path} does not exist")
        try:
            tokenizer: Tokenizer = BPETokenizer.from_file(tokenizer_path, **special)
        except ValueError:
            raise
        except Exception as error:  # tokenizers raises a bare Exception for a malformed file
            raise ValueError(f"{tokenizer_path}: not a tokenizers tokenizer.json ({error})") from None
        if tokenizer.vocab_size > meta["vocab_size"]:
            raise ValueError(f"{tokenizer_path}: {tokenizer.vocab_size} ids, more than vocab_size {meta['vocab_size']}")
        tokenizer.vocab_size = meta["vocab_size"]  # the model's size; a padded vocabulary is allowed
    else:
        tokenizer = IdsTokenizer(meta["vocab_size"], **special)
    return ShardSet(shards(train_files), shards(val_files) if val_files else None, tokenizer)
