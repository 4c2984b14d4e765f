"""Patch one Hugging Face model instance in place, and undo it.

Only the instance changes: its ``torch.nn.LayerNorm`` submodules and its family's RMSNorm
modules are replaced by ``lstrain.nn.LayerNorm`` / ``lstrain.nn.RMSNorm`` modules holding the
*same* Parameter objects (so state_dict keys, tensors, tied weights and optimizer state are
untouched), and transformers' composite tanh GELU (no parameters) by torch's one-kernel
``GELU(approximate="tanh")``; each SwiGLU MLP gets an instance ``forward`` that runs gate and
up through ``lstrain.ops.shared_input_linear`` and its SiLU, product and down projection
through ``lstrain.ops.silu_mul_linear``; for a model with an LM
head, an instance attribute ``forward`` shadows the class's forward to compute the loss
through ``lstrain.ops.linear_cross_entropy``; and each
rotary attention module gets an instance ``forward`` that rotates q and k through
``lstrain.ops.rope`` (q, k and v through ``shared_input_linear``, the output projection
through ``lstrain.ops.linear``); the decoder layers' swapped RMSNorms and the layers themselves get
instance forwards that make the norms' outputs again in backward rather than keep them. A config
whose attention implementation is "sdpa" names
``lstrain.patch.attention.SKIP_SDPA`` instead (transformers' SDPA with its mask skip kept
under CUDA-graph capture and torch.compile, registered in transformers' attention registries
under that new name), and the base model gets an instance ``forward`` that tells its mask
function when the position ids are its own. The class, every other instance of it and
transformers' module functions are left as they were; ``unpatch`` puts the original modules
back, removes (or restores) the instance ``forward`` attributes and the config's "sdpa".

Numerics of the RMSNorm swap: transformers' LlamaRMSNorm (and Mistral's, Qwen2's, Qwen3's) computes
``x * rsqrt(mean(x^2) + eps)`` in fp32, casts that to the input's dtype, then multiplies by
the weight in the weight's dtype: two roundings in bf16/fp16, and a result of the promoted
dtype (fp32 for fp32 weights and a bf16 input). ``lstrain.ops.rms_norm`` does all of it in
fp32 with one rounding to the input's dtype. In fp32 the two agree to a few ulp; in bf16 the
kernel is the more accurate of the two (inside the tolerance rule); an output dtype differs
only for a weight dtype other than the input's, which a HF model does not have outside
autocast, and under autocast the residual stream an RMSNorm reads is fp32 anyway.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
import sys
import types
from dataclasses import dataclass, field

import torch

import lstrain.ops
from lstrain.layers.recompute import RecomputedNorms, register_norm_output, remake_rms_norm
from lstrain.nn.layer_norm import LayerNorm
from lstrain.nn.rms_norm import RMSNorm
from lstrain.patch.attention import SKIP_SDPA, implied_positions, register_skip_sdpa
from lstrain.patch.families import Family, family_of
from lstrain.patch.loss import LOSSES

__all__ = [
    "SUPPORTED_TRANSFORMERS_MAJOR",
    "LeftAlone",
    "PatchReport",
    "Swapped",
    "check_transformers_version",
    "patch",
    "unpatch",
]

# Where a patched model keeps what unpatch needs (a plain attribute: not in its state_dict).
_STATE = "_lstrain_patch"
_LOSS_ROUTE = "torch.nn.Linear + cross-entropy on logits"
_ROPE_ROUTE = "transformers' apply_rotary_pos_emb"
_NORM_OUTPUT_ROUTE = "output saved for backward by its consumers"
# The transformers major versions this module is written against (tested: 5.17 on an H200 and
# an H100, 5.25 on the CPU).
SUPPORTED_TRANSFORMERS_MAJOR = 5
# The names a KV cache goes by in the attention forwards of transformers 5.x.
_CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value")
# Where a module given an instance forward keeps the forward it wraps.
_WRAPPED = "_lstrain_wrapped_forward"


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
    """What ``patch`` did to a model; ``str()`` of it is a summary, one line per kind of change
    with the layers' indices folded (``model.layers.*.mlp (x24)``)."""

    family: str
    swapped: list[Swapped] = field(default_factory=list)
    left_alone: list[LeftAlone] = field(default_factory=list)

    def __str__(self) -> str:
        swapped = _fold((s.path, f"{_short(s.old_type)} -> {_short(s.new_type)}") for s in self.swapped)
        left_alone = _fold((item.path, item.reason) for item in self.left_alone)
        lines = [f"lstrain.patch ({self.family}): {len(self.swapped)} changes, {len(self.left_alone)} left alone"]
        lines += [f"  swapped     {path}{count}: {what}" for path, count, what in swapped]
        lines += [f"  left alone  {path}{count}: {why}" for path, count, why in left_alone]
        return "\n".join(lines)


