"""The ``lstrain`` command: one module per subcommand, each adding its own parser.

A subcommand module has ``add_parser(commands)``, which adds its parser to the
subparsers and sets the namespace's ``run(args) -> exit code``; it is listed in
``_SUBCOMMANDS``. Nothing here or at a subcommand module's top imports torch: a
subcommand may have to prepare the process (``lstrain check`` switches Triton's
interpreter on) before any lstrain kernel is defined.
"""

from __future__ import annotations

import argparse

from lstrain import __version__
from lstrain.cli import check, train

__all__ = ["main"]

_SUBCOMMANDS = (check, train)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lstrain`` console script and of ``python -m lstrain``.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit code of the subcommand that ran.

    Raises:
        SystemExit: on a usage error (code 2), for ``--help`` and for ``--version`` (code 0).
    """
    parser = argparse.ArgumentParser(prog="lstrain", description="Fused Triton kernels for Transformer training.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for subcommand in _SUBCOMMANDS:
        subcommand.add_parser(commands)
    args = parser.parse_args(argv)
    return args.run(args)
