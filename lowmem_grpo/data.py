"""Prompt data: read rows from a file, render prompts, and serve batches in a resumable order.

Rows are dicts (one JSON object per line, a CSV row, a Parquet row). The recipe names the prompt and
answer fields; the whole row is passed to reward functions, so extra fields (tests, numbers, target)
reach them untouched. A row missing a field is an error naming the file and row, or a counted skip with
`data.on_bad_row: skip`.

A source is a file (.jsonl, .csv, .parquet) or a Hugging Face dataset split (`hf:NAME[:CONFIG]@SPLIT`,
hub.py). Without `data.eval_path`, `data.eval_fraction` holds out a seeded share of the training rows,
grouped by prompt so that no held-out prompt is also a training prompt (`split_rows`).
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from pathlib import Path

from . import hub
from .recipe import DataConfig


class DataError(Exception):
    pass


def read_rows(path: str) -> list[dict]:
    if hub.is_hub(path):
        try:
            return hub.load_rows(path)
        except ValueError as exc:
            raise DataError(f"{path}: {exc}") from None
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{path}: file not found")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json"):
        rows = []
        with open(p) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
                rows.append(row)
        return rows
    if suffix == ".csv":
        with open(p, newline="") as f:
            return [dict(r) for r in csv.DictReader(f)]
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading Parquet needs pyarrow (pip install 'lowmem-grpo[data]')") from None
        return pq.read_table(p).to_pylist()
    raise DataError(f"{path}: unknown file type {suffix!r}; allowed: .jsonl, .csv, .parquet")


@dataclass
class Example:
    row: dict          # the dataset row, untouched
    prompt_text: str   # what the model sees (template and chat template applied)
    prompt_ids: list   # its token ids


class PromptSet:
    """The usable rows of one source, rendered and tokenized once. `limit`: read only the first N rows.
    `rows`: these rows instead of reading `path` (which then only labels errors)."""

    def __init__(self, path: str, cfg: DataConfig, tokenizer, limit: int | None = None, rows: list | None = None):
        self.path, self.cfg = path, cfg
        self.examples: list[Example] = []
        self.skipped: list[str] = []
        for i, row in enumerate((read_rows(path) if rows is None else rows)[:limit], 1):
            try:
                self.examples.append(self._render(row, tokenizer))
            except DataError as exc:
                if cfg.on_bad_row == "error":
                    raise DataError(f"{path}: row {i}: {exc} (set data.on_bad_row: skip to skip such rows)") from None
                self.skipped.append(f"row {i}: {exc}")
        if not self.examples:
            raise DataError(f"{path}: no usable rows" + (f" ({len(self.skipped)} skipped, first: {self.skipped[0]})" if self.skipped else ""))

    def _render(self, row: dict, tokenizer) -> Example:
        cfg = self.cfg
        for name in (cfg.prompt_field, cfg.answer_field):
            if name not in row or row[name] is None:
                raise DataError(f"missing field {name!r} (row has: {', '.join(sorted(map(str, row))) or 'nothing'})")
        text = fill_template(row, cfg)
        if cfg.chat_template:
            messages = ([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else [])
            messages.append({"role": "user", "content": text})
            try:
                text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception as exc:  # e.g. a tokenizer with no chat template: transformers raises ValueError
                raise DataError(f"data.chat_template is true but the tokenizer cannot apply one: {exc}") from None
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if tokenizer.bos_token_id is not None and (not ids or ids[0] != tokenizer.bos_token_id):
                ids = [tokenizer.bos_token_id] + ids
        if len(ids) > cfg.max_prompt_tokens:
            raise DataError(f"prompt is {len(ids)} tokens, over data.max_prompt_tokens={cfg.max_prompt_tokens}")
        return Example(row, text, ids)

    def __len__(self) -> int:
        return len(self.examples)


def fill_template(row: dict, cfg: DataConfig) -> str:
    """`data.template` filled from the row's fields plus {prompt} (the prompt field's value)."""
    fields = {str(k): v for k, v in row.items()}  # format(**) needs string keys (rows given as Python dicts)
    fields["prompt"] = row[cfg.prompt_field]
    try:
        return cfg.template.format(**fields)
    # AttributeError / TypeError: "{prompt.x}", "{x[0]}" on a value without them (found by fuzzing)
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as exc:
        raise DataError(f"data.template {cfg.template!r} cannot be filled from this row: {exc!r}") from None


def batch_indices(n: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Indices of the prompts of batch `step` (0-based): epochs are seeded shuffles of the dataset, so the
    data position is a pure function of (seed, step) and a resumed run sees exactly the same prompts."""
    out = []
    start = step * batch_size
    for pos in range(start, start + batch_size):
        epoch, offset = divmod(pos, n)
        order = list(range(n))
        random.Random(f"{seed}:{epoch}").shuffle(order)
        out.append(order[offset])
    return out


