"""Generate the README's recipe reference from the schema (lowmem_grpo/recipe.py).

    python scripts/gen_recipe_reference.py          # print the table
    python scripts/gen_recipe_reference.py --write  # replace it in README.md
tests/test_recipe.py fails when the README's copy is stale.
"""

import re
import sys
from pathlib import Path

from lowmem_grpo.recipe import field_reference

BEGIN, END = "<!-- recipe-reference:begin -->", "<!-- recipe-reference:end -->"


def reference_block() -> str:
    lines = [BEGIN, "| key | type | default | meaning |", "|---|---|---|---|"]
    for key, typ, default, meaning in field_reference():
        lines.append(f"| `{key}` | {typ.replace('|', '&#124;')} | `{default}` | {meaning.replace('|', '&#124;')} |")
    lines.append(END)
    return "\n".join(lines)


if __name__ == "__main__":
    block = reference_block()
    if "--write" in sys.argv:
        readme = Path(__file__).resolve().parent.parent / "README.md"
        text = readme.read_text()
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
        readme.write_text(text)
    else:
        print(block)
