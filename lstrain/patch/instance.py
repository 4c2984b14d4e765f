"""Patch one Hugging Face model instance in place, and undo it.

Only the instance changes: its ``torch.nn.LayerNorm`` submodules are replaced by
``lstrain.nn.LayerNorm`` modules holding the *same* Parameter objects (so state_dict keys,
tensors, tied weights and optimizer state are untouched), and, for a model with an LM head,
an instance attribute ``forward`` shadows the class's forward to compute the loss through
``lstrain.ops.linear_cross_entropy``. The class, and every other instance of it, is left as
it was; ``unpatch`` puts the original modules back and removes the instance ``forward``.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

import torch

from lstrain.nn.layer_norm import LayerNorm
from lstrain.patch.families import family_of
from lstrain.patch.loss import LOSSES

__all__ = ["LeftAlone", "PatchReport", "Swapped", "patch", "unpatch"]

# Where a patched model keeps what unpatch needs (a plain attribute: not in its state_dict).
_STATE = "_lstrain_patch"
_LOSS_ROUTE = "torch.nn.Linear + cross-entropy on logits"


@dataclass(frozen=True)
class Swapped:
    """One thing ``patch`` replaced: a module, or the LM-head loss."""

    path: str
    old_type: str
    new_type: str


@dataclass(frozen=True)
class LeftAlone:
    """One candidate ``patch`` did not touch, and why."""

    path: str
    reason: str


@dataclass
class PatchReport:
    """What ``patch`` did to a model."""

    family: str
    swapped: list[Swapped] = field(default_factory=list)
    left_alone: list[LeftAlone] = field(default_factory=list)


@dataclass
class _PatchState:
    options: dict[str, bool]
    report: PatchReport
    # (parent module, child name, original module) of every swapped module.
    modules: list[tuple[torch.nn.Module, str, torch.nn.Module]]
    patched_forward: bool


def _type_name(module: object) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _has_hooks(module: torch.nn.Module) -> bool:
    return any(
        getattr(module, name)
        for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    )


def _shared_layer_norm(old: torch.nn.LayerNorm) -> LayerNorm:
    """An ``lstrain.nn.LayerNorm`` holding ``old``'s own Parameter objects."""
    # Built on the meta device so that nothing is allocated for the weights it drops at once.
    new = LayerNorm(
        old.normalized_shape, eps=old.eps, elementwise_affine=old.elementwise_affine,
        bias=old.bias is not None, device="meta",
    )  # fmt: skip
    new.weight, new.bias = old.weight, old.bias
    new.train(old.training)
    return new


def _swap_layer_norms(model: torch.nn.Module, enabled: bool, state: _PatchState) -> None:
    report = state.report
    candidates = [(path, module) for path, module in model.named_modules() if isinstance(module, torch.nn.LayerNorm)]
    for path, old in candidates:
        if not enabled:
            report.left_alone.append(LeftAlone(path, "layer_norm=False"))
        elif type(old) is not torch.nn.LayerNorm:
            reason = f"{_type_name(old)} subclasses torch.nn.LayerNorm; its forward may differ"
            report.left_alone.append(LeftAlone(path, reason))
        elif _has_hooks(old):
            report.left_alone.append(LeftAlone(path, "has forward or backward hooks, which a new module would lose"))
        else:
            parent_path, _, name = path.rpartition(".")
            parent = model.get_submodule(parent_path)
            new = _shared_layer_norm(old)
            setattr(parent, name, new)
            state.modules.append((parent, name, old))
            report.swapped.append(Swapped(path, _type_name(old), _type_name(new)))


