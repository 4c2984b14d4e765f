"""Hugging Face integration: ``lstrain.patch(model)`` puts lstrain's fused pieces into a model.

``lstrain.patch`` is this package and is callable: ``lstrain.patch(model, ...)`` is
:func:`lstrain.patch.instance.patch`, ``lstrain.unpatch(model)`` undoes it. The supported
families are the one table in ``lstrain.patch.families``: GPT-2 (GPT2LMHeadModel,
GPT2Model), BERT (BertForMaskedLM, BertModel), LLaMA (LlamaForCausalLM, LlamaModel),
Mistral (MistralForCausalLM, MistralModel), Qwen2 (Qwen2ForCausalLM, Qwen2Model) and Qwen3
(Qwen3ForCausalLM, Qwen3Model).

Supported transformers versions: 5.x. Tested with transformers 5.25 (the CPU, Triton's
interpreter) and 5.17 (an H200, an H100). ``patch`` checks the installed
version and refuses another major version with a RuntimeError
(:func:`check_transformers_version`): 4.x models route
labels, caches and attention differently, and a 6.x may again.
"""

import sys
import types

from lstrain.patch.families import FAMILIES, Family, supported_names
from lstrain.patch.instance import LeftAlone, PatchReport, Swapped, check_transformers_version, patch, unpatch

__all__ = [
    "FAMILIES",
    "Family",
    "LeftAlone",
    "PatchReport",
    "Swapped",
    "check_transformers_version",
    "patch",
    "supported_names",
    "unpatch",
]


class _CallablePackage(types.ModuleType):
    """This package, callable as :func:`patch`.

    Importing ``lstrain.patch`` binds the package to the name ``lstrain.patch``, which would
    hide a function of that name; a callable package makes ``lstrain.patch(model)`` work
    however the package was first imported.
    """

    def __call__(self, model, **options) -> PatchReport:
        return patch(model, **options)


sys.modules[__name__].__class__ = _CallablePackage
