"""`lowmem-grpo report`: PNG plots and report.md from a recorded (tiny) run."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

from conftest import QUIET, recipe_dict
from lowmem_grpo.recipe import recipe_from_dict
from lowmem_grpo.report import DPI, FIGSIZE
from lowmem_grpo.train import Trainer

EXPECTED = ["reward.png", "success.png", "success_hist.png", "kl.png", "clip.png", "entropy.png", "lengths.png",
            "time_memory.png"]


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path  # the PNG signature
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13, path
    return struct.unpack(">II", data[16:24])


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "lowmem_grpo.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}, timeout=300)


def test_report_from_a_recorded_run(tiny_model_dir, tiny_data, tmp_path):
    run = tmp_path / "run"
    d = recipe_dict(tiny_model_dir, tiny_data, run, train={"steps": 3, "eval_every": 2, "eval_max_prompts": 4,
                                                          "preflight": False})
    Trainer(recipe_from_dict(d), **QUIET).fit()
    p = _cli("report", str(run), "--out", str(tmp_path / "rep"))
    assert p.returncode == 0, p.stderr
    assert f"and {len(EXPECTED)} plots" in p.stdout
    want = (round(FIGSIZE[0] * DPI), round(FIGSIZE[1] * DPI))
    for name in EXPECTED:
        assert _png_size(tmp_path / "rep" / name) == want, name
    md = (tmp_path / "rep" / "report.md").read_text()
    for name in EXPECTED:
        assert f"]({name})" in md, name
    assert "## Held-out accuracy" in md and md.count("\n| 0 |") == 1 and "| 2 |" in md and "| 3 |" in md
    assert "final success rate" in md and "peak memory" in md and "Best held-out accuracy" in md


def test_report_needs_a_run_with_metrics(tmp_path):
    p = _cli("report", str(tmp_path))
    assert p.returncode == 2 and "no metrics.jsonl" in p.stderr and "Traceback" not in p.stderr
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.5}\n')
    p = _cli("report", str(tmp_path))
    assert p.returncode == 2 and "no step rows" in p.stderr and "Traceback" not in p.stderr
