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


def _step_row(step, **values):
    row = {"step": step, "loss": 0.1, "reward/mean": 0.5, "success_rate": 0.5, "success_rate/hist": [1, 1],
           "time/step_s": 1.0}
    return {**row, **values}


def _write_rows(run, rows):
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_keeps_the_last_written_row_of_a_step_written_twice(tmp_path):
    """A metrics.jsonl whose steps 6..8 were written again (a resume from step 5's checkpoint that did not cut the
    file back: the trainer's own resume does, metrics.truncate_after) counted them twice: mean and total step time,
    the "final" figures, the curves, a step's held-out accuracy listed twice. The last-written row of a step wins
    (a resume re-runs the steps after its checkpoint; the stopped run's rows of them are discarded work), per kind:
    the final eval's own row at the last step does not replace that step's training row."""
    run = tmp_path / "run"
    rows = ([{"step": 0, "eval/accuracy": 0.1}]
            + [_step_row(s, **({"eval/accuracy": 0.3} if s == 5 else {})) for s in range(1, 9)]       # the killed run
            + [_step_row(s, **{"reward/mean": 0.9, "time/step_s": 2.0}) for s in range(6, 11)]     # its resume
            + [{"step": 5, "eval/accuracy": 0.4}, {"step": 10, "eval/accuracy": 0.7, "eval/n": 8}])
    _write_rows(run, rows)
    res = _report(run, tmp_path / "rep")
    assert res.exit_code == 0 and res.exception is None, res.output
    md = (tmp_path / "rep" / "report.md").read_text()
    assert ", 10 run;" in md and "| final reward (mean of last 1 steps) | 0.9 |" in md, md
    assert "| mean step time | 1.5 s |" in md and "| total step time | 0.25 min |" in md, md   # 5 x 1 s + 5 x 2 s
    assert "3 earlier row(s) of steps written again" in md and "3 earlier row(s) of steps written again" in res.output
    assert md.count("\n| 5 |") == 1 and "| 5 | 40.0% |" in md and "| 10 | 70.0% | - | 8 |" in md, md


def test_report_success_histogram_is_drawn_at_its_steps_and_rates(tmp_path, monkeypatch):
    """The histogram image: a step without a histogram (every completion skipped: all-zero counts) shifted every
    later column (columns were spread evenly over the steps), and a resume with another G (--set
    generation.num_generations) drew G=2's "all solved" bin at 0.25 of the G=8 grid. Now each step has its own
    column (blank without a histogram) and each bin its own rate; report.md says that G changed."""
    import matplotlib.axes
    import numpy as np

    drawn = []
    imshow = matplotlib.axes.Axes.imshow
    monkeypatch.setattr(matplotlib.axes.Axes, "imshow",
                        lambda self, m, **kw: drawn.append((np.asarray(m, dtype=float), kw)) or imshow(self, m, **kw))
    run = tmp_path / "run"
    _write_rows(run, [_step_row(1, **{"success_rate/hist": [0] * 8 + [4]}),
                      _step_row(2, **{"success_rate/hist": [0, 0, 0]}),            # no prompt with a valid completion
                      _step_row(3, **{"success_rate/hist": [0, 0, 4]}),            # G=2 after a resume: all solved
                      _step_row(4, **{"success_rate/hist": [4, 0, 0]})])
    res = _report(run, tmp_path / "rep")
    assert res.exit_code == 0 and res.exception is None, res.output
    (m, kw), = drawn
    assert m.shape == (9, 4) and kw["extent"][:2] == (0.5, 4.5), (m, kw)
    assert m[8, 0] == 1 and m[8, 2] == 1 and m[0, 3] == 1 and np.isnan(m[:, 1]).all(), m
    assert np.nansum(m) == 3
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "(The group size changed during the run: G=8 from step 1, G=2 from step 3." in md, md


