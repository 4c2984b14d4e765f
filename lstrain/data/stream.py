"""Packed, shuffled batches of a token split, and BERT's MLM masking.

A split's tokens (documents joined by the eos id) are cut into non-overlapping sequences of
``seq_len`` tokens; the tail shorter than a sequence is dropped, and no sequence crosses a
shard boundary. Sample ``g`` of the run (``g = step * global_batch + row``) is sequence
``perm(epoch)[g % sequences]`` with ``epoch = g // sequences``, ``perm`` a permutation drawn
from (seed, split, epoch): every sequence once per epoch, a fresh order each epoch, and a
batch that is a pure function of (seed, step, rank, world_size), so resuming at step k gives
exactly batch k of an uninterrupted run. Rank r of world_size takes the contiguous rows
``[r * batch_size, (r + 1) * batch_size)`` of the global batch, so the ranks' batches
concatenated in rank order are the one-process batch of ``batch_size * world_size`` rows.
MLM masking draws from (seed, split, g) too, so a row is masked alike whichever rank reads it.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from lstrain.data.tokenizer import Tokenizer

__all__ = ["IGNORE_INDEX", "TokenStream", "mask_tokens", "mask_tokens_fixed"]

IGNORE_INDEX = -100  # labels that the loss skips (torch's and HF's ignore_index)
_SPLIT_SALT = {"train": 0, "val": 1}
_MASK_STREAM = 1  # a second random stream per sample, apart from the permutations'


def mask_tokens(
    ids: np.ndarray,
    rng: np.random.Generator,
    probability: float,
    mask_id: int,
    special_ids: np.ndarray,
    normal_ids: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """BERT's masking, as HF's DataCollatorForLanguageModeling does it.

    Each non-special token is selected with ``probability``; a selected token becomes the
    mask id (80%), a random non-special id (10%) or stays itself (10%). Labels are the
    original ids where selected and ``IGNORE_INDEX`` elsewhere.

    Args:
        ids: int64 ids of one or more rows.
        rng: the random stream.
        probability: the selection probability.
        mask_id: the mask id.
        special_ids: ids never selected (eos, pad, mask).
        normal_ids: the ids a random replacement is drawn from (HF draws from the whole
            vocabulary; specials are left out here so that no pad or mask appears at random).

    Returns:
        (input_ids, labels), both int64 and shaped like ``ids``.
    """
    selected = (rng.random(ids.shape) < probability) & ~np.isin(ids, special_ids)
    labels = np.where(selected, ids, IGNORE_INDEX)
    draw = rng.random(ids.shape)
    inputs = ids.copy()
    inputs[selected & (draw < 0.8)] = mask_id
    randomized = selected & (draw >= 0.8) & (draw < 0.9)
    inputs[randomized] = rng.choice(normal_ids, size=int(randomized.sum()))
    return inputs, labels


def mask_tokens_fixed(
    ids: np.ndarray,
    rng: np.random.Generator,
    probability: float,
    max_predictions: int,
    mask_id: int,
    special_ids: np.ndarray,
    normal_ids: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Original BERT pretraining's masking (``create_masked_lm_predictions``) of one row.

    Exactly ``min(max_predictions, max(1, round(probability * candidates)))`` of the row's
    non-special tokens are selected, uniformly without replacement; a selected token becomes
    the mask id (80%), a random non-special id (10%) or stays itself (10%).

    Args:
        ids: int64 ids of one row.
        rng: the random stream.
        probability: the share of candidates selected.
        max_predictions: the most positions selected, and the size of the fixed outputs.
        mask_id: the mask id.
        special_ids: ids never selected (eos, pad, mask).
        normal_ids: the ids a random replacement is drawn from.

    Returns:
        (input_ids, labels, masked_positions, masked_labels): the first two shaped like
        ``ids`` (labels the original id where selected, ``IGNORE_INDEX`` elsewhere); the
        last two ``[max_predictions]``: the selected positions in increasing order and their
        original ids, padded with position 0 and label ``IGNORE_INDEX``.
    """
    candidates = np.flatnonzero(~np.isin(ids, special_ids))
    count = min(max_predictions, max(1, round(probability * len(candidates)))) if len(candidates) else 0
    chosen = np.sort(rng.choice(candidates, size=count, replace=False))
    draw = rng.random(count)
    inputs = ids.copy()
    inputs[chosen[draw < 0.8]] = mask_id
    randomized = chosen[(draw >= 0.8) & (draw < 0.9)]
    inputs[randomized] = rng.choice(normal_ids, size=len(randomized))
    labels = np.full_like(ids, IGNORE_INDEX)
    labels[chosen] = ids[chosen]
    positions = np.zeros(max_predictions, dtype=np.int64)
    masked_labels = np.full(max_predictions, IGNORE_INDEX, dtype=np.int64)
    positions[:count], masked_labels[:count] = chosen, ids[chosen]
    return inputs, labels, positions, masked_labels


