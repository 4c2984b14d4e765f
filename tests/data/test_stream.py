"""Batches: determinism, resuming, epochs, the rank split, MLM masking."""

import dataclasses

import numpy as np
import pytest
import torch

from lstrain.data import IGNORE_INDEX, ByteTokenizer, TokenStream, build_data, mask_tokens

SEQ = 32


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def data(stdlib_config):
    return build_data(stdlib_config, seq_len=SEQ, seed=1)


def test_a_batch_is_a_function_of_seed_and_step(stdlib_config, data):
    again = build_data(stdlib_config, seq_len=SEQ, seed=1)  # a fresh run: new streams, nothing consumed
    for step in (0, 1, 7, 10_000):
        assert _equal(data.train.batch(step, 4), again.train.batch(step, 4))
    assert not torch.equal(data.train.batch(0, 4)["input_ids"], data.train.batch(1, 4)["input_ids"])
    other = build_data(stdlib_config, seq_len=SEQ, seed=2)
    assert not torch.equal(data.train.batch(0, 4)["input_ids"], other.train.batch(0, 4)["input_ids"])
    assert not torch.equal(data.train.batch(0, 4)["input_ids"][:1], data.val.batch(0, 4)["input_ids"][:1])


def test_resuming_at_step_k_gives_batch_k(stdlib_config, data):
    uninterrupted = [data.train.batch(step, 3) for step in range(12)]
    resumed = build_data(stdlib_config, seq_len=SEQ, seed=1)
    assert all(_equal(resumed.train.batch(step, 3), uninterrupted[step]) for step in range(8, 12))


def test_an_epoch_reads_every_sequence_once_then_reshuffles():
    tokens = np.arange(10 * 8, dtype=np.uint16) % 200 + 3  # 10 sequences of 8
    stream = TokenStream([tokens], 8, 0, "train", ByteTokenizer())
    assert stream.sequences == 10
    rows = torch.cat([stream.batch(step, 4)["input_ids"] for step in range(5)])  # 20 rows: two epochs
    firsts = [int(row[0]) for row in rows]
    expected = sorted(int(tokens[i * 8]) for i in range(10))
    assert sorted(firsts[:10]) == expected and sorted(firsts[10:]) == expected
    assert firsts[:10] != firsts[10:]
    for row in rows:  # each row is one packed sequence: a window of the tokens at a multiple of 8
        start = (int(row[0]) - 3) % 200
        assert start % 8 == 0 and torch.equal(row, torch.from_numpy(tokens[start : start + 8].astype(np.int64)))


def test_a_batch_bigger_than_an_epoch_wraps_around():
    stream = TokenStream([np.arange(3 * 4, dtype=np.uint16) + 3], 4, 0, "train", ByteTokenizer())
    assert stream.batch(0, 7)["input_ids"].shape == (7, 4)


@pytest.mark.parametrize("mlm", [False, True])
def test_ranks_take_contiguous_rows_of_the_global_batch(stdlib_config, mlm):
    data = build_data(stdlib_config, seq_len=SEQ, seed=3, mlm=mlm)
    for step in (0, 5):
        whole = data.train.batch(step, 6)
        parts = [data.train.batch(step, 2, rank=r, world_size=3) for r in range(3)]
        assert _equal(whole, {k: torch.cat([p[k] for p in parts]) for k in whole})


def test_shards_do_not_join_into_one_sequence():
    shards = [np.full(10, 5, dtype=np.uint16), np.full(7, 6, dtype=np.uint16), np.full(3, 7, dtype=np.uint16)]
    with pytest.warns(UserWarning, match="uses 17 of its 20 tokens: 1 shard"):
        stream = TokenStream(shards, 4, 0, "train", ByteTokenizer())
    assert stream.sequences == 2 + 1 and stream.tokens == 17  # the tokens of the shards read
    rows = stream.batch(0, 3)["input_ids"]
    assert sorted(int(r[0]) for r in rows) == [5, 5, 6] and all(len(set(r.tolist())) == 1 for r in rows)


def test_pad_ids_are_masked_out():
    tokenizer = ByteTokenizer()
    tokens = np.array([10, 11, tokenizer.pad_id, tokenizer.pad_id] * 4, dtype=np.uint16)
    batch = TokenStream([tokens], 4, 0, "train", tokenizer).batch(0, 2)
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0]] * 2
    assert batch["labels"].tolist() == [[10, 11, IGNORE_INDEX, IGNORE_INDEX]] * 2


