"""Recipes: defaults, every error at once with its key path, no tracebacks, README reference in sync."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lowmem_grpo.recipe import Recipe, RecipeError, field_reference, load_recipe, recipe_from_dict

ROOT = Path(__file__).resolve().parent.parent
MIN = {"model": {"name_or_path": "m"}, "data": {"train_path": "t.jsonl"}}


def problems(d):
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(d)
    return dict(info.value.problems)


def test_minimal_recipe_gets_defaults():
    r = recipe_from_dict(MIN)
    assert r.generation.num_generations == 8 and r.algorithm.beta == 0.04 and r.algorithm.mu == 1
    assert r.model.load_in_4bit and r.rewards.functions[0].function == "math"


def test_all_problems_reported_at_once_with_key_paths():
    bad = {"model": {"name_or_path": "m", "load_in_4bits": True},
           "data": {"train_path": "t.jsonl", "on_bad_row": "ignore"},
           "generation": {"num_generations": 1, "temperature": "hot"},
           "algorithm": {"beta": -1},
           "optimizer": {"lr": 0},
           "trian": {}}
    p = problems(bad)
    assert set(p) == {"model.load_in_4bits", "data.on_bad_row", "generation.num_generations",
                      "generation.temperature", "algorithm.beta", "optimizer.lr", "trian"}
    assert "known keys in model" in p["model.load_in_4bits"] and "load_in_4bit" in p["model.load_in_4bits"]
    assert "'error'" in p["data.on_bad_row"] and "'skip'" in p["data.on_bad_row"]
    assert ">= 2" in p["generation.num_generations"]
    assert ">= 0" in p["algorithm.beta"]


def test_required_fields_and_list_items():
    p = problems({"rewards": {"functions": [{"weight": 2}]}})
    assert "model.name_or_path" in p and "data.train_path" in p
    assert "rewards.functions.0.function" in p


def test_yaml_syntax_error_names_the_line(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("model:\n  name_or_path: [unclosed\n")
    with pytest.raises(RecipeError, match="line"):
        load_recipe(f)


def test_overrides(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump(MIN))
    r = load_recipe(f, ["train.steps=7", "lora.target_modules=[q_proj, v_proj]"])
    assert r.train.steps == 7 and r.lora.target_modules == ["q_proj", "v_proj"]


def test_every_shipped_recipe_validates():
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        assert isinstance(load_recipe(path), Recipe), path


def test_validate_cli_reports_without_traceback(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump({"model": {"name_or_path": "m", "lora_rank": 3}, "algorithm": {"mu": 0}}))
    p = subprocess.run([sys.executable, "-m", "lowmem_grpo.cli", "validate", str(f)], capture_output=True, text=True,
                       env={**os.environ})
    assert p.returncode == 2
    assert "model.lora_rank" in p.stderr and "algorithm.mu" in p.stderr and "data.train_path" in p.stderr
    assert "Traceback" not in p.stderr


def test_every_field_has_a_meaning_and_readme_reference_is_current():
    rows = field_reference()
    assert rows and all(meaning for _, _, _, meaning in rows)
    from importlib import util

    spec = util.spec_from_file_location("gen", ROOT / "scripts" / "gen_recipe_reference.py")
    gen = util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.reference_block() in (ROOT / "README.md").read_text(), \
        "README recipe reference is stale: run python scripts/gen_recipe_reference.py --write"
