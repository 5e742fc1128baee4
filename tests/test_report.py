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


def _report(run, out):
    from click.testing import CliRunner

    from lowmem_grpo.cli import main

    return CliRunner().invoke(main, ["report", str(run), "--out", str(out)])


def test_report_leaves_out_what_cannot_be_plotted_and_counts_it(tmp_path):
    """An audit's metrics.jsonl: values of 1e308 (matplotlib: "arange: cannot compute length"), a 400-digit step
    (OverflowError), text where loss goes, steps out of order (the header and the "final" figures came from file
    order), an accuracy of 5.0 (printed as 500.0% and named best). The report is written; what it left out is
    counted in report.md, the steps are in order, and an accuracy outside 0..1 is flagged, never best."""
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 5, "loss": 0.1, "reward/mean": 0.5, "success_rate": 0.5, "success_rate/hist": [1, 1]},
            {"step": 3, "loss": 0.1, "reward/mean": 0.3, "success_rate": 0.3, "success_rate/hist": [7, 3]},
            {"step": 9, "loss": 0.1, "reward/mean": 0.9, "success_rate": 0.9, "success_rate/hist": [1, 9]},
            {"step": 1, "loss": 0.1, "reward/mean": 0.1, "success_rate": 1e308, "time/step_s": 1e308},
            {"step": 7, "loss": "abc", "reward/mean": "x"},
            {"step": 2, "eval/accuracy": 5.0, "eval/n": "ten"}, {"step": 4, "eval/accuracy": 0.25, "eval/n": 8},
            {"step": 6, "loss": None, "reward/mean": 0.6, "success_rate": -1}]   # null: a non-finite loss, kept
    lines = [json.dumps(r) for r in rows] + ['{"step": ' + "9" * 400 + ', "loss": 0.1, "reward/mean": 0.5}']
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    res = _report(run, tmp_path / "rep")
    assert res.exit_code == 0 and res.exception is None, res.output
    md = (tmp_path / "rep" / "report.md").read_text()
    assert ", 9 run;" in md and "| final reward (mean of last 1 steps) | 0.9 |" in md, md
    assert "best success rate (trailing mean) | 90.0% at step 9" in md
    assert ("(Left out of the plots and figures: 1 row(s) with a step beyond ±9,007,199,254,740,992 (no run has as "
            "many); 1 row(s) whose loss and reward/mean are neither numbers nor null (e.g. text); 2 value(s) beyond "
            "±1e300, which cannot be plotted; 2 value(s) of success_rate or eval/accuracy outside 0..1, which is no "
            "share.)") in md, md
    assert "(Left out of the plots and figures: 1 row(s) with a step beyond" in res.output   # said, not only in md
    assert "| 2 | 5 (outside 0..1: not a share) | - | - |" in md and "| 4 | 25.0% | - | 8 |" in md
    assert "Best held-out accuracy: 25.0% at step 4." in md and "500" not in md
    assert {"reward.png", "success.png", "success_hist.png"} <= {p.name for p in (tmp_path / "rep").iterdir()}
    assert "time_memory.png" not in md   # its only value was 1e308
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": "abc"}) + "\n")
    res = _report(run, tmp_path / "rep")
    assert res.exit_code == 2 and "no step rows to plot (1 row(s) whose loss and reward/mean are neither numbers " \
                                  "nor null)" in res.output, res.output


def test_report_says_in_one_line_where_it_cannot_write(tmp_path, monkeypatch):
    """reward.png or report.md already a folder, a full disk: one error line naming the file, exit 2 (an
    IsADirectoryError traceback before)."""
    import errno

    import matplotlib.figure

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.1, "reward/mean": 0.5}) + "\n")
    (tmp_path / "a" / "reward.png").mkdir(parents=True)
    (tmp_path / "b" / "report.md").mkdir(parents=True)
    for out, name in ((tmp_path / "a", "reward.png"), (tmp_path / "b", "report.md")):
        res = _report(run, out)
        assert res.exit_code == 2 and res.output == f"error: --out {out}: cannot write {name} (Is a directory)\n", \
            res.output

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    res = _report(run, tmp_path / "c")
    assert res.exit_code == 2 and "cannot write reward.png (No space left on device)" in res.output, res.output
