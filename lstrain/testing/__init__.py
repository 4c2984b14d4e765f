"""Property-based checks of fused ops and modules against plain-PyTorch references.

Public, so that users can check their own modules the way lstrain checks its ops:
:func:`check_module` / :func:`check_function` apply the tolerance rule
(:mod:`lstrain.testing.compare`), :mod:`lstrain.testing.strategies` holds hypothesis
strategies and profiles.
"""

from lstrain.testing.compare import (
    DEFAULT_ATOL,
    Comparison,
    assert_all_passed,
    check_function,
    check_module,
    compare_to_reference,
)
from lstrain.testing.strategies import register_profiles

__all__ = [
    "DEFAULT_ATOL",
    "Comparison",
    "assert_all_passed",
    "check_function",
    "check_module",
    "compare_to_reference",
    "register_profiles",
]
