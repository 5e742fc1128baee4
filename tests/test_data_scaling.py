"""Data that does not have to fit in Python objects (issue 14): prompt selection is O(prompts per step) and
gives the same order as before; rows are read lazily and equal what the eager readers gave; a bad row
met when its batch comes is named or counted; the held-out split is the one the eager code made; memory
stays bounded."""

from __future__ import annotations

import csv
import json
import os
import random
import subprocess
import sys

import pytest

from lowmem_grpo import data, hub, sources, tiny
from lowmem_grpo.data import DataChanged, DataError, PromptSet, batch_indices, prompt_sets, read_rows, split_indices
from lowmem_grpo.recipe import DataConfig


@pytest.fixture(scope="module")
def tok():
    return tiny.build_tokenizer()


# ----------------------------------------------------------------------------------------------------
# References: the eager code this replaced, kept verbatim in behaviour (obviously correct, slow).

def old_batch_indices(n, batch_size, step, seed):
    out = []
    for pos in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(pos, n)
        order = list(range(n))
        random.Random(f"{seed}:{epoch}").shuffle(order)
        out.append(order[offset])
    return out


def old_jsonl(path):
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    return rows


def old_csv(path):
    with open(path, newline="") as f:
        return [dict(r) for r in csv.DictReader(f)]


def old_split(rows, cfg):
    keys = [data._prompt_key(r, cfg) for r in rows]
    distinct = sorted(set(keys))
    random.Random(f"split:{cfg.split_seed}").shuffle(distinct)
    held = set(distinct[:min(len(distinct) - 1, max(1, round(cfg.eval_fraction * len(distinct))))])
    return [r for r, k in zip(rows, keys) if k not in held], [r for r, k in zip(rows, keys) if k in held]


# ----------------------------------------------------------------------------------------------------
# Prompt selection

@pytest.mark.parametrize("n, batch, seed", [(1, 4, 0), (3, 8, 1), (10, 4, 1), (10, 10, 2), (37, 5, 3),
                                            (64, 64, 0), (1000, 64, 7), (2500, 300, 11)])
