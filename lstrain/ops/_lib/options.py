"""Host-side checks of the ops' arguments: scalar options (probabilities, scales, eps,
indices), and that their tensor arguments are tensors.

An option may be a Python number, a numpy scalar or a 0-d CPU tensor, read on the host for
free; a CUDA tensor is refused, since reading it would synchronise with the host (and
break CUDA-graph capture). Each check returns the plain Python value the kernels take.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import numpy as np
import torch

__all__ = ["bool_option", "check_tensors", "float_option", "int_option"]


def _host_value(op: str, name: str, value: object, kind: str, python: str = "float") -> object:
    """``value`` as a Python scalar, or a ValueError naming ``name`` when it is no scalar;
    ``python`` names the conversion a CUDA tensor's message asks for (float, int, bool)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.is_complex():
            raise ValueError(f"{op}: {name} must be {kind}, got a tensor of shape {tuple(value.shape)}")
        if value.device.type != "cpu":
            raise ValueError(
                f"{op}: {name} must be {kind}, got a 0-d tensor on {value.device}; reading it would synchronise "
                f"with the host: pass a Python {python} ({python}({name}) once, outside the step)"
            )
        return value.item()
    return value


def float_option(
    op: str,
    name: str,
    value: object,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """A finite real option within optional bounds, as a Python float.

    Args:
        op: the op's name, for the message.
        name: the argument's name.
        value: a Python int or float, a numpy scalar or a 0-d CPU tensor.
        low, high: bounds (None: unbounded on that side).
        low_open, high_open: whether a bound itself is excluded.

    Returns:
        ``float(value)``.

    Raises:
        ValueError: naming ``name`` and ``value``: not a real number (bools and CUDA
            tensors included), not finite, or outside the bounds.
    """
    if low is None and high is None:
        kind = "a finite number"
    elif high is None:
        kind = f"a finite number {'>' if low_open else '>='} {low}"
    elif low is None:
        kind = f"a finite number {'<' if high_open else '<='} {high}"
    else:
        kind = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    scalar = _host_value(op, name, value, kind)
    if isinstance(scalar, bool) or not isinstance(scalar, numbers.Real):
        raise ValueError(f"{op}: {name} must be {kind}, got {type(value).__name__} {value!r}")
    number = float(scalar)
    # comparisons, not math.isfinite: a symbolic float of torch.compile(dynamic=True) has them
    inside = -math.inf < number < math.inf
    if low is not None:
        inside = inside and (number > low if low_open else number >= low)
    if high is not None:
        inside = inside and (number < high if high_open else number <= high)
    if not inside:
        raise ValueError(f"{op}: {name} must be {kind}, got {value!r}")
    return number


def int_option(op: str, name: str, value: object, low: int | None = None) -> int:
    """An integer option (at least ``low`` when given), as a Python int.

    Args:
        op: the op's name, for the message.
        name: the argument's name.
        value: a Python int, a numpy integer or a 0-d integer CPU tensor.
        low: the smallest value allowed (None: any).

    Returns:
        ``int(value)``.

    Raises:
        ValueError: naming ``name`` and ``value``: not an integer (floats and bools
            included) or below ``low``.
    """
    kind = "an integer" if low is None else f"an integer >= {low}"
    scalar = _host_value(op, name, value, kind, "int")
    if isinstance(scalar, bool) or not isinstance(scalar, numbers.Integral):
        raise ValueError(f"{op}: {name} must be {kind}, got {type(value).__name__} {value!r}")
    if low is not None and scalar < low:
        raise ValueError(f"{op}: {name} must be {kind}, got {value!r}")
    return int(scalar)


def bool_option(op: str, name: str, value: object) -> bool:
    """A flag, as a Python bool; refused, as torch refuses it, when it is anything else.

    Args:
        op: the op's name, for the message.
        name: the argument's name.
        value: a Python bool, a numpy bool or a 0-d bool CPU tensor.

    Returns:
        ``bool(value)``.

    Raises:
        ValueError: naming ``name`` and ``value``: not a bool (ints, strings and None
            included: ``bool()`` of them would read ``"no"`` as True).
    """
    scalar = _host_value(op, name, value, "a bool", "bool")
    if not isinstance(scalar, (bool, np.bool_)):
        raise ValueError(f"{op}: {name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(scalar)


def check_tensors(op: str, tensors: Mapping[str, object], optional: Mapping[str, object] | None = None) -> None:
    """Refuse a tensor argument that is no tensor (a list, a number, an array).

    The ops call it first, before anything reads an attribute of their arguments, so that
    such a value is named here rather than failing deep inside as an AttributeError. Plain
    isinstance checks: free on the host, and evaluated once while ``torch.compile`` traces.

    Args:
        op: the op's name, for the message.
        tensors: the arguments that must be tensors, by name.
        optional: the arguments that may be tensors or None, by name (None: no such).

    Raises:
        ValueError: ``"{op}: {name} must be a tensor, got {type}"`` (``"a tensor or None"``
            for an optional one) for the first argument that is not.
    """
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{op}: {name} must be a tensor, got {type(value).__name__}")
    for name, value in (optional or {}).items():
        if value is not None and not isinstance(value, torch.Tensor):
            raise ValueError(f"{op}: {name} must be a tensor or None, got {type(value).__name__}")
