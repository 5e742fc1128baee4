"""Recipes: defaults, every error at once with its key path, no tracebacks, README reference in sync."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import save_file

from lowmem_grpo import tiny
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


def test_an_unknown_key_is_named_as_written_even_when_it_looks_like_pydantics_own_tags():
    # pydantic tags the branches of a union in its error paths ('literal[...]', 'list[...]'), which are left out;
    # a user's key spelled so is still the key (found by tests/test_fuzz.py: {'literal[': None} named no key)
    p = problems({"model": {"name_or_path": "m", "literal[x]": 1}, "data": {"train_path": "t.jsonl"}, "list[": {}})
    assert "model.literal[x]" in p and "list[" in p, p


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
    # nothing after '=' is no value (YAML would read null): named, with what the field takes for "none" (a text
    # field: '', quoted so that a shell passes it on; null only where the schema takes it)
    with pytest.raises(RecipeError) as err:
        load_recipe(f, ["data.eval_path="])
    assert err.value.problems == [("data.eval_path", "--set data.eval_path= gives no value: write "
                                                     "--set \"data.eval_path=''\" for an empty value")]
    assert load_recipe(f, ["data.eval_path=''"]).data.eval_path == ""
    with pytest.raises(RecipeError, match="write --set algorithm.entropy_target=null for none"):
        load_recipe(f, ["algorithm.entropy_target="])
    assert load_recipe(f, ["algorithm.entropy_target=null"]).algorithm.entropy_target is None


def test_set_takes_text_fields_as_written_and_indexes_lists(tmp_path):
    """--set values are YAML, which reads 'Q: {prompt}' as a mapping: a field whose schema type is text takes the
    text as written instead; a number in the key path is an entry of a list; each misuse is one named problem."""
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump({**MIN, "rewards": {"functions": [{"function": "math"}, {"function": "format"}]}}))
    r = load_recipe(f, ["data.template=Q: {prompt}", "data.system_prompt=You are: helpful", "data.answer_field=42",
                        'data.prompt_field="question"', "rewards.functions.1.weight=2", "train.steps=7"])
    assert (r.data.template, r.data.system_prompt, r.data.answer_field) == ("Q: {prompt}", "You are: helpful", "42")
    assert r.data.prompt_field == "question" and r.train.steps == 7
    assert [fn.weight for fn in r.rewards.functions] == [1.0, 2.0]

    def problem(*overrides, recipe=f):
        with pytest.raises(RecipeError) as err:
            load_recipe(recipe, list(overrides))
        assert len(err.value.problems) == 1, err.value.problems
        return err.value.problems[0]

    assert problem("rewards.functions.2.weight=2") == (
        "rewards.functions.2", "rewards.functions is a list with entries 0..1: no entry '2' (an entry is named by "
                               "its number; to add one, set the whole list)")
    assert problem("rewards.functions.x.weight=2")[0] == "rewards.functions.x"
    bare = tmp_path / "bare.yaml"
    bare.write_text(yaml.safe_dump(MIN))   # no rewards.functions in the file: its default list is not there to index
    key, msg = problem("rewards.functions.0.weight=2", recipe=bare)
    assert key == "rewards.functions" and "is not in the recipe (its default applies)" in msg
    assert "--set 'rewards.functions=[...]'" in msg
    assert problem("rewards.on_error.x=1") == ("rewards.on_error", "is a value (Literal['raise', 'zero']), not a "
                                                                   "section: it has no key to set; write --set "
                                                                   "rewards.on_error=VALUE")
    key, msg = problem("data.eval_path=null")   # the text "null" would be read as a file name
    assert key == "data.eval_path" and "write --set \"data.eval_path=''\" for an empty value" in msg
    assert problem("train.steps=[1")[1].startswith("value '[1' is not valid YAML")


def test_betas_need_two_numbers():
    for betas, got in (([0.9], "; got [0.9]"), ([0.9, 0.99, 0.999], "; got [0.9, 0.99, 0.999]"), (0.9, " (got 0.9)")):
        p = problems({**MIN, "optimizer": {"betas": betas}})
        assert p == {"optimizer.betas": f"needs two numbers [beta1, beta2], e.g. [0.9, 0.99]{got}"}, p
    assert recipe_from_dict({**MIN, "optimizer": {"betas": [0.8, 0.9]}}).optimizer.betas == (0.8, 0.9)


def test_validate_reads_the_first_rows_of_local_data(tmp_path):
    """What train stops on in local data, validate reports (exit 2), naming the field and the file: a file that is
    not there, a data.prompt_field or a data.template field that no row has; without loading the model."""
    from click.testing import CliRunner

    from lowmem_grpo.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2", "nums": [1, 2]}\n' * 3)
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump({"model": {"name_or_path": "no-such/model"}, "data": {"train_path": str(data)}}))

    def validate(*overrides):
        return CliRunner().invoke(main, ["validate", str(f)] + [f"--set={o}" for o in overrides])

    assert validate().exit_code == 0
    assert validate("data.template=Q: {prompt} {nums[0]}").exit_code == 0
    res = validate(f"data.train_path={tmp_path / 'nope.jsonl'}", "rewards.functions=[{function: code}]")
    assert res.exit_code == 2 and f"data.train_path: {tmp_path / 'nope.jsonl'}: file not found" in res.output
    res = validate("data.prompt_field=question")
    assert res.exit_code == 2, res.output
    assert f"data.prompt_field: 'question' names a field that none of its 3 rows has, in {data} (they have: answer, " \
           "nums, prompt)" in res.output
    held = tmp_path / "held.jsonl"   # (a copy: eval_path may not be train_path's file)
    held.write_text(data.read_text())
    res = validate("data.template=Q: {question}", f"data.eval_path={held}")
    assert res.exit_code == 2 and "2 problem(s)" in res.output   # the file, read as train_path and as eval_path
    assert f"data.template: {{question}} names a field that none of its 3 rows has, in {data}" in res.output


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


def test_careless_recipe_values_are_named_errors(tmp_path):
    """Values that pydantic's types let through but a run cannot use: each names its key and what is allowed."""
    bad = {**MIN, "data": {"train_path": "t.jsonl", "template": "What is it?", "prompt_field": ""},
           "rewards": {"functions": [{"function": "math", "weight": float("nan")}]},
           "algorithm": {"epsilon_high": float("inf")},
           "optimizer": {"betas": [1.5, 0.9]},
           "lora": {"target_modules": []},
           "output": {"dir": ""},
           "seed": 2**70}
    p = problems(bad)
    assert set(p) == {"data.template", "data.prompt_field", "rewards.functions.0.weight", "algorithm.epsilon_high",
                      "optimizer.betas", "lora.target_modules", "output.dir", "seed"}, p
    assert "every prompt would be the same text" in p["data.template"]
    assert "finite number" in p["rewards.functions.0.weight"] and "finite number" in p["algorithm.epsilon_high"]
    assert p["optimizer.betas"] == "each beta must be >= 0 and < 1, got [1.5, 0.9]"  # (without pydantic's prefix)
    assert "empty list" in p["lora.target_modules"] and "all-linear" in p["lora.target_modules"]
    assert "allowed: <= 4294967295" in p["seed"]
    # YAML's true/false for a number: pydantic's lax mode read them as 1/0 (`train.steps: true` trained one step)
    p = problems({**MIN, "train": {"steps": True}, "generation": {"temperature": False}, "model": {
        "name_or_path": "m", "load_in_4bit": True}, "seed": True})
    assert set(p) == {"train.steps", "generation.temperature", "seed"}, p
    assert p["train.steps"] == "expected a number, not true or false (got True)"
    for template, says in (("{prompt", "not a valid format string"), ("{0} and {prompt}", "positional field {0}"),
                           ("{prompt!x}", "unknown conversion '!x'")):
        assert says in problems({**MIN, "data": {"train_path": "t.jsonl", "template": template}})["data.template"]


