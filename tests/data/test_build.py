"""build_data: sources, the cache, and the errors raised before any training."""

import json
import os

import numpy as np
import pytest

import lstrain.data.build as build
import lstrain.data.corpus as corpus
from lstrain.data import DataConfig, build_data


def _write_texts(root):
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("Alpha file. " * 40)
    (root / "sub" / "b.md").write_text("# Beta\n\n" + "beta text, " * 40)
    (root / "sub" / "c.py").write_text("print('gamma')\n" * 30)
    (root / "skip.bin.gz").write_bytes(b"\x00\x01")  # not a text suffix
    (root / ".git").mkdir()
    (root / ".git" / "HEAD.txt").write_text("hidden, never read")
    (root / "empty.txt").write_text("")
    return {"a.txt", "b.md", "c.py"}


def test_stdlib_source_builds_offline(stdlib_config):
    data = build_data(stdlib_config, seq_len=64)
    assert data.tokenizer.kind == "bpe" and not data.mlm and data.seq_len == 64
    assert data.train.tokens > 10 * data.val.tokens > 0
    meta = json.loads((data.cache_path / "meta.json").read_text())
    assert meta["tokens"] == data.train.tokens + data.val.tokens
    assert data.val.tokens == pytest.approx(meta["tokens"] * stdlib_config.val_fraction, abs=1)
    batch = data.train.batch(0, 4)
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    for tensor in batch.values():
        assert tensor.shape == (4, 64) and str(tensor.dtype) == "torch.int64" and tensor.device.type == "cpu"
    assert (batch["labels"] == batch["input_ids"]).all() and (batch["attention_mask"] == 1).all()


def test_text_directory(tmp_path):
    names = _write_texts(tmp_path / "texts")
    data = build_data(DataConfig(str(tmp_path / "texts"), "byte", cache_dir=str(tmp_path / "cache")), seq_len=16)
    meta = json.loads((data.cache_path / "meta.json").read_text())
    assert {os.path.basename(f) for f in meta["files"]} == names
    # every byte of the three files plus one eos after each
    total = sum((tmp_path / "texts" / n).stat().st_size for n in ("a.txt", "sub/b.md", "sub/c.py"))
    assert data.train.tokens + data.val.tokens == total + 3
    assert all(t >= 3 or t == data.tokenizer.eos_id for t in data.train.batch(0, 8)["input_ids"].flatten().tolist())


def test_a_text_file_capped_by_max_bytes(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("".join(f"line {i}\n" for i in range(2000)))
    config = DataConfig(str(path), "byte", cache_dir=str(tmp_path / "cache"), max_bytes=1000, val_fraction=0.1)
    data = build_data(config, seq_len=32)
    assert data.train.tokens + data.val.tokens == 1001
    stored = np.memmap(data.cache_path / "tokens.bin", dtype=np.uint16, mode="r")
    assert data.tokenizer.decode(stored[:-1].tolist()) == path.read_text()[:1000]


def test_the_second_build_reads_the_cache(monkeypatch, tmp_path):
    config = DataConfig(vocab_size=300, max_bytes=50_000, cache_dir=str(tmp_path))
    first = build_data(config, seq_len=32)
    assert not first.from_cache
    stamps = {p.name: p.stat().st_mtime_ns for p in first.cache_path.iterdir()}
    assert set(stamps) == {"tokenizer.json", "tokens.bin", "meta.json"}

    def no_training(*args, **kwargs):
        raise AssertionError("the BPE was trained again")

    monkeypatch.setattr(build, "train_bpe", no_training)
    monkeypatch.setattr(build, "_tokenize", no_training)
    second = build_data(config, seq_len=32, seed=5)
    assert second.from_cache and second.cache_path == first.cache_path
    assert {p.name: p.stat().st_mtime_ns for p in second.cache_path.iterdir()} == stamps
    assert isinstance(second.train.shards[0], np.memmap)
    assert second.train.tokens == first.train.tokens
    # another vocabulary or cap is another entry
    monkeypatch.undo()
    assert build_data(DataConfig(vocab_size=301, max_bytes=50_000, cache_dir=str(tmp_path)), 32).cache_path != (
        first.cache_path
    )
    assert len(list((tmp_path / "data").iterdir())) == 2  # no temporary folder left behind


def test_a_changed_file_is_tokenized_again(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("x" * 500)
    config = DataConfig(str(path), "byte", cache_dir=str(tmp_path / "cache"))
    first = build_data(config, seq_len=8)
    path.write_text("y" * 600)
    second = build_data(config, seq_len=8)
    assert second.cache_path != first.cache_path and not second.from_cache
    assert second.train.tokens + second.val.tokens == 601


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"source": "/no/such/corpus"}, FileNotFoundError, "source: '/no/such/corpus' does not exist"),
        ({"source": " "}, ValueError, "source: ' ' names no corpus"),
        ({"tokenizer": "wordpiece"}, ValueError, "tokenizer: 'wordpiece' is not one of bpe, byte"),
        ({"vocab_size": 100}, ValueError, "vocab_size: 100 is below 259"),
        ({"val_fraction": 0.0}, ValueError, "val_fraction: 0.0 is not in"),
        ({"val_fraction": 1.0}, ValueError, "val_fraction: 1.0 is not in"),
        ({"mlm_probability": 1.5}, ValueError, "mlm_probability: 1.5 is not in"),
        ({"max_bytes": 0}, ValueError, "max_bytes: 0 is not"),
    ],
)
def test_a_bad_option_is_an_error(tmp_path, changes, error, match):
    config = DataConfig(cache_dir=str(tmp_path), **changes)
    with pytest.raises(error, match=match):
        build_data(config, seq_len=32)
    assert not (tmp_path / "data").exists()  # refused before reading or training anything


