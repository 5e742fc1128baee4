"""Prompt data: read rows from a source, render prompts when they are needed, and serve batches in a
resumable order.

Rows are dicts (one JSON object per line, a CSV row, a Parquet row). The recipe names the prompt and
answer fields; the whole row is passed to reward functions, so extra fields (tests, numbers, target)
reach them untouched. A prompt field holding a list of chat messages ({"role", "content"}: TRL's
conversational format) is rendered by the tokenizer's chat template as it is (`chat_messages`), and the
answer field is needed only when a reward reads it. A row missing a field is an error naming the file and
row, or a counted skip with `data.on_bad_row: skip`.

A source is a file (.jsonl, .csv, .parquet) or a Hugging Face dataset split (`hf:NAME[:CONFIG]@SPLIT`,
hub.py), indexed but never read whole into Python objects (sources.py), so a dataset of millions of rows
costs little memory and start-up time.

A PromptSet renders and tokenizes a row when its batch comes (a small cache keeps recent ones). At
start-up it checks a bounded sample (`CHECK_HEAD` first rows and `CHECK_SAMPLE` seeded others; every
row of a smaller source): a bad row there is an error naming the file and row, or a skip that removes the
row from the set. A bad row first met later is the same error, or a counted skip: in a training set
replaced by the next usable row (`PromptSet.examples`), so a step still gets its full batch and the choice
depends only on the data; in a held-out set (`held_out`: the one eval scores) it leaves the set, as if the
start-up check had found it, so that no prompt is scored twice.

Without `data.eval_path`, `data.eval_fraction` holds out a seeded share of the training rows, grouped by
prompt so that no held-out prompt is also a training prompt (`split_indices`); only row indices are kept.
"""

from __future__ import annotations

import bisect
import decimal
import json
import math
import numbers
import operator
import random
import re
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from .recipe import DataConfig
from .sources import (DataChanged, DataError, DataSettingsError, ListSource, Subset, Unreadable, open_source,  # noqa: F401
                      read_rows, row_number)
from .user_code import short_repr

_REEXPORTED = (DataChanged, read_rows)   # sources.py's, imported from here by callers and tests

NO_CHAT_TEMPLATE = ("needs the tokenizer's chat template, and this tokenizer has none (tokenizer.chat_template is not "
                    "set): use a chat (instruct) model's tokenizer")
# After a row's error: the way past it, if it is that row's (a field the whole file lacks fails every row)
ROW_SKIP_ADVICE = "if only some rows are like this, data.on_bad_row: skip skips them, counted"

# No token spans more than this many characters (a generous bound: runs of spaces make the longest): text cut to
# chars_within(n) before tokenizing keeps all its first n tokens, and a megabyte of it costs no seconds.
CHARS_PER_TOKEN, CHARS_FLOOR = 64, 4096


def chars_within(tokens: int) -> int:
    """The most characters `tokens` tokens can cover (CHARS_PER_TOKEN each, plus a floor)."""
    return CHARS_FLOOR + CHARS_PER_TOKEN * max(0, tokens)


CHECK_HEAD = 1000      # the first rows checked at start-up
CHECK_SAMPLE = 1000    # plus this many seeded others (every row of a source of at most the sum)
CACHE_EXAMPLES = 1024  # rendered examples kept (eval's first prompts; a step's batch)


# ----------------------------------------------------------------------------------------------------
# Prompt sets
# ----------------------------------------------------------------------------------------------------

@dataclass
class Example:
    row: dict          # the dataset row, untouched
    prompt_text: str   # what the model sees (template and chat template applied)
    prompt_ids: list   # its token ids
    messages: Optional[list[dict]] = None  # a chat prompt: the messages given to the chat template; None for text


class _Examples(Sequence):
    """The examples of a PromptSet, rendered when indexed: [i], [a:b] (a list), len, iteration."""

    def __init__(self, ps: "PromptSet"):
        self._ps = ps

    def __len__(self) -> int:
        return len(self._ps)

    def _held_out_slice(self, s: slice) -> list:
        """A slice of a held-out set, whose rows found bad now leave it: positions are taken in ascending order, so
        a row that leaves moves only positions not yet taken, and each usable row comes once."""
        ps = self._ps
        start, stop, step = s.indices(len(ps))
        if step < 0:   # the same positions ascending, then reversed
            pos = range(start, stop, step)
            return self._held_out_slice(slice(pos[-1], pos[0] + 1, -step))[::-1] if pos else []
        out = []
        for j in range(start, stop, step):
            ex = ps._example_or_end(j) if j < len(ps) else None
            if ex is None:   # rows left the set on the way: it ends before j
                break
            out.append(ex)
        return out

    def __getitem__(self, i):
        n = len(self._ps)
        if isinstance(i, slice):
            if self._ps.held_out:
                return self._held_out_slice(i)
            return [self._ps._example(j) for j in range(*i.indices(n))]
        i = operator.index(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"example {i} of a set of {n}")
        return self._ps._example(i)

    def __iter__(self):
        j = 0
        while j < len(self._ps):   # (a held-out set may lose rows on the way)
            ex = self._ps._example_or_end(j)
            if ex is None:
                return
            yield ex
            j += 1


