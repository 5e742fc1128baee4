"""Prompt sources: Hugging Face datasets (`hf:NAME[:CONFIG]@SPLIT`, read offline from local folders here)
and the seeded held-out split of the training rows (`data.eval_fraction`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import recipe_dict, write_recipe
from lowmem_grpo import hub, tiny
from lowmem_grpo.data import DataError, PromptSet, prompt_set, read_rows, split_rows
from lowmem_grpo.recipe import DataConfig, RecipeError, recipe_from_dict


def test_hf_sources_parse():
    assert hub.parse("hf:openai/gsm8k:main@train") == hub.HubSpec("openai/gsm8k", "main", "train")
    assert hub.parse("hf:Jiayi-Pan/Countdown-Tasks-3to4@train[:20000]") == hub.HubSpec(
        "Jiayi-Pan/Countdown-Tasks-3to4", None, "train[:20000]")
    assert hub.parse("hf:/data/my_gsm8k@test") == hub.HubSpec("/data/my_gsm8k", None, "test")
    assert str(hub.parse("hf:openai/gsm8k:main@test")) == "hf:openai/gsm8k:main@test"


@pytest.mark.parametrize("value, message", [
    ("hf:openai/gsm8k", "names no split"),
    ("hf:@train", "names no dataset"),
    ("hf:openai/gsm8k:@train", "empty config"),
    ("hf:openai/gsm8k:main@", "empty split"),
    ("hf:@@x", "more than one '@'"),
    ("hf:a:b:c@train", "more than one ':' after the dataset name"),
])
def test_bad_hf_sources_are_recipe_errors_naming_the_field(tiny_model_dir, tiny_data, tmp_path, value, message):
    for field in ("train_path", "eval_path"):
        d = recipe_dict(tiny_model_dir, tiny_data, tmp_path)
        d["data"][field] = value
        with pytest.raises(RecipeError) as err:
            recipe_from_dict(d)
        assert [k for k, m in err.value.problems if message in m and "hf:NAME[:CONFIG]@SPLIT" in m] == [f"data.{field}"]


def test_eval_fraction_with_eval_path_is_a_named_error(tiny_model_dir, tiny_data, tmp_path):
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path)
    d["data"]["eval_fraction"] = 0.1
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(d)
    assert [k for k, _ in err.value.problems] == ["data.eval_fraction"]
    d["data"]["eval_fraction"] = 1.0
    d["data"].pop("eval_path")
    with pytest.raises(RecipeError, match=r"data.eval_fraction: .*allowed: < 1"):
        recipe_from_dict(d)


def _folder(tmp_path, rows_by_split: dict, parquet: bool = False):
    folder = tmp_path / "ds"
    folder.mkdir()
    for split, rows in rows_by_split.items():
        if parquet:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), folder / f"{split}.parquet")
        else:
            (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.mark.parametrize("parquet", [False, True])
def test_hub_source_reads_a_local_folder_through_datasets(tmp_path, parquet):
    train = [{"question": f"q{i}", "answer": f"#### {i}", "nums": [i, i + 1]} for i in range(5)]
    test = [{"question": "t0", "answer": "#### 7", "nums": [1, 2]}]
    folder = _folder(tmp_path, {"train": train, "test": test}, parquet)
    assert read_rows(f"hf:{folder}@train") == train       # lists and strings come back as written
    assert read_rows(f"hf:{folder}@test") == test
    assert read_rows(f"hf:{folder}@train[1:3]") == train[1:3]
    cfg = DataConfig(train_path=f"hf:{folder}@train", prompt_field="question", template="Q: {prompt} {nums}")
    ps = PromptSet(cfg.train_path, cfg, tiny.build_tokenizer())
    assert [e.prompt_text for e in ps.examples][:2] == ["Q: q0 [0, 1]", "Q: q1 [1, 2]"]
    with pytest.raises(DataError, match=r"split 'validation'.*Unknown split"):
        read_rows(f"hf:{folder}@validation")


def test_uncached_hub_dataset_offline_is_a_clear_error(tmp_path):
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"   # conftest: tests never reach the hub
    with pytest.raises(DataError) as err:
        read_rows("hf:lowmem-grpo-tests/no-such-dataset:main@train")
    msg = str(err.value)
    assert "dataset 'lowmem-grpo-tests/no-such-dataset' (config 'main'), split 'train'" in msg
    assert "offline" in msg and "copy its cache" in msg and "jsonl" in msg


@pytest.mark.slow
def test_uncached_hub_dataset_in_train_names_the_field_without_traceback(tiny_model_dir, tiny_data, tmp_path):
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run")
    d["data"]["eval_path"] = "hf:lowmem-grpo-tests/nothing@test"
    recipe = write_recipe(tmp_path / "r.yaml", d)
    p = subprocess.run([sys.executable, "-m", "lowmem_grpo.cli", "train", str(recipe)], capture_output=True,
                       text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "error: data.eval_path: hf:lowmem-grpo-tests/nothing@test: cannot load the Hugging Face dataset" in p.stderr
    assert "Traceback" not in p.stderr


def test_missing_datasets_package_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "datasets", None)   # as on an install without the data extra
    with pytest.raises(DataError, match=r"needs the `datasets` package \(pip install 'lowmem-grpo\[data\]'\)"):
        read_rows(f"hf:{tmp_path}@train")


# ----------------------------------------------------------------------------------------------------
# The held-out split

def _rows(n_distinct: int, repeats: int = 1):
    return [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "copy": c} for i in range(n_distinct) for c in range(repeats)]


def test_split_is_seeded_disjoint_and_complete():
    rows = _rows(200, repeats=3)  # every prompt three times: a row-level split would leak prompts
    cfg = DataConfig(train_path="x.jsonl", eval_fraction=0.1, split_seed=4)
    train, held = split_rows(rows, cfg)
    assert {r["prompt"] for r in train}.isdisjoint({r["prompt"] for r in held})
    assert len({r["prompt"] for r in held}) == 20 and len(held) == 60         # 10% of the distinct prompts, all rows
    assert sorted(map(json.dumps, train + held)) == sorted(map(json.dumps, rows))
    assert [rows.index(r) for r in held] == sorted(rows.index(r) for r in held)  # source order kept
    assert split_rows(rows, cfg) == (train, held)                             # deterministic
    other = split_rows(rows, cfg.model_copy(update={"split_seed": 5}))[1]
    assert {r["prompt"] for r in other} != {r["prompt"] for r in held}        # the seed matters


def test_split_needs_enough_prompts():
    with pytest.raises(DataError, match=r"data.eval_fraction=0.5: .* 1 distinct prompt"):
        split_rows(_rows(1, repeats=4), DataConfig(train_path="x.jsonl", eval_fraction=0.5))


def test_trainer_holds_out_the_split_and_eval_uses_it(tiny_model_dir, tiny_data, tmp_path):
    from lowmem_grpo.train import Trainer
    from conftest import QUIET

    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", train={"steps": 2, "eval_max_prompts": 100})
    d["data"].pop("eval_path")
    d["data"]["eval_fraction"] = 0.2
    trainer = Trainer(recipe_from_dict(d), **QUIET)
    train_prompts = {e.prompt_text for e in trainer.train_set.examples}
    held = [e.prompt_text for e in trainer.eval_set.examples]
    all_prompts = {json.loads(line)["prompt"] for line in tiny_data[0].read_text().splitlines()}
    assert len(held) == round(0.2 * len(all_prompts)) and train_prompts.isdisjoint(held)
    assert train_prompts | set(held) == all_prompts
    # every prompt a training step draws comes from the training part
    from lowmem_grpo.data import batch_indices

    drawn = {trainer.train_set.examples[i].prompt_text for s in range(50)
             for i in batch_indices(len(trainer.train_set), 2, s, 3)}
    assert drawn <= train_prompts
    out = trainer.fit()
    assert out["final_eval"]["n"] == min(len(held), 100)
    # `lowmem-grpo eval --split test` reads the same held-out prompts
    assert [e.prompt_text for e in prompt_set(trainer.recipe.data, trainer.tokenizer, "test").examples] == held


GOOD = {"prompt": "1+1=", "answer": "2"}


def _open(path, **cfg):
    return PromptSet(str(path), DataConfig(train_path=str(path), **cfg), tiny.build_tokenizer())


def test_files_a_careless_user_makes(tmp_path):
    """Byte order marks are read past; a JSON document or a folder in place of a JSONL file, and an empty or corrupt
    Parquet file, are one error naming the file and what is expected."""
    line = (json.dumps(GOOD) + "\r\n").encode()
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + line * 2)   # as Windows editors save it
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbfprompt,answer\r\n1+1=,2\r\n")  # as Excel saves it
    for name in ("bom.jsonl", "bom.csv"):
        assert [e.row for e in _open(tmp_path / name).examples][0] == GOOD, name
    (tmp_path / "array.json").write_text(json.dumps([GOOD] * 3, indent=2))
    (tmp_path / "line.json").write_text(json.dumps([GOOD] * 3))
    (tmp_path / "pretty.jsonl").write_text(json.dumps(GOOD, indent=2))
    for name, what in (("array.json", "an array"), ("line.json", "an array"),
                       ("pretty.jsonl", "an object spread over several lines")):
        for skip in ("error", "skip"):  # not a bad row to skip: the whole file is in another format
            with pytest.raises(DataError, match=rf"{name}: holds one JSON document \({what}\), not JSON Lines; "
                                                r"expected one JSON object per line"):
                _open(tmp_path / name, on_bad_row=skip)
    tiny.write_jsonl([[1, 2], GOOD], tmp_path / "list.jsonl")  # a first row of plain values: only a bad row
    assert len(_open(tmp_path / "list.jsonl", on_bad_row="skip")) == 1
    with pytest.raises(DataError, match=rf"{tmp_path}: is a directory; give a .jsonl, .csv or .parquet file"):
        _open(tmp_path)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}),
                   tmp_path / "empty.parquet")
    with pytest.raises(DataError, match=r"empty.parquet: no usable rows \(the Parquet table is empty\)"):
        _open(tmp_path / "empty.parquet")
    (tmp_path / "cut.parquet").write_bytes(b"PAR1" + b"\0" * 20)
    with pytest.raises(DataError, match=r"cut.parquet: cannot read it as parquet: ArrowInvalid"):
        _open(tmp_path / "cut.parquet")


class _NoTokens:
    """A tokenizer that knows none of the text's characters (what transformers builds from a model folder
    without tokenizer files)."""
    bos_token_id, eos_token_id, chat_template = None, None, None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": []}


@pytest.mark.parametrize("row, message", [
    ({"prompt": "1+1=", "answer": None}, r"field 'answer' is null \(the row has it, with no value\)"),
    ({"prompt": {"role": "user", "content": "1+1="}, "answer": "2"},
     r"the prompt field 'prompt' holds a mapping \(keys: content, role\); expected text, or a list of chat messages"),
    ({"prompt": "  ", "answer": "2"}, "the prompt field 'prompt' is empty"),
])
def test_rows_that_would_be_garbage_are_bad_rows(tmp_path, row, message):
    f = tmp_path / "d.jsonl"
    tiny.write_jsonl([GOOD, row], f)
    with pytest.raises(DataError, match=rf"d.jsonl: row 2: {message}"):
        _open(f)
    ps = _open(f, on_bad_row="skip")
    assert len(ps) == 1 and len(ps.skipped) == 1


def test_a_prompt_of_no_tokens_is_a_bad_row(tmp_path):
    f = tmp_path / "d.jsonl"
    tiny.write_jsonl([GOOD], f)
    with pytest.raises(DataError, match=r"row 1: the prompt renders to no tokens .*tokenizer files"):
        PromptSet(str(f), DataConfig(train_path=str(f)), _NoTokens())


def test_a_file_that_cannot_be_opened(tmp_path, monkeypatch):
    """(Permissions cannot be taken away from root, who runs the tests: the refusal is simulated.)"""
    from lowmem_grpo import sources

    f = tmp_path / "d.jsonl"
    tiny.write_jsonl([GOOD], f)

    def refuse(path, flags, *a):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(sources.os, "open", refuse)
    for name in ("d.jsonl", "d.csv"):
        (tmp_path / name).write_text(f.read_text())
        with pytest.raises(DataError, match=rf"{name}: cannot be read \(Permission denied\)"):
            _open(tmp_path / name)


def test_a_csv_record_longer_than_the_header_and_a_repeated_field_are_named(tmp_path):
    """An unquoted comma shifts a record's values: the row is bad (error or counted skip), never a row whose
    extra values hide under a key no field names. A header naming one field twice would keep one column only."""
    f = tmp_path / "d.csv"
    f.write_text("prompt,answer\n1+1=,2\nWhat is 1,000+1?,1001\n2+2=,4\n")
    with pytest.raises(DataError, match=r"d.csv: row 2 \(line 3\): 3 values for the header's 2 fields \(prompt, answer\): "
                                        r"quote a value that holds a comma"):
        _open(f)
    ps = _open(f, on_bad_row="skip")
    assert [e.row for e in ps.examples] == [GOOD, {"prompt": "2+2=", "answer": "4"}]
    assert len(ps.skipped) == 1 and ps.skipped[0].startswith("row 2: 3 values")
    (tmp_path / "quoted.csv").write_text('prompt,answer\n"What is 1,000+1?",1001\n')
    assert _open(tmp_path / "quoted.csv").examples[0].row == {"prompt": "What is 1,000+1?", "answer": "1001"}
    (tmp_path / "twice.csv").write_text("prompt,answer,prompt\n1+1=,2,x\n")
    with pytest.raises(DataError, match=r"twice.csv:1: the header names the field 'prompt' twice"):
        _open(tmp_path / "twice.csv")
    (tmp_path / "index.csv").write_text(",prompt,answer\n0,1+1=,2\n")   # pandas' to_csv with its index
    assert _open(tmp_path / "index.csv").examples[0].row == {"": "0", **GOOD}


@pytest.mark.parametrize("answer, said", [
    ([1, 2], r"holds list \[1, 2\]; expected text or a number"),
    ({"value": 2}, r"holds dict \{'value': 2\}; expected text or a number"),
    (float("nan"), r"is nan \(not a finite number\)"),
    (float("inf"), r"is inf \(not a finite number\)"),
    (True, r'holds the boolean True; write it as text \("true"\) or a number'),
])
def test_an_answer_that_is_not_text_or_a_finite_number_is_a_bad_row(tmp_path, answer, said):
    """The math and exact rewards compare the answer's text: a list would be judged as its repr, NaN as 'nan'."""
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps(GOOD) + "\n" + json.dumps({"prompt": "2+2=", "answer": answer}) + "\n")
    with pytest.raises(DataError, match=rf"d.jsonl: row 2: the answer field 'answer' {said}"):
        _open(f)
    assert len(_open(f, on_bad_row="skip")) == 1
    # numbers are answers; and data for TRL-style rewards (no answer read) is not checked
    f.write_text(json.dumps({"prompt": "2+2=", "answer": 4}) + "\n" + json.dumps({"prompt": "1/2=", "answer": 0.5}))
    assert [e.row["answer"] for e in _open(f).examples] == [4, 0.5]
    f.write_text(json.dumps({"prompt": "2+2=", "answer": answer}) + "\n")
    assert len(PromptSet(str(f), DataConfig(train_path=str(f)), tiny.build_tokenizer(), require_answer=False)) == 1


def test_a_setting_no_row_can_meet_is_an_error_without_row_advice(tmp_path):
    """Found by an audit: data.chat_template: true on a tokenizer without a template failed on row 1 with "set
    data.on_bad_row: skip to skip such rows", which then skipped every row ("no usable rows (40 skipped)"). It is
    the setting's error now, skip or not; a row's own error keeps the advice, worded for a few rows."""
    tok = tiny.build_tokenizer()
    f = tmp_path / "d.jsonl"
    tiny.write_jsonl(tiny.addition_rows(5, 0), f)
    for on_bad_row in ("error", "skip"):
        cfg = DataConfig(train_path=str(f), chat_template=True, on_bad_row=on_bad_row)
        with pytest.raises(DataError) as err:
            PromptSet(str(f), cfg, tok)
        assert "needs the tokenizer's chat template, and this tokenizer has none" in str(err.value)
        assert "on_bad_row" not in str(err.value) and "skipped" not in str(err.value)
    with pytest.raises(DataError, match=r"row 1: .*if only some rows are like this, data.on_bad_row: skip skips them"):
        PromptSet(str(f), DataConfig(train_path=str(f), max_prompt_tokens=2), tok)
