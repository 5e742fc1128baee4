"""Prompt data: read rows from a file, render prompts, and serve batches in a resumable order.

Rows are dicts (one JSON object per line, a CSV row, a Parquet row). The recipe names the prompt and
answer fields; the whole row is passed to reward functions, so extra fields (tests, numbers, target)
reach them untouched. A row missing a field is an error naming the file and row, or a counted skip with
`data.on_bad_row: skip`.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from pathlib import Path

from .recipe import DataConfig


class DataError(Exception):
    pass


def read_rows(path: str) -> list[dict]:
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
    """The usable rows of one file, rendered and tokenized once. `limit`: read only the first N rows."""

    def __init__(self, path: str, cfg: DataConfig, tokenizer, limit: int | None = None):
        self.path, self.cfg = path, cfg
        self.examples: list[Example] = []
        self.skipped: list[str] = []
        for i, row in enumerate(read_rows(path)[:limit], 1):
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
        fields = dict(row)
        fields["prompt"] = row[cfg.prompt_field]
        try:
            text = cfg.template.format(**fields)
        except (KeyError, IndexError, ValueError) as exc:
            raise DataError(f"data.template {cfg.template!r} cannot be filled from this row: {exc!r}") from None
        if cfg.chat_template:
            messages = ([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else [])
            messages.append({"role": "user", "content": text})
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
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
