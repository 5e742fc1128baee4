"""No import circle anywhere in the package, and every module imports on its own.

The graph is read from the source (ast): an edge A -> B for every `import`/`from ... import` of a
lowmem_grpo module in A, at module level or inside a function (a lazy import still ties the two modules
together). `from .pkg import name` counts as an edge to pkg.name when that is a module, else to pkg.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "lowmem_grpo"


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    root = ".".join(base + ([node.module] if node.module else []))
                else:
                    root = node.module or ""
                targets = [f"{root}.{a.name}" if f"{root}.{a.name}" in mods else root for a in node.names]
            for t in targets:
                while t and t not in mods:  # `import lowmem_grpo.rewards.math as m` -> that module
                    t = t.rpartition(".")[0]
                if t and t != name:
                    graph[name].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]):
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 20
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_checker_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    g = import_graph()
    assert "lowmem_grpo.rollout.base" in g["lowmem_grpo.evaluate"]  # relative imports are resolved
    assert "lowmem_grpo.diagnostics" in g["lowmem_grpo.train"]     # `from . import diagnostics as diag`


@pytest.mark.slow(60)
def test_every_module_imports_on_its_own():
    """Each module in a fresh interpreter, first thing (an import-order dependency would fail here); the
    interpreters run a few at a time (each is mostly torch's import, ~2 s). vLLM's engine module is left out
    where vllm is not installed (it is an optional extra)."""
    names = sorted(modules())
    try:
        import vllm  # noqa: F401
    except ImportError:
        names.remove("lowmem_grpo.rollout.vllm")

    def problem(name):
        p = subprocess.run([sys.executable, "-c", "import " + name], capture_output=True, text=True, timeout=300)
        return p.returncode and name + ": " + (p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1]

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        bad = [b for b in pool.map(problem, names) if b]
    assert len(names) > 20 and not bad, "\n".join(bad)
