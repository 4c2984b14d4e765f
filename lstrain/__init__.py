"""lstrain: fused Triton kernels for training GPT- and BERT-style Transformers.

``lstrain.ops`` holds the functional ops, ``lstrain.nn`` drop-in modules,
``lstrain.layers`` the Transformer layers built from them, ``lstrain.models`` GPT-2,
``lstrain.optim`` the flat-buffer optimizers, ``lstrain.testing`` the property checks,
``lstrain.patch(model)`` / ``lstrain.unpatch(model)`` patch a Hugging Face model instance
(``lstrain.patch`` is a callable package).
Submodules load on first use, so that ``lstrain.cli`` can switch Triton's interpreter
on before any kernel is defined.
"""

import importlib

__all__ = ["layers", "models", "nn", "ops", "optim", "patch", "testing", "unpatch"]
_PACKAGES = {"layers", "models", "nn", "ops", "optim", "patch", "testing"}
# The one version source: pyproject.toml has setuptools read it statically, so it stays a literal.
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _PACKAGES:
        return importlib.import_module(f"lstrain.{name}")
    if name == "unpatch":
        return importlib.import_module("lstrain.patch").unpatch
    raise AttributeError(f"module 'lstrain' has no attribute {name!r}")