class PromptSet:
    """The usable rows of one source, rendered and tokenized when asked for. `limit`: only the first N
    rows. `rows`: these rows instead of reading `path` (which then only labels errors). `source`: an
    opened source (open_source, or a part of one) instead of reading `path`. `require_answer`: every row must
    hold data.answer_field (False when no reward reads it, Rewards.reads_answer). `context_tokens`: the model's
    context (model.context_tokens); a prompt that fills it, leaving no room for a completion, is a bad row.

    `examples[i]` is the i-th usable row's Example. Rows found bad in the start-up check are not in the
    set; a row found bad later is an error (on_bad_row=error) or, with skip, counted in `skipped` (every
    skip, at start-up or later, once) and then:
    - a training set (held_out=False) replaces it by the next usable row, so that `examples[i]` still is one
      and depends only on the data (a resumed run sees the same prompts); `len(ps)` is fixed at start-up;
    - a held-out set (held_out=True: a set that is scored, never trained on) drops it, as if the start-up
      check had found it: `len(ps)` goes down by one, and `examples[:n]` is the first n usable rows, each
      once (a replacement would score one prompt twice)."""

    def __init__(self, path: str, cfg: DataConfig, tokenizer, limit: Optional[int] = None,
                 rows: Optional[list] = None, source=None, require_answer: bool = True, held_out: bool = False,
                 context_tokens: Optional[int] = None, reset_fills: bool = False):
        self.path, self.cfg, self.tokenizer = path, cfg, tokenizer
        self.context_tokens = context_tokens
        self.reset_fills = reset_fills   # an environment's reset() may fill an empty last user message (chat_messages)
        self.require_answer = require_answer   # False: no reward reads data.answer_field, so rows may lack it
        self.held_out = held_out   # True: a row found bad after start-up leaves the set (never replaced)
        if source is None:
            source = ListSource(path, rows[:limit]) if rows is not None else open_source(path, limit)
        elif limit is not None and limit < len(source):
            source = Subset(source, np.arange(max(0, limit)), path)
        self.source = source
        self.skipped: list[str] = []
        self._cache: OrderedDict = OrderedDict()
        self._late_bad: set = set()
        n = len(source)
        if n <= CHECK_HEAD + CHECK_SAMPLE:
            check = range(n)
        else:  # a fixed seed: which rows are checked (and so len(ps)) depends only on the data
            check = sorted([*range(CHECK_HEAD), *random.Random("lowmem-grpo:check").sample(range(CHECK_HEAD, n), CHECK_SAMPLE)])
        bad, longest = [], None
        for i in check:
            try:
                ex = self._render_at(i)
            except (DataError, Unreadable) as exc:
                self._bad_row(i, exc)
                bad.append(i)
                continue
            if longest is None or len(ex.prompt_ids) > len(longest.prompt_ids):
                longest = ex
            if len(self._cache) < CACHE_EXAMPLES:
                self._cache[i] = ex
        self.checked = len(check)
        self._bad = bad  # sorted source indices not in the set
        self._len = n - len(bad)
        self._longest = longest
        if longest is None:
            raise DataError(f"{path}: no usable rows" + (f" ({len(self.skipped)} skipped, first: {self.skipped[0]})" if self.skipped else ""))
        self.examples = _Examples(self)

    def __len__(self) -> int:
        return self._len

    def longest_prompt(self) -> list:
        """Token ids of the longest prompt among the rows checked at start-up: every row of a source of at
        most CHECK_HEAD + CHECK_SAMPLE rows, else that sample (reading every row of a large source is what
        lazy data avoids; no prompt is longer than data.max_prompt_tokens, the hard bound)."""
        return self._longest.prompt_ids

    def _source_index(self, pos: int) -> int:
        """Source index of the pos-th row that the start-up check did not find bad."""
        r = pos
        while True:
            nxt = pos + bisect.bisect_right(self._bad, r)
            if nxt == r:
                return r
            r = nxt

    def _example(self, pos: int) -> Example:
        ex = self._example_or_end(pos)
        if ex is None:
            raise IndexError(f"example {pos} of a set of {self._len} (rows found bad left the set)")
        return ex

    def _example_or_end(self, pos: int) -> Optional[Example]:
        """The example at position pos (0 <= pos < len); None where a held-out set lost rows found bad now and so
        has no position pos any more."""
        for _ in range(self._len):
            r = self._source_index(pos)
            ex = self._cached_or_rendered(r)
            if ex is not None:
                return ex
            if self.held_out:   # the row leaves the set: pos now names the next usable row
                bisect.insort(self._bad, r)
                self._len -= 1
                if not self._len:
                    break
                if pos >= self._len:
                    return None
                continue
            pos = (pos + 1) % self._len  # skip: the next usable row
        raise DataError(f"{self.path}: no usable rows ({len(self.skipped)} skipped, first: {self.skipped[0]})")

    def _cached_or_rendered(self, r: int) -> Optional[Example]:
        """Source row r's example, or None when it is bad (found now: the error raised, or the skip counted)."""
        ex = self._cache.get(r)
        if ex is not None:
            self._cache.move_to_end(r)
            return ex
        if r in self._late_bad:
            return None
        try:
            ex = self._render_at(r)
        except (DataError, Unreadable) as exc:
            self._bad_row(r, exc)
            self._late_bad.add(r)
            return None
        self._cache[r] = ex
        if len(self._cache) > CACHE_EXAMPLES:
            self._cache.popitem(last=False)
        return ex

    def _bad_row(self, i: int, exc: Exception) -> None:
        """Raise the error naming the row (on_bad_row=error), or count the skip."""
        if isinstance(exc, DataChanged):
            raise exc
        if isinstance(exc, DataSettingsError):   # every row would fail so: no row to skip
            raise DataSettingsError(f"{self.path}: {exc}") from None
        number = row_number(self.source, i)
        if self.cfg.on_bad_row == "error":
            line = self.source.line(i)
            where = f"row {number}" + (f" (line {line})" if line not in (None, number) else "")
            raise DataError(f"{self.path}: {where}: {exc} ({ROW_SKIP_ADVICE})") from None
        self.skipped.append(f"row {number}: {exc}")

    def render_message(self, row: dict, message: str, template_kwargs: Optional[dict] = None) -> Example:
        """`message` (an environment's first user message, docs/algorithm.md §20) rendered as this row's prompt
        would be: in place of its prompt field, through data.template and the chat template (`template_kwargs`, the
        episode's own variables, over data.chat_template_kwargs). DataError as for a row; a message too long for
        data.max_prompt_tokens is refused before it is tokenized (an environment may return megabytes, once per
        episode)."""
        if isinstance(message, str) and len(message) > chars_within(self.cfg.max_prompt_tokens):
            raise DataError(f"the message is {len(message)} characters: more than data.max_prompt_tokens="
                            f"{self.cfg.max_prompt_tokens} tokens can hold")
        cfg = self.cfg.model_copy(update={"chat_template_kwargs": {**self.cfg.chat_template_kwargs,
                                                                   **template_kwargs}}) if template_kwargs else None
        return self._render({**row, self.cfg.prompt_field: message}, self.tokenizer, cfg)

    def _render_at(self, i: int) -> Example:
        return self._render(self.source.row(i), self.tokenizer)

    def render_row(self, row: dict) -> Example:
        """A row from elsewhere (not this set's source) rendered as this set renders its own; DataError if it
        cannot be."""
        return self._render(row, self.tokenizer)

    def _render(self, row: dict, tokenizer, cfg=None) -> Example:
        cfg = cfg or self.cfg
        check_fields(row, cfg, self.require_answer)
        prompt = row[cfg.prompt_field]
        chat = None
        if is_chat(prompt):   # a conversational row: the messages as they are
            chat = chat_messages(row[cfg.prompt_field], cfg, self.reset_fills)
            text = _chat_text(tokenizer, chat, f"the prompt field {cfg.prompt_field!r} holds chat messages, which",
                              cfg.chat_template_kwargs)
            ids = tokenizer(_text_problem(text, cfg), add_special_tokens=False)["input_ids"]
        elif cfg.chat_template:
            # the setting's error, whatever the row (a row of chat messages without a template is that row's)
            if not getattr(tokenizer, "chat_template", None):
                raise DataSettingsError(f"data.chat_template is true, which {NO_CHAT_TEMPLATE}")
            text = _text_problem(fill_template(row, cfg), cfg)
            messages = ([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else [])
            messages.append({"role": "user", "content": text})
            text = _chat_text(tokenizer, messages, "data.chat_template is true, which", cfg.chat_template_kwargs)
            ids = tokenizer(_text_problem(text, cfg), add_special_tokens=False)["input_ids"]
        else:
            text = fill_template(row, cfg)
            ids = plain_prompt_ids(tokenizer, _text_problem(text, cfg))
        if not ids:  # nothing to condition on: generation would fail on an empty row
            raise DataError("the prompt renders to no tokens (an empty text, or a tokenizer that has none of its "
                            "characters: check that model.name_or_path holds the model's tokenizer files)")
        if len(ids) > cfg.max_prompt_tokens:
            raise DataError(f"prompt is {len(ids)} tokens, over data.max_prompt_tokens={cfg.max_prompt_tokens}")
        # vLLM refuses such a prompt mid-run, transformers decodes past the model's positions (found by a red team)
        if self.context_tokens is not None and len(ids) >= self.context_tokens:
            raise DataError(f"prompt is {len(ids)} tokens, which fills the model's context ({self.context_tokens} "
                            "tokens: its max_position_embeddings, or the context its RoPE scaling makes): no room is "
                            "left for a completion")
        return Example(row, text, ids, chat)


# ----------------------------------------------------------------------------------------------------
# The prompt an adapter was trained on: recorded beside it, checked when it is evaluated
# ----------------------------------------------------------------------------------------------------

PROMPT_RECORD = "lowmem_grpo_prompt.json"   # in a checkpoint's (and an export's) adapter folder


def prompt_record(example: Example) -> Optional[str]:
    """The first training prompt, as a row and the tokens it was rendered to, for the adapter's folder: an eval
    that renders that row to other tokens (another template, system prompt or chat template, or a change of
    tokenization rule: a run made before the BOS rule's change scored 0% in eval, found by a red team) says so.
    None when the row is not JSON data."""
    try:
        return json.dumps({"row": example.row, "prompt_ids": list(map(int, example.prompt_ids))}, ensure_ascii=False)
    except (TypeError, ValueError):
        return None


def prompt_drift(adapter_dir, pset: "PromptSet") -> Optional[str]:
    """A warning when the adapter's recorded training prompt renders, by this data config and tokenizer, to tokens
    other than those it was trained on; None when they agree, or nothing can be compared (no record: an adapter
    from elsewhere or an older run; a row this config cannot render: another dataset's fields)."""
    path = Path(adapter_dir) / PROMPT_RECORD
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        row, trained = record["row"], [int(t) for t in record["prompt_ids"]]
        now = pset.render_row(row).prompt_ids
    except (OSError, ValueError, TypeError, KeyError, DataError):
        return None
    if now == trained:
        return None
    k = next((i for i, (a, b) in enumerate(zip(trained, now)) if a != b), min(len(trained), len(now)))

    def shown(ids: list) -> str:
        return repr(pset.tokenizer.decode(ids[k:k + 12]))

    return (f"warning: the adapter was trained on prompts rendered otherwise: its run's first training prompt is "
            f"{len(now)} tokens here and was {len(trained)} in training, first differing at token {k} (trained "
            f"{shown(trained)}, here {shown(now)}; {path}). The figures are not those of the prompts it learned on: "
            "evaluate with the recipe's data settings and the tokenizer it was trained with (RUN/recipe.yaml)")


def check_fields(row: dict, cfg, require_answer: bool) -> None:
    """A DataError for a row whose fields cannot make a prompt (and an answer, when a reward reads one: TRL-style data
    has none): a field missing or null, data.answer_problem, a prompt that is a mapping or blank. What PromptSet
    checks before it renders and tokenizes the prompt; `lowmem-grpo validate` checks a file's first rows so too."""
    for name in (cfg.prompt_field, cfg.answer_field) if require_answer else (cfg.prompt_field,):
        if name not in row:
            raise DataError(f"missing field {name!r} (row has: {', '.join(sorted(map(str, row))) or 'nothing'})")
        if row[name] is None:  # present, so "missing" would contradict the list of fields the row has
            raise DataError(f"field {name!r} is null (the row has it, with no value)")
    if require_answer:
        answer_problem(row[cfg.answer_field], cfg.answer_field)
    prompt = row[cfg.prompt_field]
    # a mapping would be rendered as its Python repr; a blank string as a prompt with no question in it
    if isinstance(prompt, dict):
        raise DataError(f"the prompt field {cfg.prompt_field!r} holds a mapping (keys: "
                        f"{', '.join(sorted(map(str, prompt)))[:80]}); expected text, or a list of chat messages "
                        "[{role, content}, ...]")
    if isinstance(prompt, str) and not prompt.strip():
        raise DataError(f"the prompt field {cfg.prompt_field!r} is empty")
    # a CSV or pandas export writes a column of chat messages as JSON text, which was the model's prompt as it is
    # (found by a red team)
    if isinstance(prompt, str) and prompt.lstrip().startswith("[") and _json_chat(prompt, cfg):
        raise DataError(f"the prompt field {cfg.prompt_field!r} holds chat messages as JSON text "
                        f"({short_repr(prompt.strip())}), which would be the prompt as it is written; store them as a "
                        "list of messages (a JSON array in .jsonl, a list column in .parquet: a CSV cell holds only text)")


def _json_chat(text: str, cfg) -> bool:
    """Whether `text` is a JSON list of chat messages (mappings with 'role' and 'content')."""
    if len(text) > chars_within(cfg.max_prompt_tokens):   # too long for a prompt anyway (_text_problem says so)
        return False
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return False
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m and "content" in m
                                                           for m in value)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _text_problem(text: str, cfg: DataConfig) -> str:
    """A prompt's text, checked before a tokenizer sees it (returned as it is); DataError:
    - over chars_within(data.max_prompt_tokens) characters: more tokens than that limit for sure (no token covers
      more than CHARS_PER_TOKEN characters), refused here rather than after tokenizing it whole (a 50 MB row took
      minutes and 19 GB to be refused so);
    - a lone surrogate (e.g. a JSON escape of half a UTF-16 pair, "\\ud800"): not Unicode text, which the tokenizer
      refuses with a TypeError."""
    if len(text) > chars_within(cfg.max_prompt_tokens):
        raise DataError(f"prompt is {len(text)} characters, over data.max_prompt_tokens={cfg.max_prompt_tokens} (that "
                        f"many tokens hold at most {chars_within(cfg.max_prompt_tokens)} characters)")
    bad = _SURROGATE.search(text)
    if bad:
        raise DataError(f"the prompt holds text that is not valid Unicode (a lone surrogate {ascii(bad.group())} at "
                        f"character {bad.start()}, e.g. from a JSON escape of half a UTF-16 pair); fix the data's "
                        "encoding")
    return text