def test_unreadable_recipe_files_are_named_errors(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_bytes(b"model:\n  name_or_path: caf\xe9\n")  # Latin-1, not UTF-8
    with pytest.raises(RecipeError, match=r"<file>: not UTF-8 text \(byte 26"):
        load_recipe(f)
    # YAML keeps the last of two equal keys: the first section's settings would vanish without a word
    f.write_text("train:\n  steps: 5\nmodel:\n  name_or_path: m\ntrain:\n  prompts_per_step: 2\n")
    with pytest.raises(RecipeError, match=r"line 5, column 1: duplicate key 'train' \(first at line 1\)"):
        load_recipe(f)
    f.write_text("model: {name_or_path: m, <<: {x: 1}}\ndata: {train_path: t.jsonl}\n")  # a merge key is no duplicate
    with pytest.raises(RecipeError, match=r"model.x: unknown key"):
        load_recipe(f)
    with pytest.raises(RecipeError, match="<file>: is a directory"):
        load_recipe(tmp_path)


def test_cli_options_a_careless_user_gets_wrong(tmp_path):
    """In-process (no model is loaded): each a one-line error, exit 2, no traceback."""
    from click.testing import CliRunner

    from lowmem_grpo.cli import main

    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump(MIN))
    for memory in ("1e400", "inf", "-8GiB", "0"):  # float() reads these; no card has them
        res = CliRunner().invoke(main, ["estimate", str(f), "--memory", memory])
        assert res.exit_code == 2 and f"{memory!r}: expected a positive size" in res.output, res.output
    (tmp_path / "run").mkdir()
    res = CliRunner().invoke(main, ["train", str(f), "--resume", str(tmp_path / "run")])  # RECIPE would be ignored
    assert res.exit_code == 2 and "not both" in res.output and res.exception.__class__ is SystemExit
    res = CliRunner().invoke(main, ["train", "--resume", str(tmp_path / "run")])
    assert res.exit_code == 2 and "is not a run directory (no recipe.yaml in it)" in res.output


