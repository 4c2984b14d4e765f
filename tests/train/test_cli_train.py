"""``lstrain train`` as a user types it: a recipe file, overrides, exit codes."""

import json

import pytest
import torch

from lstrain import _backend, cli
from lstrain.cli.train import DEFAULT_RECIPE, resolve_recipe
from tests.train.helpers import corpus

MICRO = """
[model]
n_layer = 1
n_embd = 32
n_head = 2
n_positions = 32
fused = false

[data]
source = "{source}"
tokenizer = "byte"
cache_dir = "{cache}"

[training]
local_batch_size = 2
seq_len = 16
steps = 2
mixed_precision = "fp32"

[checkpoint]
folder = "{folder}/checkpoints"

[metrics]
log_freq = 1
folder = "{folder}/metrics"

[eval]
steps = 1
"""


def _recipe(tmp_path):
    path = tmp_path / "micro.toml"
    path.write_text(MICRO.format(source=corpus(tmp_path), cache=tmp_path / "cache", folder=tmp_path))
    return path


@pytest.mark.skipif(
    not (torch.cuda.is_available() or _backend.interpreter_active()),
    reason="FusedAdamW on the CPU needs the Triton interpreter",
)
def test_train_runs_a_recipe_with_overrides(tmp_path, capsys):
    assert cli.main(["train", str(_recipe(tmp_path)), "--set", "training.steps=3", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "done: 3 steps" in out and "checkpoint:" in out
    records = [json.loads(line) for line in (tmp_path / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    # the folder now holds checkpoints: a second new run is refused, --resume is the way on
    assert cli.main(["train", str(_recipe(tmp_path)), "--no-progress"]) == 2
    assert "already holds checkpoints; pass --resume" in capsys.readouterr().err


def test_a_bad_recipe_exits_2_with_the_reason(tmp_path, capsys):
    assert cli.main(["train", str(_recipe(tmp_path)), "--set", "training.stpes=3"]) == 2
    err = capsys.readouterr().err
    assert "lstrain train:" in err and "unknown key 'stpes' (did you mean 'steps'?)" in err
    assert cli.main(["train", str(tmp_path / "nope.toml")]) == 2
    assert "nope.toml does not exist" in capsys.readouterr().err


def test_the_default_recipe_is_gpt2_tiny():
    assert DEFAULT_RECIPE == "gpt2-tiny"
    assert resolve_recipe(None).name == "gpt2-tiny.toml" and resolve_recipe(None).is_file()
    assert resolve_recipe("gpt2-small") == resolve_recipe(None).with_name("gpt2-small.toml")
    assert all(resolve_recipe(name).is_file() for name in ("gpt2-small", "gpt2-medium", "bert-base", "bert-large"))


def test_allow_batch_change_reaches_train(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr("lstrain.train.train", lambda run, **kwargs: seen.update(kwargs))
    assert cli.main(["train", str(_recipe(tmp_path)), "--resume", "--allow-batch-change", "--no-progress"]) == 0
    assert seen["resume"] is True and seen["allow_batch_change"] is True


def test_resume_before_the_recipe_takes_the_recipe_and_batch_change_needs_resume(tmp_path, monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr("lstrain.train.train", lambda run, **kwargs: seen.update(kwargs, steps=run.training.steps))
    recipe = str(_recipe(tmp_path))
    assert cli.main(["train", "--resume", recipe, "--set", "training.steps=7", "--no-progress"]) == 0
    assert seen["resume"] is True and seen["steps"] == 7  # the recipe given, not the default one
    seen.clear()
    assert cli.main(["train", recipe, "--allow-batch-change", "--no-progress"]) == 2
    assert "--allow-batch-change applies to a resumed run" in capsys.readouterr().err and not seen


def test_a_named_recipe_without_the_recipes_folder_says_where_they_live(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("lstrain.cli.train.RECIPES", tmp_path / "recipes")  # a wheel install: no recipes/ beside it
    assert cli.main(["train", "--no-progress"]) == 2
    assert "named recipes (gpt2-tiny) live in the repository's recipes/ folder" in capsys.readouterr().err
