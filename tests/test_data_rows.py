"""Rows that broke the loaders (a red-team audit): each is that row's error, naming the file and row, or a
counted skip with data.on_bad_row: skip, never a traceback; a held-out set drops a row found bad late rather
than scoring another prompt twice; a long CSV field and a save_to_disk folder load."""

from __future__ import annotations

import csv
import json
import random
from fractions import Fraction

import pytest

from conftest import chat_tokenizer
from lowmem_grpo import data, tiny
from lowmem_grpo.data import DataError, PromptSet, chars_within, prompt_set, prompt_sets
from lowmem_grpo.recipe import DataConfig

GOOD = {"prompt": "1+1=", "answer": "2"}


@pytest.fixture(scope="module")
def tok():
    return tiny.build_tokenizer()


def _lines(path, *lines: str):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _open(path, tok, **cfg):
    return PromptSet(str(path), DataConfig(train_path=str(path), **cfg), tok)


# ----------------------------------------------------------------------------------------------------
# F4: an integer of more digits than Python reads from text (json.loads raises ValueError, no JSONDecodeError)

@pytest.mark.parametrize("line, said", [
    ('{"prompt": "1+1=", "answer": ' + "9" * 5000 + "}", "holds an integer of more than 4300 digits, which Python "
                                                        "will not read"),
    ('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + ', "answer": "2"}', r"not readable JSON \(nested too deeply\)"),
    ("[" * 100_000 + "]" * 100_000, r"not readable JSON \(nested too deeply\)"),   # (an array: the format check parses it)
])
@pytest.mark.parametrize("first", [True, False])   # the first row is also read for the file-level format check
def test_json_that_python_will_not_read_is_a_bad_row(tmp_path, tok, line, said, first):
    good = json.dumps(GOOD)
    f = _lines(tmp_path / "d.jsonl", *([line, good] if first else [good, line]))
    row = 1 if first else 2
    with pytest.raises(DataError, match=rf"d.jsonl: row {row}: {said}"):
        _open(f, tok)
    ps = _open(f, tok, on_bad_row="skip")
    assert len(ps) == 1 and ps.examples[0].row == GOOD
    assert len(ps.skipped) == 1 and ps.skipped[0].startswith(f"row {row}: ")


# ----------------------------------------------------------------------------------------------------
# F5: a long integer answer is a number (finite), not an OverflowError from float()

def test_a_long_integer_answer_is_a_number(tmp_path, tok):
    """400 digits: float() overflows, yet it is a finite number, and the math reward compares it exactly."""
    big = 10**399 + 7
    f = _lines(tmp_path / "d.jsonl", json.dumps({"prompt": "x=", "answer": big}), json.dumps(GOOD))
    assert [e.row["answer"] for e in _open(f, tok).examples] == [big, "2"]
    rows = [{"prompt": "x=", "answer": Fraction(10**400, 3)}, GOOD]   # a Real too large for a float: finite too
    assert len(PromptSet("rows", DataConfig(train_path="x.jsonl"), tok, rows=rows)) == 2
    # an int Python will not write as text (rows given as Python objects) cannot be compared as text: the row's
    rows = [GOOD, {"prompt": "x=", "answer": 10**5000}]
    with pytest.raises(DataError, match=r"rows: row 2: the answer field 'answer' holds an integer of \d+ bits, too "
                                        "long for Python to write as text"):
        PromptSet("rows", DataConfig(train_path="x.jsonl"), tok, rows=rows)


# ----------------------------------------------------------------------------------------------------
# F6: a lone surrogate (JSON "\ud800") reached the tokenizer, which raised TypeError

CHAT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"


@pytest.mark.parametrize("prompt", ["1+1=\ud800", [{"role": "user", "content": "1+1=\udc00"}]])
def test_a_lone_surrogate_in_a_prompt_is_a_bad_row(tmp_path, prompt):
    tok = tiny.build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps(GOOD) + "\n" + json.dumps({"prompt": prompt, "answer": "2"}) + "\n")  # (ASCII: escaped)
    with pytest.raises(DataError, match=r"d.jsonl: row 2: the prompt holds text that is not valid Unicode \(a lone "
                                        r"surrogate '\\ud[8c]00' at character \d+"):
        _open(f, tok)
    ps = _open(f, tok, on_bad_row="skip")
    assert [e.row for e in ps.examples] == [GOOD] and len(ps.skipped) == 1


