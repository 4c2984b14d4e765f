"""``build_data``: a source and a tokenizer -> cached token ids -> train and validation streams.

A text corpus is tokenized once: the tokenizer.json (BPE), the ids (``tokens.bin``) and a
``meta.json`` go to ``<cache_dir>/data/<tokenizer>-<vocab>-<hash>/``, the hash taken over the
files read (path, size, mtime), ``max_bytes`` and the tokenizer settings. A later run with the
same key memory-maps them and starts at once. The cache lives under ``cache_dir`` rather than
next to the data, since the data may be read-only (the standard library, a shared data set).
The entry is written to a temporary folder and renamed into place, so that an interrupted run
leaves no half entry and ranks that build it at once agree on one.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from lstrain.data.corpus import PYTHON_STDLIB, CorpusFile, read_documents, select_files
from lstrain.data.shards import is_shard_source, open_shards
from lstrain.data.stream import TokenStream, check_max_predictions_per_seq
from lstrain.data.tokenizer import MIN_BPE_VOCAB, BPETokenizer, ByteTokenizer, Tokenizer, train_bpe

__all__ = ["TOKENIZERS", "Data", "DataConfig", "build_data"]

TOKENIZERS = ("bpe", "byte")
_CACHE_FORMAT = 1  # bump when what a cache entry holds changes
_ENCODE_BATCH = 64  # document pieces per encode_batch call


@dataclass
class DataConfig:
    """Where the text comes from and how it is tokenized (the recipe's [data] section).

    Attributes:
        source: ``"python-stdlib"`` (the ``.py`` files of the running Python's standard
            library: offline, real text), a text file, a directory of text files (recursive),
            or token shards (a ``.bin`` file or a directory of them, with a meta.json).
        tokenizer: ``"bpe"`` (byte-level BPE trained on the corpus on first use, cached) or
            ``"byte"`` (259 ids: 3 specials and 256 bytes; ``vocab_size`` is then unused).
            Token shards bring their own vocabulary and ignore it.
        vocab_size: the BPE's most ids, specials included.
        val_fraction: the share of the tokens (the corpus's tail) held out for validation,
            unless token shards name their own validation shards.
        cache_dir: where tokenizers and token ids are cached; None for ~/.cache/lstrain.
        max_bytes: the most bytes of text read, or None for all.
        mlm_probability: the share of tokens MLM masking selects (``build_data(mlm=True)``).
        max_predictions_per_seq: MLM only. None: each token is selected with
            ``mlm_probability`` (HF's collator) and ``labels`` says which. An int P: original
            BERT pretraining's ``create_masked_lm_predictions``: each sequence gets exactly
            ``min(P, max(1, round(mlm_probability * candidates)))`` masked positions, and the
            batch also carries them at a fixed size, ``masked_positions`` and
            ``masked_labels`` ``[batch, P]`` (padded with position 0 and label -100), for a
            loss over gathered rows with a static shape (capturable in a CUDA graph).
            BERT used 20 at seq_len 128 and 76-80 at 512.
    """

    source: str = "python-stdlib"
    tokenizer: str = "bpe"
    vocab_size: int = 4096
    val_fraction: float = 0.05
    cache_dir: str | None = None
    max_bytes: int | None = None
    mlm_probability: float = 0.15
    max_predictions_per_seq: int | None = None


@dataclass
class Data:
    """What ``build_data`` returns.

    Attributes:
        tokenizer: encode / decode and the special ids; its ``vocab_size`` is the model's.
        train: the training stream.
        val: the validation stream.
        seq_len: tokens per sequence.
        mlm: whether the streams mask for MLM.
        cache_path: the cache entry of a text corpus, or None for token shards.
        from_cache: whether the entry was there already (nothing was trained or tokenized).
    """

    tokenizer: Tokenizer
    train: TokenStream
    val: TokenStream
    seq_len: int
    mlm: bool
    cache_path: Path | None
    from_cache: bool


def _check_config(config: DataConfig, seq_len: int) -> None:
    if not isinstance(config.source, str) or not config.source.strip():
        raise ValueError(f"source: {config.source!r} names no corpus (a text file, a folder, shards or python-stdlib)")
    if config.tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer: {config.tokenizer!r} is not one of {', '.join(TOKENIZERS)}")
    if config.tokenizer == "bpe" and config.vocab_size < MIN_BPE_VOCAB:
        raise ValueError(
            f"vocab_size: {config.vocab_size} is below {MIN_BPE_VOCAB}, the BPE's 256 bytes and its special tokens"
        )
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len: {seq_len!r} is not a positive integer")
    if not 0.0 < config.val_fraction < 1.0:
        raise ValueError(f"val_fraction: {config.val_fraction} is not in (0, 1)")
    if not 0.0 < config.mlm_probability < 1.0:
        raise ValueError(f"mlm_probability: {config.mlm_probability} is not in (0, 1)")
    check_max_predictions_per_seq(config.max_predictions_per_seq, seq_len)  # TokenStream's check, before any reading
    if config.max_bytes is not None and config.max_bytes < 1:
        raise ValueError(f"max_bytes: {config.max_bytes} is not a positive number of bytes (or None)")


def _cache_entry(config: DataConfig, files: list[CorpusFile]) -> Path:
    """The cache folder of this corpus and tokenizer."""
    key = {
        "format": _CACHE_FORMAT,
        "tokenizer": config.tokenizer,
        "vocab_size": config.vocab_size if config.tokenizer == "bpe" else None,
        "max_bytes": config.max_bytes,
        "files": [(str(f.path.resolve()), f.size, f.mtime_ns, f.read_bytes) for f in files],
    }
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    vocab = config.vocab_size if config.tokenizer == "bpe" else ByteTokenizer.vocab_size
    return _cache_root(config) / "data" / f"{config.tokenizer}-{vocab}-{digest}"


def _cache_root(config: DataConfig) -> Path:
    return Path(config.cache_dir).expanduser() if config.cache_dir else Path("~/.cache/lstrain").expanduser()


def _tokenize(files: list[CorpusFile], tokenizer: Tokenizer, path: Path, dtype: type) -> int:
    """Write the corpus's ids to ``path``, the eos id after each document; return their count."""
    count = 0
    with open(path, "wb") as out:
        pieces: list[str] = []
        ends: list[bool] = []  # whether pieces[i] ends its document

        def flush() -> None:
            nonlocal count
            for ids, end in zip(tokenizer.encode_batch(pieces), ends, strict=True):
                array = np.asarray(ids + [tokenizer.eos_id] if end else ids, dtype=dtype)
                array.tofile(out)
                count += len(array)
            pieces.clear()
            ends.clear()

        for document in read_documents(files):
            pieces += document
            ends += [False] * (len(document) - 1) + [True]
            if len(pieces) >= _ENCODE_BATCH:
                flush()
        flush()
    return count


def _build_entry(config: DataConfig, files: list[CorpusFile], entry: Path) -> None:
    """Train (BPE) and tokenize into a temporary folder, then rename it to ``entry``."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if config.tokenizer == "bpe":
            tokenizer: Tokenizer = train_bpe(
                (piece for document in read_documents(files) for piece in document), config.vocab_size
            )
            tokenizer.save(tmp / "tokenizer.json")
        else:
            tokenizer = ByteTokenizer()
        dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
        count = _tokenize(files, tokenizer, tmp / "tokens.bin", dtype)
        meta = {"dtype": np.dtype(dtype).name, "tokens": count, "vocab_size": tokenizer.vocab_size}
        meta["config"] = asdict(config)
        meta["files"] = [str(f.path) for f in files]
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp, entry)
        except OSError:
            if not (entry / "meta.json").is_file():  # not another process's finished entry
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_entry(config: DataConfig, entry: Path) -> tuple[Tokenizer, np.ndarray]:
    """The tokenizer and the memory-mapped ids of a finished cache entry."""
    meta = json.loads((entry / "meta.json").read_text())
    if config.tokenizer == "bpe":
        tokenizer: Tokenizer = BPETokenizer.from_file(entry / "tokenizer.json")
    else:
        tokenizer = ByteTokenizer()
    return tokenizer, np.memmap(entry / "tokens.bin", dtype=meta["dtype"], mode="r")


def _split(shards: list[np.ndarray], val_fraction: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Cut the last ``val_fraction`` of the tokens off as validation (views, no copy)."""
    total = sum(len(s) for s in shards)
    rest = math.ceil(total * val_fraction)  # validation tokens still to take, from the end
    train, val = list(shards), []
    while rest > 0 and train:
        last = train.pop()
        take = min(rest, len(last))
        val.insert(0, last[len(last) - take :])
        if take < len(last):
            train.append(last[: len(last) - take])
        rest -= take
    return train, val


def build_data(config: DataConfig, seq_len: int, seed: int = 0, mlm: bool = False) -> Data:
    """Read, tokenize (or load the cached ids) and split a corpus into batch streams.

    Args:
        config: the source and tokenizer.
        seq_len: tokens per sequence.
        seed: the shuffling and masking seed.
        mlm: mask for BERT's masked LM (``config.mlm_probability``, and
            ``config.max_predictions_per_seq``) instead of causal LM.

    Returns:
        The tokenizer and the train and validation streams.

    Raises:
        FileNotFoundError: a source path that does not exist, or shards without meta.json.
        ValueError: an empty source, a bad option (tokenizer name, vocab_size below the
            BPE's bytes and specials, val_fraction, seq_len, max_predictions_per_seq, the
            latter without ``mlm``), an empty corpus, a split shorter than one sequence,
            shards that do not match their dtype or vocabulary, MLM without a mask id.
    """
    _check_config(config, seq_len)
    if not mlm and config.max_predictions_per_seq is not None:
        raise ValueError(
            f"max_predictions_per_seq: {config.max_predictions_per_seq} is for masked LM (BERT); this data is causal "
            "(leave it unset)"
        )
    if config.source != PYTHON_STDLIB and not Path(config.source).expanduser().exists():
        raise FileNotFoundError(f"source: {config.source!r} does not exist (and is not {PYTHON_STDLIB!r})")
    cache_path, from_cache = None, False
    if config.source != PYTHON_STDLIB and is_shard_source(config.source):
        shards = open_shards(config.source)
        tokenizer = shards.tokenizer
        train, val = (shards.train, shards.val) if shards.val is not None else _split(shards.train, config.val_fraction)
    else:
        files = select_files(config.source, config.max_bytes, skip=_cache_root(config))
        cache_path = _cache_entry(config, files)
        from_cache = (cache_path / "meta.json").is_file()
        if not from_cache:
            _build_entry(config, files, cache_path)
        tokenizer, tokens = _load_entry(config, cache_path)
        train, val = _split([tokens], config.val_fraction)
    probability = config.mlm_probability if mlm else None
    predictions = config.max_predictions_per_seq if mlm else None
    return Data(
        tokenizer=tokenizer,
        train=TokenStream(train, seq_len, seed, "train", tokenizer, probability, predictions),
        val=TokenStream(val, seq_len, seed, "val", tokenizer, probability, predictions),
        seq_len=seq_len,
        mlm=mlm,
        cache_path=cache_path,
        from_cache=from_cache,
    )
