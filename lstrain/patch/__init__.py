"""Hugging Face integration: ``lstrain.patch(model)`` puts lstrain's fused pieces into a model.

``lstrain.patch`` is this package and is callable: ``lstrain.patch(model, ...)`` is
:func:`lstrain.patch.instance.patch`, ``lstrain.unpatch(model)`` undoes it. The supported
families are the one table in ``lstrain.patch.families``.
"""

import sys
import types

from lstrain.patch.families import FAMILIES, Family, supported_names
from lstrain.patch.instance import LeftAlone, PatchReport, Swapped, patch, unpatch

__all__ = ["FAMILIES", "Family", "LeftAlone", "PatchReport", "Swapped", "patch", "supported_names", "unpatch"]


class _CallablePackage(types.ModuleType):
    """This package, callable as :func:`patch`.

    Importing ``lstrain.patch`` binds the package to the name ``lstrain.patch``, which would
    hide a function of that name; a callable package makes ``lstrain.patch(model)`` work
    however the package was first imported.
    """

    def __call__(self, model, **options) -> PatchReport:
        return patch(model, **options)


sys.modules[__name__].__class__ = _CallablePackage
