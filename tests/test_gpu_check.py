"""scripts/gpu_check.py where CI can run it: the plan (--dry-run), the message on a machine without CUDA, the
table of the recorded H100 results repriced by the memory model (docs/gpu/), and the wheel list in
docs/benchmarks.md against the project's dependencies. The CUDA runs themselves are GPU-only."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"
RESULTS = sorted((ROOT / "docs" / "gpu").glob("results-*.json"))


def run(*args, timeout=300):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def test_dry_run_plans_every_row_from_a_shipped_config_and_runs_nothing():
    proc = run("--dry-run")
    assert proc.returncode == 0, proc.stderr
    names = ["qwen1.5b-512", "qwen7b-1024", "llama8b-512", "llama8b-20k", "llama8b-20k-offload"]
    for name in names:
        assert f"  {name}: " in proc.stdout
    assert "pytest tests/gpu" in proc.stdout
    for folder in re.findall(r"\((lowmem_grpo/model_configs/[^)]+)\)", proc.stdout):
        assert (ROOT / folder / "config.json").is_file(), folder
    assert "device:" not in proc.stdout  # nothing touched CUDA
    assert "offload on, update only" in proc.stdout


def test_an_unknown_row_is_an_error_naming_the_known_ones():
    proc = run("--dry-run", "--rows", "qwen1.5b-512", "gpt5")
    assert proc.returncode == 2
    assert "unknown row(s) gpt5" in proc.stderr and "llama8b-20k" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_without_cuda_it_says_so_and_exits_2():
    proc = run("--rows", "qwen1.5b-512", "--skip-tests")
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr and "--dry-run" in proc.stderr


def test_the_memory_model_is_within_15_percent_of_every_recorded_h100_row():
    """The H100 figures of docs/benchmarks.md, repriced by this checkout's memory model: a change to the model
    that moves a prediction more than 15% off what the GPU measured fails here."""
    assert len(RESULTS) >= 3
    rows = {r["row"]["name"] for p in RESULTS for r in json.loads(p.read_text())["results"]}
    assert rows == {"qwen1.5b-512", "qwen7b-1024", "llama8b-512", "llama8b-20k", "llama8b-20k-offload"}
    proc = run("--from-results", *map(str, RESULTS))
    assert proc.returncode == 0, proc.stderr
    errors = {line.split()[0]: float(re.search(r"([+-]\d+\.\d)%", line).group(1))
              for line in proc.stdout.splitlines() if re.match(r"(qwen|llama)", line)}
    assert errors.keys() == rows
    assert all(abs(e) <= 15 for e in errors.values()), errors


def _name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_the_wheel_list_names_every_dependency_once():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = {_name(r) for r in project["dependencies"] + project["optional-dependencies"]["bench"]} | {"pytest"}
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    table = text.split("<!-- gpu-wheels:begin -->")[1].split("<!-- gpu-wheels:end -->")[0]
    rows = [line.split("|")[1:-1] for line in table.strip().splitlines()[2:]]
    listed = [_name(cells[0]) for cells in rows]
    assert sorted(listed) == sorted(deps), set(listed) ^ deps
    for cells in rows:  # each is either on the machine or carried, not both, not neither
        on_machine, carried = cells[1].strip(), cells[2].strip()
        assert bool(on_machine) != bool(carried), cells
        if carried:
            assert re.search(rf"\b{re.escape(cells[0].strip())} \d", carried), cells  # the wheel itself, pinned