def test_selection_is_the_old_per_prompt_order(n, batch, seed):
    per_epoch = -(-n // batch)
    steps = sorted({0, 1, per_epoch - 1, per_epoch, per_epoch + 1, 2 * per_epoch, 3 * per_epoch + 2})
    expected = {step: old_batch_indices(n, batch, step, seed) for step in steps}
    for step in steps:  # steps at and around the epoch boundaries of the first three epochs
        assert batch_indices(n, batch, step, seed) == expected[step], (n, batch, seed, step)
    for step in reversed(steps):  # a resumed run asks for a later epoch first; the cache must not matter
        assert batch_indices(n, batch, step, seed) == expected[step]


def test_selection_with_interleaved_sets_and_seeds():
    # the trainer and eval may draw from sets of different sizes; cached epochs are keyed on all of it
    for step in range(12):
        for n, seed in ((50, 0), (51, 0), (50, 1)):
            assert batch_indices(n, 8, step, seed) == old_batch_indices(n, 8, step, seed)
    with pytest.raises(ValueError, match="at least 1"):
        batch_indices(0, 4, 0, 0)


def test_an_epoch_order_is_built_once(monkeypatch):
    data._EPOCHS.clear()
    built = []
    real = random.Random.shuffle

    def counting(self, x):
        built.append(len(x))
        return real(self, x)

    monkeypatch.setattr(random.Random, "shuffle", counting)
    for step in range(40):  # 10 steps an epoch: 4 epochs
        batch_indices(100, 10, step, 5)
    assert built == [100] * 4  # one shuffle per epoch, not one per prompt (400)


# ----------------------------------------------------------------------------------------------------
# Lazy rows equal eager rows

JSONL_TEXT = ('{"prompt": "1+1=", "answer": "2", "n": 1}\r\n'
              "\r\n   \n"                                                  # blank lines are not rows
              '{"prompt": "b\u2028c", "answer": 3, "extra": [1, {"k": null}]}\r'  # a bare \r ends a line too
              '{"prompt": "\u00e9", "answer": 2.5}\n'
              "\u00a0\n"                                                   # Unicode whitespace: blank
              '\t{"prompt": "t", "answer": true, "n": "mixed types across rows"}\n'
              '{"answer": "no prompt here"}\n'
              '{"prompt": "last line, no line end", "answer": "0"}')


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1 << 20])
def test_lazy_jsonl_rows_equal_eager(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(sources, "_CHUNK", chunk)  # small chunks: lines and \r\n pairs cut across reads
    f = tmp_path / "d.jsonl"
    f.write_bytes(JSONL_TEXT.encode())
    eager = old_jsonl(f)
    src = data.open_source(str(f))
    assert [src.row(i) for i in range(len(src))] == eager == read_rows(str(f))
    assert [r for _, r in src.iter_rows(block=2)] == eager
    assert [src.line(i) for i in range(len(src))] == [1, 4, 5, 7, 8, 9]  # text mode's line numbers
    assert [len(data.open_source(str(f), limit=k)) for k in (0, 2, 10)] == [0, 2, 6]


def test_lazy_csv_rows_equal_eager(tmp_path, tok):
    f = tmp_path / "d.csv"
    f.write_bytes(b'q,a,note\r\n1+2,3,"a quoted\r\nfield on two lines"\r\n\r\n'
                  b'2+2,4\n'                                  # a short record: a bad row (DictReader: note None)
                  b'3+3,6,x,extra1,extra2\n'                  # a long one: a bad row (DictReader: extras under None)
                  b'"4+4",8,\xc3\xa9\r'                       # a bare \r line end
                  b'5+5,,""\n6+6,12,last')
    eager = old_csv(f)
    assert eager[1]["note"] is None and eager[2][None] == ["extra1", "extra2"]
    good = [eager[0], *eager[3:]]
    src = data.open_source(str(f))
    assert [src.row(i) for i in range(len(src)) if i not in (1, 2)] == good
    with pytest.raises(data.Unreadable, match=r"2 values for the header's 3 fields \(q, a, note\)"):
        src.row(1)
    with pytest.raises(data.Unreadable, match=r"5 values for the header's 3 fields \(q, a, note\)"):
        src.row(2)
    with pytest.raises(data.DataError, match=r"d.csv:5: 2 values for the header's 3 fields"):
        read_rows(str(f))
    assert eager[0]["note"] == "a quoted\r\nfield on two lines"
    assert [src.line(i) for i in range(len(src))] == [2, 5, 6, 7, 8, 9]
    ps = PromptSet(str(f), DataConfig(train_path=str(f), prompt_field="q", answer_field="a", on_bad_row="skip"), tok)
    assert [e.row for e in ps.examples] == [eager[0], eager[3], eager[5]]   # 5+5's answer "" is empty: a bad row
    starts = ["row 2: 2 values", "row 3: 5 values", "row 5: the answer field 'a' is empty"]
    assert [skip[:len(start)] for skip, start in zip(ps.skipped, starts)] == starts and len(ps.skipped) == 3


def _arrow_rows():
    return [{"prompt": f"{i}+1=", "answer": i + 1, "nums": [i, i + 1], "meta": {"k": str(i)}, "opt": None if i % 2 else 1.5}
            for i in range(30)]


@pytest.mark.parametrize("kind", ["parquet", "hf-jsonl", "hf-parquet"])
def test_lazy_arrow_rows_equal_eager(tmp_path, tok, kind):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _arrow_rows()
    folder = tmp_path / "ds"
    folder.mkdir()
    if kind == "hf-jsonl":
        (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), folder / "train.parquet")
    source = str(folder / "train.parquet") if kind == "parquet" else f"hf:{folder}@train"
    eager = pq.read_table(folder / "train.parquet").to_pylist() if kind == "parquet" else hub.load_rows(source)
    assert eager == rows
    src = data.open_source(source)
    assert [src.row(i) for i in range(len(src))] == rows == [r for _, r in src.iter_rows(block=7)]
    ps = PromptSet(source, DataConfig(train_path=source), tok)
    assert [e.row for e in ps.examples] == rows and [e.row for e in ps.examples[5:9]] == rows[5:9]
    assert len(PromptSet(source, DataConfig(train_path=source), tok, limit=4)) == 4


def test_examples_is_a_sequence(tmp_path, tok):
    rows = [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(20)]
    ps = PromptSet("rows", DataConfig(train_path="x.jsonl"), tok, rows=rows)
    ex = ps.examples
    assert len(ex) == 20 and ex[-1].row is rows[-1] and [e.row for e in ex[::7]] == rows[::7]
    assert [e.row for e in ex] == rows and ex[3] is ex[3]  # cached: rendered once
    with pytest.raises(IndexError):
        ex[20]
    assert ps.longest_prompt() == max((e.prompt_ids for e in ex), key=len)