# ----------------------------------------------------------------------------------------------------
# F11: a prompt longer than data.max_prompt_tokens could cover is refused before it is tokenized

class _Watched:
    """The tokenizer, refusing (AssertionError, which no row handling catches) a text over `most` characters."""

    def __init__(self, tok, most: int):
        self._tok, self._most = tok, most

    def __call__(self, text, **kwargs):
        assert len(text) <= self._most, f"the tokenizer was given {len(text)} characters"
        return self._tok(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tok, name)


@pytest.mark.parametrize("kind", ["text", "chat messages", "data.chat_template"])
def test_a_huge_prompt_is_refused_without_tokenizing_it(tmp_path, kind):
    inner = tiny.build_tokenizer()
    inner.chat_template = CHAT_TEMPLATE
    cfg = dict(max_prompt_tokens=64, chat_template=kind == "data.chat_template")
    tok = _Watched(inner, chars_within(64) + 200)   # (room for a chat template's own text)
    huge = "1" * 3_000_000
    prompt = [{"role": "user", "content": huge}] if kind == "chat messages" else huge
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps(GOOD) + "\n" + json.dumps({"prompt": prompt, "answer": "2"}) + "\n")
    with pytest.raises(DataError, match=r"d.jsonl: row 2: prompt is 30000\d\d characters, over "
                                        r"data.max_prompt_tokens=64"):
        _open(f, tok, **cfg)
    ps = _open(f, tok, on_bad_row="skip", **cfg)
    assert len(ps) == 1 and ps.skipped[0].startswith("row 2: prompt is")
    # the bound is a sure one: a text just within it is tokenized, and refused only if its tokens are too many
    f.write_text(json.dumps({"prompt": "1" * (chars_within(64) - 100), "answer": "2"}) + "\n")
    with pytest.raises(DataError, match=r"row 1: prompt is \d+ tokens, over data.max_prompt_tokens=64"):
        _open(f, tok, **cfg)


def test_a_prompt_that_fills_the_models_context_is_a_bad_row(tmp_path, tok):
    """Found by a red team: a prompt of the model's context or longer leaves no room for a completion (vLLM refused
    it mid-run with a traceback). With context_tokens it is that row's error, or a counted skip, in every split."""
    rows = [{"prompt": "1" * n + "+1=", "answer": "2"} for n in (1, 9, 10, 2)]   # BOS + n + 3 tokens: 5, 13, 14, 6
    f = tmp_path / "d.jsonl"
    tiny.write_jsonl(rows, f)
    with pytest.raises(DataError, match=r"d.jsonl: row 3: prompt is 14 tokens, which fills the model's context "
                                        r"\(14 tokens: its max_position_embeddings, or the context its RoPE scaling "
                                        r"makes\): no room is left for a completion"):
        PromptSet(str(f), DataConfig(train_path=str(f)), tok, context_tokens=14)
    ps = PromptSet(str(f), DataConfig(train_path=str(f), on_bad_row="skip"), tok, context_tokens=14)
    assert [len(e.prompt_ids) for e in ps.examples] == [5, 13, 6] and len(ps.skipped) == 1
    assert ps.skipped[0].startswith("row 3: prompt is 14 tokens, which fills the model's context")
    assert len(PromptSet(str(f), DataConfig(train_path=str(f)), tok, context_tokens=15)) == 4   # 14 < 15: room for one
    held = tmp_path / "held.jsonl"   # (a copy: eval_path may not be train_path's file)
    held.write_text(f.read_text())
    sets = prompt_sets(DataConfig(train_path=str(f), eval_path=str(held), on_bad_row="skip"), tok, context_tokens=14)
    assert [len(s) for s in sets.values()] == [3, 3] and all(len(s.skipped) == 1 for s in sets.values())


# ----------------------------------------------------------------------------------------------------
# F3: a held-out set (what eval scores) drops a row found bad after start-up; a training set replaces it

