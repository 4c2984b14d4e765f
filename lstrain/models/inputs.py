"""Checks of a model's forward arguments, shared by the models: the shapes and dtypes of
``input_ids`` and the tensors laid out like it, and the range of ids (host reads, so on the
CPU by default and never under ``torch.compile``). Each error names the model and the
argument; the range error also gives the first bad value and its index."""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = [
    "check_ids_in_range",
    "check_input_ids",
    "check_integer",
    "check_shaped_like_input_ids",
    "should_check_ids",
]

_INTEGER = (torch.int64, torch.int32)


def check_input_ids(model: str, input_ids: torch.Tensor, limit_name: str, limit: int) -> None:
    """Refuse ``input_ids`` unless ``[batch, seq]`` int64 / int32 with ``1 <= seq <= limit``.

    Args:
        model: the name that opens the message (``"GPT2"``).
        input_ids: the token ids.
        limit_name: the config field that bounds ``seq`` (``"n_positions"``).
        limit: its value.

    Raises:
        ValueError: naming ``model`` and ``input_ids``: the shape or dtype, or the length.
    """
    if input_ids.dim() != 2 or input_ids.dtype not in _INTEGER:
        raise ValueError(
            f"{model}: input_ids must be [batch, seq] int64 or int32, got shape {tuple(input_ids.shape)} "
            f"{input_ids.dtype}"
        )
    seq = input_ids.shape[1]
    if not 0 < seq <= limit:
        raise ValueError(f"{model}: input_ids has {seq} positions; {limit_name} allows 1 to {limit}")


def check_shaped_like_input_ids(
    model: str, input_ids: torch.Tensor, named: Iterable[tuple[str, torch.Tensor | None]]
) -> None:
    """Refuse the first of ``named``'s (name, tensor) pairs, None skipped, not shaped like ``input_ids``.

    Raises:
        ValueError: naming ``model`` and the tensor, with both shapes.
    """
    for name, t in named:
        if t is not None and tuple(t.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"{model}: {name} must be shaped like input_ids {tuple(input_ids.shape)}, got {tuple(t.shape)}"
            )


def check_integer(model: str, named: Iterable[tuple[str, torch.Tensor | None]]) -> None:
    """Refuse the first of ``named``'s (name, tensor) pairs, None skipped, not int64 / int32.

    Raises:
        ValueError: naming ``model``, the tensor and its dtype.
    """
    for name, t in named:
        if t is not None and t.dtype not in _INTEGER:
            raise ValueError(f"{model}: {name} must be int64 or int32, got {t.dtype}")


def should_check_ids(check_ids: bool | None, input_ids: torch.Tensor) -> bool:
    """Whether to read ids on the host: ``check_ids``, None meaning ``input_ids`` is on the CPU;
    never while ``torch.compile`` traces (a host read would break the graph)."""
    if check_ids is None:
        check_ids = input_ids.device.type == "cpu"
    return bool(check_ids) and not torch.compiler.is_compiling()


def check_ids_in_range(
    model: str,
    name: str,
    ids: torch.Tensor | None,
    rows: int,
    *,
    ignore: int | None = None,
    table: str | None = None,
    note: str = "",
) -> None:
    """Refuse ``ids`` (None skipped) with a value outside ``[0, rows)`` other than ``ignore``.

    Args:
        model: the name that opens the message.
        name: the argument's name.
        ids: the integer tensor.
        rows: the exclusive upper bound.
        ignore: a value allowed anyway (labels' ignore index).
        table: what ``[0, rows)`` is, named in the message (``"vocabulary"``: "outside the
            vocabulary [0, rows)"); None for a bare "outside [0, rows)".
        note: appended to the message (``" (max_position_embeddings)"``).

    Raises:
        ValueError: ``"{model}: {name} {value} at {index} is outside ..."``, the first bad
            value in row-major order and its index.
    """
    if ids is None:
        return
    bad = (ids < 0) | (ids >= rows)
    if ignore is not None:
        bad &= ids != ignore
    if bad.any():
        index = tuple(int(i) for i in bad.nonzero()[0])
        where = f"the {table} [0, {rows})" if table is not None else f"[0, {rows})"
        raise ValueError(f"{model}: {name} {int(ids[index])} at {index} is outside {where}{note}")