def _validate(recipe_path, *overrides):
    from click.testing import CliRunner

    from lowmem_grpo.cli import main

    return CliRunner().invoke(main, ["validate", str(recipe_path)] + [f"--set={o}" for o in overrides])


def test_validate_refuses_a_model_path_train_refuses_and_notes_a_context_too_short(tmp_path):
    """model.name_or_path a file, or a folder without config.json, tokenizer or weights: train refuses them at once
    (hub.py's checks), validate said ok. A completion longer than the local model's max_position_embeddings: a note, as the
    trainer's start-up says it. A hub id is not looked up (validate does not reach the hub)."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "1+2", "answer": "3"}\n')
    model = tmp_path / "model"
    model.mkdir()
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump({"model": {"name_or_path": str(model)}, "data": {"train_path": str(data)},
                                 "generation": {"max_new_tokens": 8}}))
    res = _validate(f)
    assert res.exit_code == 2 and f"model.name_or_path: {str(model)!r}: the folder has no config.json, so it is no model folder (it " \
                                  "is empty)" in res.output, res.output
    (model / "config.json").write_text('{"model_type": "qwen2", "max_position_embeddings": 64}')
    res = _validate(f)
    assert res.exit_code == 2 and f"model.name_or_path: {str(model)!r}: no tokenizer files" in res.output, res.output
    tiny.build_tokenizer().save_pretrained(model)
    res = _validate(f)
    assert res.exit_code == 2 and f"model.name_or_path: {str(model)!r}: no weights file" in res.output, res.output
    save_file({}, str(model / "model.safetensors"))   # (validate reads a weights file's header, not its tensors)
    res = _validate(f)
    assert res.exit_code == 0 and "max_position_embeddings" not in res.output, res.output
    res = _validate(f, "generation.max_new_tokens=64")
    assert res.exit_code == 0 and ("note: generation.max_new_tokens=64 alone comes to the model's "
                                   "max_position_embeddings=64 (its config.json) or past it") in res.output, res.output
    res = _validate(f, f"model.name_or_path={model / 'config.json'}")
    assert res.exit_code == 2 and f"model.name_or_path: {str(model / 'config.json')!r}: no such model folder" in \
        res.output, res.output
    res = _validate(f, "model.name_or_path=no-such/model")
    assert res.exit_code == 0 and "note: model.name_or_path 'no-such/model' is a hub id, not checked here" in \
        res.output, res.output


@pytest.mark.parametrize("row,says", [
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"prompt": "1+3", "answer": [4]}', "the answer field 'answer' holds list [4]"),
    ('{"prompt": "1+3", "answer": NaN}', "the answer field 'answer' is nan (not a finite number)"),
    ('{"prompt": "1+3", "answer": true}', "the answer field 'answer' holds the boolean True"),
    ('{"prompt": "1+3"}', "missing field 'answer' (row has: prompt)"),
    ('{"prompt": [{"role": "bot", "content": "1+3"}], "answer": "4"}', "has role 'bot'; allowed: system, user"),
    ('{"prompt": [{"role": "user", "content": [{"type": "text"}]}], "answer": "4"}', "has content list"),
    ('{"prompt": " ", "answer": "4"}', "the prompt field 'prompt' is empty"),
])
def test_validate_says_which_row_train_would_stop_on(tmp_path, row, says):
    """A bad row among the first rows validate reads: train (data.on_bad_row: error) stops on it at start-up, with
    the same words (data.py's row checks: answer_problem, chat_messages), so validate reports it; with skip, the row
    is skipped and validate says ok. A reward that reads no answer needs none."""
    from lowmem_grpo import tiny
    from lowmem_grpo.data import DataError, PromptSet

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "1+2", "answer": "3"}\n' + row + "\n")
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump({"model": {"name_or_path": "no-such/model"}, "data": {"train_path": str(data)}}))
    res = _validate(f)
    assert res.exit_code == 2, res.output
    assert f"data.train_path: {data}: row 3: " in res.output and says in res.output, res.output
    assert "data.on_bad_row: skip skips them" in res.output
    with pytest.raises(DataError) as err:   # what train says of it: the same words
        PromptSet(str(data), load_recipe(f).data, tiny.build_tokenizer())
    assert f"{data}: row 3: " + str(err.value).split("row 3: ", 1)[1] in res.output, (str(err.value), res.output)
    assert _validate(f, "data.on_bad_row=skip").exit_code == 0
    if "answer" in says:
        assert _validate(f, "rewards.functions=[{function: format}]").exit_code == 0


def test_validate_refuses_a_held_out_split_train_cannot_make(tmp_path):
    """data.eval_fraction on a file whose prompts are all one: train refuses it at once (data.split_indices);
    validate, which reads the whole of a small file, too."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n' * 5)
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump({"model": {"name_or_path": "no-such/model"},
                                 "data": {"train_path": str(data), "eval_path": "", "eval_fraction": 0.5}}))
    res = _validate(f)
    assert res.exit_code == 2 and (f"data.eval_fraction: {data}: data.eval_fraction=0.5: the training source has 1 "
                                   "distinct prompt(s), too few") in res.output, res.output
    data.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "1+2", "answer": "3"}\n')
    assert _validate(f).exit_code == 0


