"""The one table of Hugging Face model families that ``lstrain.patch`` supports.

A family names the exact transformers classes it covers (matched by module and name, so
that transformers is never imported here), where its LM head is and which loss its own
forward computes. A class outside this table is refused: its forward may route labels,
heads or losses in ways the patched forward would get wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """

    name: str
    classes: dict[str, str | None]
    loss: str


FAMILIES = (
    Family(
        name="GPT-2",
        classes={
            "transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel": "lm_head",
            "transformers.models.gpt2.modeling_gpt2.GPT2Model": None,
        },
        loss="causal",
    ),
    Family(
        name="BERT",
        classes={
            "transformers.models.bert.modeling_bert.BertForMaskedLM": "cls.predictions.decoder",
            "transformers.models.bert.modeling_bert.BertModel": None,
        },
        loss="masked",
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