def _unchecked(n: int) -> list:
    """Positions of a set of n rows that the start-up check does not read."""
    check = set(range(data.CHECK_HEAD)) | set(random.Random("lowmem-grpo:check").sample(range(data.CHECK_HEAD, n),
                                                                                         data.CHECK_SAMPLE))
    return sorted(set(range(n)) - check)


def _late_bad_file(tmp_path, n: int):
    """n addition rows, one of them (past the start-up check's sample) with a list as its answer."""
    bad = _unchecked(n)[-1]
    f = tmp_path / "held.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": [1] if i == bad else str(i + 1)}) + "\n"
                         for i in range(n)))
    return f, bad


@pytest.fixture
def small_check(monkeypatch):
    monkeypatch.setattr(data, "CHECK_HEAD", 20)   # so that 100 rows are a "large" set
    monkeypatch.setattr(data, "CHECK_SAMPLE", 20)


def test_eval_set_drops_a_late_bad_row_and_counts_it(tmp_path, tok, small_check):
    n = 100
    f, bad = _late_bad_file(tmp_path, n)
    train = tmp_path / "train.jsonl"
    train.write_text(f.read_text())
    cfg = DataConfig(train_path=str(train), eval_path=str(f), on_bad_row="skip")
    sets = prompt_sets(cfg, tok)
    held = sets["test"]
    assert held.held_out and not sets["train"].held_out and len(held) == n   # the bad row is past the check
    texts = [e.prompt_text for e in held.examples[:n]]
    assert len(texts) == n - 1 and len(set(texts)) == n - 1 and f"{bad}+1=" not in texts   # each prompt once
    assert len(held) == n - 1 and held.skipped == [f"row {bad + 1}: the answer field 'answer' holds list [1]; "
                                                   "expected text or a number (one reference answer per row)"]
    assert [e.prompt_text for e in held.examples[:n]] == texts and len(held.skipped) == 1   # counted once
    assert [e.prompt_text for e in held.examples] == texts
    # the first k usable rows, as if the start-up check had found it
    fresh = prompt_set(cfg, tok, "test")
    assert [e.prompt_text for e in fresh.examples[: bad + 2]] == texts[: bad + 2]
    assert [e.prompt_text for e in fresh.examples[::-3]] == texts[::-3]
    # training keeps its full batches: the row is replaced by the next usable one (an eval of --split train: not)
    trained = [e.prompt_text for e in sets["train"].examples[:n]]
    assert len(trained) == n and len(set(trained)) == n - 1 and f"{bad}+1=" not in trained
    assert len(sets["train"]) == n and len(sets["train"].skipped) == 1
    evaluated = prompt_set(cfg, tok, "train", for_eval=True)
    assert evaluated.held_out and [e.prompt_text for e in evaluated.examples[:n]] == texts
    with pytest.raises(DataError, match=rf"held.jsonl: row {bad + 1}: the answer field"):   # on_bad_row=error
        prompt_set(cfg.model_copy(update={"on_bad_row": "error"}), tok, "test").examples[:n]


def test_the_held_out_split_of_the_training_file_drops_too(tmp_path, tok, small_check):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(200)]
    f = tmp_path / "d.jsonl"
    tiny.write_jsonl(rows, f)
    cfg = DataConfig(train_path=str(f), eval_fraction=0.5, on_bad_row="skip")
    _, held = data.split_indices(data.open_source(str(f)), cfg)
    bad = int(held[_unchecked(len(held))[-1]])   # a held-out row that the check does not read
    rows[bad]["answer"] = [1]                    # (same prompt: the split is the same)
    tiny.write_jsonl(rows, f)
    test = prompt_set(cfg, tok, "test")
    texts = [e.prompt_text for e in test.examples[:len(held)]]
    assert len(texts) == len(held) - 1 == len(set(texts)) and f"{bad}+1=" not in texts
    assert [s.split(":")[0] for s in test.skipped] == [f"row {bad + 1}"]


