"""docs/algorithm.md stays true to the repository: the tests it names exist, the sections cited as
"docs/algorithm.md §N" exist, and nothing points to documents a user of the repository does not have."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALGORITHM = ROOT / "docs" / "algorithm.md"

# What a user's checkout holds: the package, scripts, tests, docs, recipes and the README.
WALK = ("lowmem_grpo", "scripts", "tests", "docs", "recipes", "README.md")
TEXT = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".json", ".jsonl", ".cfg", ".ini", ".sh"}

# Documents outside the repository (spelled in pieces so that a search of the repository does not find
# this file; the walk below leaves it out anyway, since its examples cite them).
OUTSIDE = ("../" + "shared", "grpo-" + "spec", "design" + ".md")
# "spec 4", "Spec 4", "spec-4", "spec sections 1-7", "spec §4": a numbered citation of the old spec. Words
# such as "TinyModelSpec", "spec_from_file_location" or "spec.name" do not match.
SPEC_CITATION = re.compile(r"\bspecs?(?:\s+sections?)?[\s-]*§?\s*\d", re.IGNORECASE)
# "docs/algorithm.md §4", "docs/algorithm.md §1, §4-§6", "[docs/algorithm.md](docs/algorithm.md) §1 and §2"
SECTION_CITATION = re.compile(r"docs/algorithm\.md\)?((?:\s*(?:,|and|or|-)?\s*§\d+)+)")
TEST_REFERENCE = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


def repository_files():
    for name in WALK:
        path = ROOT / name
        paths = [path] if path.is_file() else sorted(path.rglob("*"))
        for p in paths:
            if p.is_file() and p.suffix in TEXT and "__pycache__" not in p.parts and p != Path(__file__).resolve():
                yield p


def sections(text: str) -> set[int]:
    """Numbers of the document's numbered sections: "## 4. ..." (and "### 4.3 ..." counts as 4)."""
    return {int(m) for m in re.findall(r"^#{2,}\s+(\d+)[.\s]", text, flags=re.MULTILINE)}


def cited_sections(text: str) -> list[int]:
    return [int(n) for m in SECTION_CITATION.finditer(text) for n in re.findall(r"§(\d+)", m.group(1))]


def test_algorithm_sections_are_numbered_one_to_n():
    found = sections(ALGORITHM.read_text(encoding="utf-8"))
    assert found == set(range(1, max(found) + 1)), sorted(found)
    assert {1, 2, 3, 4, 5, 6, 7, 8} <= found


def test_every_test_the_document_names_exists():
    text = ALGORITHM.read_text(encoding="utf-8")
    named = TEST_REFERENCE.findall(text)
    assert len(named) > 20
    missing = []
    for path, name in sorted(set(named)):
        f = ROOT / path
        if not f.is_file() or not re.search(rf"^\s*def {name}\(", f.read_text(encoding="utf-8"), re.MULTILINE):
            missing.append(f"{path}::{name}")
    assert not missing, missing


def test_every_recipe_key_the_document_names_exists():
    from lowmem_grpo.recipe import field_reference

    keys = {key for key, *_ in field_reference()}
    text = ALGORITHM.read_text(encoding="utf-8")
    named = set(re.findall(r"`((?:algorithm|generation|train|rewards)\.\w+)`", text))
    assert named and not named - keys, sorted(named - keys)
    # every algorithm option is documented
    assert {k for k in keys if k.startswith("algorithm.")} <= named


def test_no_file_points_outside_the_repository():
    bad = []
    for p in repository_files():
        for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if any(word in line for word in OUTSIDE) or SPEC_CITATION.search(line):
                bad.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_every_cited_section_exists():
    have = sections(ALGORITHM.read_text(encoding="utf-8"))
    bad = []
    for p in repository_files():
        text = p.read_text(encoding="utf-8", errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            missing = [s for s in cited_sections(line) if s not in have]
            if missing:
                bad.append(f"{p.relative_to(ROOT)}:{n}: §{missing} in {line.strip()}")
    # inside the document itself, a bare "§N" refers to its own sections
    for n, line in enumerate(ALGORITHM.read_text(encoding="utf-8").splitlines(), 1):
        missing = [int(s) for s in re.findall(r"§(\d+)", line) if int(s) not in have]
        if missing:
            bad.append(f"docs/algorithm.md:{n}: §{missing}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("text, spec, cites", [
    ("see spec 4 and Spec-8", True, []),
    ("Spec sections 1-7", True, []),
    ("TinyModelSpec(hidden_size=64); spec_from_file_location; spec.name; format(v, spec)", False, []),
    ("docs/algorithm.md §1, §4-§6", False, [1, 4, 6]),
    ("[docs/algorithm.md](docs/algorithm.md) §2 and §9", False, [2, 9]),
    ("docs/algorithm.md §3's weights", False, [3]),
])
def test_the_patterns(text, spec, cites):
    assert bool(SPEC_CITATION.search(text)) == spec
    assert cited_sections(text) == cites


