"""transformers' SDPA attention with its mask skip kept under CUDA-graph capture and compile.

transformers 5.x builds no mask tensor for a causal (or bidirectional) attention without
padding: its ``sdpa_mask`` returns None and SDPA runs with ``is_causal``, on the flash / cuDNN
kernels. But it takes that skip only when it is not "tracing", and it counts CUDA-stream
capture (5.17) and torch.compile as tracing, because an exported graph must not hard-code
``is_causal`` for shapes it was not traced with. So a model trained in one CUDA graph, or
compiled, attends through a materialised (batch, 1, T, T) boolean mask, which SDPA's cuDNN
kernels run far slower: on an H200 the attention kernels of one LLaMA-0.75B training step
took 20.4 ms instead of 7.1, GPT-2 medium's 17.9 ms instead of 8.8. Training neither
exports nor replays a graph at another shape (a CUDA graph has fixed shapes; compile guards
on them), so the skip is as right there as it is eagerly.

``SKIP_SDPA`` names an attention implementation that is transformers' own SDPA forward,
with a mask function that returns None whenever no padding mask is given and transformers'
own rule would skip eagerly, and otherwise is transformers' ``sdpa_mask``.

Without a cache (``use_cache=False``) and a padding mask, transformers also looks for packed
sequences in the position ids, and while tracing it cannot read them, so it disallows the
skip. A patched base model that makes its position ids itself (none given: ``arange``, one
sequence per row) runs inside :func:`implied_positions`, under which the mask function
skips a causal mask anyway.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys

import torch

__all__ = ["SKIP_SDPA", "implied_positions", "register_skip_sdpa"]

# The attention implementation name the patch gives a model whose config says "sdpa".
SKIP_SDPA = "lstrain_sdpa"
# True while a patched base model runs on position ids it made itself, without a padding
# mask or a cache.
_IMPLIED_POSITIONS = contextvars.ContextVar("lstrain_implied_positions", default=False)


@contextlib.contextmanager
def implied_positions(implied: bool):
    """Tell the mask function whether the forward inside made its own position ids (no
    packed sequences) and has neither a padding mask nor a cache.

    Args:
        implied: that it has.
    """
    token = _IMPLIED_POSITIONS.set(implied)
    try:
        yield
    finally:
        _IMPLIED_POSITIONS.reset(token)


def _skip_sdpa_mask(sdpa_mask):
    """transformers' ``sdpa_mask`` (as it is called: keyword arguments) with the skip for an
    absent padding mask taken whatever is tracing, except under ``torch.export``."""

    def mask(*, q_length: int, kv_length: int, attention_mask=None, local_size=None, **kwargs):
        within_window = local_size is None or kv_length < local_size
        if attention_mask is None and within_window and not torch.compiler.is_exporting():
            # transformers' own rule without a padding mask: a bidirectional mask is no mask at
            # all; a causal one for q_length == 1 or a square one is SDPA's is_causal, unless
            # transformers disallowed that for packed sequences it could not rule out tracing
            if kwargs.get("allow_is_bidirectional_skip", False):
                return None
            causal_skip = kwargs.get("allow_is_causal_skip", True) or _IMPLIED_POSITIONS.get()
            if causal_skip and (q_length == 1 or q_length == kv_length):
                return None
        return sdpa_mask(
            q_length=q_length, kv_length=kv_length, attention_mask=attention_mask, local_size=local_size, **kwargs
        )

    return mask


def register_skip_sdpa() -> None:
    """Register ``SKIP_SDPA`` with transformers' attention and mask-function registries (a
    new name beside theirs: no model that does not name it changes). Idempotent.

    Raises:
        ImportError: transformers is not installed.
        RuntimeError: this transformers has no "sdpa" attention or mask function to build on.
    """
    import transformers.masking_utils as masking
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attentions, masks = ALL_ATTENTION_FUNCTIONS, masking.ALL_MASK_ATTENTION_FUNCTIONS
    if SKIP_SDPA in attentions and SKIP_SDPA in masks:
        return
    if "sdpa" not in attentions or "sdpa" not in masks:
        version = sys.modules["transformers"].__version__
        raise RuntimeError(f"transformers {version} registers no 'sdpa' attention and mask function")
    type(attentions).register(SKIP_SDPA, attentions["sdpa"])
    type(masks).register(SKIP_SDPA, _skip_sdpa_mask(masks["sdpa"]))