def plain_prompt_ids(tokenizer, text: str) -> list[int]:
    """A text prompt's tokens with the special tokens the tokenizer itself adds (tokenizer(text), as TRL and
    transformers' pipelines tokenize): Llama's and Mistral's BOS, nothing for Qwen or GPT-2's <|endoftext|>. (A
    BOS was prepended here whenever the tokenizer named one, which Phi-3's and GPT-2-style tokenizers never add.)
    An EOS the tokenizer appends goes: the completion continues the prompt."""
    ids = list(tokenizer(text)["input_ids"])
    eos = tokenizer.eos_token_id
    if eos is not None and ids[-1:] == [eos] and tokenizer(text, add_special_tokens=False)["input_ids"][-1:] != [eos]:
        ids.pop()
    return ids


def answer_problem(value, field: str) -> None:
    """A reference answer is text (not blank) or a number (a Parquet decimal too). The rewards that read it (math,
    exact) compare its text, so a list or mapping would be judged as its Python repr, NaN or infinity as the words
    'nan' or 'inf', and a blank answer (an empty CSV cell) matched an empty completion in exact and skipped every
    completion in math (found by a red team)."""
    if isinstance(value, bool):
        raise DataError(f"the answer field {field!r} holds the boolean {value}; write it as text "
                        f"({json.dumps(str(value).lower())}) or a number")
    if isinstance(value, str) and not value.strip():
        raise DataError(f"the answer field {field!r} is empty")
    if isinstance(value, decimal.Decimal):   # a Parquet decimal column; not a numbers.Real (found by a red team)
        if not value.is_finite():
            raise DataError(f"the answer field {field!r} is {value} (not a finite number)")
        return
    if not isinstance(value, (str, numbers.Real)):
        raise DataError(f"the answer field {field!r} holds {type(value).__name__} {short_repr(value)}; expected text "
                        "or a number (one reference answer per row)")
    if isinstance(value, numbers.Integral):   # finite however long; compared as text, so it must have one
        if value.bit_length() > 64:
            try:
                str(value)
            except ValueError:   # over Python's limit on the digits of an int turned into text (4300)
                raise DataError(f"the answer field {field!r} holds an integer of {value.bit_length()} bits, too long "
                                "for Python to write as text (sys.set_int_max_str_digits); write it as text") from None
        return
    if isinstance(value, str):
        return
    try:
        finite = math.isfinite(float(value))
    except OverflowError:   # a Real too large for a float (e.g. a Fraction) is still a finite number
        finite = True
    if not finite:
        raise DataError(f"the answer field {field!r} is {value} (not a finite number)")


