"""Hugging Face checkpoint files, shared by the models: ``config.json`` and
``model.safetensors`` (or its shards) in a local directory, read and written as
``transformers``' ``save_pretrained`` lays them out. Nothing is ever downloaded."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

__all__ = ["check_state_fits", "config_from_hf", "config_to_hf", "read_checkpoint", "write_checkpoint"]


# Config fields that are lstrain's own: never read from or written to a config.json.
LSTRAIN_FIELDS = frozenset({"fused", "attn_implementation"})


def config_from_hf(cls: type, hf: dict, model_type: str, fixed: dict, overrides: dict):
    """A model's Config dataclass from a Hugging Face ``config.json``.

    Args:
        cls: the Config dataclass (its fields take HF's names; :data:`LSTRAIN_FIELDS` are
            lstrain's own).
        hf: the parsed ``config.json``.
        model_type: the ``model_type`` the file must have (a missing one is assumed to be it).
        fixed: HF settings the model implements only at these values.
        overrides: fields to set regardless (e.g. ``fused=False``).

    Returns:
        ``cls(...)`` from the file's fields it knows, then the overrides.

    Raises:
        ValueError: naming ``cls``: another ``model_type``, or a fixed setting at another value.
    """
    if hf.get("model_type", model_type) != model_type:
        raise ValueError(f"{cls.__name__}: config.json has model_type {hf['model_type']!r}, expected {model_type!r}")
    for name, assumed in fixed.items():
        if hf.get(name, assumed) != assumed:
            raise ValueError(f"{cls.__name__}: config.json sets {name}={hf[name]!r}; only {assumed!r} is supported")
    fields = {f.name for f in dataclasses.fields(cls)} - LSTRAIN_FIELDS
    return cls(**{**{k: v for k, v in hf.items() if k in fields}, **overrides})


def config_to_hf(config, architecture: str, model_type: str, fixed: dict) -> dict:
    """A Config dataclass as the ``config.json`` of ``transformers``' ``architecture``.

    Args:
        config: the model's Config dataclass.
        architecture: HF's class name (``GPT2LMHeadModel``, ``BertForMaskedLM``).
        model_type: HF's ``model_type``.
        fixed: the HF settings the model implements, written as they are.

    Returns:
        A JSON-serialisable dict.
    """
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k not in LSTRAIN_FIELDS}
    return {"architectures": [architecture], "model_type": model_type, **fields, **fixed}


def read_checkpoint(path: str | Path, owner: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``config.json`` and every tensor of ``model.safetensors`` (or of the shards listed in
    ``model.safetensors.index.json``) in a local directory.

    Args:
        path: the directory.
        owner: who reads it, for the message (``"GPT2.from_pretrained"``).

    Returns:
        (the parsed config, the tensors by key, on the CPU).

    Raises:
        FileNotFoundError: ``path`` is not a directory holding those files (a hub name is
            not downloaded).
    """
    from safetensors.torch import load_file

    path = Path(path)
    config_file, index_file = path / "config.json", path / "model.safetensors.index.json"
    files = [path / "model.safetensors"]
    if index_file.is_file():
        files = [path / name for name in sorted(set(json.loads(index_file.read_text())["weight_map"].values()))]
    missing = [str(f) for f in (config_file, *files) if not f.is_file()]
    if missing:
        raise FileNotFoundError(
            f"{owner}: {path} must be a local directory with config.json and model.safetensors "
            f"(a hub name is not downloaded); missing {missing}"
        )
    tensors = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return json.loads(config_file.read_text()), tensors


def check_state_fits(owner: str, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Check that a checkpoint's tensors, under ``model``'s state_dict keys, fit ``model``.

    Args:
        owner: the loader, for the message (``"GPT2.from_pretrained"``).
        model: the model the state is for.
        state: the tensors by ``model``'s state_dict keys.

    Raises:
        ValueError: keys missing or unexpected, or tensors of another shape, all listed.
    """
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in state.items()}
    problems = [f"missing {sorted(expected.keys() - found.keys())}"] if expected.keys() - found.keys() else []
    if found.keys() - expected.keys():
        problems.append(f"unexpected {sorted(found.keys() - expected.keys())}")
    problems += [f"{k} has shape {found[k]}, expected {s}" for k, s in expected.items() if k in found and found[k] != s]
    if problems:
        raise ValueError(f"{owner}: the checkpoint does not fit the config: {'; '.join(problems)}")


def write_checkpoint(path: str | Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``config.json`` and ``model.safetensors`` into a directory (created if needed).

    Args:
        path: the directory.
        config: the ``config.json`` dict.
        tensors: by HF key; written contiguous, from the CPU, in their dtype.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {key: value.detach().contiguous().cpu() for key, value in tensors.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
