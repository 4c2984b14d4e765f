"""Recipes: TOML into the components' configs, and the errors a user sees."""

from pathlib import Path

import pytest

from lstrain.config import RecipeError, load_recipe, parse_recipe
from lstrain.train import CheckpointConfig, MetricsConfig, OptimizerConfig

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.toml"))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_parses(path):
    run = load_recipe(path)
    assert run.model.name == path.stem.split("-")[0]  # gpt2-*, bert-*
    assert run.training.steps > 0
    config = run.model.build(run.data.vocab_size)
    assert run.training.seq_len <= run.model.family.positions(config)
    if run.model.name == "bert":  # the captured step needs fixed masked positions
        assert run.data.max_predictions_per_seq >= round(run.data.mlm_probability * run.training.seq_len)


def test_the_bert_recipes_are_issue_30s_shapes():
    large = load_recipe(RECIPES[0].with_name("bert-large.toml"))
    config = large.model.build(large.data.vocab_size, pad_id=1)
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (24, 1024, 16)
    assert (large.training.seq_len, large.training.local_batch_size) == (512, 16)
    assert config.pad_token_id == 1  # the tokenizer's, not BertConfig's default 0
    base = load_recipe(RECIPES[0].with_name("bert-base.toml")).model.build(30522)
    assert (base.num_hidden_layers, base.hidden_size) == (12, 768)


def test_a_bert_model_section_takes_bert_config_fields():
    run = parse_recipe({"model": {"name": "bert", "preset": "large", "num_hidden_layers": 2}})
    assert run.model.family.label == "BERT" and run.model.fields == {"num_hidden_layers": 2}
    config = run.model.build(300, pad_id=5)
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size, config.pad_token_id) == (2, 1024, 300, 5)
    assert parse_recipe({"model": {"name": "bert", "pad_token_id": 0}}).model.build(300, pad_id=5).pad_token_id == 0
    # a pad id past the check's stand-in vocabulary is the tokenizer's to judge at the build
    assert parse_recipe({"model": {"name": "bert", "pad_token_id": 300}}).model.build(30522).pad_token_id == 300
    with pytest.raises(RecipeError, match="pad_token_id must be None or an int"):
        parse_recipe({"model": {"name": "bert", "pad_token_id": -1}})
    with pytest.raises(RecipeError, match=r"\[model\]: unknown key 'n_layer'.*; allowed: name, preset, hidden_size"):
        parse_recipe({"model": {"name": "bert", "n_layer": 2}})
    with pytest.raises(RecipeError, match="preset must be one of base, large; got 'medium'"):
        parse_recipe({"model": {"name": "bert", "preset": "medium"}})
    with pytest.raises(RecipeError, match="name must be one of gpt2, bert, llama; got 't5'"):
        parse_recipe({"model": {"name": "t5"}})
    with pytest.raises(RecipeError, match="BertConfig: hidden_size"):
        parse_recipe({"model": {"name": "bert", "hidden_size": 30}})
    run = parse_recipe(
        {"model": {"name": "gpt2"}}, ["model.name=bert", "model.hidden_size=96", "data.max_predictions_per_seq=20"]
    )
    assert run.model.name == "bert" and run.model.fields == {"hidden_size": 96}
    assert run.data.max_predictions_per_seq == 20


def test_the_sections_reach_their_dataclasses():
    run = parse_recipe(
        {
            "model": {"n_layer": 2, "n_embd": 64, "n_head": 2, "preset": "small"},
            "data": {"source": "corpus.txt", "tokenizer": "byte"},
            "training": {"steps": 7, "max_norm": 1},  # an int for a float field
            "optimizer": {"betas": [0.8, 0.9]},
        }
    )
    assert run.model.fields == {"n_layer": 2, "n_embd": 64, "n_head": 2}
    assert run.model.build(300).n_layer == 2 and run.model.build(300).vocab_size == 300
    assert run.data.source == "corpus.txt" and run.data.tokenizer == "byte"
    assert run.training.steps == 7 and run.training.max_norm == 1.0 and isinstance(run.training.max_norm, float)
    assert run.optimizer.betas == (0.8, 0.9)
    assert run.lr_scheduler.decay_type == "cosine"  # a section left out keeps its defaults


def test_an_unknown_key_is_named_with_the_keys_allowed():
    with pytest.raises(RecipeError, match=r"\[training\]: unknown key 'step' \(did you mean 'steps'\?\); allowed: "
                       r"local_batch_size, seq_len, .*steps"):  # fmt: skip
        parse_recipe({"training": {"step": 10}})
    with pytest.raises(
        RecipeError, match=r"\[model\]: unknown key 'layers' \(did you mean 'n_layer'\?\); allowed: name, preset, "
    ):
        parse_recipe({"model": {"layers": 3}})
    with pytest.raises(RecipeError, match=r"unknown section \[train\]; sections: model, data, training"):
        parse_recipe({"train": {"steps": 10}})


