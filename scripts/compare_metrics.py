"""Are two runs the same run? Compare their metrics.jsonl row by row, wall-clock keys left out.

    python scripts/compare_metrics.py RUN_A RUN_B [--ignore-new]

A refactor that claims "behaviour unchanged" runs the same recipe and seed before and after and passes
this: every row (step rows and eval rows) must hold the same keys with equal values, except the
wall-clock ones (time/*, memory/*), which no two runs share. --ignore-new allows keys that only RUN_B's
rows have (a metric the change added); their names are printed. Exit status 0 when equal, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

WALL_CLOCK = ("time/", "memory/")


def rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl" if run.is_dir() else run
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compare(a: list[dict], b: list[dict], ignore_new: bool) -> tuple[list[str], set[str]]:
    problems, new = [], set()
    if len(a) != len(b):
        problems.append(f"{len(a)} rows vs {len(b)}")
    for i, (ra, rb) in enumerate(zip(a, b)):
        keys_a = {k for k in ra if not k.startswith(WALL_CLOCK)}
        keys_b = {k for k in rb if not k.startswith(WALL_CLOCK)}
        added = keys_b - keys_a
        new |= added
        if keys_a - keys_b or (added and not ignore_new):
            problems.append(f"row {i} (step {ra.get('step')}): keys only in A {sorted(keys_a - keys_b)}, "
                            f"only in B {sorted(added)}")
        for k in sorted(keys_a & keys_b):
            if ra[k] != rb[k]:
                problems.append(f"row {i} (step {ra.get('step')}): {k}: {ra[k]!r} != {rb[k]!r}")
    return problems, new


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_a", type=Path)
    ap.add_argument("run_b", type=Path)
    ap.add_argument("--ignore-new", action="store_true", help="allow keys only RUN_B's rows have")
    args = ap.parse_args()
    a, b = rows(args.run_a), rows(args.run_b)
    problems, new = compare(a, b, args.ignore_new)
    compared = sum(len([k for k in r if not k.startswith(WALL_CLOCK)]) for r in a)
    for p in problems[:50]:
        print(p)
    if new:
        print(f"keys only in B: {sorted(new)}")
    print(f"{len(a)} rows, {compared} values compared (wall-clock keys left out): "
          + ("EQUAL" if not problems else f"{len(problems)} differences"))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
