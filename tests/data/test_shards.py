"""Token shards: nanoGPT's .bin layout written with numpy, read memory-mapped."""

import json

import numpy as np
import pytest

from lstrain.data import DataConfig, build_data
from lstrain.data.tokenizer import train_bpe


def _write(folder, arrays, meta):
    folder.mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        array.tofile(folder / name)
    if meta is not None:
        (folder / "meta.json").write_text(json.dumps(meta))
    return str(folder)


def _rows_are_windows(batch, tokens, seq_len):
    """Whether each row is one of the aligned windows tokens[k*seq_len : (k+1)*seq_len]."""
    windows = {tuple(tokens[k * seq_len : (k + 1) * seq_len].tolist()) for k in range(len(tokens) // seq_len)}
    return all(tuple(row) in windows for row in batch["input_ids"].tolist())


@pytest.mark.parametrize(("dtype", "vocab"), [("uint16", 50257), ("uint32", 128_256)])
def test_train_and_val_shards_round_trip(tmp_path, dtype, vocab):
    rng = np.random.default_rng(0)
    train = rng.integers(0, vocab, 5000).astype(dtype)
    val = rng.integers(0, vocab, 700).astype(dtype)
    source = _write(tmp_path / "shards", {"train.bin": train, "val.bin": val}, {"dtype": dtype, "vocab_size": vocab})
    data = build_data(DataConfig(source, cache_dir=str(tmp_path / "cache")), seq_len=64)
    assert data.cache_path is None and data.tokenizer.kind == "ids" and data.tokenizer.vocab_size == vocab
    assert (data.train.tokens, data.val.tokens) == (5000, 700)
    assert isinstance(data.train.shards[0], np.memmap) and data.train.shards[0].dtype == np.dtype(dtype)
    batch = data.train.batch(3, 8)
    assert batch["input_ids"].dtype.is_signed and int(batch["input_ids"].max()) < vocab
    assert _rows_are_windows(batch, train, 64) and _rows_are_windows(data.val.batch(0, 4), val, 64)
    assert not (tmp_path / "cache").exists()  # shards are already tokenized: nothing cached
    with pytest.raises(ValueError, match="no tokenizer"):
        data.tokenizer.decode([1, 2])


def test_one_bin_file_is_split_by_val_fraction(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16)
    source = _write(tmp_path, {"tokens.bin": tokens}, {"dtype": "uint16", "vocab_size": 1000, "eos_id": 0})
    data = build_data(DataConfig(source + "/tokens.bin", val_fraction=0.1), seq_len=10)
    assert (data.train.tokens, data.val.tokens) == (900, 100)
    assert data.val.batch(0, 10)["input_ids"].min() >= 900
    assert data.train.batch(0, 90)["input_ids"].max() < 900


def test_several_shards_and_a_tokenizer_file(tmp_path):
    tokenizer = train_bpe(["some text for a tokenizer " * 50], 300)
    tokenizer.save(tmp_path / "tok.json")
    ids = np.asarray(tokenizer.encode("shard text " * 200), dtype=np.uint16)
    meta = {"dtype": "uint16", "vocab_size": 320, "eos_id": 0, "pad_id": 1, "mask_id": 2, "tokenizer": "tok.json"}
    arrays = {"train_000.bin": ids, "train_001.bin": ids[:300], "val_000.bin": ids[:200]}
    data = build_data(DataConfig(_write(tmp_path, arrays, meta)), seq_len=16, mlm=True)
    assert data.train.tokens == len(ids) + 300 and data.val.tokens == 200
    assert data.tokenizer.vocab_size == 320  # the model's (padded) vocabulary, not the file's
    assert data.tokenizer.decode(ids.tolist()) == "shard text " * 200
    assert (data.train.batch(0, 4)["input_ids"] == 2).any()  # masked


U16 = np.arange(100, dtype=np.uint16)


@pytest.mark.parametrize(
    ("written", "meta", "match"),
    [
        (np.arange(100, dtype=np.uint32), {"dtype": "uint16", "vocab_size": 200}, "every other uint16 is 0"),
        (np.arange(101, dtype=np.uint16), {"dtype": "uint32", "vocab_size": 200}, "not a whole number"),
        (U16 + 900, {"dtype": "uint32", "vocab_size": 70000}, "token .* >= vocab_size 70000: dtype mismatch"),
        (U16, {"dtype": "uint16", "vocab_size": 70000}, "vocab_size 70000 does not fit dtype uint16"),
        (U16, {"dtype": "int8", "vocab_size": 200}, "dtype 'int8' is not one of uint16, uint32"),
        (U16, {"dtype": "uint16", "vocab": 200}, "unknown key 'vocab'"),
        (U16, {"dtype": "uint16", "vocab_size": 50}, "token 99 >= vocab_size 50"),
        (U16, {"dtype": "uint16", "vocab_size": 200, "eos_id": 200}, r"eos_id 200 is not an id in \[0, 200\)"),
    ],
)
def test_bad_shards_are_errors(tmp_path, written, meta, match):
    source = _write(tmp_path, {"train.bin": written, "val.bin": written}, meta)
    with pytest.raises(ValueError, match=match):
        build_data(DataConfig(source), seq_len=8)


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        (None, "meta.json giving their dtype and vocabulary"),
        ({"dtype": "uint16", "vocab_size": 200, "tokenizer": "t.json"}, "t.json does not exist"),
    ],
)
def test_missing_shard_files_are_errors(tmp_path, meta, match):
    source = _write(tmp_path, {"train.bin": U16, "val.bin": U16}, meta)
    with pytest.raises(FileNotFoundError, match=match):
        build_data(DataConfig(source), seq_len=8)


