"""Generate the README's recipe reference (lowmem_grpo/recipe.py) and its reward options table
(lowmem_grpo/rewards/options.py) from the schemas.

    python scripts/gen_recipe_reference.py          # print both tables
    python scripts/gen_recipe_reference.py --write  # replace them in README.md
tests/test_recipe.py and tests/test_reward_options.py fail when the README's copy is stale.
"""

import re
import sys
from pathlib import Path

from lowmem_grpo.recipe import field_reference
from lowmem_grpo.rewards.options import BUILTINS, option_reference

BEGIN, END = "<!-- recipe-reference:begin -->", "<!-- recipe-reference:end -->"
REWARDS_BEGIN, REWARDS_END = "<!-- reward-options:begin -->", "<!-- reward-options:end -->"


def _cell(text: str) -> str:
    return text.replace("|", "&#124;")


def reference_block() -> str:
    lines = [BEGIN, "| key | type | default | meaning |", "|---|---|---|---|"]
    for key, typ, default, meaning in field_reference():
        lines.append(f"| `{key}` | {_cell(typ)} | `{default}` | {_cell(meaning)} |")
    lines.append(END)
    return "\n".join(lines)


def reward_options_block() -> str:
    readers = ", ".join(f"`{name}`" for name, spec in BUILTINS.items() if spec.reads_answer)
    lines = [REWARDS_BEGIN,
             f"{readers} read the reference answer from the row field `data.answer_field` (not a reward option).",
             "",
             "| reward | option | type | default | meaning |", "|---|---|---|---|---|"]
    for rewards, option, typ, default, meaning in option_reference():
        option, default = (f"`{option}`", f"`{default}`") if option else ("(none)", "")
        lines.append(f"| {rewards} | {option} | {_cell(typ)} | {_cell(default)} | {_cell(meaning)} |")
    lines.append(REWARDS_END)
    return "\n".join(lines)


def _replace(text: str, begin: str, end: str, block: str) -> str:
    if text.count(begin) != 1 or text.count(end) != 1:
        raise SystemExit(f"README.md must hold {begin} and {end} once each")
    return re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)


if __name__ == "__main__":
    if "--write" in sys.argv:
        readme = Path(__file__).resolve().parent.parent / "README.md"
        text = _replace(readme.read_text(), BEGIN, END, reference_block())
        readme.write_text(_replace(text, REWARDS_BEGIN, REWARDS_END, reward_options_block()))
    else:
        print(reference_block())
        print()
        print(reward_options_block())