def test_a_temperature_vllm_would_raise_is_refused_with_engine_vllm():
    """vLLM samples at 0.01 at the lowest (it raises a lower temperature silently), so the trainer's log-probs would
    be at another temperature than the samples' (found by a red team): refused with engine vllm, by its key."""
    p = problems({**MIN, "generation": {"engine": "vllm", "temperature": 0.005}})
    assert set(p) == {"generation.temperature"}, p
    assert "0.005" in p["generation.temperature"] and "0.01" in p["generation.temperature"]
    assert "\n" not in p["generation.temperature"]
    assert recipe_from_dict({**MIN, "generation": {"engine": "vllm", "temperature": 0.01}}).generation.temperature == 0.01
    assert recipe_from_dict({**MIN, "generation": {"engine": "hf", "temperature": 0.005}}).generation.temperature == 0.005


def test_eval_path_may_not_be_the_training_file(tmp_path):
    """Found by a red team: data.eval_path naming data.train_path's file (as written, or by a link to it) scored the
    prompts the model trains on, and validate said ok."""
    train = tmp_path / "d.jsonl"
    train.write_text('{"prompt": "1+1", "answer": "2"}\n')
    link = tmp_path / "link.jsonl"
    link.symlink_to(train)
    other = tmp_path / "held.jsonl"
    other.write_text(train.read_text())
    for eval_path in (str(train), str(link), f"{tmp_path}/../{tmp_path.name}/d.jsonl"):
        p = problems({**MIN, "data": {"train_path": str(train), "eval_path": eval_path}})
        assert p == {"data.eval_path": f"is the same data as train_path ({eval_path!r} and {str(train)!r}): evaluation "
                                       "would score prompts the model trains on; name another file, or leave eval_path "
                                       "empty and set eval_fraction to hold out a share of them"}, p
    assert "data.eval_path" in problems({**MIN, "data": {"train_path": "hf:x/y@train", "eval_path": "hf:x/y@train"}})
    for eval_path in (str(other), "hf:x/y@test", str(tmp_path / "not-yet.jsonl")):
        assert recipe_from_dict({**MIN, "data": {"train_path": str(train), "eval_path": eval_path}}).data.eval_path