@pytest.mark.parametrize("seq_len", [0, -3, 2.5])
def test_a_bad_seq_len_is_an_error(tmp_path, seq_len):
    with pytest.raises(ValueError, match="seq_len"):
        build_data(DataConfig(cache_dir=str(tmp_path)), seq_len=seq_len)


def test_an_empty_corpus_is_an_error(tmp_path):
    (tmp_path / "texts" / "sub").mkdir(parents=True)
    (tmp_path / "texts" / "sub" / "empty.md").write_text("")
    (tmp_path / "texts" / "image.png").write_bytes(b"\x89PNG")
    with pytest.raises(ValueError, match="empty corpus: source .* holds no non-empty text file"):
        build_data(DataConfig(str(tmp_path / "texts"), cache_dir=str(tmp_path)), seq_len=8)


@pytest.mark.parametrize(("size", "split"), [(100, "train"), (1000, "val")])
def test_a_split_shorter_than_one_sequence_is_an_error(tmp_path, size, split):
    path = tmp_path / "short.txt"
    path.write_text("z" * size)
    config = DataConfig(str(path), "byte", cache_dir=str(tmp_path), val_fraction=0.05)
    # 1000 bytes: 951 training tokens hold a sequence of 128, the 50 validation ones do not
    with pytest.raises(ValueError, match=f"the {split} split has .* shorter than one sequence of seq_len 128"):
        build_data(config, seq_len=128)


def test_a_line_longer_than_a_piece_is_cut_between_characters(tmp_path, monkeypatch):
    """A file without newlines is read in pieces cut at a byte count: never inside a
    multi-byte character (it became two U+FFFD in the corpus)."""
    monkeypatch.setattr(corpus, "PIECE_BYTES", 7)
    text = "a" + "é" * 40 + "€" * 20
    (tmp_path / "one_line.txt").write_text(text, encoding="utf-8")
    data = build_data(DataConfig(str(tmp_path / "one_line.txt"), "byte", cache_dir=str(tmp_path / "cache")), seq_len=8)
    stored = np.memmap(data.cache_path / "tokens.bin", dtype=np.uint16, mode="r")
    assert data.tokenizer.decode(stored[:-1].tolist()) == text


def test_a_cache_inside_the_source_folder_is_not_read_as_corpus(tmp_path):
    names = _write_texts(tmp_path / "texts")
    config = DataConfig(str(tmp_path / "texts"), "bpe", vocab_size=300, cache_dir=str(tmp_path / "texts" / "cache"))
    first = build_data(config, seq_len=16)
    second = build_data(config, seq_len=16)  # the first build's tokenizer.json / meta.json now sit in the source
    assert second.from_cache and second.cache_path == first.cache_path
    assert {os.path.basename(f) for f in json.loads((second.cache_path / "meta.json").read_text())["files"]} == names