def test_every_recipe_key_in_the_readmes_trl_table_exists():
    """The README's "Coming from TRL" table is written by hand: each recipe key it names must be a field."""
    from lowmem_grpo.recipe import field_reference

    keys = {key for key, *_ in field_reference()} | {"seed"}
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("### Coming from TRL", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`((?:model|lora|data|rewards|generation|algorithm|optimizer|train|output)\.[\w\[\].]+)", section))
    named = {n.rstrip("._") for n in named}
    assert len(named) > 30 and not named - keys, sorted(named - keys)


def table_values(text: str, key_pattern: str) -> dict[str, str]:
    """{key: the value cells of its rows} of a markdown table whose first column names keys (a row whose first cell
    is empty continues the row above it)."""
    values: dict[str, str] = {}
    keys: list[str] = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2 or set(cells[0]) <= {"-"} and cells[0]:
            continue
        keys = re.findall(key_pattern, cells[0]) or (keys if not cells[0] else [])
        for key in keys:
            values[key] = values.get(key, "") + " " + cells[1]
    return values


def test_every_algorithm_value_is_in_both_option_tables():
    """Found by an audit: the values the recipe schema allows (loss.py reads its Literals too) were written out by
    hand in the README's algorithm table and docs/algorithm.md's "Options at a glance", and nothing tied them
    together. Every value of every Literal option of `algorithm.` is named in its key's rows of both."""
    from typing import Literal, get_args, get_origin

    from lowmem_grpo.recipe import AlgorithmConfig

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    readme = table_values(readme.split("## Algorithm options", 1)[1].split("\n#", 1)[0], r"`([\w*]+)`")
    glance = ALGORITHM.read_text(encoding="utf-8").split("### Options at a glance", 1)[1].split("\n#", 1)[0]
    glance = {k.removeprefix("algorithm."): v for k, v in table_values(glance, r"`(algorithm\.\w+)`").items()}
    options = {name: get_args(f.annotation) for name, f in AlgorithmConfig.model_fields.items()
               if get_origin(f.annotation) is Literal}
    assert {"clip", "aggregation", "sampler_correction", "importance_sampling_level"} <= set(options)
    missing = [f"{where}: algorithm.{name}: `{value}`" for where, table in (("README.md", readme), ("docs", glance))
               for name, values in options.items() for value in values if f"`{value}`" not in table.get(name, "")]
    assert not missing, missing


def test_the_variant_checklist_names_what_exists():
    """docs/algorithm.md's "Adding an algorithm variant" (found missing by an audit) stays true: every file, script
    and function or constant it names in backticks exists (a rename breaks it here, not for the next reader)."""
    text = ALGORITHM.read_text(encoding="utf-8").split("### Adding an algorithm variant", 1)[1].split("\n## ", 1)[0]
    code = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "lowmem_grpo").rglob("*.py"))
    names = re.findall(r"`([^`\s]+)`", text)
    assert len(names) > 15, names
    missing = []
    for name in names:
        path = name.split("::")[0]
        if "/" in path or path.endswith(".py"):
            ok = (ROOT / path).is_file()
        elif name.isidentifier():
            ok = bool(re.search(rf"^\s*(?:def|class) {name}\b|^{name} = ", code, re.MULTILINE))
        else:   # a recipe key or a command line: checked elsewhere
            continue
        if not ok:
            missing.append(name)
    assert not missing, missing


def test_the_readmes_step_phases_are_the_trainers():
    """README's "How a step works" lists the trainer's phases, each with the time/<phase>_s metric that times it
    (one list of phases: metrics.PHASES, which Trainer.train_step times; found by an audit: the README had five
    steps, train.py eight, the metrics other names)."""
    from lowmem_grpo.metrics import PHASES

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## How a step works"):readme.index("## Rollout engines")]
    missing = [p for p in PHASES if f"`time/{p}_s`" not in section]
    assert not missing, f"README's 'How a step works' does not name: {missing}"
    train = (ROOT / "lowmem_grpo" / "train.py").read_text()
    assert all(f'clock("{p}")' in train for p in PHASES)