def test_a_held_out_set_drops_every_late_bad_row_once(tok, small_check):
    n = next(n for n in range(100, 300) if n - 1 in _unchecked(n))   # a set whose last row is not checked
    late = _unchecked(n)
    bad = ({late[0], late[1], late[5], late[6], n - 1} | {p for p in late if p - 1 in late and p - 2 in late}) - {n - 2}
    assert len(bad) > 5   # (the last row is bad, the one before it good)
    rows = [{"prompt": f"{i}+1=", "answer": [1] if i in bad else str(i + 1)} for i in range(n)]
    good = [r for i, r in enumerate(rows) if i not in bad]
    cfg = DataConfig(train_path="x.jsonl", on_bad_row="skip")
    for take in (lambda ps: ps.examples[:], lambda ps: list(ps.examples), lambda ps: ps.examples[:n + 5],
                 lambda ps: ps.examples[::-1][::-1]):
        ps = PromptSet("rows", cfg, tok, rows=rows, held_out=True)
        assert len(ps) == n
        assert [e.row for e in take(ps)] == good
        assert len(ps) == len(good) and len(ps.skipped) == len(bad)
    ps = PromptSet("rows", cfg, tok, rows=rows, held_out=True)
    assert [e.row for e in ps.examples[: len(good)]] == good and len(ps) == len(good) + 1   # the last: not yet met
    with pytest.raises(IndexError, match=rf"example {len(good)} of a set of {len(good)} \(rows found bad left the set\)"):
        ps.examples[len(good)]   # the last position's row is bad: it leaves, and the set has no such position
    assert len(ps) == len(good) and len(ps.skipped) == len(bad)


# ----------------------------------------------------------------------------------------------------
# F13: a CSV field over the csv module's default limit (131,072 characters) rejected the whole file

@pytest.fixture
def default_csv_limit():
    old = csv.field_size_limit(131_072)   # as a fresh process has it (another test may have raised it)
    yield
    csv.field_size_limit(old)


def test_a_csv_field_over_the_csv_modules_default_limit(tmp_path, tok, default_csv_limit):
    f = tmp_path / "d.csv"
    f.write_text("prompt,answer\n1+1=,2\n" + '"' + "x" * 200_000 + '",3\n' + "2+2=," + "4" * 150_000 + "\n")
    ps = _open(f, tok, on_bad_row="skip")   # the long prompt is a bad row of its own, skipped; the long answer loads
    assert [e.row["answer"] for e in ps.examples] == ["2", "4" * 150_000]
    assert ps.skipped == ["row 2: prompt is 200000 characters, over data.max_prompt_tokens=512 (that many tokens hold "
                          f"at most {chars_within(512)} characters)"]


# ----------------------------------------------------------------------------------------------------
# A folder written by datasets' save_to_disk

def test_a_save_to_disk_folder(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    rows = [GOOD, {"prompt": "2+2=", "answer": "4"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[:1])}).save_to_disk(str(tmp_path / "both"))
    assert data.read_rows(str(tmp_path / "one")) == rows   # a Dataset's folder: loaded (load_from_disk)
    assert [e.row for e in _open(tmp_path / "one", tok).examples] == rows
    assert len(PromptSet(str(tmp_path / "one"), DataConfig(train_path="x.jsonl"), tok, limit=1)) == 1
    assert data.read_rows(str(tmp_path / "both" / "test")) == rows[:1]   # one split of a DatasetDict's
    with pytest.raises(DataError) as err:   # a DatasetDict's folder: which split?
        data.read_rows(str(tmp_path / "both"))
    assert str(err.value) == (f"{tmp_path / 'both'}: is a folder written by DatasetDict.save_to_disk, which holds "
                              f"several splits; give one split's folder: {tmp_path / 'both' / 'train'}, "
                              f"{tmp_path / 'both' / 'test'}")
    with pytest.raises(DataError) as err:   # hf:PATH@SPLIT suggested for folders: load_dataset refuses this one
        data.read_rows(f"hf:{tmp_path / 'one'}@train")
    assert "written by Dataset.save_to_disk" in str(err.value) and f"give the folder itself ({tmp_path / 'one'})" in str(err.value)
    assert "offline" not in str(err.value) and "hub" not in str(err.value)


# ----------------------------------------------------------------------------------------------------
# Chat prompts and answers that rendered or scored wrongly (found by a red team)

