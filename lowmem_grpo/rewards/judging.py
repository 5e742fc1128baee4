"""What `lowmem-grpo validate` and the trainer's start-up say about a recipe's code tests, read from its local data:
how the assert tests are judged (rewards/code.py) and the stdin/stdout cases (rewards/code_io.py), with the rows
each reward would skip."""

from __future__ import annotations

from . import code, code_io


def judging_notes(r, rows: int = 1000) -> list:
    """For a recipe `r` with a code reward: how the tests of its local data files' first `rows` rows are
    judged (outside the sandbox, or inside where a solution could forge the verdict; the stdin/stdout rewards'
    cases, and the rows they would skip), one line per file and tests field;
    `lowmem-grpo validate` prints them and the trainer logs them at start-up. Hub splits are not fetched."""

    def fields(names) -> list:   # (tests field, checker field) pairs, each counted once
        return sorted({(str(f.kwargs.get("tests_field", "tests")), f.kwargs.get("checker_field"))
                       for f in r.rewards.functions if f.function in names}, key=str)

    counters = [(field, code.count_judging) for field, _ in fields(("code", "code_binary"))]
    counters += [(field, lambda rows, field, checker=checker: code_io.count_cases(rows, field, checker))
                 for field, checker in fields(("code_io", "code_io_binary"))]
    if not counters:
        return []
    from ..hub import is_hub
    from ..sources import DataError, open_source

    notes = []
    for path in dict.fromkeys(p for p in (r.data.train_path, r.data.eval_path) if p and not is_hub(p)):
        for field, count in counters:
            try:
                counts = count((row for _, row in open_source(path, limit=rows).iter_rows()), field)
            except DataError as exc:
                notes.append(f"{path}: tests not checked ({exc})")
                continue
            notes.append(counts.describe(path if counts.rows < rows else f"{path} (first {rows} rows)"))
    return notes