def test_mlm_masks_like_hugging_face(stdlib_config):
    plain = build_data(stdlib_config, seq_len=64, seed=4)
    masked = build_data(stdlib_config, seq_len=64, seed=4, mlm=True)
    tokenizer = masked.tokenizer
    original, batch = plain.train.batch(2, 128)["input_ids"], masked.train.batch(2, 128)
    inputs, labels = batch["input_ids"], batch["labels"]
    special = torch.isin(original, torch.tensor(tokenizer.special_ids))
    selected = labels != IGNORE_INDEX
    assert not (selected & special).any()
    assert torch.equal(labels[selected], original[selected])
    assert torch.equal(inputs[~selected], original[~selected])  # unselected tokens untouched
    share = selected.sum().item() / (~special).sum().item()
    assert share == pytest.approx(0.15, abs=0.01)  # ~8000 tokens: 5 sigma is 0.02 of the share
    n = selected.sum().item()
    as_mask = (inputs[selected] == tokenizer.mask_id).sum().item() / n
    kept = (inputs[selected] == original[selected]).sum().item() / n
    assert as_mask == pytest.approx(0.8, abs=0.03)
    assert kept == pytest.approx(0.1, abs=0.025)  # includes the 1/vocab random draws of the same id
    randomized = inputs[selected & (inputs != tokenizer.mask_id) & (inputs != original)]
    assert len(randomized) / n == pytest.approx(0.1, abs=0.025)
    assert not torch.isin(randomized, torch.tensor(tokenizer.special_ids)).any()
    assert (batch["attention_mask"] == 1).all()
    assert _equal(masked.train.batch(2, 128), batch)  # deterministic too


def test_mlm_probability_is_the_configs(stdlib_config):
    config = dataclasses.replace(stdlib_config, mlm_probability=0.4)
    plain = build_data(config, seq_len=64).train.batch(0, 64)["input_ids"]
    labels = build_data(config, seq_len=64, mlm=True).train.batch(0, 64)["labels"]
    assert (labels != IGNORE_INDEX).float().mean().item() == pytest.approx(0.4, abs=0.03)
    assert plain.shape == labels.shape


def test_mask_tokens_never_selects_special_ids():
    ids = np.tile(np.array([0, 1, 2, 50, 60], dtype=np.int64), 2000)
    special, normal = np.array([0, 1, 2]), np.arange(3, 259)
    inputs, labels = mask_tokens(ids, np.random.default_rng(0), 0.5, 2, special, normal)
    is_special = np.isin(ids, special)
    assert (labels[is_special] == IGNORE_INDEX).all() and (inputs[is_special] == ids[is_special]).all()
    assert (labels[~is_special] != IGNORE_INDEX).mean() == pytest.approx(0.5, abs=0.03)


def test_mlm_streams_never_select_eos_or_pad():
    tokenizer = ByteTokenizer()
    tokens = np.tile(np.array([40, 41, 42, tokenizer.eos_id, tokenizer.pad_id], dtype=np.uint16), 400)
    batch = TokenStream([tokens], 50, 0, "train", tokenizer, mlm_probability=0.5).batch(0, 40)
    selected = batch["labels"] != IGNORE_INDEX
    ids = torch.from_numpy(tokens[:50].astype(np.int64))  # every sequence of 50 is the same here
    special = torch.isin(ids, torch.tensor(tokenizer.special_ids)).expand_as(selected)
    assert selected.any() and not (selected & special).any()
    assert torch.equal(batch["input_ids"][special], ids.expand_as(selected)[special])
    assert torch.equal(batch["attention_mask"][0], (ids != tokenizer.pad_id).long())


def test_mlm_needs_a_mask_id():
    tokenizer = ByteTokenizer()
    tokenizer.mask_id = None
    with pytest.raises(ValueError, match="mlm: the tokenizer has no mask id"):
        TokenStream([np.arange(64, dtype=np.uint16)], 8, 0, "train", tokenizer, mlm_probability=0.15)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((-1, 2), "step: -1 is negative"),
        ((0, 0), "batch_size: 0 is below 1"),
        ((0, 2, 2, 2), r"rank: 2 is not in \[0, world_size=2\)"),
        ((0, 2, -1, 2), r"rank: -1 is not in"),
        ((0, 2, 0, 0), r"rank: 0 is not in \[0, world_size=0\)"),
    ],
)
def test_bad_batch_arguments_are_errors(data, args, match):
    with pytest.raises(ValueError, match=match):
        data.train.batch(*args)