# ----------------------------------------------------------------------------------------------------
# Bad rows met when their batch comes

def _write_addition(path, n, bad: dict = None, blank_first=True):
    """n addition rows; `bad` maps a 0-based row to the text of its line instead."""
    with open(path, "w") as f:
        if blank_first:
            f.write("\n")  # so that row numbers and line numbers differ by one
        for i in range(n):
            f.write((bad or {}).get(i, json.dumps({"prompt": f"{i}+0=", "answer": str(i)})) + "\n")
    return path


def _step_drawing(pos, n, batch, seed):
    return next(s for s in range(10 * n // batch) if pos in batch_indices(n, batch, s, seed))


@pytest.mark.parametrize("bad_line, message", [('{"prompt": "x"}', "missing field 'answer'"),
                                               ('{"prompt": "x", "answer": ', "not valid JSON"),
                                               ('{"prompt": "99999999999999+0=", "answer": "1"}',
                                                "prompt is 18 tokens, over data.max_prompt_tokens=12")])
def test_a_bad_row_deep_in_a_large_file(tmp_path, tok, monkeypatch, bad_line, message):
    monkeypatch.setattr(data, "CHECK_HEAD", 300)  # a small start-up check, so that 20,000 rows are "large"
    monkeypatch.setattr(data, "CHECK_SAMPLE", 200)
    n, deep = 20_000, 15_000
    f = _write_addition(tmp_path / "d.jsonl", n, {deep: bad_line})
    cfg = DataConfig(train_path=str(f), max_prompt_tokens=12)
    ps = PromptSet(str(f), cfg, tok)  # the bad row is past the check: start-up succeeds
    assert len(ps) == n and ps.checked == 500 and deep not in random.Random("lowmem-grpo:check").sample(range(300, n), 200)
    step = _step_drawing(deep, n, 64, 3)
    with pytest.raises(DataError) as err:
        [ps.examples[i] for i in batch_indices(n, 64, step, 3)]
    assert f"d.jsonl: row {deep + 1} (line {deep + 2}): {message}" in str(err.value)
    assert "data.on_bad_row: skip" in str(err.value)

    skip = cfg.model_copy(update={"on_bad_row": "skip"})
    runs = []
    for _ in range(2):  # a fresh set (as after a resume) gives the same prompts
        ps = PromptSet(str(f), skip, tok)
        batch = [ps.examples[i] for i in batch_indices(n, 64, step, 3)]
        assert len(batch) == 64 and len(ps.skipped) == 1 and ps.skipped[0].startswith(f"row {deep + 1}: ")
        runs.append([e.row for e in batch])
        assert {"prompt": f"{deep + 1}+0=", "answer": str(deep + 1)} in runs[-1]  # replaced by the next row
        assert all(r.get("answer") is not None and r["prompt"] != "x" for r in runs[-1])
        [ps.examples[i] for i in batch_indices(n, 64, step, 3)]
        assert len(ps.skipped) == 1  # counted once, however often its batch comes
    assert runs[0] == runs[1]


def test_bad_rows_in_the_start_up_check_leave_the_set(tmp_path, tok):
    f = _write_addition(tmp_path / "d.jsonl", 50, {3: '{"prompt": "x"}', 10: "[1, 2]"})
    with pytest.raises(DataError, match=r"d.jsonl: row 4 \(line 5\): missing field 'answer' \(row has: prompt\) \(if only some rows are like this, data.on_bad_row: skip skips them"):
        PromptSet(str(f), DataConfig(train_path=str(f)), tok)
    ps = PromptSet(str(f), DataConfig(train_path=str(f), on_bad_row="skip"), tok)
    assert len(ps) == 48 and ps.skipped == ["row 4: missing field 'answer' (row has: prompt)",
                                            "row 11: expected a JSON object, got list"]
    rows = old_jsonl(f)
    good = [r for r in rows if isinstance(r, dict) and "answer" in r]
    assert [e.row for e in ps.examples] == good  # the order of batches is over the usable rows, as before


def test_a_file_changed_after_indexing_is_an_error(tmp_path, tok):
    f = _write_addition(tmp_path / "d.jsonl", 3000, blank_first=False)
    ps = PromptSet(str(f), DataConfig(train_path=str(f)), tok)
    with open(f, "a") as out:
        out.write(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(DataChanged, match="d.jsonl: the file changed on disk"):
        [ps.examples[i] for i in range(len(ps))]


# ----------------------------------------------------------------------------------------------------
# The held-out split

def test_split_indices_equal_the_eager_split():
    rng = random.Random(0)
    words = ["a", "b", "\u00e9", "\u4e2d", "\U0001f600", "\ud800", "Z", " ", "aa"]  # code-point order != naive
    rows = [{"prompt": "".join(rng.choices(words, k=rng.randint(0, 3))), "answer": "1"} for _ in range(500)]
    rows += [{"question": "no prompt field", "answer": i % 3} for i in range(20)]  # keyed by the whole row
    for seed, frac in ((0, 0.1), (3, 0.25), (9, 0.5)):
        cfg = DataConfig(train_path="x.jsonl", eval_fraction=frac, split_seed=seed)
        train, held = old_split(rows, cfg)
        assert data.split_rows(rows, cfg) == (train, held)
        t, h = split_indices(sources.ListSource("x", rows), cfg)
        assert [rows[i] for i in t] == train and [rows[i] for i in h] == held


def test_split_of_a_file_keeps_file_row_numbers(tmp_path, tok):
    n = 400
    f = _write_addition(tmp_path / "d.jsonl", n, {n - 1: '{"prompt": "x"}'})
    cfg = DataConfig(train_path=str(f), eval_fraction=0.2, split_seed=1, on_bad_row="skip")
    sets = prompt_sets(cfg, tok)
    train_rows, held_rows = old_split(old_jsonl(f), cfg)
    assert [e.row for e in sets["test"].examples] == held_rows
    bad_in_train = {"prompt": "x"} in train_rows
    assert [e.row for e in sets["train"].examples] == [r for r in train_rows if r != {"prompt": "x"}]
    where = sets["train"] if bad_in_train else sets["test"]
    assert where.skipped == [f"row {n}: missing field 'answer' (row has: prompt)"]  # the file's row, not the part's
    with pytest.raises(DataError, match=rf"data.train_path: .*d.jsonl \((training|held-out) part, .*\): row {n} \(line {n + 1}\)"):
        prompt_sets(cfg.model_copy(update={"on_bad_row": "error"}), tok)


# ----------------------------------------------------------------------------------------------------
# Memory

_RSS_CHILD = r"""
import json, sys
from lowmem_grpo import tiny
from lowmem_grpo.data import PromptSet, batch_indices
from lowmem_grpo.recipe import DataConfig

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 1024

path, how = sys.argv[1], sys.argv[2]
tok = tiny.build_tokenizer()
tok("1+1=", add_special_tokens=False)
before = rss()
if how == "lazy":
    ps = PromptSet(path, DataConfig(train_path=path), tok)
    batch = [ps.examples[i] for i in batch_indices(len(ps), 64, 0, 0)]
    n = len(ps)
else:  # what reading it whole cost: every row a dict (before any rendering)
    rows = [json.loads(line) for line in open(path) if line.strip()]
    n = len(rows)
print(json.dumps({"n": n, "mib": rss() - before}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="VmRSS is read from /proc (Linux)")
def test_a_large_jsonl_set_keeps_memory_bounded(tmp_path):
    n = 200_000
    f = _write_addition(tmp_path / "big.jsonl", n, blank_first=False)
    growth = {}
    for how in ("lazy", "eager"):
        p = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(f), how], capture_output=True, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout.strip().splitlines()[-1])
        assert out["n"] == n
        growth[how] = out["mib"]
    # Lazy: 16 bytes of index a row (3 MiB) plus the checked and cached examples. Eager: ~40 MiB of dicts.
    assert growth["eager"] > 20, growth
    assert growth["lazy"] < growth["eager"] / 3, growth


def test_unreadable_files_are_named_errors(tmp_path):
    pq = tmp_path / "x.parquet"
    pq.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"x.parquet: cannot read it as parquet: "):
        data.open_source(str(pq))
    bad = tmp_path / "x.csv"
    bad.write_bytes(b"q,a\n1,2\n\xff\xfe,3\n")
    with pytest.raises(DataError, match=r"x.csv:3: not valid UTF-8"):   # (open_source: a bad row of a lazy source)
        read_rows(str(bad))
