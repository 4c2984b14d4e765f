"""Checkpoints: the model as Hugging Face files, the rest of the trainer's state beside it.

A checkpoint is a directory ``<folder>/step-00000100/`` holding ``config.json`` and
``model.safetensors`` (the model's ``save_pretrained``: ``GPT2.from_pretrained`` and HF's
``GPT2LMHeadModel.from_pretrained`` load a GPT-2's, ``BertForMaskedLM.from_pretrained`` and
HF's ``BertForMaskedLM.from_pretrained`` a BERT's, ``Llama.from_pretrained`` and HF's
``LlamaForCausalLM.from_pretrained`` a LLaMA's) and ``trainer.pt``: the optimizer's, the
loss scaler's and the schedule's state, the data position (the step, and the sequences per
step and seq_len it counts in), the RNG states and the recipe. It is written into a
temporary directory next to it, every file and the directory fsynced, then renamed into
place: a crash or an error mid-write leaves the earlier checkpoints as they
were and no ``step-*`` directory half written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "data_mismatch",
    "data_splits",
    "find_checkpoint",
    "list_checkpoints",
    "load_trainer_state",
    "model_mismatch",
    "remove_partial_writes",
    "run_mismatch",
    "save_checkpoint",
]

TRAINER_FILE = "trainer.pt"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TEMP_PREFIX = ".tmp-"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(folder: str | Path) -> list[Path]:
    """The complete checkpoints in ``folder``, oldest first.

    Args:
        folder: the checkpoint folder (it need not exist).

    Returns:
        The ``step-*`` directories that hold a trainer state, by step.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for child in folder.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / TRAINER_FILE).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint that ``--resume PATH`` names: a checkpoint directory itself, or the
    latest one in a checkpoint folder.

    Args:
        path: a ``step-*`` directory or a folder of them.

    Returns:
        The checkpoint directory.

    Raises:
        FileNotFoundError: there is no checkpoint there.
    """
    path = Path(path)
    if (path / TRAINER_FILE).is_file():
        return path
    found = list_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"--resume: no checkpoint in {path} (expected step-*/{TRAINER_FILE})")
    return found[-1]


def save_checkpoint(folder: str | Path, step: int, model: torch.nn.Module, state: dict[str, Any], keep: int) -> Path:
    """Write a checkpoint atomically, then delete all but the latest ``keep``.

    Args:
        folder: the checkpoint folder, created if needed.
        step: the number of optimizer steps taken (the directory's name).
        model: has ``save_pretrained(directory)``.
        state: the trainer's state (``torch.save``-able; loaded with ``weights_only=True``).
        keep: how many checkpoints to keep.

    Returns:
        The checkpoint directory.

    Raises:
        OSError, RuntimeError: the write failed; the temporary directory is removed and
            the earlier checkpoints are untouched.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step-{step:08d}"
    temp = folder / f"{_TEMP_PREFIX}{final.name}-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    try:
        temp.mkdir()
        model.save_pretrained(temp)
        torch.save(state, temp / TRAINER_FILE)
        for child in temp.iterdir():
            _fsync_path(child)
        _fsync_path(temp)
        if final.exists():  # the same step saved again (a resumed run): swap, never half replace
            old = folder / f"{_TEMP_PREFIX}old-{final.name}-{os.getpid()}"
            os.rename(final, old)
            os.rename(temp, final)
            shutil.rmtree(old)
        else:
            os.rename(temp, final)
        _fsync_path(folder)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    for stale in list_checkpoints(folder)[:-keep]:
        shutil.rmtree(stale)
    return final


def remove_partial_writes(folder: str | Path) -> None:
    """Delete temporary directories that a killed run left in ``folder``; a checkpoint a run
    was killed while replacing (moved aside, its successor not yet in place) is put back.
    Call it before looking for checkpoints, and not while another run saves into ``folder``.

    Args:
        folder: the checkpoint folder.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return
    moved_aside = f"{_TEMP_PREFIX}old-"
    restored = False
    for child in sorted(folder.iterdir()):
        if child.name.startswith(moved_aside) and child.is_dir():
            name, _, pid = child.name[len(moved_aside) :].rpartition("-")
            final = folder / name
            if _STEP_DIR.match(name) and pid.isdigit() and not final.exists():
                os.rename(child, final)
                restored = True
    if restored:
        _fsync_path(folder)
    for child in folder.iterdir():
        if child.name.startswith(_TEMP_PREFIX) and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint directory (tensors on the CPU).

    Args:
        checkpoint: a ``step-*`` directory.

    Returns:
        What :func:`save_checkpoint` was given as ``state``.
    """
    return torch.load(checkpoint / TRAINER_FILE, map_location="cpu", weights_only=True)


def model_mismatch(checkpoint: Path, hf_config: dict) -> list[str]:
    """How a checkpoint's model differs from the model a run builds.

    Args:
        checkpoint: a checkpoint directory.
        hf_config: the run's model config as HF's config.json (``GPT2Config.to_hf_dict()``).

    Returns:
        ``"field: checkpoint X, recipe Y"`` for each differing field (empty: it fits).
    """
    saved = json.loads((checkpoint / "config.json").read_text())
    keys = sorted(set(saved) | set(hf_config))
    return [
        f"{key}: checkpoint {saved.get(key)!r}, recipe {hf_config.get(key)!r}"
        for key in keys
        if saved.get(key) != hf_config.get(key)
    ]


def data_mismatch(state: dict[str, Any], position: dict[str, int]) -> str | None:
    """How a checkpoint's data position differs from the run's, or None when it carries over.

    Args:
        state: the checkpoint's trainer state (:func:`load_trainer_state`).
        position: the run's ``{"sequences_per_step": ..., "seq_len": ...}``.

    Returns:
        ``"sequences_per_step 32 and seq_len 128 (this run: 16 and 128; ...)"`` when
        either differs, else None. A checkpoint written before the trainer state held ``data``
        is read from its recipe and world size.
    """
    saved = state.get("data")
    if saved is None:  # older trainer states: the recipe they ran
        from lstrain.train.config import TrainingConfig

        training = TrainingConfig(**state["run"]["training"])
        world = state.get("world_size", 1)
        sequences = training.local_batch_size * world * training.accumulation(world)
        saved = {"sequences_per_step": sequences, "seq_len": training.seq_len}
    keys = ("sequences_per_step", "seq_len")
    if all(saved[key] == position[key] for key in keys):
        return None
    return (
        f"sequences_per_step {saved['sequences_per_step']} and seq_len {saved['seq_len']} (this run: "
        f"{position['sequences_per_step']} and {position['seq_len']}; sequences_per_step = local_batch_size x "
        "ranks x gradient_accumulation_steps)"
    )


def run_mismatch(
    state: dict[str, Any], seed: int, tokenizer_fingerprint: str, splits: dict[str, Any] | None = None
) -> str | None:
    """What a checkpoint was trained with that a resumed run would change without a word:
    the seed (the data order and the dropout masks), the tokenizer (what the ids mean) or
    the data's splits (another source, size or val_fraction reorders the training data and
    may train on what was validation; other masking settings change the MLM targets).

    Args:
        state: the checkpoint's trainer state (:func:`load_trainer_state`).
        seed: the run's ``training.seed``.
        tokenizer_fingerprint: the run's tokenizer's ``fingerprint()``.
        splits: the run's data splits as :func:`data_splits` describes them.

    Returns:
        What differs, or None. A checkpoint written before the trainer state held the
        tokenizer's fingerprint or the splits is compared by what it holds.
    """
    saved_seed = state["run"]["training"]["seed"]
    if saved_seed != seed:
        return f"training.seed {saved_seed} (this run: {seed}; another seed draws another data order)"
    saved = state.get("tokenizer")
    if saved is not None and saved != tokenizer_fingerprint:
        return "another tokenizer (this run's [data] trains or loads a different one: the ids mean other text)"
    saved = state.get("splits")
    if saved is not None and splits is not None and saved != splits:
        changed = ", ".join(
            f"{key} {saved.get(key)} (this run: {splits.get(key)})" for key in splits if saved.get(key) != splits[key]
        )
        return (
            f"other data: {changed}; another source, max_bytes or val_fraction reorders the training data and may "
            "train on what was validation"
        )
    return None


def data_splits(data: Any) -> dict[str, Any]:
    """What identifies a run's data beyond its tokenizer: the tokens of its train and
    validation splits and its masking settings (None for causal data); not seq_len, which
    the data position compares (:func:`data_mismatch`).

    Args:
        data: the run's data (``tokenizer``, ``train`` and ``val`` token streams).

    Returns:
        A dict of plain values, stored in the trainer state and compared at a resume.
    """
    # getattr: data of the caller's own making may not describe itself (then None, compared as such)
    return {
        "train_tokens": getattr(data.train, "tokens", None),
        "val_tokens": getattr(data.val, "tokens", None),
        "mlm_probability": getattr(data.train, "mlm_probability", None),
        "max_predictions_per_seq": getattr(data.train, "max_predictions_per_seq", None),
    }
