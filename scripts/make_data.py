"""Write the generated datasets shipped in data/: word_problems.jsonl and countdown.jsonl.

    python scripts/make_data.py            # writes data/word_problems.jsonl and data/countdown.jsonl
    python scripts/make_data.py --check    # exits 1 if the shipped files differ from what it would write

Both are produced by deterministic generators written for this project (no public dataset is copied),
so the files can be rebuilt byte for byte, and a test checks that they are.

word_problems.jsonl: small arithmetic word problems from templates, {"prompt", "answer", "solution"}.
The answer is an integer as text (the math reward compares it exactly); "solution" is a worked solution
ending in '#### <answer>' (GSM8K style), useful as a format example and as a consistency check.
countdown.jsonl: lowmem_grpo.rewards.countdown.generate_countdown.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORD_PROBLEMS_N, WORD_PROBLEMS_SEED = 256, 1234
COUNTDOWN_N, COUNTDOWN_SEED = 256, 4321

NAMES = ["Ana", "Ben", "Chloe", "Dev", "Ema", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kira", "Liam", "Mei",
         "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tariq", "Uma", "Vera", "Wen", "Yusuf", "Zoe"]
ITEMS = ["apples", "stickers", "marbles", "pencils", "cards", "shells", "stamps", "beads", "coins", "books"]


def _problem(rng: random.Random, kind: int) -> tuple[str, int, str]:
    """(prompt, answer, worked solution) for template `kind`; all quantities are whole and non-negative."""
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    if kind == 0:
        a, b, c = rng.randint(3, 40), rng.randint(2, 9), rng.randint(2, 12)
        ans = a + b * c
        return (f"{name} has {a} {item}. {name} buys {b} packs with {c} {item} in each pack. "
                f"How many {item} does {name} have now?", ans,
                f"The packs hold {b} * {c} = {b * c} {item}. {a} + {b * c} = {ans}.")
    if kind == 1:
        a, b = rng.randint(3, 12), rng.randint(4, 12)
        c = rng.randint(1, a * b - 1)
        ans = a * b - c
        return (f"A bakery bakes {a} trays of muffins with {b} muffins on each tray. It sells {c} muffins. "
                f"How many muffins are left?", ans, f"It baked {a} * {b} = {a * b} muffins. {a * b} - {c} = {ans}.")
    if kind == 2:
        a, b, c = rng.randint(5, 40), rng.randint(2, 14), rng.randint(1, 30)
        ans = a * b + c
        return (f"{name} reads {a} pages every day for {b} days, and then {c} more pages. "
                f"How many pages does {name} read in total?", ans,
                f"{a} * {b} = {a * b} pages, plus {c}: {a * b} + {c} = {ans}.")
    if kind == 3:
        each, friends = rng.randint(2, 25), rng.randint(2, 9)
        total = each * friends
        return (f"{name} shares {total} {item} equally among {friends} friends. How many {item} does each "
                f"friend get?", each, f"{total} / {friends} = {each}.")
    if kind == 4:
        price, count = rng.randint(2, 30), rng.randint(2, 8)
        paid = ((price * count) // 10 + rng.randint(1, 5)) * 10
        ans = paid - price * count
        return (f"A ticket costs ${price}. {name} buys {count} tickets and pays with ${paid}. How many dollars "
                f"of change does {name} get?", ans,
                f"The tickets cost {price} * {count} = {price * count} dollars. {paid} - {price * count} = {ans}.")
    if kind == 5:
        speed, hours = rng.randint(20, 120), rng.randint(2, 9)
        ans = speed * hours
        return (f"A train travels at {speed} kilometres per hour for {hours} hours. How many kilometres does it "
                f"travel?", ans, f"{speed} * {hours} = {ans}.")
    if kind == 6:
        weekly, weeks = rng.randint(3, 50), rng.randint(2, 20)
        spent = rng.randint(1, weekly * weeks - 1)
        ans = weekly * weeks - spent
        return (f"{name} saves ${weekly} every week. After {weeks} weeks, {name} spends ${spent} on a gift. "
                f"How many dollars does {name} have left?", ans,
                f"{name} saved {weekly} * {weeks} = {weekly * weeks} dollars. {weekly * weeks} - {spent} = {ans}.")
    if kind == 7:
        rows, per_row = rng.randint(3, 25), rng.randint(4, 20)
        broken = rng.randint(1, rows * per_row // 4)
        ans = rows * per_row - broken
        return (f"A hall has {rows} rows of chairs with {per_row} chairs in each row. {broken} chairs are broken. "
                f"How many chairs can be used?", ans,
                f"There are {rows} * {per_row} = {rows * per_row} chairs. {rows * per_row} - {broken} = {ans}.")
    if kind == 8:
        age, gap, years = rng.randint(5, 40), rng.randint(1, 30), rng.randint(1, 15)
        ans = age + (age + gap) + 2 * years
        return (f"{name} is {age} years old. {other} is {gap} years older than {name}. What will the sum of their "
                f"ages be in {years} years?", ans,
                f"{other} is {age} + {gap} = {age + gap}. Now the sum is {2 * age + gap}; in {years} years each is "
                f"{years} older: {2 * age + gap} + {2 * years} = {ans}.")
    if kind == 9:
        off = rng.choice((10, 20, 25, 50))
        step = {10: 10, 20: 5, 25: 4, 50: 2}[off]
        price = step * rng.randint(2, 40)
        ans = price * (100 - off) // 100
        return (f"A jacket costs ${price}. It is on sale for {off}% off. What is the sale price in dollars?", ans,
                f"The discount is {price} * {off} / 100 = {price * off // 100} dollars. "
                f"{price} - {price * off // 100} = {ans}.")
    if kind == 10:
        length, width = rng.randint(3, 60), rng.randint(2, 40)
        ans = 2 * (length + width)
        return (f"A garden is {length} metres long and {width} metres wide. What is its perimeter in metres?", ans,
                f"2 * ({length} + {width}) = {ans}.")
    if kind == 11:
        start, given, found = rng.randint(20, 90), rng.randint(1, 19), rng.randint(1, 30)
        ans = start - given + found
        return (f"{name} had {start} {item}, gave {given} of them to {other}, and then found {found} more. "
                f"How many {item} does {name} have now?", ans, f"{start} - {given} + {found} = {ans}.")
    raise ValueError(kind)


N_KINDS = 12


def word_problems(n: int = WORD_PROBLEMS_N, seed: int = WORD_PROBLEMS_SEED) -> list[dict]:
    """n distinct word problems, cycling through the templates; deterministic in `seed`."""
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < n:
        prompt, answer, steps = _problem(rng, len(out) % N_KINDS)
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append({"prompt": prompt, "answer": str(answer), "solution": f"{steps}\n#### {answer}"})
    return out


def countdown(n: int = COUNTDOWN_N, seed: int = COUNTDOWN_SEED) -> list[dict]:
    sys.path.insert(0, str(ROOT))
    from lowmem_grpo.rewards.countdown import generate_countdown

    return generate_countdown(n, seed)


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def outputs() -> dict:
    return {"word_problems.jsonl": render(word_problems()), "countdown.jsonl": render(countdown())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "data", help="output folder (default: data/)")
    ap.add_argument("--check", action="store_true", help="compare with the files instead of writing them")
    args = ap.parse_args(argv)
    bad = 0
    for name, text in outputs().items():
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                print(f"{path}: differs from the generator's output")
                bad += 1
        else:
            args.out.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path} ({text.count(chr(10))} rows)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
