"""``torch.autocast`` for lstrain's matrix-product ops (gemm, SwiGLU MLP, linear + CE).

Inside an autocast region torch runs a matmul in the region's dtype, whatever its inputs'
dtypes (fp32 parameters included); these ops do the same, by casting their floating-point
inputs first. The casts are differentiable, so gradients reach fp32 parameters in fp32.
The other ops compute in fp32 inside their kernels and run in their inputs' dtype, but for
the losses, which give fp32 under autocast as torch's do (``loss_dtype``).
"""

from __future__ import annotations

import torch

__all__ = ["autocast_inputs", "loss_dtype"]

_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "maia", "ipu")


def _autocast_on(device_type: str) -> bool:
    # Autocast knows cpu, cuda and a few others; a device it does not (meta) makes
    # is_autocast_enabled raise, and the op's own checks then name the misplaced tensor.
    # (torch.amp.is_autocast_available would say so too, but torch.compile cannot trace it.)
    return device_type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type)


def loss_dtype(op: str, logits: torch.Tensor, out_dtype: object = None) -> torch.dtype:
    """A loss's dtype: ``out_dtype`` when given, else what torch gives a loss over
    ``logits``: float32 inside an autocast region (autocast runs torch's losses in
    float32), else the logits' own.

    Args:
        op: the loss op's name, for the message.
        logits: the loss's input (logits, or the hidden states of a fused head).
        out_dtype: the caller's choice, or None.

    Returns:
        ``out_dtype``, or ``torch.float32`` under autocast for ``logits``' device (float64
        stays), else ``logits.dtype``.

    Raises:
        ValueError: an ``out_dtype`` that is neither None nor a floating dtype.
    """
    if out_dtype is not None:
        if not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
            raise ValueError(f"{op}: out_dtype must be None or a floating dtype, got {out_dtype!r}")
        return out_dtype
    if _autocast_on(logits.device.type):
        return torch.promote_types(logits.dtype, torch.float32)
    return logits.dtype


def autocast_inputs(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The tensors, cast to autocast's dtype when autocast is on for their device.

    Args:
        *tensors: an op's inputs on one device; None and non-float tensors pass through.

    Returns:
        The same tensors, floating-point ones other than float64 in
        ``torch.get_autocast_dtype(device)`` when ``torch.is_autocast_enabled(device)``, else
        unchanged (as on a device autocast does not support, such as meta).
    """
    device_type = next(t.device.type for t in tensors if t is not None)
    if not _autocast_on(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    # as torch's autocast: float64 is not cast
    cast = (t is not None and t.is_floating_point() and t.dtype != torch.float64 for t in tensors)
    return tuple(t.to(dtype) if c else t for t, c in zip(tensors, cast, strict=True))
