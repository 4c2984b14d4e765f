"""The byte and BPE tokenizers: round trips, special ids, bad ids."""

import pytest

from lstrain.data import ByteTokenizer, build_data
from lstrain.data.corpus import read_documents, select_files, stdlib_files
from lstrain.data.tokenizer import EOS_TOKEN, MIN_BPE_VOCAB, SPECIAL_TOKENS, train_bpe

# Text the corpus may never have seen: non-ASCII, an emoji, odd whitespace, a special token's string.
ODD_TEXT = "naïve café — 日本語 🚀\ttabs\r\nCRLF   spaces\n\n" + EOS_TOKEN + " <pad><mask>\x00end"


def test_bpe_round_trips_stdlib_text(stdlib_config):
    tokenizer = build_data(stdlib_config, seq_len=64).tokenizer
    assert tokenizer.kind == "bpe" and MIN_BPE_VOCAB < tokenizer.vocab_size <= stdlib_config.vocab_size
    # files the BPE trained on and files it did not: the first and the last of the library's order
    files = select_files("python-stdlib", None)
    tokens = text_bytes = 0
    for document in read_documents(files[:3] + files[-3:]):
        text = "".join(document)
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        tokens, text_bytes = tokens + len(ids), text_bytes + len(text.encode())
    # it did learn merges (over all six files: one short file of another Python's library
    # may hold few of them)
    assert tokens < text_bytes / 1.5
    assert tokenizer.decode(tokenizer.encode(ODD_TEXT)) == ODD_TEXT


def test_special_strings_in_text_stay_text(stdlib_config):
    tokenizer = build_data(stdlib_config, seq_len=64).tokenizer
    for make in (lambda: tokenizer, ByteTokenizer):
        ids = make().encode(ODD_TEXT)
        assert not set(ids) & set(make().special_ids)


def test_special_ids_are_first_and_decode_by_name(stdlib_config):
    for tokenizer in (build_data(stdlib_config, seq_len=64).tokenizer, ByteTokenizer()):
        assert (tokenizer.eos_id, tokenizer.pad_id, tokenizer.mask_id) == (0, 1, 2)
        assert tokenizer.bos_id == tokenizer.eos_id and tokenizer.special_ids == (0, 1, 2)
        assert tokenizer.decode([0, 1, 2]) == "".join(SPECIAL_TOKENS)


def test_byte_tokenizer():
    tokenizer = ByteTokenizer()
    assert tokenizer.vocab_size == 259
    assert tokenizer.encode("A") == [ord("A") + 3]
    assert tokenizer.decode(tokenizer.encode(ODD_TEXT)) == ODD_TEXT
    assert tokenizer.decode(tokenizer.encode("é")[:1]) == "\ufffd"  # half a character


@pytest.mark.parametrize("bad", [-1, 259])
def test_decode_refuses_an_id_outside_the_vocabulary(bad):
    with pytest.raises(ValueError, match=f"ids: {bad} is outside"):
        ByteTokenizer().decode([5, bad])


def test_the_fingerprint_tells_bpes_trained_on_other_text_apart(tmp_path):
    """Two BPEs of one vocabulary size trained on other text number their merges otherwise:
    their fingerprints differ; the same BPE saved and loaded again keeps its own."""
    from lstrain.data.tokenizer import BPETokenizer

    first = train_bpe(["the cat sat on the mat " * 50], MIN_BPE_VOCAB + 8)
    second = train_bpe(["a dog ran to a log " * 50], MIN_BPE_VOCAB + 8)
    assert first.vocab_size == second.vocab_size
    assert first.fingerprint() != second.fingerprint()
    first.save(tmp_path / "tokenizer.json")
    assert BPETokenizer.from_file(tmp_path / "tokenizer.json").fingerprint() == first.fingerprint()
    assert ByteTokenizer().fingerprint() == ByteTokenizer().fingerprint() != first.fingerprint()


def test_train_bpe_refuses_a_vocabulary_without_room_for_the_bytes():
    with pytest.raises(ValueError, match="vocab_size: 258 is below 259"):
        train_bpe(["text"], 258)


def test_stdlib_files_leave_out_third_party_packages():
    files = stdlib_files()
    assert len(files) > 100
    assert not any("site-packages" in f.parts for f in files)


def test_tokens_a_tokenizer_json_marks_special_are_never_masked(tmp_path):
    """A BERT-style vocabulary's [CLS] / [SEP]: special for MLM as in Hugging Face's collator."""
    import tokenizers

    from lstrain.data.tokenizer import BPETokenizer

    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "[MASK]": 3, "a": 4, "b": 5}
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    hf.add_special_tokens(["[CLS]", "[SEP]", "[MASK]"])
    hf.save(str(tmp_path / "tokenizer.json"))
    tokenizer = BPETokenizer.from_file(tmp_path / "tokenizer.json", mask_id=3)
    assert tokenizer.special_ids == (1, 2, 3)