# honours add_generation_prompt, as a real template does
TURNS_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{% if m.name is defined %}({{ m.name }}){% endif %}"
                  "{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def chat_tok():
    return chat_tokenizer(TURNS_TEMPLATE)


def _chat_rows(tmp_path, *prompts):
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"prompt": p, "answer": "2"}) + "\n" for p in prompts))
    return f


def _m(role, content, **more):
    return {"role": role, "content": content, **more}


def test_a_chat_prompt_that_ends_with_the_assistants_message_is_continued(tmp_path, chat_tok):
    """[user, assistant 'partial'] was rendered with a new assistant turn after 'partial'; TRL's apply_chat_template
    continues it (continue_final_message). A last user or tool message opens the assistant's turn."""
    f = _chat_rows(tmp_path, [_m("user", "1+1="), _m("assistant", "It is")],
                   [_m("user", "1+1="), _m("assistant", "", tool_calls=[{"type": "function", "function": {
                       "name": "add", "arguments": {"a": 1, "b": 1}}}]), _m("tool", "2")],
                   [_m("user", "1+1=")])
    ps = _open(f, chat_tok)
    assert [e.prompt_text for e in ps.examples] == ["<|user|>1+1=\n<|assistant|>It is",
                                                    "<|user|>1+1=\n<|assistant|>\n<|tool|>2\n<|assistant|>",
                                                    "<|user|>1+1=\n<|assistant|>"]


@pytest.mark.parametrize("prompt, said", [
    ([_m("system", "Be brief")], r"the prompt field 'prompt' ends with a system message \(prompt\[0\]\); allowed last: "
                                 r"user or tool \(the model answers it\), assistant \(the model continues it\)"),
    ([_m("user", "1+1="), _m("system", "Be brief")], r"the prompt field 'prompt' ends with a system message \(prompt\[1\]\)"),
    ([_m("assistant", "It is")], r"the prompt field 'prompt' has no user message \(its roles: assistant\); a prompt "
                                 "needs one to answer"),
    ([_m("system", "s"), _m("tool", "2")], r"the prompt field 'prompt' has no user message \(its roles: system, tool\)"),
    ([_m("user", " ")], r"the prompt field's message prompt\[0\] \(user\) is empty"),
    ([_m("user", ""), _m("user", "1+1=")], r"the prompt field's message prompt\[0\] \(user\) is empty"),
    ([_m("user", "1+1="), _m("assistant", " \n")], r"the prompt field's message prompt\[1\] \(assistant\) is empty"),
])
def test_a_chat_prompt_with_nothing_to_answer_is_a_bad_row(tmp_path, chat_tok, prompt, said):
    """As TRL refuses a last system message ("Invalid role in the last message"); a prompt of no user message and
    a blank message are refused as a blank text prompt is. Each was rendered with a new assistant turn."""
    f = _chat_rows(tmp_path, [_m("user", "1+1=")], prompt)
    with pytest.raises(DataError, match=rf"d.jsonl: row 2: {said}.* \(if only some rows"):
        _open(f, chat_tok)
    ps = _open(f, chat_tok, on_bad_row="skip")
    assert len(ps) == 1 and len(ps.skipped) == 1 and ps.skipped[0].startswith("row 2: ")


def test_an_empty_last_user_message_is_the_slot_an_environment_fills(tmp_path, chat_tok):
    """TRL's prompt for a row an environment_factory's reset() gives (trl.py's EMPTY_PROMPT): its text is appended to
    the last message, so a last user message of no text at all is no blank prompt (spaces are) in a run with an
    environment; in one without, nothing fills it, and the model was asked nothing (found by a red team)."""
    f = _chat_rows(tmp_path, [_m("user", "")], [_m("system", "s"), _m("user", "")])
    ps = PromptSet(str(f), DataConfig(train_path=str(f)), chat_tok, reset_fills=True)
    assert [e.prompt_text for e in ps.examples] == ["<|user|>\n<|assistant|>", "<|system|>s\n<|user|>\n<|assistant|>"]
    with pytest.raises(DataError, match=r"row 1: the prompt field's message prompt\[0\] \(user\) is empty \(an empty "
                                        r"last user message is the slot an environment's reset\(\) fills, and this run "
                                        r"has none\)"):
        _open(f, chat_tok)


