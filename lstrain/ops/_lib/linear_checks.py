"""The checks of a projection's weight and bias, shared by the ops that end in one."""

from __future__ import annotations

import torch

__all__ = ["check_projection"]


def check_projection(op: str, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Refuse a weight / bias that cannot project ``x``'s last dim (torch's Linear layout).

    Args:
        op: the op's name, for the messages.
        name: what ``x`` is called in the op's signature, for the messages.
        x: the projection's input, ``[*, in]``.
        weight: should be ``[out, in]``, x's dtype and device.
        bias: should be ``[out]`` (or None), x's dtype and device.

    Raises:
        ValueError: naming the weight or bias and what does not fit.
    """
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{op}: weight must be [out, {x.shape[-1]}], got shape {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{op}: bias has shape {tuple(bias.shape)}, expected ({weight.shape[0]},)")
    for label, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise ValueError(
                f"{op}: {label} is {t.dtype} on {t.device}, {name} {x.dtype} on {x.device}; they must match"
            )