CHAT_ROLES = ("system", "user", "assistant", "tool")


def hold_to_engine_context(sets: list, engine: Optional[int], model: Optional[int], engine_name: str,
                           max_prompt_tokens: int) -> Optional[str]:
    """Where the rollout engine takes fewer tokens than the model's config gives (vLLM defaults a LongRoPE model to
    its pretraining length, and caps any at the tokenizer's model_max_length), the prompt sets (None: absent) are
    held to the engine's context as to the model's: a longer prompt is a bad row, not an EngineError mid-run (found
    by a red team). DataError if a row checked at start-up is already too long; else a note, or None."""
    sets = [s for s in sets if s is not None]
    if engine is None or (model is not None and engine >= model) or not sets:
        return None
    longest = max(len(s.longest_prompt()) for s in sets)
    where = f"generation.engine={engine_name} takes {engine} tokens for this model" + \
        (f" (its config: {model})" if model else "")
    if longest >= engine:
        raise DataError(f"{where}, and the longest prompt is {longest} tokens: set data.max_prompt_tokens below "
                        f"{engine} (with data.on_bad_row=skip, longer rows are skipped)")
    for s in sets:
        s.context_tokens = engine
    return f"{where}: a prompt of {engine} tokens or more is a bad row" if max_prompt_tokens >= engine else None