def _short(name: str) -> str:
    """A class's name as users write it: ``Qwen3RMSNorm`` for transformers' classes,
    ``torch.nn.LayerNorm`` and ``lstrain.nn.RMSNorm`` for the modules' own."""
    if re.fullmatch(r"transformers(\.\w+)+", name):
        return name.rsplit(".", 1)[1]
    return re.sub(r"^(torch\.nn|lstrain\.nn)\.(?:modules\.)?\w+\.(\w+)$", r"\1.\2", name)


def _fold(entries) -> list[tuple[str, str, str]]:
    """``(path, text)`` pairs grouped by the path with its indices made ``*``, in first-seen
    order: ``(path, " (xN)" or "", text)``, the path folded only where a group has several."""
    groups: dict[tuple[str, str], list[str]] = {}
    for path, text in entries:
        groups.setdefault((re.sub(r"(?<=\.)\d+(?=\.|$)", "*", path), text), []).append(path)
    return [
        (folded or "(the model)", f" (x{len(paths)})", text)
        if len(paths) > 1
        else (paths[0] or "(the model)", "", text)
        for (folded, text), paths in groups.items()
    ]


# Pickle would store each patched forward as "the attribute forward of this module", which
# unpickles as the class's forward: a loaded model would run unpatched while saying it is
# patched. So the patch's state and every wrapped forward refuse to be pickled.
_NOT_PICKLABLE = (
    "a model patched by lstrain.patch cannot be pickled (torch.save(model), a spawned process's argument): its "
    "patched forwards belong to this instance; save model.state_dict() or model.save_pretrained(...) and patch the "
    "loaded model, or lstrain.unpatch(model) first"
)


class _Wrapped:
    """The forward a patched module had, called by the forward that replaced it; like the
    patch's state, it refuses pickling (a patched submodule saved alone) and deep-copies."""

    def __init__(self, forward):
        self.forward = forward

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def __reduce_ex__(self, protocol):
        raise TypeError(_NOT_PICKLABLE)

    def __deepcopy__(self, memo):
        return _Wrapped(copy.deepcopy(self.forward, memo))


@dataclass
class _PatchState:
    options: dict[str, bool]
    report: PatchReport
    # (parent module, child name, original module, the module put in its place) of every swap.
    modules: list[tuple[torch.nn.Module, str, torch.nn.Module, torch.nn.Module]]
    # (module, the instance forward it had before or None, the function it was given) of
    # every module given a forward.
    forwards: list[tuple[torch.nn.Module, object, object]] = field(default_factory=list)
    # the config switched from "sdpa" to SKIP_SDPA, or None
    sdpa_config: object | None = None

    def __reduce_ex__(self, protocol):
        raise TypeError(_NOT_PICKLABLE)

    def __deepcopy__(self, memo):
        # copy.deepcopy of a patched model gives a patched copy (its forwards find the copy's modules)
        copied = object.__new__(type(self))
        memo[id(self)] = copied
        for name, value in vars(self).items():
            setattr(copied, name, copy.deepcopy(value, memo))
        return copied


def _type_name(module: object) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _has_hooks(module: torch.nn.Module) -> bool:
    return any(
        getattr(module, name)
        for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    )


_STATE_DICT_HOOKS = (
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _held_by_instance(module: torch.nn.Module) -> str | None:
    """What ``module`` holds on the instance that another module in its place would not
    have, or None: hooks, its own ``module.compile()``, parametrizations, or weights on the
    meta device, which something (accelerate's offload hooks) brings to the device only when
    the module's own forward runs."""
    if _has_hooks(module) or any(getattr(module, name, None) for name in _STATE_DICT_HOOKS):
        return "has hooks"
    if getattr(module, "_compiled_call_impl", None) is not None:
        return "was compiled with module.compile()"
    if torch.nn.utils.parametrize.is_parametrized(module):
        return "has parametrized weights"
    if any(t.is_meta for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))):
        return "is offloaded (its weights are on the meta device)"
    return None


def _swap_reason(model: torch.nn.Module, path: str, module: torch.nn.Module) -> str | None:
    """Why the module at ``path`` must not be replaced by a new module, or None if it may be."""
    if isinstance(model.get_submodule(path.rpartition(".")[0]), _compiled_module_type()):
        return "is wrapped by torch.compile(module), which would go on running it"
    if (held := _held_by_instance(module)) is not None:
        return f"{held}, which a new module would lose"
    return None