# ----------------------------------------------------------------------------------------------------
# Train / held-out sources
# ----------------------------------------------------------------------------------------------------

def _prompt_key(row, cfg: DataConfig) -> str:
    """What identifies a prompt: the row's filled template (before any chat template), else the row."""
    if isinstance(row, dict) and cfg.prompt_field in row:
        try:
            return fill_template(row, cfg)
        except DataError:
            pass
    return json.dumps(row, sort_keys=True, default=str)


def split_rows(rows: list, cfg: DataConfig) -> tuple[list, list]:
    """(training rows, held-out rows): a seeded (`data.split_seed`) share `data.eval_fraction` of the
    distinct prompts is held out, with every row of those prompts, so that no held-out prompt is also
    trained on even when the data repeats a prompt. Both keep the source's row order."""
    keys = [_prompt_key(r, cfg) for r in rows]
    distinct = sorted(set(keys))
    random.Random(f"split:{cfg.split_seed}").shuffle(distinct)
    n_held = min(len(distinct) - 1, max(1, round(cfg.eval_fraction * len(distinct))))
    if n_held < 1:
        raise DataError(f"data.eval_fraction={cfg.eval_fraction}: the training source has {len(distinct)} distinct "
                        "prompt(s), too few to hold any out and still train on some")
    held = set(distinct[:n_held])
    return [r for r, k in zip(rows, keys) if k not in held], [r for r, k in zip(rows, keys) if k in held]


def prompt_sets(cfg: DataConfig, tokenizer, which=("train", "test")) -> dict:
    """{split: PromptSet or None} for each asked split: 'train', the training set; 'test', the held-out set
    (None when the recipe has none): `data.eval_path`, else the `data.eval_fraction` split of
    `data.train_path`, whose source is read once for both. Errors name the field."""
    for w in which:
        if w not in ("train", "test"):
            raise DataError(f"split {w!r} is unknown; allowed: train, test")
    split = bool(cfg.eval_fraction and not cfg.eval_path)
    rows = {}
    if "train" in which or ("test" in which and split):
        rows["train"] = _named(lambda: read_rows(cfg.train_path), "data.train_path")
        if split:
            rows["train"], rows["test"] = split_rows(rows["train"], cfg)
    out = {}
    for w in which:
        if w == "test" and cfg.eval_path:
            out[w] = _named(lambda: PromptSet(cfg.eval_path, cfg, tokenizer), "data.eval_path")
        elif w not in rows:
            out[w] = None
        else:
            label = cfg.train_path + (f" ({'held-out' if w == 'test' else 'training'} part, data.eval_fraction="
                                      f"{cfg.eval_fraction})" if split else "")
            out[w] = _named(lambda: PromptSet(label, cfg, tokenizer, rows=rows[w]), "data.train_path")
    return out


def prompt_set(cfg: DataConfig, tokenizer, which: str) -> "PromptSet | None":
    """One split of prompt_sets."""
    return prompt_sets(cfg, tokenizer, (which,))[which]


def _named(fn, field: str):
    try:
        return fn()
    except DataError as exc:
        raise DataError(f"{field}: {exc}") from None