def is_chat(value) -> bool:
    """A prompt field given as chat messages: a list holding a mapping (or an empty list: no prompt at all,
    reported as such). A list of plain values (Countdown's numbers) is a value for data.template like any other."""
    return isinstance(value, (list, tuple)) and (not value or any(isinstance(m, dict) for m in value))


def chat_messages(value, cfg: DataConfig, reset_fills: bool = False) -> list[dict]:
    """A row's prompt given as chat messages, checked, as the chat template gets them: data.system_prompt first
    when set and the row has no system message. Rendered by the tokenizer's chat template alone (whatever
    data.chat_template says), so data.template must be its default. reset_fills: the run has an environment, whose
    reset() may give the first message in place of an empty last user message (TRL's placeholder, trl.py's
    EMPTY_PROMPT; rollout/turns.py refuses an episode whose reset() leaves it empty). DataError naming what is wrong."""
    field = cfg.prompt_field
    if cfg.template != "{prompt}":
        raise DataError(f"the prompt field {field!r} holds chat messages, which the tokenizer's chat template renders "
                        f"as they are, so data.template must be its default '{{prompt}}' (it is {cfg.template!r}): "
                        "put the text in the messages instead")
    if not value:
        raise DataError(f"the prompt field {field!r} is an empty list; chat messages need at least one message")
    messages = []
    for j, m in enumerate(value):
        where = f"the prompt field's message {field}[{j}]"
        if not isinstance(m, dict):
            raise DataError(f"{where} is {type(m).__name__}, expected a mapping with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise DataError(f"{where} has role {role!r}; allowed: {', '.join(CHAT_ROLES)}")
        if not isinstance(content, str):
            raise DataError(f"{where} ({role}) has content {type(content).__name__ if content is not None else 'missing'}"
                            f"{'' if content is None else ' ' + repr(content)[:40]}, expected text (a str)")
        # a blank turn, as a blank text prompt: nothing said. Not an assistant turn that only calls tools, nor,
        # with an environment, a last user message of no text at all: the slot its reset() fills
        slot = role == "user" and content == "" and j == len(value) - 1
        if not content.strip() and not (role == "assistant" and m.get("tool_calls")) and not (slot and reset_fills):
            raise DataError(f"{where} ({role}) is empty" + (" (an empty last user message is the slot an environment's "
                            "reset() fills, and this run has none)" if slot else ""))
        # Arrow and Parquet merge the messages' structs, giving each every key of any with None ('name': None), which
        # a template renders as 'name=None'; TRL drops them (remove_none_values). Found by a red team.
        messages.append(_without_none(m))
    # As TRL's apply_chat_template: the last message is the user's or a tool's (the model answers it) or the
    # assistant's (the model continues it, _chat_text); a system one was rendered with a new assistant turn, and a
    # prompt of no user message gave the model nothing to answer (found by a red team)
    if messages[-1]["role"] == "system":
        raise DataError(f"the prompt field {field!r} ends with a system message ({field}[{len(messages) - 1}]); "
                        "allowed last: user or tool (the model answers it), assistant (the model continues it)")
    if not any(m["role"] == "user" for m in messages):
        raise DataError(f"the prompt field {field!r} has no user message (its roles: "
                        f"{', '.join(dict.fromkeys(m['role'] for m in messages))}); a prompt needs one to answer")
    if cfg.system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": cfg.system_prompt})
    return messages


def _without_none(value):
    """A message with its None-valued keys dropped, in nested mappings too (TRL's remove_none_values)."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


def _chat_text(tokenizer, messages: list[dict], what: str, extra: Optional[dict] = None) -> str:
    """The messages through the tokenizer's chat template, with the assistant's turn opened (or, when the last
    message is the assistant's, that turn continued: TRL's continue_final_message) and `extra`
    (data.chat_template_kwargs) as template variables; `what` starts the error ("... which") when the
    tokenizer has no template or it fails."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{what} {NO_CHAT_TEMPLATE}")
    # [user q, assistant 'partial'] was rendered with a new assistant turn after 'partial' (found by a red team)
    continued = messages[-1]["role"] == "assistant"
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=not continued,
                                             continue_final_message=continued, **(extra or {}))
    except Exception as exc:  # a template that raises on these messages (e.g. it refuses a role order)
        raise DataError(f"{what} needs the tokenizer's chat template, which failed on them: "
                        f"{type(exc).__name__}: {exc}") from None