def check_max_predictions_per_seq(predictions: int | None, seq_len: int) -> None:
    """Refuse a ``max_predictions_per_seq`` that is not None or an int in ``[1, seq_len]``.

    Raises:
        ValueError: naming ``max_predictions_per_seq`` and its value.
    """
    if predictions is None:
        return
    if isinstance(predictions, bool) or not isinstance(predictions, int) or predictions <= 0:
        raise ValueError(f"max_predictions_per_seq: {predictions!r} is not a positive integer (or None)")
    if predictions > seq_len:
        raise ValueError(f"max_predictions_per_seq: {predictions} exceeds seq_len {seq_len}")


class TokenStream:
    """One split's batches (see the module docstring for their order and layout).

    Args:
        shards: the split's tokens, one 1-D integer array (a memmap) per shard.
        seq_len: tokens per sequence.
        seed: the shuffling (and masking) seed.
        split: ``"train"`` or ``"val"``: each split draws its own order.
        tokenizer: for the pad, mask and special ids.
        mlm_probability: selection probability of MLM masking, or None for causal LM.
        max_predictions_per_seq: MLM with a fixed number of masked positions per sequence
            (:func:`mask_tokens_fixed`), an int in ``[1, seq_len]``; or None for HF's
            per-token draws (:func:`mask_tokens`), and always None for causal LM.

    Raises:
        ValueError: a max_predictions_per_seq that is not None or an int in [1, seq_len], or
            one given for causal LM; no whole sequence in the split; MLM without a mask id.
    """

    def __init__(
        self,
        shards: list[np.ndarray],
        seq_len: int,
        seed: int,
        split: str,
        tokenizer: Tokenizer,
        mlm_probability: float | None = None,
        max_predictions_per_seq: int | None = None,
    ):
        check_max_predictions_per_seq(max_predictions_per_seq, seq_len)
        if mlm_probability is None and max_predictions_per_seq is not None:
            raise ValueError(
                f"max_predictions_per_seq: {max_predictions_per_seq} is for MLM streams only; "
                "causal LM (mlm_probability=None) takes None"
            )
        self.max_predictions_per_seq = max_predictions_per_seq
        self.shards = [s for s in shards if len(s) >= seq_len]
        self.seq_len, self.seed, self.split = seq_len, seed, split
        self.tokenizer, self.mlm_probability = tokenizer, mlm_probability
        self.tokens = int(sum(len(s) for s in self.shards))
        # first sequence index of each shard, and the total as the last entry
        self._first = np.cumsum([0] + [len(s) // seq_len for s in self.shards])
        self.sequences = int(self._first[-1])
        all_tokens = int(sum(len(s) for s in shards))
        if self.sequences == 0:
            raise ValueError(
                f"the {split} split has {all_tokens} tokens in {len(shards)} shard(s), each shorter than one sequence "
                f"of seq_len {seq_len}: read more text (max_bytes), shorten seq_len, or change val_fraction"
            )
        if all_tokens - self.tokens > all_tokens // 10:
            warnings.warn(
                f"the {split} split uses {self.tokens} of its {all_tokens} tokens: "
                f"{len(shards) - len(self.shards)} shard(s) shorter than one sequence of seq_len {seq_len} are skipped",
                stacklevel=2,
            )
        if mlm_probability is not None and tokenizer.mask_id is None:
            raise ValueError("mlm: the tokenizer has no mask id (token shards: give mask_id in meta.json)")
        special = np.asarray(tokenizer.special_ids, dtype=np.int64)
        self._special = special
        self._normal = np.setdiff1d(np.arange(tokenizer.vocab_size, dtype=np.int64), special)
        self._perms: dict[int, np.ndarray] = {}

    def __repr__(self) -> str:
        return f"TokenStream({self.split}: {self.tokens} tokens, {self.sequences} sequences of {self.seq_len})"

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a batch spans at most two epochs, unless one is tiny
                self._perms.pop(next(iter(self._perms)))
            rng = np.random.default_rng([self.seed, _SPLIT_SALT[self.split], epoch])
            self._perms[epoch] = rng.permutation(self.sequences)
        return self._perms[epoch]

    def sequence(self, index: int) -> np.ndarray:
        """Sequence ``index`` (in storage order) as int64 ids of length ``seq_len``."""
        shard = int(np.searchsorted(self._first, index, side="right")) - 1
        start = (index - int(self._first[shard])) * self.seq_len
        return np.asarray(self.shards[shard][start : start + self.seq_len], dtype=np.int64)

    def batch(self, step: int, batch_size: int, rank: int = 0, world_size: int = 1) -> dict[str, torch.Tensor]:
        """The rows of step ``step``'s global batch that rank ``rank`` trains on.

        Args:
            step: the step (for gradient accumulation, count micro-batches).
            batch_size: rows per rank; the global batch has ``batch_size * world_size``.
            rank: this process's rank.
            world_size: the number of data-parallel processes.

        Returns:
            int64 CPU tensors of shape ``[batch_size, seq_len]``: ``input_ids``, ``labels``
            (causal LM: the ids themselves, the model shifts them; MLM: the original ids at
            masked positions, -100 elsewhere) and ``attention_mask`` (0 at pad ids); with
            ``max_predictions_per_seq`` P also ``masked_positions`` and ``masked_labels``
            of shape ``[batch_size, P]`` (see :func:`mask_tokens_fixed`).

        Raises:
            ValueError: a negative step, a batch_size below 1, or a rank outside the world.
        """
        if step < 0:
            raise ValueError(f"step: {step} is negative")
        if batch_size < 1:
            raise ValueError(f"batch_size: {batch_size} is below 1")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank: {rank} is not in [0, world_size={world_size})")
        first = (step * world_size + rank) * batch_size
        samples = range(first, first + batch_size)
        ids = np.stack(
            [self.sequence(int(self._permutation(g // self.sequences)[g % self.sequences])) for g in samples]
        )
        pad_id = self.tokenizer.pad_id
        fixed = {}
        attention_mask = np.ones_like(ids) if pad_id is None else (ids != pad_id).astype(np.int64)
        if self.mlm_probability is None:
            inputs, labels = ids, np.where(attention_mask == 1, ids, IGNORE_INDEX)
        else:
            rngs = [np.random.default_rng([self.seed, _SPLIT_SALT[self.split], _MASK_STREAM, g]) for g in samples]
            args = (self.tokenizer.mask_id, self._special, self._normal)
            if self.max_predictions_per_seq is None:
                rows = [mask_tokens(row, rng, self.mlm_probability, *args) for rng, row in zip(rngs, ids, strict=True)]
            else:
                predictions = self.max_predictions_per_seq
                rows = [
                    mask_tokens_fixed(row, rng, self.mlm_probability, predictions, *args)
                    for rng, row in zip(rngs, ids, strict=True)
                ]
            inputs, labels = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
            if self.max_predictions_per_seq is not None:
                fixed = {
                    "masked_positions": torch.from_numpy(np.stack([r[2] for r in rows])),
                    "masked_labels": torch.from_numpy(np.stack([r[3] for r in rows])),
                }
        return {
            "input_ids": torch.from_numpy(inputs),
            "labels": torch.from_numpy(labels),
            "attention_mask": torch.from_numpy(attention_mask),
            **fixed,
        }