def _return_input(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def _fused_loss_forward(model: torch.nn.Module, head_path: str, loss_name: str):
    """A forward for ``model`` that computes its labels' loss without building logits.

    It runs the model's own forward with the LM head made the identity for that one call,
    so that the arguments, the base model's call and the output class stay transformers'
    own; what comes out as "logits" is the head's input, and the loss is computed from it.
    """
    original = model.forward
    signature = inspect.signature(original)
    var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    head = model.get_submodule(head_path)
    loss_function = LOSSES[loss_name]

    @functools.wraps(original)
    def forward(*args, return_logits: bool = False, **kwargs):
        arguments = signature.bind(*args, **kwargs).arguments
        labels = arguments.get("labels")
        logits_to_keep = arguments.get("logits_to_keep", 0)
        # The logits are built where asked for, and where the loss would be over a slice of them.
        if labels is None or return_logits or not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            return original(*args, **kwargs)
        extra = dict(arguments.pop(var_keyword, {})) if var_keyword else {}
        arguments["labels"] = None
        return_dict = extra.pop("return_dict", None)
        if return_dict is None:  # as transformers' can_return_tuple decides it
            return_dict = getattr(model.config, "return_dict", True)
        own_forward = head.__dict__.get("forward")
        head.forward = _return_input
        try:
            output = original(**arguments, **extra, return_dict=True)
        finally:
            if own_forward is None:
                del head.forward
            else:
                head.forward = own_forward
        fields = {name: value for name, value in output.items() if name != "logits"}
        fields["loss"] = loss_function(output["logits"], head.weight, head.bias, labels, **extra)
        result = type(output)(**fields)
        return result if return_dict else result.to_tuple()

    return forward


def patch(model: torch.nn.Module, *, layer_norm: bool = True, cross_entropy: bool = True) -> PatchReport:
    """Put lstrain's fused modules and loss into a Hugging Face model instance, in place.

    Supported: GPT2LMHeadModel, GPT2Model, BertForMaskedLM, BertModel (``lstrain.patch.
    families``). The class is never changed. With ``cross_entropy``, a forward given
    ``labels`` returns the loss computed by ``lstrain.ops.linear_cross_entropy`` with the
    model's own semantics (GPT-2's label shift, ignore index -100, the mean over kept
    tokens, ``num_items_in_batch``) and ``logits=None``; pass ``return_logits=True`` to the
    forward to get transformers' own logits and loss instead. Patching a patched model with
    the same options is a no-op that returns the first report.

    Args:
        model: the model instance.
        layer_norm: replace every ``torch.nn.LayerNorm`` by ``lstrain.nn.LayerNorm``, sharing
            its Parameters.
        cross_entropy: compute the LM-head loss without logits.

    Returns:
        The report: what was swapped (path, old type, new type), what was left alone and why.

    Raises:
        TypeError: the model's class is not supported (the message lists what is).
        ValueError: the model is already patched with other options.
    """
    options = {"layer_norm": layer_norm, "cross_entropy": cross_entropy}
    state = model.__dict__.get(_STATE)
    if state is not None:
        if state.options != options:
            raise ValueError(
                f"model is already patched with {state.options}; unpatch it before patching with {options}"
            )
        return state.report
    family, head_path = family_of(model)
    state = _PatchState(options, PatchReport(family.name), [], patched_forward=False)
    _swap_layer_norms(model, layer_norm, state)
    if head_path is None:
        state.report.left_alone.append(LeftAlone("", f"{type(model).__name__} has no LM head, so no loss to fuse"))
    elif not cross_entropy:
        state.report.left_alone.append(LeftAlone(head_path, "cross_entropy=False"))
    else:
        # An instance attribute shadows the class's forward for this model only.
        model.forward = _fused_loss_forward(model, head_path, family.loss)
        state.patched_forward = True
        state.report.swapped.append(Swapped(head_path, _LOSS_ROUTE, "lstrain.ops.linear_cross_entropy"))
    model.__dict__[_STATE] = state
    return state.report


def unpatch(model: torch.nn.Module) -> bool:
    """Undo ``patch``: the original modules and the class's forward come back.

    The original modules hold the same Parameters the patched ones did, so whatever training
    did to the weights is kept.

    Args:
        model: a model ``patch`` was given.

    Returns:
        True if the model was patched, False if there was nothing to undo.
    """
    state = model.__dict__.pop(_STATE, None)
    if state is None:
        return False
    for parent, name, old in reversed(state.modules):
        setattr(parent, name, old)
    if state.patched_forward:
        del model.forward
    return True