def test_report_legend_shows_every_reward_name_as_written(tmp_path, monkeypatch):
    """matplotlib leaves out of a legend a label that starts with "_" (a reward function `_format` had a line and no
    entry) and reads $...$ as math (`a$x$` showed as "ax")."""
    import matplotlib.figure

    legends = []
    savefig = matplotlib.figure.Figure.savefig

    def record(self, *a, **k):
        legends.extend(t.get_text() for ax in self.axes if ax.get_legend() for t in ax.get_legend().get_texts())
        return savefig(self, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    run = tmp_path / "run"
    _write_rows(run, [_step_row(s, **{"reward/_format": 0.2, "reward/a$x$": 0.1, "reward/ñandú": 0.3})
                      for s in (1, 2)])
    res = _report(run, tmp_path / "rep")
    assert res.exit_code == 0 and res.exception is None, res.output
    shown = [t.strip().replace("\\$", "$") for t in legends]
    assert {"total", "_format", "a$x$", "ñandú"} <= set(shown), legends
    assert all(not t.startswith("_") for t in legends) and "a$x$" not in legends, legends   # as matplotlib needs them


def test_report_names_the_run_from_its_folder_and_says_what_is_missing(tmp_path, monkeypatch):
    """`lowmem-grpo report .` in a run folder titled report.md "# Run report: " (Path(".").name is ""); a folder that
    does not exist was "no metrics.jsonl"; an empty metrics.jsonl (a run in its first step) "no step rows"."""
    run = tmp_path / "my-run"
    _write_rows(run, [_step_row(1)])
    monkeypatch.chdir(run)
    res = _report(".", tmp_path / "rep")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "rep" / "report.md").read_text().startswith("# Run report: my-run\n")
    res = _report(tmp_path / "nowhere", tmp_path / "rep")
    assert res.exit_code == 2 and "nowhere: no such folder" in res.output, res.output
    (run / "metrics.jsonl").write_text("\n")
    res = _report(run, tmp_path / "rep")
    assert res.exit_code == 2 and "metrics.jsonl: no rows yet" in res.output, res.output
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/accuracy": 0.5}) + "\n")   # step 0's eval only
    res = _report(run, tmp_path / "rep")
    assert res.exit_code == 2 and "no step rows to plot (only 1 held-out eval row(s): a run writes a step's row " \
                                  "when the step is done)" in res.output, res.output


def test_report_removes_its_own_figures_that_it_no_longer_draws(tmp_path):
    """A report written again into the same folder (RUN/report, or one --out) left an earlier report's kl.png there,
    beside a report.md without it: old data shown as the run's."""
    run, out = tmp_path / "run", tmp_path / "rep"
    _write_rows(run, [_step_row(s, **{"kl/ref": 0.01}) for s in (1, 2)])
    assert _report(run, out).exit_code == 0 and (out / "kl.png").is_file()
    (out / "notes.png").write_text("mine")
    _write_rows(run, [_step_row(s) for s in (1, 2)])
    res = _report(run, out)
    assert res.exit_code == 0, res.output
    assert not (out / "kl.png").exists() and (out / "reward.png").is_file()
    assert (out / "notes.png").read_text() == "mine"   # (not one of the report's names)


def test_report_reads_a_large_metrics_file_a_row_at_a_time(tmp_path):
    """Each row was held whole (every step's per-prompt list): a 100,000-step run's 250 MB metrics.jsonl took 1.6 GB.
    Now a row keeps only the keys the report uses."""
    import tracemalloc

    from lowmem_grpo.report import render

    run = tmp_path / "run"
    _write_rows(run, [_step_row(s, **{"success_rate/per_prompt": [0.5] * 2000}) for s in range(1, 301)])
    import matplotlib.pyplot as plt   # (its import is not the report's memory)

    plt.close("all")

    tracemalloc.start()
    try:
        render(run, tmp_path / "rep")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, peak / 2**20   # (held whole: 21 MB)


def test_a_resume_cuts_a_metrics_file_holding_a_bad_byte_or_a_text_step(tmp_path):
    """Found by a red team: metrics.truncate_after (a resume's cut back to the checkpoint) raised UnicodeDecodeError
    on a byte that is not UTF-8, and TypeError on a row whose step is text. Those lines are damage, dropped as a line
    cut by a crash is; the rows of steps up to the checkpoint stay, the later ones go."""
    from lowmem_grpo.metrics import read_metrics_file, truncate_after

    f = tmp_path / "metrics.jsonl"
    f.write_bytes(b'{"step": 1, "loss": 0.5}\n{"step": 2, "note": "\xff"}\n{"step": "3", "loss": 1}\n'
                  b'{"step": true}\n{"step": 3, "loss": 0.25}\n{"step": 6, "loss": 0.1}\n{"step": 7, "lo')
    truncate_after(f, 5)
    rows, _ = read_metrics_file(f)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[1]["note"] == "\ufffd"
