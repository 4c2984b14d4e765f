"""The one table of Hugging Face model families that ``lstrain.patch`` supports.

A family names the exact transformers classes it covers (matched by module and name, so
that transformers is never imported here), where its LM head is, which loss its own
forward computes, and the family's own RMSNorm, activation and attention classes whose
instances ``patch`` may swap or route through lstrain. A class outside this table is refused: its
forward may route labels, heads or losses in ways the patched forward would get wrong.

Mistral, Qwen2 and Qwen3 are LLaMA's modules under their own names (transformers generates
their modeling files from LLaMA's): the same RMSNorm (fp32 statistics, ``variance_epsilon``),
rotary embedding and attention, whose differences are the ``sliding_window`` argument their
attention forwards pass on to the attention function and, in Qwen3, an RMSNorm over each
head of q and k before the rotation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["FAMILIES", "Family", "family_of", "supported_names"]


@dataclass(frozen=True)
class Family:
    """A family of Hugging Face models and what ``patch`` may swap in it.

    Attributes:
        name: the family's name, as reports show it.
        classes: ``module.QualName`` of each supported class -> the submodule path of its
            LM head ``Linear``, or ``None`` for a model without one (the base model).
        loss: the loss the class's own forward computes from its labels: ``"causal"``
            (transformers' ``ForCausalLMLoss``: labels shifted left, ``num_items_in_batch``
            honoured) or ``"masked"`` (``CrossEntropyLoss()``'s mean, as BertForMaskedLM).
        rms_norms: ``module.QualName`` of the family's RMSNorm classes (weight times the
            input normalised in fp32, eps in ``variance_epsilon``), swapped for
            ``lstrain.nn.RMSNorm``.
        tanh_gelus: ``module.QualName`` of composite tanh-GELU classes the family's configs
            select (transformers' ``NewGELUActivation``, GPT-2's ``gelu_new``: seven
            elementwise kernels forward and their autograd backward), swapped for
            ``torch.nn.GELU(approximate="tanh")``, the same function in one kernel each way.
        mlps: ``module.QualName`` of the family's SwiGLU MLP classes (``down_proj(act_fn(
            gate_proj(x)) * up_proj(x))``), whose SiLU and product run through
            ``lstrain.ops.silu_mul``.
        attentions: ``module.QualName`` of the family's rotary attention classes -> where
            its forward takes the ``sliding_window`` it passes to the attention function:
            ``"none"`` (LLaMA passes none), ``"config"`` (``config.sliding_window``, as
            Mistral) or ``"module"`` (the module's own ``sliding_window``, as Qwen2).
        head_norms: whether those attention modules normalise each head of q and k
            (``q_norm``, ``k_norm``: instances of one of ``rms_norms`` over ``head_dim``)
            before the rotation, as Qwen3's do.
    """

    name: str
    classes: dict[str, str | None]
    loss: str
    rms_norms: tuple[str, ...] = ()
    tanh_gelus: tuple[str, ...] = ()
    mlps: tuple[str, ...] = ()
    attentions: dict[str, str] = field(default_factory=dict)
    head_norms: bool = False


# transformers' "gelu_new" (GPT-2's default activation_function; a BERT config may name it)
_NEW_GELU = "transformers.activations.NewGELUActivation"

FAMILIES = (
    Family(
        name="GPT-2",
        classes={
            "transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel": "lm_head",
            "transformers.models.gpt2.modeling_gpt2.GPT2Model": None,
        },
        loss="causal",
        tanh_gelus=(_NEW_GELU,),
    ),
    Family(
        name="BERT",
        classes={
            "transformers.models.bert.modeling_bert.BertForMaskedLM": "cls.predictions.decoder",
            "transformers.models.bert.modeling_bert.BertModel": None,
        },
        loss="masked",
        tanh_gelus=(_NEW_GELU,),
    ),
    Family(
        name="LLaMA",
        classes={
            "transformers.models.llama.modeling_llama.LlamaForCausalLM": "lm_head",
            "transformers.models.llama.modeling_llama.LlamaModel": None,
        },
        loss="causal",
        rms_norms=("transformers.models.llama.modeling_llama.LlamaRMSNorm",),
        mlps=("transformers.models.llama.modeling_llama.LlamaMLP",),
        attentions={"transformers.models.llama.modeling_llama.LlamaAttention": "none"},
    ),
    Family(
        name="Mistral",
        classes={
            "transformers.models.mistral.modeling_mistral.MistralForCausalLM": "lm_head",
            "transformers.models.mistral.modeling_mistral.MistralModel": None,
        },
        loss="causal",
        rms_norms=("transformers.models.mistral.modeling_mistral.MistralRMSNorm",),
        mlps=("transformers.models.mistral.modeling_mistral.MistralMLP",),
        attentions={"transformers.models.mistral.modeling_mistral.MistralAttention": "config"},
    ),
    Family(
        name="Qwen2",
        classes={
            "transformers.models.qwen2.modeling_qwen2.Qwen2ForCausalLM": "lm_head",
            "transformers.models.qwen2.modeling_qwen2.Qwen2Model": None,
        },
        loss="causal",
        rms_norms=("transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm",),
        mlps=("transformers.models.qwen2.modeling_qwen2.Qwen2MLP",),
        attentions={"transformers.models.qwen2.modeling_qwen2.Qwen2Attention": "module"},
    ),
    Family(
        name="Qwen3",
        classes={
            "transformers.models.qwen3.modeling_qwen3.Qwen3ForCausalLM": "lm_head",
            "transformers.models.qwen3.modeling_qwen3.Qwen3Model": None,
        },
        loss="causal",
        rms_norms=("transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm",),
        mlps=("transformers.models.qwen3.modeling_qwen3.Qwen3MLP",),
        attentions={"transformers.models.qwen3.modeling_qwen3.Qwen3Attention": "module"},
        head_norms=True,
    ),
)


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def supported_names() -> list[str]:
    """The short class names of every supported model, for messages."""
    return [path.rsplit(".", 1)[1] for family in FAMILIES for path in family.classes]


def family_of(model: object) -> tuple[Family, str | None]:
    """The family of ``model`` and its LM head's submodule path.

    Only the exact class counts: a subclass may override the forward being wrapped.

    Args:
        model: a model instance.

    Returns:
        ``(family, head)``; ``head`` is ``None`` for a model without an LM head.

    Raises:
        TypeError: the model's class is not in ``FAMILIES``.
    """
    name = _qualified_name(type(model))
    for family in FAMILIES:
        if name in family.classes:
            return family, family.classes[name]
    raise TypeError(
        f"lstrain.patch does not support {type(model).__name__} ({name}); supported: {', '.join(supported_names())}"
    )