def fill_template(row: dict, cfg: DataConfig) -> str:
    """`data.template` filled from the row's fields plus {prompt} (the prompt field's value)."""
    fields = {str(k): v for k, v in row.items()}  # format(**) needs string keys (rows given as Python dicts)
    fields["prompt"] = row[cfg.prompt_field]
    try:
        return cfg.template.format(**fields)
    # AttributeError / TypeError: "{prompt.x}", "{x[0]}" on a value without them (found by fuzzing)
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as exc:
        raise DataError(f"data.template {cfg.template!r} cannot be filled from this row: {exc!r}") from None


# ----------------------------------------------------------------------------------------------------
# Batch order
# ----------------------------------------------------------------------------------------------------

_EPOCHS: OrderedDict = OrderedDict()  # (n, seed, epoch) -> that epoch's order; the latest few only
_EPOCHS_KEPT = 2


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """Epoch `epoch`'s order of rows 0..n-1: a seeded shuffle, computed once and kept (int64, 8 bytes a row).
    The shuffle is random.Random(f"{seed}:{epoch}").shuffle of list(range(n)), as the trainer has always
    drawn it, so runs and checkpoints from earlier versions replay the same prompts."""
    key = (n, seed, epoch)
    order = _EPOCHS.get(key)
    if order is None:
        rows = list(range(n))
        random.Random(f"{seed}:{epoch}").shuffle(rows)
        order = _EPOCHS[key] = np.array(rows, dtype=np.int64)
        while len(_EPOCHS) > _EPOCHS_KEPT:
            _EPOCHS.popitem(last=False)
    else:
        _EPOCHS.move_to_end(key)
    return order


