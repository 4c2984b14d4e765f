"""``lstrain train``: train a model from a TOML recipe (``recipes/gpt2-tiny.toml`` by default).

``lstrain train [RECIPE] [--set section.key=value ...] [--resume [DIR] [--allow-batch-change]]``; under
``torchrun --nproc_per_node N -m lstrain train ...`` each process is one data-parallel rank.
On a machine without a GPU the model's ops run their plain-PyTorch references and
``torch.optim.AdamW`` updates the flat parameter buffers (fast enough for the tiny recipe);
with ``TRITON_INTERPRET=1`` set, lstrain's kernels and FusedAdamW run in Triton's
interpreter instead (exact but far slower: the tests' path).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["DEFAULT_RECIPE", "add_parser", "resolve_recipe", "run"]

# the checkout's recipes/ folder (pip install -e .): lstrain/cli/train.py -> the repository root
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
DEFAULT_RECIPE = "gpt2-tiny"


def resolve_recipe(name: str | None) -> Path:
    """The recipe file that ``lstrain train NAME`` means.

    Args:
        name: a path to a .toml file, a recipe name in the checkout's ``recipes/`` folder
            (``gpt2-tiny``), or None for the default (gpt2-tiny).

    Returns:
        The path (it may not exist: :func:`lstrain.config.load_recipe` says so).
    """
    if name is None:
        name = DEFAULT_RECIPE
    path = Path(name)
    if path.is_file() or path.suffix == ".toml":
        return path
    return RECIPES / f"{name}.toml"


def run(args: argparse.Namespace) -> int:
    """Train what ``args`` (from :func:`add_parser`'s parser) ask for.

    Args:
        args: ``recipe``, ``set`` (overrides), ``resume`` (None, True or a path),
            ``allow_batch_change``, ``no_progress``.

    Returns:
        0 when the run finished; 2 for a bad recipe, override or input (the message on
        stderr, before any step runs).
    """
    from lstrain.config import RecipeError, load_recipe
    from lstrain.train import train

    resume, recipe_name = args.resume, args.recipe
    if isinstance(resume, str) and resume.endswith(".toml") and recipe_name is None:
        # `--resume my.toml`: argparse took the recipe for --resume's folder
        resume, recipe_name = True, resume
    if getattr(args, "allow_batch_change", False) and not resume:
        print("lstrain train: --allow-batch-change applies to a resumed run: pass --resume too", file=sys.stderr)
        return 2
    path = resolve_recipe(recipe_name)
    if not path.is_file() and path.parent == RECIPES and not RECIPES.is_dir():
        print(
            f"lstrain train: the named recipes ({path.stem}) live in the repository's recipes/ folder, which this "
            "install does not have: pass the path of a .toml recipe (e.g. from a clone of the repository)",
            file=sys.stderr,
        )
        return 2
    try:
        recipe = load_recipe(path, args.set or [])
        train(
            recipe,
            resume=resume,
            progress=not args.no_progress,
            allow_batch_change=getattr(args, "allow_batch_change", False),
        )
    except (RecipeError, ValueError, FileNotFoundError) as error:
        print(f"lstrain train: {error}", file=sys.stderr)
        return 2
    return 0


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``train`` to the ``lstrain`` command's subparsers.

    Args:
        commands: what ``ArgumentParser.add_subparsers`` returned.

    Returns:
        The ``train`` parser; its namespace's ``run`` is :func:`run`.
    """
    parser = commands.add_parser("train", help="train a model from a TOML recipe (default: recipes/gpt2-tiny.toml)")
    parser.add_argument("recipe", nargs="?", help="a .toml file or a name in recipes/ (default: gpt2-tiny)")
    parser.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                        help="override a recipe value, e.g. --set training.steps=100 (repeatable)")  # fmt: skip
    parser.add_argument("--resume", nargs="?", const=True, default=None, metavar="DIR",
                        help="continue from the latest checkpoint of [checkpoint] folder, or from DIR")  # fmt: skip
    parser.add_argument("--allow-batch-change", action="store_true",
                        help="with --resume: continue a checkpoint trained with another batch or seq_len "
                        "(the data then continues at step x the new batch, not where it stopped)")  # fmt: skip
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    parser.set_defaults(run=run)
    return parser
