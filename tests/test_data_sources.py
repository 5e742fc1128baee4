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
from lowmem_grpo.sources import open_source


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


def test_the_quickstarts_warm_start_probes_problems_it_neither_trains_on_nor_holds_out():
    """The probe that stops the quickstart's warm start measures generalisation, and GRPO trains on problems the warm
    start never saw (tiny.warm_start_split): a probe of training rows stopped it on a memorising base
    (docs/benchmarks.md, quickstart)."""
    from lowmem_grpo import tiny

    train, held = tiny.split_addition_data(n_train=2000, n_test=200, seed=1234)
    pool, probe = tiny.warm_start_split(train + held)
    pool_p, probe_p, seen = ({r["prompt"] for r in rows} for rows in (pool, probe, train + held))
    assert len(probe_p) == 200 and len(pool_p) == len(pool) and pool_p.isdisjoint(probe_p)
    assert seen.isdisjoint(pool_p | probe_p) and len(pool_p | probe_p | seen) == 100 * 100
    assert all(eval(r["prompt"][:-1]) == int(r["answer"]) for r in pool + probe)
    assert tiny.warm_start_split(train + held) == (pool, probe)   # seeded


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
    (tmp_path / "array.jsonl").write_text(json.dumps([GOOD] * 3, indent=2))   # (a .json file may hold an array)
    (tmp_path / "line.jsonl").write_text(json.dumps([GOOD] * 3))
    (tmp_path / "pretty.jsonl").write_text(json.dumps(GOOD, indent=2))
    for name, what in (("array.jsonl", "an array"), ("line.jsonl", "an array"),
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


# ----------------------------------------------------------------------------------------------------
# Files a red team made: each was a misleading row error, or worse, rows silently lost

def _csv(tmp_path, text, name="d.csv"):
    f = tmp_path / name
    f.write_bytes(text.encode() if isinstance(text, str) else text)
    return f


def test_a_csv_quote_that_never_closes_is_a_file_error(tmp_path):
    """The csv module reads a quote that never closes to the end of the file: rows 11-30 were one record, blamed as
    row 11's null answer, and with on_bad_row: skip training went on with 10 rows."""
    rows = [f"q{i},{i}" for i in range(30)]
    rows[10] = '"q10 with an unclosed quote,10'
    f = _csv(tmp_path, "prompt,answer\n" + "\n".join(rows) + "\n")
    for on_bad_row in ("error", "skip"):
        with pytest.raises(DataError) as err:
            _open(f, on_bad_row=on_bad_row)
        assert str(err.value) == (f"{f}:12: a quoted value opens on this line and its quote never closes, so it runs "
                                  "to the end of the file (line 31), swallowing the 19 lines after it into one value; "
                                  'close the quote (a quote inside a quoted value is written twice: "")')
    assert len(open_source(str(f), limit=5)) == 5   # the first rows alone: not reached
    with pytest.raises(DataError, match=r"d.csv:12: a quoted value opens"):
        open_source(str(f), limit=20)
    # the quote opens on a later line of its record (after a quoted line break), and the last line has no line end
    _csv(tmp_path, 'prompt,answer,note\n1+1=,2,x\n"a\r\nb",3,"open\r\nto the end', "late.csv")
    with pytest.raises(DataError, match=r"late.csv:4: .*to the end of the file \(line 5\), swallowing the 1 line "):
        _open(tmp_path / "late.csv")
    _csv(tmp_path, 'prompt,answer\n1+1=,2\n"2+2=,4\n', "lastline.csv")
    with pytest.raises(DataError, match=r"lastline.csv:3: .*runs to the end of the file \(line 3\); close the quote"):
        _open(tmp_path / "lastline.csv")
    _csv(tmp_path, 'prompt,"answer\n1+1=,2\n', "header.csv")
    with pytest.raises(DataError, match=r"header.csv:1: a quoted value opens .* swallowing the 1 line after it"):
        _open(tmp_path / "header.csv")
    # closed quotes, a quote inside an unquoted value, and text after a closing quote stay as they were
    for text, last in (('prompt,answer\n1+1=,2\n"a\nb ""c""",3\n', 'a\nb "c"'),
                       ('prompt,answer\n1+1=,2\n"a\r\nb",3', "a\r\nb"),
                       ('prompt,answer\n1+1=,2\nsay "hi,3\n', 'say "hi'),
                       ('prompt,answer\n1+1=,2\n"a"b,3\n', "ab")):
        assert [r["prompt"] for r in read_rows(str(_csv(tmp_path, text)))] == ["1+1=", last]


def test_the_file_changed_error_says_what_a_resume_does(tmp_path):
    f = tmp_path / "d.jsonl"
    tiny.write_jsonl([GOOD] * 3, f)
    src = open_source(str(f))
    with open(f, "a") as out:
        out.write(json.dumps(GOOD) + "\n")
    with pytest.raises(DataError) as err:
        src.row(0)
    assert str(err.value) == (f"{f}: the file changed on disk after it was indexed at start-up; restart the run (or "
                              "write new data to a new file): --resume continues from the last checkpoint; a changed "
                              "row count changes the prompt order from there")


@pytest.mark.parametrize("header, said", [
    ("prompt, answer", r"the header's field ' answer' has leading whitespace"),
    ("prompt ,answer", r"the header's field 'prompt ' has trailing whitespace"),
    ("prompt,\tanswer ", r"the header's field '\\tanswer ' has leading and trailing whitespace"),
])
def test_a_csv_header_field_with_spaces_is_named_at_open(tmp_path, header, said):
    """'prompt, answer' names the field ' answer': "missing field 'answer' (row has:  answer, prompt)" hid why."""
    f = _csv(tmp_path, f"{header}\n1+1=,2\n")
    for on_bad_row in ("error", "skip"):
        with pytest.raises(DataError, match=rf"^{f}:1: {said}, which is part of its name in CSV; remove the spaces "
                                            "around the commas in the header$"):
            _open(f, on_bad_row=on_bad_row)
    assert read_rows(str(_csv(tmp_path, ",prompt,answer\n0,1+1=,2\n")))[0] == {"": "0", **GOOD}   # pandas' index


@pytest.mark.parametrize("sep, what", [(";", "semicolon"), ("\t", "tab")])
def test_a_semicolon_or_tab_separated_csv_is_named(tmp_path, sep, what):
    f = _csv(tmp_path, f"prompt{sep}answer\n1+1={sep}2\n")
    with pytest.raises(DataError) as err:
        _open(f, on_bad_row="skip")
    assert str(err.value) == (f"{f}:1: the header {'prompt' + sep + 'answer'!r} is one field holding {sep!r}: the "
                              f"file looks {what}-separated, and a .csv file is read comma-separated; save it with "
                              f"commas (e.g. pandas.read_csv(path, sep={sep!r}).to_csv(new_path, index=False))")
    # one field with no separator in it is a one-column file, and a comma makes the header several fields
    assert read_rows(str(_csv(tmp_path, "prompt\n1+1=\n"))) == [{"prompt": "1+1="}]
    one_comma = _csv(tmp_path, f"prompt,answer{sep}x\n1+1=,2\n")
    assert read_rows(str(one_comma)) == [{"prompt": "1+1=", f"answer{sep}x": "2"}]


def test_a_csv_record_shorter_than_the_header_is_a_bad_row(tmp_path):
    """It was "field 'answer' is null (the row has it, with no value)", which blamed the field, not the record."""
    f = _csv(tmp_path, "prompt,answer\n1+1=,2\nWhat is\n2+2=,4\n")   # a line break in an unquoted value
    with pytest.raises(DataError, match=r"d.csv: row 2 \(line 3\): 1 value for the header's 2 fields "
                                        r"\(prompt, answer\): write every field's value, an empty one as nothing "
                                        r"between its commas, and quote a value that holds a line break"):
        _open(f)
    ps = _open(f, on_bad_row="skip")
    assert [e.row for e in ps.examples] == [GOOD, {"prompt": "2+2=", "answer": "4"}]
    assert ps.skipped == ["row 2: 1 value for the header's 2 fields (prompt, answer): write every field's value, an "
                          "empty one as nothing between its commas, and quote a value that holds a line break"]
    assert read_rows(str(_csv(tmp_path, "prompt,answer,note\n1+1=,2,\n")))[0] == {**GOOD, "note": ""}


def test_a_byte_that_is_not_utf8_in_a_csv_is_a_bad_row(tmp_path):
    """It failed the whole file, skip or not, where a JSONL file skips the line."""
    f = _csv(tmp_path, b"prompt,answer\n1+1=,2\nq\xff,3\n\"\xc3\xa9\xfe\n\",4\n2+2=,4\n")
    with pytest.raises(DataError, match=r"d.csv: row 2 \(line 3\): not valid UTF-8 \(invalid start byte\)"):
        _open(f)
    ps = _open(f, on_bad_row="skip")
    assert [e.row for e in ps.examples] == [GOOD, {"prompt": "2+2=", "answer": "4"}]
    assert ps.skipped == ["row 2: not valid UTF-8 (invalid start byte)", "row 3: not valid UTF-8 (invalid start byte)"]
    with pytest.raises(DataError, match=r"d.csv:3: not valid UTF-8 \(invalid start byte\)"):   # read_rows: its line
        read_rows(str(f))
    f.write_bytes(b"prompt,answ\xe9r\n1+1=,2\n")   # (Latin-1) in the header: no field can be named
    with pytest.raises(DataError, match=r"d.csv:1: the header is not valid UTF-8; save the file as UTF-8"):
        _open(f, on_bad_row="skip")


def test_a_json_file_holding_an_array_is_read_as_rows(tmp_path):
    """As `datasets` reads it. Read as JSON Lines, its lines were bad rows but one that happened to be a whole object,
    which with on_bad_row: skip was all it trained on."""
    rows = [GOOD, {"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3=", "answer": 6}]
    f = tmp_path / "d.json"
    for text in (json.dumps(rows, indent=2), json.dumps(rows), "\ufeff\n\n " + json.dumps(rows) + "\n\n",
                 "[" + ",\n".join(map(json.dumps, rows)) + "]\n"):   # (the red team's: [{...},\n{...},\n{...}])
        f.write_text(text, encoding="utf-8")
        assert [e.row for e in _open(f, on_bad_row="error").examples] == rows
    f.write_text('[\r\n  {"prompt": "1+1=", "answer": "2"},\r\n  [1, 2],\r\n\r\n  "x", ' + json.dumps(rows[1]) + "]")
    src = open_source(str(f))
    assert len(src) == 4 and [src.line(i) for i in range(4)] == [2, 3, 5, 5]
    with pytest.raises(DataError, match=r"d.json: row 2 \(line 3\): expected a JSON object, got list"):
        _open(f)
    ps = _open(f, on_bad_row="skip")
    assert [e.row for e in ps.examples] == [GOOD, rows[1]] and len(ps.skipped) == 2
    f.write_bytes(b'[{"prompt": "1+1=", "answer": "2"},\n {"prompt": "q\xff", "answer": "3"}]')
    assert _open(f, on_bad_row="skip").skipped == ["row 2: not valid UTF-8"]
    # a broken array is the file's error, naming where; so is text after it
    for text, where in (('[{"prompt": "1+1=", "answer": "2"},\n {"prompt": "2+2=" "answer": "4"}]',
                         r"2: not valid JSON \(Expecting ',' delimiter, column 20\)"),
                        ('[{"prompt": "1+1=", "answer": "2"}\n {"prompt": "2+2="}]',
                         r"2: not valid JSON \(Expecting ',' delimiter or '\]', column 2\)"),
                        ('[{"prompt": "1+1=", "answer": "2"},\n', r"2: not valid JSON \(Expecting value, column 1\)"),
                        ('[\n{"prompt": "1+1=", "answer": "2"}\n]\n{"prompt": "x"}', r"4: text follows the end of the "
                         r"JSON array \(column 1\)")):
        f.write_text(text)
        for on_bad_row in ("error", "skip"):
            with pytest.raises(DataError, match=rf"d.json:{where}; a .json file that starts with '\[' is read as one "
                                                r"JSON array of row objects"):
                _open(f, on_bad_row=on_bad_row)
    # JSON Lines in a .json file, whose first row is a list of values: still JSON Lines (the list a bad row)
    f.write_text("[1, 2]\n" + json.dumps(GOOD) + "\n")
    assert [e.row for e in _open(f, on_bad_row="skip").examples] == [GOOD]
    f.write_text("[]")
    with pytest.raises(DataError, match=r"d.json: no usable rows"):
        _open(f)


@pytest.mark.parametrize("head, said", [
    (b"\xff\xfe", "looks UTF-16 encoded (it starts with a UTF-16 byte order mark): save it as UTF-8"),
    (b"\xfe\xff", "looks UTF-16 encoded (it starts with a UTF-16 byte order mark): save it as UTF-8"),
    (b"\xff\xfe\x00\x00", "looks UTF-32 encoded (it starts with a UTF-32 byte order mark): save it as UTF-8"),
    (b"\x1f\x8b", "is gzip-compressed: decompress it (gunzip) and give the file it holds"),
])
def test_a_file_in_another_encoding_or_compressed_is_named(tmp_path, head, said):
    """Each was "not valid UTF-8" on every row (or the first line), which named no cause."""
    import gzip

    text = "prompt,answer\n1+1=,2\n"
    body = {b"\xff\xfe": text.encode("utf-16-le"), b"\xfe\xff": text.encode("utf-16-be"),
            b"\xff\xfe\x00\x00": text.encode("utf-32-le"), b"\x1f\x8b": gzip.compress(text.encode())[2:]}[head]
    for name in ("d.csv", "d.jsonl", "d.json"):
        f = _csv(tmp_path, head + body, name)
        for on_bad_row in ("error", "skip"):
            with pytest.raises(DataError) as err:
                _open(f, on_bad_row=on_bad_row)
            assert str(err.value) == f"{f}: {said}"


def test_a_data_path_starting_with_a_tilde_is_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    tiny.write_jsonl([GOOD], tmp_path / "d.jsonl")
    (tmp_path / "d.csv").write_text("prompt,answer\n1+1=,2\n")
    assert read_rows("~/d.jsonl") == read_rows("~/d.csv") == [GOOD]
    assert [e.row for e in _open("~/d.jsonl").examples] == [GOOD]
    with pytest.raises(DataError, match=r"^~/nothing.jsonl: file not found$"):
        read_rows("~/nothing.jsonl")