def _compiled_module_type() -> type:
    """The wrapper ``torch.compile(module)`` returns (imported late: it loads torch._dynamo)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return OptimizedModule


def _replace(model: torch.nn.Module, path: str, old: torch.nn.Module, new: torch.nn.Module, state) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    setattr(parent, name, new)
    state.modules.append((parent, name, old, new))
    state.report.swapped.append(Swapped(path, _type_name(old), _type_name(new)))


def _set_forward(module: torch.nn.Module, function, state: _PatchState) -> None:
    """Give ``module`` the instance forward ``function(module, ...)``.

    It is bound to the module (a method object) and finds the forward it wraps in the
    module's own ``__dict__``, never in a closure: ``copy.deepcopy`` of a patched model then
    gives a patched copy whose forwards run the copy's modules, not the original's.
    """
    state.forwards.append((module, module.__dict__.get("forward"), function))
    original = module.forward
    module.__dict__[_WRAPPED] = _Wrapped(original)
    signature = inspect.signature(original)
    functools.update_wrapper(function, original, updated=())
    del function.__wrapped__
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    function.__signature__ = signature.replace(parameters=[self_parameter, *signature.parameters.values()])
    module.forward = types.MethodType(function, module)


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
            reason = f"{_short(_type_name(old))} subclasses torch.nn.LayerNorm; its forward may differ"
            report.left_alone.append(LeftAlone(path, reason))
        elif (reason := _swap_reason(model, path, old)) is not None:
            report.left_alone.append(LeftAlone(path, reason))
        else:
            _replace(model, path, old, _shared_layer_norm(old), state)


def _shared_rms_norm(old: torch.nn.Module) -> RMSNorm:
    """An ``lstrain.nn.RMSNorm`` holding ``old``'s own weight, with ``old``'s eps."""
    new = RMSNorm(tuple(old.weight.shape), eps=float(old.variance_epsilon), device="meta")
    new.weight = old.weight
    new.train(old.training)
    return new


def _swap_rms_norms(model: torch.nn.Module, family: Family, enabled: bool, state: _PatchState) -> None:
    report = state.report
    for path, old in list(model.named_modules()):
        name = _type_name(old)
        if name not in family.rms_norms:
            if type(old).__name__.endswith("RMSNorm") and not isinstance(old, RMSNorm):
                reason = f"{_short(name)} is not one of {family.name}'s RMSNorm classes"
                report.left_alone.append(LeftAlone(path, reason))
            continue
        weight = old._parameters.get("weight")
        if not enabled:
            report.left_alone.append(LeftAlone(path, "rms_norm=False"))
        elif (reason := _swap_reason(model, path, old)) is not None:
            report.left_alone.append(LeftAlone(path, reason))
        elif weight is None or weight.dim() != 1 or not isinstance(getattr(old, "variance_epsilon", None), float):
            report.left_alone.append(LeftAlone(path, "has no 1-d weight and float variance_epsilon to carry over"))
        else:
            _replace(model, path, old, _shared_rms_norm(old), state)


def _swap_tanh_gelus(model: torch.nn.Module, family: Family, enabled: bool, state: _PatchState) -> None:
    report = state.report
    for path, old in list(model.named_modules()):
        if _type_name(old) not in family.tanh_gelus:
            continue
        if not enabled:
            report.left_alone.append(LeftAlone(path, "activation=False"))
        elif (reason := _swap_reason(model, path, old)) is not None:
            report.left_alone.append(LeftAlone(path, reason))
        else:
            _replace(model, path, old, torch.nn.GELU(approximate="tanh"), state)


# The SiLU modules transformers' ACT2FN["silu"] / ["swish"] give (5.x), by module and name.
_SILUS = ("torch.nn.modules.activation.SiLU", "transformers.activations.SiLUActivation")
_MLP_ROUTE = "act_fn(gate_proj(x)) * up_proj(x)"
_MLP_OPS = "lstrain.ops.shared_input_linear + silu_mul_linear (its plain Linears)"


def _plain_linears(*modules: torch.nn.Module) -> bool:
    """Whether each module is a plain ``torch.nn.Linear`` without hooks or a forward of its
    own, whose forward an op may run from its weight and bias. Asked at every call: a
    module swapped, hooked or given an instance forward after ``patch`` (a LoRA adapter, a
    quantized layer, accelerate's offload hooks) then runs its own forward."""
    return all(type(m) is torch.nn.Linear and not _has_hooks(m) and "forward" not in m.__dict__ for m in modules)


def _projections(x: torch.Tensor, *modules: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """Each module applied to ``x``: through ``lstrain.ops.shared_input_linear`` (one input
    gradient, summed in the GEMMs) where they are all plain Linears, else their forwards."""
    if _plain_linears(*modules):
        return lstrain.ops.shared_input_linear(x, [m.weight for m in modules], [m.bias for m in modules])
    return tuple(m(x) for m in modules)


def _silu_mul_mlp_forward():
    """A forward for one SwiGLU MLP module (a new function each: ``_set_forward`` gives it
    the wrapped forward's name and signature): transformers' LlamaMLP forward with gate and
    up through ``shared_input_linear`` and the SiLU and the product in one kernel each way,
    with the down projection (``silu_mul_linear``, which saves gate and up but not the
    product) where it is a plain ``torch.nn.Linear`` without hooks."""

    def forward(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        gate, up = _projections(x, mlp.gate_proj, mlp.up_proj)
        if _plain_linears(mlp.down_proj):
            return lstrain.ops.silu_mul_linear(gate, up, mlp.down_proj.weight, mlp.down_proj.bias)
        return mlp.down_proj(lstrain.ops.silu_mul(gate, up))

    return forward


def _mlp_reason(module: torch.nn.Module) -> str | None:
    """Why a family MLP's forward cannot run through ``silu_mul``, or None if it can."""
    missing = [name for name in ("gate_proj", "up_proj", "down_proj", "act_fn") if not hasattr(module, name)]
    if missing:
        return f"has no {', '.join(missing)}"
    if _type_name(module.act_fn) not in _SILUS:
        return f"its act_fn is {_short(_type_name(module.act_fn))}, not SiLU"
    if list(inspect.signature(module.forward).parameters) != ["x"]:
        return "its forward takes other arguments than x"
    if any(_has_hooks(m) for m in (module, module.act_fn)):
        return "has forward or backward hooks on it or its act_fn, which the fused forward would skip"
    return None


def _route_mlps(model: torch.nn.Module, family: Family, enabled: bool, state: _PatchState) -> None:
    report = state.report
    for path, module in model.named_modules():
        if _type_name(module) not in family.mlps:
            continue
        if not enabled:
            report.left_alone.append(LeftAlone(path, "activation=False"))
        elif (reason := _mlp_reason(module)) is not None:
            report.left_alone.append(LeftAlone(path, reason))
        else:
            _set_forward(module, _silu_mul_mlp_forward(), state)
            report.swapped.append(Swapped(path, _MLP_ROUTE, _MLP_OPS))


def _rope_attention_forward(attention: torch.nn.Module, rope, sliding_window: str, head_norms: bool):
    """A forward for one rotary attention module that rotates q and k through ``rope``.

    It is the forward of transformers 5.x's LlamaAttention (Mistral's, Qwen2's; with
    ``head_norms``, Qwen3's, whose ``q_norm`` and ``k_norm`` normalise each head first) with the
    rotation through lstrain's op, q / k / v through ``shared_input_linear`` and the output
    projection through ``lstrain.ops.linear`` where they are plain Linears (their weight
    gradients into a flat buffer, the input gradient summed in the GEMMs); the KV cache
    update and the attention function the config names are the module's own. The cache is
    updated as a ``DynamicCache`` (what a forward builds by default, even in training, where
    ``config.use_cache`` is True) is in every 5.x release: ``update(k, v, layer_idx)``; a call
    with another cache (static, quantized: generation) runs the module's own forward.
    """
    # The forward's own named arguments (the cache, in some 5.x releases cache_position) are
    # not passed on to the attention function; the rest of its kwargs are.
    parameters = inspect.signature(attention.forward).parameters.values()
    own_arguments = [p.name for p in parameters if p.kind != p.VAR_KEYWORD][3:]
    models_module = sys.modules[type(attention).__module__]
    eager = models_module.eager_attention_forward
    functions = models_module.ALL_ATTENTION_FUNCTIONS
    dynamic_cache = models_module.DynamicCache

    def forward(attention, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        cache = next((kwargs[name] for name in _CACHE_ARGUMENTS if kwargs.get(name) is not None), None)
        if position_embeddings is None or (cache is not None and type(cache) is not dynamic_cache):
            return attention.__dict__[_WRAPPED](hidden_states, position_embeddings, attention_mask, **kwargs)
        for name in (*_CACHE_ARGUMENTS, *own_arguments):
            kwargs.pop(name, None)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, attention.head_dim)
        query, key, value = (
            p.view(hidden_shape)
            for p in _projections(hidden_states, attention.q_proj, attention.k_proj, attention.v_proj)
        )
        if head_norms:
            query, key = attention.q_norm(query), attention.k_norm(key)
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        cos, sin = position_embeddings
        query, key = rope(query, cos, sin), rope(key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, attention.layer_idx)
        implementation = attention.config._attn_implementation
        if hasattr(functions, "get_interface"):
            interface = functions.get_interface(implementation, eager)
        else:
            interface = eager if implementation in (None, "eager") else functions[implementation]
        if sliding_window == "config":
            kwargs["sliding_window"] = getattr(attention.config, "sliding_window", None)
        elif sliding_window == "module":
            kwargs["sliding_window"] = attention.sliding_window
        output, weights = interface(
            attention, query, key, value, attention_mask,
            dropout=0.0 if not attention.training else attention.attention_dropout,
            scaling=attention.scaling, **kwargs,
        )  # fmt: skip
        output = output.reshape(*input_shape, -1).contiguous()
        if _plain_linears(attention.o_proj):
            output = lstrain.ops.linear(output, attention.o_proj.weight, attention.o_proj.bias)
        else:
            output = attention.o_proj(output)
        return output, weights

    return forward


def _rope_reason(module: torch.nn.Module, sliding_window: str, head_norms: bool) -> str | None:
    """Why ``module``'s forward cannot be routed through lstrain's rope, or None if it can."""
    parameters = list(inspect.signature(module.forward).parameters.values())
    names = [p.name for p in parameters[:3]]
    if names != ["hidden_states", "position_embeddings", "attention_mask"] or parameters[-1].kind != (
        inspect.Parameter.VAR_KEYWORD
    ):
        return f"its forward takes ({', '.join(p.name for p in parameters)}), not this transformers 5.x one"
    needed = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx", "attention_dropout")
    needed += ("sliding_window",) if sliding_window == "module" else ()
    needed += ("q_norm", "k_norm") if head_norms else ()
    missing = [name for name in needed if not hasattr(module, name)]
    if missing:
        return f"has no {', '.join(missing)}"
    models_module = sys.modules[type(module).__module__]
    needed = ("eager_attention_forward", "ALL_ATTENTION_FUNCTIONS", "DynamicCache")
    missing = [name for name in needed if not hasattr(models_module, name)]
    if missing:
        return f"{models_module.__name__} has no {', '.join(missing)}"
    return None


def _route_rope(model: torch.nn.Module, family: Family, enabled: bool, state: _PatchState) -> None:
    report = state.report
    rope = lstrain.ops.rope
    for path, module in model.named_modules():
        sliding_window = family.attentions.get(_type_name(module))
        if sliding_window is None:
            continue
        if not enabled:
            report.left_alone.append(LeftAlone(path, "rope=False"))
        elif (reason := _rope_reason(module, sliding_window, family.head_norms)) is not None:
            report.left_alone.append(LeftAlone(path, reason))
        else:
            _set_forward(module, _rope_attention_forward(module, rope, sliding_window, family.head_norms), state)
            report.swapped.append(Swapped(path, _ROPE_ROUTE, "lstrain.ops.rope"))


def _route_attention_masks(model: torch.nn.Module, enabled: bool, state: _PatchState) -> None:
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return  # eager, flash or flex attention: no mask skip to keep
    if not enabled:
        state.report.left_alone.append(LeftAlone("config", "sdpa_mask_skip=False"))
    else:
        register_skip_sdpa()
        config._attn_implementation = SKIP_SDPA
        state.sdpa_config = config
        state.report.swapped.append(Swapped("config", "attention 'sdpa'", f"attention {SKIP_SDPA!r}"))
        base = getattr(model, "base_model", model)
        _set_forward(base, _implied_positions_forward(inspect.signature(base.forward)), state)


def _registering_norm_forward():
    """A forward for one swapped RMSNorm (a new function each, as ``_set_forward`` needs): its
    own, with the output offered to the caller's :class:`RecomputedNorms`, made again from
    the same input and weight (which the norm's backward keeps anyway) if it is saved there."""

    def forward(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        make = remake_rms_norm(norm, x)  # before the forward: an offload hook takes the weight after
        return register_norm_output(norm.__dict__[_WRAPPED](x), make)

    return forward


def _recomputing_forward():
    """A forward for a module that holds swapped RMSNorms (a decoder layer): its own, inside
    a :class:`RecomputedNorms`, so that what its layers save of the norms' outputs is made
    again in backward instead of kept."""

    def forward(module: torch.nn.Module, *args, **kwargs):
        with RecomputedNorms():
            return module.__dict__[_WRAPPED](*args, **kwargs)

    return forward


def _recompute_norm_outputs(model: torch.nn.Module, family: Family, enabled: bool, state: _PatchState) -> None:
    report = state.report
    swapped = {id(new) for _, _, _, new in state.modules}
    # the final norm's output leaves the base model for the LM head: only the layers' norms
    outer = {id(model), id(getattr(model, "base_model", model))}
    ours = set()
    for path, norm in list(model.named_modules()):
        if not isinstance(norm, RMSNorm) or id(norm) not in swapped:
            continue
        parent_path = path.rpartition(".")[0]
        parent = model.get_submodule(parent_path)
        # q / k head norms (Qwen3): the rotation after them saves none of their outputs
        if id(parent) in outer or _type_name(parent) in family.attentions:
            continue
        if not enabled:
            report.left_alone.append(LeftAlone(path, "recompute_norms=False"))
            continue
        if id(parent) not in ours and _WRAPPED in parent.__dict__:
            where = parent_path or type(model).__name__
            report.left_alone.append(LeftAlone(path, f"its output stays saved: {where} already has a patched forward"))
            continue
        _set_forward(norm, _registering_norm_forward(), state)
        if id(parent) not in ours:
            _set_forward(parent, _recomputing_forward(), state)
            ours.add(id(parent))
        report.swapped.append(Swapped(path, _NORM_OUTPUT_ROUTE, "made again in backward"))


def _implied_positions_forward(signature: inspect.Signature):
    """A forward for a base model that tells the mask function when it makes its own
    position ids and has no padding mask or cache (:func:`implied_positions`)."""
    unset = ("attention_mask", "position_ids", "past_key_values", "cache")  # 5.25 names the cache "cache"

    def forward(base, *args, **kwargs):
        own = base.__dict__[_WRAPPED]
        if torch.compiler.is_compiling():  # the skip under compile is transformers' own
            return own(*args, **kwargs)
        arguments = signature.bind_partial(*args, **kwargs).arguments
        with implied_positions(all(arguments.get(name) is None for name in unset)):
            return own(*args, **kwargs)

    return forward


def _return_input(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


# Run eagerly under torch.compile: dynamo cannot trace setting and deleting a module's
# forward; around these two graph breaks the model's forward compiles as one graph.
@torch.compiler.disable
def _bypass_head(head: torch.nn.Module):
    """Make ``head`` the identity; return the instance forward it had (or None)."""
    own_forward = head.__dict__.get("forward")
    head.forward = _return_input
    return own_forward


@torch.compiler.disable
def _restore_head(head: torch.nn.Module, own_forward) -> None:
    if own_forward is None:
        del head.forward
    else:
        head.forward = own_forward


def _fused_loss_forward(model: torch.nn.Module, head_path: str, loss_name: str):
    """A forward for ``model`` that computes its labels' loss without building logits.

    It runs the model's own forward with the LM head made the identity for that one call,
    so that the arguments, the base model's call and the output class stay transformers'
    own; what comes out as "logits" is the head's input, and the loss is computed from it.
    """
    signature = inspect.signature(model.forward)
    var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    loss_function = LOSSES[loss_name]

    def forward(model, *args, return_logits: bool = False, **kwargs):
        original = model.__dict__[_WRAPPED]
        arguments = signature.bind(*args, **kwargs).arguments
        labels = arguments.get("labels")
        logits_to_keep = arguments.get("logits_to_keep", 0)
        # The logits are built where asked for, and where the loss would be over a slice of them.
        # and under no_grad (an evaluation: the Trainer hands the logits to compute_metrics)
        if (
            labels is None
            or return_logits
            or not torch.is_grad_enabled()
            or not (isinstance(logits_to_keep, int) and logits_to_keep == 0)
        ):
            return original(*args, **kwargs)
        head = model.get_submodule(head_path)
        if not _plain_linears(head):  # a LoRA adapter, a hook on the logits: the head's own forward
            return original(*args, **kwargs)
        extra = dict(arguments.pop(var_keyword, {})) if var_keyword else {}
        arguments["labels"] = None
        return_dict = extra.pop("return_dict", None)
        if return_dict is None:  # as transformers' can_return_tuple decides it
            return_dict = getattr(model.config, "return_dict", True)
        own_forward = _bypass_head(head)
        try:
            output = original(**arguments, **extra, return_dict=True)
        finally:
            _restore_head(head, own_forward)
        fields = {name: value for name, value in output.items() if name != "logits"}
        fields["loss"] = loss_function(output["logits"], head.weight, head.bias, labels, **extra)
        result = type(output)(**fields)
        return result if return_dict else result.to_tuple()

    return forward


def check_transformers_version(version: str | None = None) -> str:
    """Check that the installed transformers is one ``patch`` is written against.

    Args:
        version: the version to check; None reads ``transformers.__version__``.

    Returns:
        The version checked.

    Raises:
        RuntimeError: the major version is not ``SUPPORTED_TRANSFORMERS_MAJOR`` (5).
    """
    if version is None:
        import transformers

        version = transformers.__version__
    major = version.split(".", 1)[0]
    if not major.isdigit() or int(major) != SUPPORTED_TRANSFORMERS_MAJOR:
        raise RuntimeError(
            f"lstrain.patch supports transformers {SUPPORTED_TRANSFORMERS_MAJOR}.x (tested with 5.17 and 5.25), "
            f"not the installed {version}: its models' forwards, losses and attention differ"
        )
    return version


def patch(
    model: torch.nn.Module,
    *,
    layer_norm: bool = True,
    rms_norm: bool = True,
    rope: bool = True,
    activation: bool = True,
    cross_entropy: bool = True,
    sdpa_mask_skip: bool = True,
    recompute_norms: bool = True,
) -> PatchReport:
    """Put lstrain's fused modules and loss into a Hugging Face model instance, in place.

    Supported (``lstrain.patch.families``): GPT2LMHeadModel, GPT2Model, BertForMaskedLM,
    BertModel, LlamaForCausalLM, LlamaModel, MistralForCausalLM, MistralModel,
    Qwen2ForCausalLM, Qwen2Model, Qwen3ForCausalLM, Qwen3Model, with transformers 5.x. The class is never changed. With
    ``cross_entropy``, a forward given ``labels`` returns the loss computed by
    ``lstrain.ops.linear_cross_entropy`` with the model's own semantics (the causal label
    shift, ignore index -100, the mean over kept tokens, ``num_items_in_batch``) and
    ``logits=None`` where gradients are enabled; under ``torch.no_grad()`` (evaluation), or
    with ``return_logits=True`` passed to the forward, transformers' own logits and loss.
    Patching a patched model with the same options is a no-op that returns the first report.
    A module holding what a new module in its place would lose (hooks, its own
    ``module.compile()`` or ``torch.compile`` wrapper, parametrizations, weights on the meta
    device, which accelerate's offload hooks bring back in its own forward) is not replaced:
    it is left alone, with the reason in the report.

    Args:
        model: the model instance.
        layer_norm: replace every ``torch.nn.LayerNorm`` by ``lstrain.nn.LayerNorm``, sharing
            its Parameters.
        rms_norm: replace the family's RMSNorm modules (LlamaRMSNorm, ...) by
            ``lstrain.nn.RMSNorm``, sharing their weights.
        rope: rotate q and k of the family's attention modules through ``lstrain.ops.rope``
            (a module whose forward is not transformers 5.x's is left alone, with the
            reason in the report), and run their q / k / v projections through
            ``lstrain.ops.shared_input_linear`` and the output projection through
            ``lstrain.ops.linear`` where those are plain ``torch.nn.Linear`` without hooks.
        activation: replace transformers' composite tanh GELU (``NewGELUActivation``,
            GPT-2's ``gelu_new``) by ``torch.nn.GELU(approximate="tanh")``: the same function
            in one kernel each way instead of seven elementwise kernels and their backward;
            and run the family's SwiGLU MLPs (LlamaMLP, ...) with gate and up through
            ``lstrain.ops.shared_input_linear`` and the SiLU and product through
            ``lstrain.ops.silu_mul_linear`` with their down projection (one kernel each way,
            one rounding, the product not saved). A projection that is not a plain
            ``torch.nn.Linear`` or has hooks, when the forward runs, runs its own forward
            (``silu_mul`` then for a down projection).
        cross_entropy: compute the LM-head loss without logits.
        sdpa_mask_skip: for a model on transformers' "sdpa" attention, switch the config to
            ``lstrain.patch.attention.SKIP_SDPA``: the same attention, but a causal or
            bidirectional mask without padding is SDPA's ``is_causal`` / no mask also when
            the step is captured in a CUDA graph or compiled, where transformers otherwise
            builds a (batch, 1, T, T) mask and SDPA leaves its flash kernels.
        recompute_norms: with ``rms_norm``, the swapped RMSNorms' outputs, which the
            projections after them save for their weight gradients, are made again in
            backward from the norms' inputs (kept anyway) instead of kept: two [tokens,
            hidden] tensors a decoder layer fewer (``lstrain.layers.RecomputedNorms``; off
            inside activation checkpointing and under torch.compile). With fp32 weights
            under ``torch.autocast``, the projections' low-precision casts of the outputs
            are what is made again.

    Returns:
        The report: what was swapped (path, old type, new type), what was left alone and why.

    Raises:
        TypeError: the model's class is not supported (the message lists what is).
        RuntimeError: the installed transformers is not a supported major version.
        ValueError: the model is already patched with other options, or a module of it is
            patched as part of another model (its base model, or the model holding it).
    """
    options = {
        "layer_norm": layer_norm,
        "rms_norm": rms_norm,
        "rope": rope,
        "activation": activation,
        "cross_entropy": cross_entropy,
        "sdpa_mask_skip": sdpa_mask_skip,
        "recompute_norms": recompute_norms,
    }
    state = model.__dict__.get(_STATE)
    if state is not None:
        if state.options != options:
            raise ValueError(
                f"model is already patched with {state.options}; unpatch it before patching with {options}"
            )
        return state.report
    for path, module in model.named_modules():
        if _STATE in module.__dict__ or _WRAPPED in module.__dict__:
            raise ValueError(
                f"{path or type(model).__name__} is already patched as part of another model (patch of a model "
                "and of its base model, or the other way round); unpatch that one first"
            )
    family, head_path = family_of(model)
    check_transformers_version()
    state = _PatchState(options, PatchReport(family.name), [])
    _swap_layer_norms(model, layer_norm, state)
    _swap_rms_norms(model, family, rms_norm, state)
    _route_rope(model, family, rope, state)
    _swap_tanh_gelus(model, family, activation, state)
    _route_mlps(model, family, activation, state)
    _route_attention_masks(model, sdpa_mask_skip, state)
    _recompute_norm_outputs(model, family, recompute_norms, state)
    if head_path is None:
        state.report.left_alone.append(LeftAlone("", f"{type(model).__name__} has no LM head, so no loss to fuse"))
    elif not cross_entropy:
        state.report.left_alone.append(LeftAlone(head_path, "cross_entropy=False"))
    else:
        # An instance attribute shadows the class's forward for this model only.
        _set_forward(model, _fused_loss_forward(model, head_path, family.loss), state)
        state.report.swapped.append(Swapped(head_path, _LOSS_ROUTE, "lstrain.ops.linear_cross_entropy"))
    model.__dict__[_STATE] = state
    return state.report


def _changed_since_patch(model: torch.nn.Module, state: _PatchState) -> tuple[str, str] | None:
    """The path of a module that unpatching would strip of something it was given after the
    patch, and what: a swapped-in module replaced, or given hooks, a compile, a
    parametrization, offloaded weights or a forward (the original comes back without them),
    or a module the patch gave a forward given another one (unpatch puts back the original's)."""
    paths = {id(module): path for path, module in model.named_modules()}
    ours = {id(module): function for module, _, function in state.forwards}

    def forward_changed(module: torch.nn.Module) -> bool:
        forward, function = module.__dict__.get("forward"), ours.get(id(module))
        return forward is not None if function is None else getattr(forward, "__func__", None) is not function

    for parent, name, _, new in state.modules:
        if id(parent) not in paths:  # taken out of the model
            continue
        path = ".".join(filter(None, (paths[id(parent)], name)))
        if getattr(parent, name, None) is not new:
            return path, "was replaced"
        if (held := _held_by_instance(new)) is not None:
            return path, held
        if forward_changed(new):
            return path, "has a forward of its own"
    for module, _, _ in state.forwards:
        if id(module) in paths and forward_changed(module):
            return paths[id(module)] or type(model).__name__, "has a forward of its own"
    return None


def unpatch(model: torch.nn.Module) -> bool:
    """Undo ``patch``: the original modules and forwards come back.

    The original modules hold the same Parameters the patched ones did, so whatever training
    did to the weights is kept.

    Args:
        model: a model ``patch`` was given.

    Returns:
        True if the model was patched, False if there was nothing to undo.

    Raises:
        RuntimeError: if a module the patch put in was since replaced, or given hooks, a
            ``module.compile()``, a parametrization, offloaded weights or a forward of its own
            (accelerate's ``cpu_offload``, ``dispatch_model``), or a module the patch gave a
            forward another one: restoring the original would undo that. The model is left
            patched.
    """
    if isinstance(model, _compiled_module_type()):  # torch.compile(model) of a patched model
        model = model._orig_mod
    state = model.__dict__.get(_STATE)
    if state is None:
        return False
    if (changed := _changed_since_patch(model, state)) is not None:
        path, what = changed
        raise RuntimeError(
            f"lstrain.unpatch: {path} {what} since it was patched, which restoring the original would undo "
            "(accelerate's cpu_offload and dispatch_model add hooks and forwards); unpatch before placing, "
            "offloading, hooking or compiling parts of the model, or load it again"
        )
    del model.__dict__[_STATE]
    for parent, name, old, _ in reversed(state.modules):
        # the patched module's parameters, which a load_state_dict(assign=True) may have replaced
        for key, value in getattr(parent, name)._parameters.items():
            if key in old._parameters:
                old._parameters[key] = value
        setattr(parent, name, old)
    for module, previous, _ in reversed(state.forwards):
        del module.__dict__[_WRAPPED]
        if previous is None:
            del module.forward
        else:
            module.forward = previous
    if state.sdpa_config is not None and state.sdpa_config._attn_implementation == SKIP_SDPA:
        state.sdpa_config._attn_implementation = "sdpa"
    return True