def test_mlm_on_shards_needs_a_mask_id(tmp_path):
    source = _write(tmp_path, {"train.bin": np.arange(100, dtype=np.uint16)}, {"dtype": "uint16", "vocab_size": 100})
    with pytest.raises(ValueError, match="give mask_id in meta.json"):
        build_data(DataConfig(source), seq_len=8, mlm=True)


def test_shards_shorter_than_one_sequence_are_an_error(tmp_path):
    arrays = {"train.bin": np.arange(100, dtype=np.uint16), "val.bin": np.arange(5, dtype=np.uint16)}
    source = _write(tmp_path, arrays, {"dtype": "uint16", "vocab_size": 100})
    with pytest.raises(ValueError, match=r"the val split has 5 tokens in 1 shard\(s\), each shorter than one sequence"):
        build_data(DataConfig(source), seq_len=8)


def test_shards_shorter_than_one_sequence_are_skipped_and_said(tmp_path):
    arrays = {f"train_{i}.bin": np.arange(5, dtype=np.uint16) for i in range(9)}
    arrays["train_9.bin"] = np.arange(16, dtype=np.uint16)
    arrays["val.bin"] = np.arange(16, dtype=np.uint16)
    source = _write(tmp_path, arrays, {"dtype": "uint16", "vocab_size": 100})
    with pytest.warns(UserWarning, match="the train split uses 16 of its 61 tokens: 9 shard"):
        data = build_data(DataConfig(source), seq_len=8)
    assert (data.train.tokens, data.train.sequences) == (16, 2)


@pytest.mark.parametrize(
    ("meta_text", "tokenizer_text", "match"),
    [
        ("{dtype: uint16}", None, r"meta.json: not valid JSON"),
        ('["uint16"]', None, r"meta.json: expected a JSON object"),
        ('{"dtype": "uint16", "vocab_size": 200, "tokenizer": "t.json"}', "{1: 2}", r"t.json: not a tokenizers"),
    ],
)
def test_corrupt_shard_metadata_names_the_file(tmp_path, meta_text, tokenizer_text, match):
    source = _write(tmp_path, {"train.bin": U16, "val.bin": U16}, None)
    (tmp_path / "meta.json").write_text(meta_text)
    if tokenizer_text is not None:
        (tmp_path / "t.json").write_text(tokenizer_text)
    with pytest.raises(ValueError, match=match):
        build_data(DataConfig(source), seq_len=8)


def test_validation_shards_are_named_by_a_word(tmp_path):
    ids = np.arange(64, dtype=np.uint16)
    names = ["interval_000.bin", "fineweb_train_001.bin", "fineweb_val_000.bin", "valid.bin"]
    source = _write(tmp_path, {name: ids for name in names}, {"dtype": "uint16", "vocab_size": 100})
    data = build_data(DataConfig(source), seq_len=8)
    assert (data.train.tokens, data.val.tokens) == (128, 128)  # interval_000 trains