def test_chat_template_kwargs_may_not_set_continue_final_message():
    """The trainer sets it itself: a prompt that ends with the assistant's message is continued (data.py)."""
    p = problems({**MIN, "data": {"train_path": "t.jsonl", "chat_template_kwargs": {"continue_final_message": True}}})
    assert "continue_final_message, which the trainer passes to apply_chat_template itself" in p["data.chat_template_kwargs"]


def test_validate_notes_a_template_that_gives_the_answer_and_a_system_prompt_no_prompt_gets(tmp_path):
    """Found by a red team, each said ok without a word: data.template writing the reference answer into the prompt a
    reward judges against it; data.system_prompt with text rows and data.chat_template false (ignored)."""
    text = tmp_path / "d.jsonl"
    text.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "1+2", "answer": "3"}\n')
    chat = tmp_path / "c.jsonl"
    chat.write_text('{"prompt": [{"role": "user", "content": "1+1"}], "answer": "2"}\n')
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump({"model": {"name_or_path": "no-such/model"}, "data": {"train_path": str(text)}}))
    res = _validate(f)
    assert res.exit_code == 0 and "note: data." not in res.output, res.output
    leak = ("note: data.template '{prompt} = {answer}' writes the reference answer (data.answer_field 'answer') into "
            "the prompt, which math judges against it: the model is given the answer")
    res = _validate(f, "data.template={prompt} = {answer}")
    assert res.exit_code == 0 and leak in res.output, res.output
    res = _validate(f, "data.template={prompt} = {answer!r}", "rewards.functions=[{function: exact}]")
    assert "writes the reference answer" in res.output and "which exact judges" in res.output, res.output
    assert "note: data." not in _validate(f, "data.template={prompt} = {answer}", "rewards.functions=[{function: format}]").output
    ignored = ("note: data.system_prompt is set, but no prompt gets it: it goes with data.chat_template: true, or first "
               "in a prompt of chat messages, and these rows are text with data.chat_template false")
    res = _validate(f, "data.system_prompt=Be brief")
    assert res.exit_code == 0 and ignored in res.output, res.output
    assert "note: data." not in _validate(f, "data.system_prompt=Be brief", "data.chat_template=true").output
    assert "note: data." not in _validate(f, "data.system_prompt=Be brief", f"data.train_path={chat}").output