def test_none_keys_that_arrow_gives_chat_messages_are_dropped(tmp_path, chat_tok):
    """Arrow merges the messages' structs: a message without 'name' got 'name': None, rendered 'name=None' (here
    '(None)'). Dropped, as TRL's remove_none_values does."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    f = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": [_m("user", "1+1=")], "answer": "2"},
                                         {"prompt": [_m("user", "2+2=", name="bob")], "answer": "4"}]), f)
    assert data.read_rows(str(f))[0]["prompt"] == [{"role": "user", "content": "1+1=", "name": None}]   # (Arrow's)
    ex = _open(f, chat_tok).examples
    assert [e.prompt_text for e in ex] == ["<|user|>1+1=\n<|assistant|>", "<|user|>(bob)2+2=\n<|assistant|>"]
    assert ex[0].messages == [_m("user", "1+1=")]


def test_chat_messages_stored_as_json_text_are_a_bad_row(tmp_path, chat_tok):
    """A CSV or pandas export writes a column of messages as JSON text, which became the prompt as written."""
    f = tmp_path / "d.csv"
    with open(f, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerows([["prompt", "answer"], ["1+1=", "2"], [json.dumps([_m("user", "2+2=")]), "4"],
                     ["[1, 2] sums to", "3"], ['[{"a": 1}]', "5"]])   # a list that is not messages: text
    with pytest.raises(DataError, match=r"d.csv: row 2 \(line 3\): the prompt field 'prompt' holds chat messages as JSON text "
                                        r"\('\[\{\"role\": \"user\", \"content\": \"2\+2=\"\}\]'\), which would be "
                                        r"the prompt as it is written; store them as a list of messages"):
        _open(f, chat_tok)
    ps = _open(f, chat_tok, on_bad_row="skip")
    assert [e.prompt_text for e in ps.examples] == ["1+1=", "[1, 2] sums to", '[{"a": 1}]'] and len(ps.skipped) == 1


@pytest.mark.parametrize("kind", ["jsonl", "csv"])
def test_a_blank_answer_is_a_bad_row_when_a_reward_reads_it(tmp_path, tok, kind):
    """An empty answer ('' of an empty CSV cell, or spaces): exact gave 1.0 to an empty completion, math skipped every
    completion of the prompt. The row's error, as a missing answer; no reward reading it: no matter."""
    if kind == "csv":
        f = tmp_path / "d.csv"
        f.write_text("prompt,answer\n1+1=,2\n2+2=,\n3+3=,  \n")
    else:
        f = _lines(tmp_path / "d.jsonl", json.dumps(GOOD), json.dumps({"prompt": "2+2=", "answer": ""}),
                   json.dumps({"prompt": "3+3=", "answer": "  "}))
    with pytest.raises(DataError, match=rf"d.{kind}: row 2( \(line 3\))?: the answer field 'answer' is empty "
                                        r"\(if only some rows"):
        _open(f, tok)
    ps = _open(f, tok, on_bad_row="skip")
    assert len(ps) == 1 and ps.skipped == ["row 2: the answer field 'answer' is empty",
                                           "row 3: the answer field 'answer' is empty"]
    assert len(PromptSet(str(f), DataConfig(train_path=str(f)), tok, require_answer=False)) == 3


def test_a_decimal_answer_is_a_number(tmp_path, tok):
    """A Parquet decimal column was refused ("holds Decimal ...; expected text or a number"): it is a number
    (decimal.Decimal is no numbers.Real), finite or the row's error."""
    from decimal import Decimal

    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["5/2=", "8/2="], "answer": pa.array([Decimal("2.50"), Decimal("4.00")],
                                                                          pa.decimal128(5, 2))}), f)
    assert [e.row["answer"] for e in _open(f, tok).examples] == [Decimal("2.50"), Decimal("4.00")]
    with pytest.raises(DataError, match=r"rows: row 2: the answer field 'answer' is NaN \(not a finite number\)"):
        PromptSet("rows", DataConfig(train_path="x.jsonl"), tok, rows=[GOOD, {"prompt": "x=", "answer": Decimal("NaN")}])