def test_fixed_masking_selects_exactly_round_p_candidates_per_row(stdlib_config):
    """Original BERT's masking: a fixed count per row, the positions and their labels at a
    fixed size (padded with position 0 and label -100), 80/10/10, deterministic."""
    config = dataclasses.replace(stdlib_config, max_predictions_per_seq=12)
    plain = build_data(stdlib_config, seq_len=64, seed=4).train.batch(2, 128)["input_ids"]
    data = build_data(config, seq_len=64, seed=4, mlm=True)
    batch, tokenizer = data.train.batch(2, 128), data.tokenizer
    positions, masked = batch["masked_positions"], batch["masked_labels"]
    assert positions.shape == masked.shape == (128, 12) and positions.dtype == masked.dtype == torch.int64
    special = torch.isin(plain, torch.tensor(tokenizer.special_ids))
    selected = batch["labels"] != IGNORE_INDEX
    expected = torch.clamp(torch.round(0.15 * (~special).sum(1).double()).long().clamp(min=1), max=12)
    assert torch.equal(selected.sum(1), expected)  # 10 of 64 (0.15 x 64 = 9.6) where no token is special
    assert not (selected & special).any()
    for row in range(128):
        count = int(expected[row])
        where = selected[row].nonzero().squeeze(1)
        assert torch.equal(positions[row, :count], where)  # in increasing order
        assert torch.equal(masked[row, :count], plain[row, where])
        assert (positions[row, count:] == 0).all() and (masked[row, count:] == IGNORE_INDEX).all()
    inputs = batch["input_ids"]
    assert torch.equal(inputs[~selected], plain[~selected])
    n = selected.sum().item()
    assert (inputs[selected] == tokenizer.mask_id).sum().item() / n == pytest.approx(0.8, abs=0.04)
    assert (inputs[selected] == plain[selected]).sum().item() / n == pytest.approx(0.1, abs=0.03)
    assert _equal(data.train.batch(2, 128), batch)
    parts = [data.train.batch(2, 64, rank=r, world_size=2) for r in range(2)]
    assert _equal(batch, {k: torch.cat([p[k] for p in parts]) for k in batch})


def test_fixed_masking_caps_at_max_predictions_and_is_refused_for_causal_lm(stdlib_config):
    config = dataclasses.replace(stdlib_config, max_predictions_per_seq=3)
    batch = build_data(config, seq_len=64, mlm=True).train.batch(0, 8)
    assert ((batch["labels"] != IGNORE_INDEX).sum(1) == 3).all() and (batch["masked_labels"] != IGNORE_INDEX).all()
    with pytest.raises(ValueError, match="max_predictions_per_seq: 3 is for masked LM .* this data is causal"):
        build_data(config, seq_len=64)  # set but meaningless for causal LM: refused, not ignored
    for bad, message in [(0, "is not a positive integer"), (65, "max_predictions_per_seq: 65 exceeds seq_len 64")]:
        with pytest.raises(ValueError, match=message):
            build_data(dataclasses.replace(stdlib_config, max_predictions_per_seq=bad), seq_len=64, mlm=True)


@pytest.mark.parametrize(
    ("predictions", "match"),
    [
        (-1, r"^max_predictions_per_seq: -1 is not a positive integer \(or None\)$"),
        (0, r"^max_predictions_per_seq: 0 is not a positive integer"),
        (True, r"^max_predictions_per_seq: True is not a positive integer"),
        (2.0, r"^max_predictions_per_seq: 2.0 is not a positive integer"),
        ("3", r"^max_predictions_per_seq: '3' is not a positive integer"),
        (9, r"^max_predictions_per_seq: 9 exceeds seq_len 8$"),
    ],
)
def test_stream_refuses_a_bad_max_predictions_per_seq(predictions, match):
    with pytest.raises(ValueError, match=match):
        TokenStream([np.arange(64, dtype=np.uint16)], 8, 0, "train", ByteTokenizer(), 0.15, predictions)


def test_stream_refuses_max_predictions_per_seq_for_causal_lm():
    with pytest.raises(ValueError, match=r"^max_predictions_per_seq: 3 is for MLM streams only; causal LM"):
        TokenStream([np.arange(64, dtype=np.uint16)], 8, 0, "train", ByteTokenizer(), max_predictions_per_seq=3)


def test_stream_takes_max_predictions_per_seq_up_to_seq_len():
    tokens = np.arange(64, dtype=np.uint16) + 3
    for predictions in (1, 8):
        stream = TokenStream([tokens], 8, 0, "train", ByteTokenizer(), 0.5, predictions)
        assert stream.batch(0, 2)["masked_positions"].shape == (2, predictions)
    assert "masked_positions" not in TokenStream([tokens], 8, 0, "train", ByteTokenizer()).batch(0, 2)