def test_a_wrong_type_names_the_type_expected():
    with pytest.raises(RecipeError, match=r"\[training\] steps: expected int, got str 'ten'"):
        parse_recipe({"training": {"steps": "ten"}})
    with pytest.raises(RecipeError, match=r"\[training\] compile: expected bool, got int 1"):
        parse_recipe({"training": {"compile": 1}})
    with pytest.raises(RecipeError, match=r"\[training\] local_batch_size: expected int, got bool True"):
        parse_recipe({"training": {"local_batch_size": True}})
    with pytest.raises(RecipeError, match=r"\[optimizer\] betas: expected 2 values"):
        parse_recipe({"optimizer": {"betas": [0.9]}})
    with pytest.raises(RecipeError, match=r"\[data\] max_bytes: expected int \| None, got float 1.5"):
        parse_recipe({"data": {"max_bytes": 1.5}})


def test_the_configs_built_in_python_check_their_switches_and_folders(tmp_path):
    with pytest.raises(ValueError, match=r"\[checkpoint\]: enabled must be a bool, got 'false'"):
        CheckpointConfig(enabled="false")
    with pytest.raises(ValueError, match=r"\[optimizer\]: master_weights must be a bool, got 1"):
        OptimizerConfig(master_weights=1)
    with pytest.raises(ValueError, match=r"\[metrics\]: folder must be a non-empty path, got ''"):
        MetricsConfig(folder="")
    assert CheckpointConfig(folder=tmp_path / "ckpt").folder == str(tmp_path / "ckpt")
    assert MetricsConfig(folder=tmp_path).folder == str(tmp_path)


def test_values_out_of_range_and_the_vocabulary():
    with pytest.raises(RecipeError, match="mixed_precision must be one of bf16, fp16, fp32; got 'fp8'"):
        parse_recipe({"training": {"mixed_precision": "fp8"}})
    with pytest.raises(RecipeError, match=r"n_embd \(64\) must be a multiple of n_head \(3\)"):
        parse_recipe({"model": {"n_embd": 64, "n_head": 3}})
    with pytest.raises(RecipeError, match="state_dtype must be one of float32, bfloat16; got 'float16'"):
        parse_recipe({"optimizer": {"state_dtype": "float16"}})
    with pytest.raises(RecipeError, match="vocab_size comes from the data's tokenizer"):
        parse_recipe({"model": {"vocab_size": 100}})


def test_overrides_are_typed_by_their_field():
    run = parse_recipe(
        {"training": {"steps": 10}, "data": {"max_bytes": 100}},
        [
            "training.steps=25",
            "optimizer.lr=1e-3",
            "optimizer.betas=[0.8, 0.99]",
            "training.compile=true",
            "sample.prompt=def main",  # a string field takes the text as it is
            "data.max_bytes=none",  # an optional field
            "model.n_layer=3",
            "optimizer.master_weights=false",
            "optimizer.state_dtype=bfloat16",
        ],
    )
    assert run.optimizer.master_weights is False and run.optimizer.state_dtype == "bfloat16"
    assert run.training.steps == 25 and run.training.compile is True
    assert run.optimizer.lr == 1e-3 and run.optimizer.betas == (0.8, 0.99)
    assert run.sample.prompt == "def main"
    assert run.data.max_bytes is None
    assert run.model.fields == {"n_layer": 3}
    # a quoted string gives its contents, spaces and all, as the recipe's own prompt = "def "
    quoted = parse_recipe({}, ['sample.prompt="def "', "data.cache_dir='/tmp/x'"])
    assert quoted.sample.prompt == "def " and quoted.data.cache_dir == "/tmp/x"


def test_bad_overrides():
    with pytest.raises(RecipeError, match="expected section.key=value"):
        parse_recipe({}, ["training.steps"])
    with pytest.raises(RecipeError, match=r"unknown section \[train\]"):
        parse_recipe({}, ["train.steps=1"])
    with pytest.raises(RecipeError, match=r"\[training\]: unknown key 'stpes' \(did you mean 'steps'\?\)"):
        parse_recipe({}, ["training.stpes=1"])
    with pytest.raises(RecipeError, match=r"\[training\] steps: 'many' is not a value of type int"):
        parse_recipe({}, ["training.steps=many"])


def test_a_recipe_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\nsteps = 1\n")
    with pytest.raises(RecipeError, match=r"bad.toml: not valid TOML"):
        load_recipe(bad)
    bad.write_text("[training]\nsteps = -1\n")
    with pytest.raises(RecipeError, match=r"bad.toml: \[training\]: steps must be a positive int, got -1"):
        load_recipe(bad)
    with pytest.raises(FileNotFoundError, match="missing.toml does not exist"):
        load_recipe(tmp_path / "missing.toml")
