"""`lowmem-grpo report`: PNG plots and report.md from a recorded (tiny) run."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import warnings

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


def test_report_on_damaged_metrics_and_recipe(tmp_path):
    """Lines that are not metrics rows (a crash's cut line, stray JSON, non-UTF-8 bytes, a row without its step) are
    skipped and counted; malformed values are left out of the plots; a broken recipe.yaml only blanks the header."""
    from click.testing import CliRunner

    from lowmem_grpo.cli import main

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "loss": 0.1 * s, "reward/mean": 0.5, "success_rate": 0.25, "time/step_s": 1.0,  # no memory
             "success_rate/hist": [3, 1] if s != 2 else [3]} for s in (1, 2, 3)]   # a one-bin histogram
    rows[2]["success_rate/hist"] = ["a", 1]
    lines = [json.dumps(r) for r in rows] + ["[1, 2]", "5", "null", '{"loss": 1.0}', '{"step": 4, "eval/accuracy": "high"}']
    (run / "metrics.jsonl").write_bytes("\n".join(lines).encode() + b'\n{"step": 5, "loss": \xff}\n{"step": 6, "lo')
    (run / "recipe.yaml").write_text("model: [\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = CliRunner().invoke(main, ["report", str(run), "--out", str(tmp_path / "rep")])
    assert res.exit_code == 0 and res.exception is None, res.output
    assert not [w for w in caught if "No artists with labels" in str(w.message)]  # the empty memory panel: no legend
    assert "(6 unreadable line(s) of metrics.jsonl skipped)" in res.output
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "6 line(s) of metrics.jsonl skipped" in md and "Model `?`" in md and "Held-out accuracy" not in md
    assert (tmp_path / "rep" / "success_hist.png").is_file()   # from the one well-formed histogram
    (tmp_path / "afile").write_text("x")
    res = CliRunner().invoke(main, ["report", str(run), "--out", str(tmp_path / "afile" / "sub")])
    assert res.exit_code == 2 and "--out" in res.output and "cannot create the folder" in res.output