def batch_indices(n: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Indices of the prompts of batch `step` (0-based): epochs are seeded shuffles of the dataset, so the
    data position is a pure function of (seed, step) and a resumed run sees exactly the same prompts."""
    if n < 1:
        raise ValueError(f"batch_indices: the set has {n} rows; it needs at least 1")
    out: list[int] = []
    pos, end = step * batch_size, (step + 1) * batch_size
    while pos < end:
        epoch, offset = divmod(pos, n)
        take = min(end - pos, n - offset)
        out += epoch_order(n, seed, epoch)[offset:offset + take].tolist()
        pos += take
    return out


# ----------------------------------------------------------------------------------------------------
# Train / held-out sources
# ----------------------------------------------------------------------------------------------------

def _prompt_key(row, cfg: DataConfig) -> str:
    """What identifies a prompt: the row's filled template (before any chat template), its chat messages (as
    JSON: a list is no template's field), else the row."""
    if isinstance(row, dict) and is_chat(row.get(cfg.prompt_field)):
        return json.dumps(row[cfg.prompt_field], sort_keys=True, default=str)
    if isinstance(row, dict) and cfg.prompt_field in row:
        try:
            return fill_template(row, cfg)
        except DataError:
            pass
    return json.dumps(row, sort_keys=True, default=str)


def split_indices(source, cfg: DataConfig) -> tuple[np.ndarray, np.ndarray]:
    """(training row indices, held-out row indices) of a source, ascending: a seeded (`data.split_seed`)
    share `data.eval_fraction` of the distinct prompts is held out, with every row of those prompts, so
    that no held-out prompt is also trained on even when the data repeats a prompt.

    The rows are read once, in order, and only their prompt keys kept (as Arrow binary, not Python
    strings). Which prompts are held out is what sorting the distinct keys and shuffling them with
    random.Random(f"split:{split_seed}") picks; UTF-8 bytes sort as the strings do, so the split is the
    same as when it sorted Python strings. A row that cannot be parsed is an error (on_bad_row=error)
    or goes to the training part, to be skipped when met."""
    import pyarrow as pa
    import pyarrow.compute as pc

    chunks, keys, readable, unreadable = [], [], array("q"), array("q")
    for i, row in source.iter_rows():
        if isinstance(row, Unreadable):
            if cfg.on_bad_row == "error":
                raise DataError(f"{source.path}:{source.line(i)}: {row} ({ROW_SKIP_ADVICE})")
            unreadable.append(i)
            continue
        readable.append(i)
        keys.append(_prompt_key(row, cfg).encode("utf-8", "surrogatepass"))
        if len(keys) == 65536:
            chunks.append(pa.array(keys, type=pa.large_binary()))
            keys = []
    chunks.append(pa.array(keys, type=pa.large_binary()))
    encoded = pc.dictionary_encode(pa.concat_arrays(chunks))
    distinct, codes = encoded.dictionary, encoded.indices.to_numpy(zero_copy_only=False)
    m = len(distinct)
    n_held = min(m - 1, max(1, round(cfg.eval_fraction * m)))
    if n_held < 1:
        raise DataError(f"data.eval_fraction={cfg.eval_fraction}: the training source has {m} distinct "
                        "prompt(s), too few to hold any out and still train on some")
    ranks = list(range(m))  # shuffling ranks moves them as it moved the sorted keys
    random.Random(f"split:{cfg.split_seed}").shuffle(ranks)
    by_rank = pc.sort_indices(distinct).to_numpy()  # dictionary index of the k-th smallest key
    held_mask = np.zeros(m, dtype=bool)
    held_mask[by_rank[np.asarray(ranks[:n_held], dtype=np.int64)]] = True
    is_held = held_mask[codes]
    rows = np.frombuffer(readable, dtype=np.int64) if len(readable) else np.zeros(0, dtype=np.int64)
    train, held = rows[~is_held], rows[is_held]
    if len(unreadable):
        train = np.sort(np.concatenate([train, np.frombuffer(unreadable, dtype=np.int64)]))
    del encoded, distinct, codes
    pa.default_memory_pool().release_unused()  # the keys' hash table: ~60 MiB at 1M rows, else kept by the pool
    return train, held


def split_rows(rows: list, cfg: DataConfig) -> tuple[list, list]:
    """split_indices for rows given as a list: (training rows, held-out rows), both in the list's order."""
    train, held = split_indices(ListSource("rows", rows), cfg)
    return [rows[i] for i in train.tolist()], [rows[i] for i in held.tolist()]


def prompt_sets(cfg: DataConfig, tokenizer, which=("train", "test"), require_answer: bool = True,
                for_eval: bool = False, context_tokens: Optional[int] = None, reset_fills: bool = False) -> dict:
    """{split: PromptSet or None} for each asked split: 'train', the training set; 'test', the held-out set
    (None when the recipe has none): `data.eval_path`, else the `data.eval_fraction` split of
    `data.train_path`, whose source is opened once for both. `require_answer`, `context_tokens`: as PromptSet's
    (pass Rewards.reads_answer, model.context_tokens). Errors name the field.

    The 'test' set is always a held-out PromptSet (held_out=True: a bad row met late is dropped and counted in
    `skipped`, never replaced, so eval scores no prompt twice); `for_eval` makes the 'train' set one too (an
    eval of the training split), where training needs the replacement that keeps a batch full."""
    for w in which:
        if w not in ("train", "test"):
            raise DataError(f"split {w!r} is unknown; allowed: train, test")
    split = bool(cfg.eval_fraction and not cfg.eval_path)
    sources = {}
    if "train" in which or ("test" in which and split):
        sources["train"] = _named(lambda: open_source(cfg.train_path), "data.train_path")
        if split:
            train, held = _named(lambda: split_indices(sources["train"], cfg), "data.train_path")
            sources["train"], sources["test"] = Subset(sources["train"], train), Subset(sources["train"], held)
    out = {}
    for w in which:
        if w == "test" and cfg.eval_path:
            out[w] = _named(lambda: PromptSet(cfg.eval_path, cfg, tokenizer, require_answer=require_answer,
                                              held_out=True, context_tokens=context_tokens, reset_fills=reset_fills),
                            "data.eval_path")
        elif w not in sources:
            out[w] = None
        else:
            label = cfg.train_path + (f" ({'held-out' if w == 'test' else 'training'} part, data.eval_fraction="
                                      f"{cfg.eval_fraction})" if split else "")
            out[w] = _named(lambda: PromptSet(label, cfg, tokenizer, source=sources[w], require_answer=require_answer,
                                              held_out=for_eval or w == "test", context_tokens=context_tokens,
                                              reset_fills=reset_fills), "data.train_path")
    return out


def prompt_set(cfg: DataConfig, tokenizer, which: str, require_answer: bool = True,
               for_eval: bool = False, context_tokens: Optional[int] = None,
               reset_fills: bool = False) -> "PromptSet | None":
    """One split of prompt_sets."""
    return prompt_sets(cfg, tokenizer, (which,), require_answer=require_answer, for_eval=for_eval,
                       context_tokens=context_tokens, reset_fills=reset_fills)[which]


def _named(fn, field: str):
    try:
        return fn()
    except DataError as exc:
        raise DataError(f"{field}: {exc}") from None
