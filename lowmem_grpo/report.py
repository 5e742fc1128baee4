"""`lowmem-grpo report RUN_DIR`: PNG plots of a run's metrics and a one-page Markdown summary.

Reads only RUN/metrics.jsonl (and RUN/recipe.yaml for the header), so it works on a finished run, a
stopped one, or one still training. Plots use matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import yaml

from .metrics import read_metrics_file
from .rewards import ROW_REWARD_KEYS

FIGSIZE = (6.4, 3.6)  # inches; at DPI this is the PNG's size in pixels (no tight bbox, so it is exact)
DPI = 80


class ReportError(Exception):
    pass


# What matplotlib can draw: past ~1e308 its axis ticks overflow ("arange: cannot compute length"); 1e300 leaves
# room for the sums and means of the figures too. A larger value is left out, and counted in report.md.
PLOT_LIMIT = 1e300
MAX_STEP = 2 ** 53   # steps as exact floats on the x axis (a 400-digit step overflows float); no run has more
SHARES = ("success_rate", "eval/accuracy")   # shown as percentages: a value outside 0..1 is no share, left out
STEP_ROW_MARKERS = ("loss", "reward/mean")          # what makes a row a training step's
MAX_BINS = 4096   # a success_rate/hist of more bins (G, the group size, is far less) is no histogram of a run's
HIST_COLS = 1000  # the histogram image's most columns: more steps share one (their mean), as the PNG is 512 px wide

# (file, title, panels: one list of (key, label) per subplot); reward.png gets one line per reward function too
FIGURES = [
    ("reward.png", "Reward", [[("reward/mean", "total")]]),
    ("success.png", "Success rate (train batches) and held-out accuracy",
     [[("success_rate", "train success rate"), ("eval/accuracy", "held-out accuracy")]]),
    ("kl.png", "KL divergence", [[("kl/ref", "KL to reference"), ("kl/mirror", "KL to sampler")]]),
    ("clip.png", "Clipped token fractions", [[("clip/fraction", "all"), ("clip/low", "low"), ("clip/high", "high")]]),
    ("entropy.png", "Token entropy (nats)", [[("entropy", "entropy")]]),
    ("lengths.png", "Completion lengths",
     [[("completion/mean_length", "mean length (tokens)")], [("completion/truncated_fraction", "truncated fraction")]]),
    ("environment.png", "Environment episodes (docs/algorithm.md §20; only runs with an environment)",
     [[("env/turns", "model turns per completion")], [("env/tokens", "environment tokens per completion")],
      [("env/tool_calls", "tool calls"), ("env/tool_errors", "tool errors"), ("env/tool_timeouts", "tool timeouts"),
       ("env/errors", "environment errors")]]),
    ("time_memory.png", "Step time and memory",
     [[("time/step_s", "step (s)"), ("time/rollout_s", "rollout (s)")], [("memory/peak_mib", "peak memory (MiB)"), ("memory/now_mib", "in use (MiB)")]]),
]
IMAGES = [name for name, _, _ in FIGURES[:2]] + ["success_hist.png"] + [name for name, _, _ in FIGURES[2:]]
# What of a row the report uses (the rest, e.g. each step's per-prompt list, is dropped as the file is read: a
# 100,000-step metrics.jsonl of 250 MB took 1.6 GB held whole, found by a red team)
USED_KEYS = frozenset({"step", *STEP_ROW_MARKERS, "success_rate/hist", "eval/mean_reward", "eval/n",
                       "nonfinite/skipped_total", *(key for _, _, panels in FIGURES for keys in panels for key, _ in keys)})


def _real(v) -> bool:
    """A JSON number (not a bool): finite or not, of any size."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _number(v) -> bool:
    """A number the plots and figures can use: finite, and within PLOT_LIMIT."""
    if type(v) is float:   # (the common case, first: a 100,000-step run asks millions of times)
        return -PLOT_LIMIT <= v <= PLOT_LIMIT   # (False for NaN and infinity)
    if not _real(v):
        return False
    try:
        return math.isfinite(v) and abs(float(v)) <= PLOT_LIMIT
    except OverflowError:   # an int too large for a float
        return False


def _usable(key: str, v) -> bool:
    """_number, and for a share (SHARES) one within 0..1."""
    return _number(v) and (key not in SHARES or 0 <= v <= 1)


def _histogram(v) -> Optional[list]:
    """A step's success_rate/hist as counts (two bins or more, none negative, some prompts), else None."""
    if (isinstance(v, list) and 2 <= len(v) <= MAX_BINS + 1 and all(_number(x) and x >= 0 for x in v)
            and 0 < sum(v) <= PLOT_LIMIT):
        return v
    return None


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if _usable(key, v):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def _used(key: str) -> bool:
    """Whether the report uses a row's `key`: a plotted key, a reward function's mean (reward/NAME), or a figure."""
    return key in USED_KEYS or (key.startswith("reward/") and key.count("/") == 1)


def _is_step_row(row: dict) -> bool:
    """A training step's row (it has a loss or a reward/mean, of any value), not an eval-only one (step 0's, the
    final eval's)."""
    return any(k in row for k in STEP_ROW_MARKERS)


def _last_written(rows: list[dict]) -> tuple[list[dict], int]:
    """The rows (file order) less those of a step that a later row of the same kind (a training step's, or an
    eval-only one: the final eval shares the last step's number) writes again; and how many went.

    The last-written row of a step wins, as the trainer's resume implies: a resume continues from a checkpoint's
    weights and re-runs the steps after it, so rows that the stopped run wrote for those steps describe work the
    resume threw away. The trainer itself drops them on resume (sinks.JsonlSink -> metrics.truncate_after cuts
    metrics.jsonl back to the checkpoint's step before a step is re-run), so a run made by it has no step twice; a
    file that has (an older version's run, files joined by hand, a cut that failed) counted each re-run step twice
    in every mean, total and curve, the curves zigzagging back (found by a red team)."""
    latest = {(r["step"], _is_step_row(r)): i for i, r in enumerate(rows)}
    kept = [r for i, r in enumerate(rows) if latest[(r["step"], _is_step_row(r))] == i]
    return kept, len(rows) - len(kept)


def _sorted_rows(rows: list[dict]) -> tuple[list[dict], dict]:
    """The rows in step order (a resumed or hand-edited metrics.jsonl need not be), less those whose step cannot be
    plotted; and what was left out, counted: {"step": rows with a step beyond MAX_STEP, "huge": values beyond
    PLOT_LIMIT, "share": shares outside 0..1}. (Non-finite values are not counted: a skipped step logs them.)"""
    kept = [r for r in rows if abs(r["step"]) <= MAX_STEP]
    counts = {"step": len(rows) - len(kept), "huge": 0, "share": 0}
    for r in kept:
        for key, v in r.items():
            if key == "step" or not _real(v) or (isinstance(v, float) and not math.isfinite(v)):
                continue
            if not _number(v):
                counts["huge"] += 1
            elif not _usable(key, v):
                counts["share"] += 1
    return sorted(kept, key=lambda r: r["step"]), counts


def _left_out_note(counts: dict, malformed: int) -> list[str]:
    """report.md's lines on the rows and values the report left out, or none."""
    parts = []
    if counts.get("again"):
        parts.append(f"{counts['again']} earlier row(s) of steps written again, as a resume re-runs the steps after "
                     "its checkpoint (the last-written row of a step is the one kept)")
    if counts["step"]:
        parts.append(f"{counts['step']} row(s) with a step beyond ±{MAX_STEP:,} (no run has as many)")
    if malformed:
        parts.append(f"{malformed} row(s) whose {' and '.join(STEP_ROW_MARKERS)} are neither numbers nor null (e.g. text)")
    if counts["huge"]:
        parts.append(f"{counts['huge']} value(s) beyond ±{PLOT_LIMIT:.0e}, which cannot be plotted".replace("e+", "e"))
    if counts["share"]:
        parts.append(f"{counts['share']} value(s) of {' or '.join(SHARES)} outside 0..1, which is no share")
    return [f"(Left out of the plots and figures: {'; '.join(parts)}.)", ""] if parts else []


def _smooth(ys: list[float]) -> list[float]:
    """Trailing mean over ~1/20 of the run: the trend of a noisy per-step curve."""
    w = max(1, len(ys) // 20)
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y - (ys[i - w] if i >= w else 0.0)
        out.append(acc / min(i + 1, w))
    return out


def _legend_label(text: str) -> str:
    """A legend entry that shows `text` as it is: matplotlib leaves out of the legend a label that starts with "_"
    (a reward function `_format`: its line had no entry) and reads $...$ as math ("a$x$" showed as "ax")."""
    text = text.replace("$", r"\$")
    return " " + text if text.startswith("_") else text


def _plot_lines(plt, rows, panels, title: str, path: Path) -> Optional[Path]:
    """panels: one list of (key, label) per subplot. Returns None when no key has data."""
    series = {k: _series(rows, k) for keys in panels for k, _ in keys}
    if not any(xs for xs, _ in series.values()):
        return None
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(panels), figsize=FIGSIZE, dpi=DPI, squeeze=False)
    for ax, keys in zip(axes[0], panels):
        plotted = False
        for key, label in keys:
            xs, ys = series[key]
            if not xs:
                continue
            plotted, label = True, _legend_label(label)
            if len(xs) > 40:  # raw faint, trend bold
                line, = ax.plot(xs, ys, alpha=0.25, linewidth=0.8)
                ax.plot(xs, _smooth(ys), color=line.get_color(), linewidth=1.5, label=label)
            else:
                ax.plot(xs, ys, marker="." if len(xs) < 15 else None, linewidth=1.2, label=label)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # (no step 1.5)
        ax.grid(alpha=0.3)
        if plotted:  # (an empty panel has no labels: matplotlib warns)
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _plot_success_hist(plt, rows, path: Path) -> Optional[Path]:
    """Per-prompt success rate over time: each column a step (a run of over HIST_COLS steps: a few steps, their
    mean), each row a rate 0, 1/G, ..., 1; colour = the fraction of the step's prompts at that rate. Mass at 0 and
    1 gives no gradient (zero-std groups). A step without a histogram (every completion skipped) is a blank column
    at its own place, and a histogram of another G (a resume with --set generation.num_generations) is drawn at its
    own rates, on a grid of the sizes' least common multiple (both were wrong before, found by a red team: columns
    spread evenly over the steps shifted every later step, and G=2's "all solved" showed at 0.25 of a G=8 grid)."""
    hist = [(r["step"], _histogram(r.get("success_rate/hist"))) for r in rows]
    hist = [(step, h) for step, h in hist if h is not None]
    if not hist:
        return None
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    sizes = {len(h) - 1 for _, h in hist}
    g = math.lcm(*sizes)
    if g > 256:   # (far-apart sizes: the nearest row of the largest)
        g = max(sizes)
    first, last = hist[0][0], hist[-1][0]
    cols = min(last - first + 1, HIST_COLS)
    width = (last - first + 1) / cols   # steps per column (1 but for long runs)
    total, count = np.zeros((g + 1, cols)), np.zeros(cols)
    for step, h in hist:
        j = min(int((step - first + 0.5) / width), cols - 1)
        at = np.rint(np.arange(len(h)) * (g / (len(h) - 1))).astype(int)
        np.add.at(total[:, j], at, np.asarray(h, dtype=float) / sum(h))
        count[j] += 1
    with np.errstate(invalid="ignore"):
        m = np.where(count > 0, total / np.maximum(count, 1), np.nan)   # NaN: no histogram there, drawn blank
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    im = ax.imshow(m, aspect="auto", origin="lower", interpolation="nearest", cmap="viridis", vmin=0, vmax=1,
                   extent=(first - 0.5, last + 0.5, -0.5 / g, 1 + 0.5 / g))
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("per-prompt success rate")
    fig.colorbar(im, ax=ax, label="fraction of prompts")
    ax.set_title("Per-prompt success-rate histogram", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _group_sizes(steps: list[dict]) -> list[tuple[int, int]]:
    """(first step, G) of each stretch of the run with one group size, as its success_rate/hist shows it (G+1 bins)."""
    out: list[tuple[int, int]] = []
    for r in steps:
        h = _histogram(r.get("success_rate/hist"))
        if h is not None and (not out or out[-1][1] != len(h) - 1):
            out.append((r["step"], len(h) - 1))
    return out


def _fmt(v, pct=False) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.1f}%" if pct else (f"{v:.4g}" if isinstance(v, float) else str(v))


def render(run_dir, out_dir=None) -> dict:
    """Write the PNGs and report.md into out_dir (default RUN/report). Returns {"report": path, "images": [...]}."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such folder")
    if not (run_dir / "metrics.jsonl").is_file():
        raise ReportError(f"{run_dir}: no metrics.jsonl (not a run directory, or one whose run has not started)")
    try:
        rows, skipped = read_metrics_file(run_dir / "metrics.jsonl", keep=_used)
    except OSError as exc:
        raise ReportError(f"{run_dir / 'metrics.jsonl'}: cannot read it ({exc.strerror or exc})") from None
    if not rows and not skipped:
        raise ReportError(f"{run_dir / 'metrics.jsonl'}: no rows yet (a run writes one when its first step, or its "
                          "first held-out eval, is done)")
    rows, again = _last_written(rows)
    rows, counts = _sorted_rows(rows)   # (a stable sort: a step's rows stay in file order)
    counts["again"] = again
    # held-out accuracies, one a step (the last-written: a training row's eval_every one, or an eval-only row);
    # one outside 0..1 is listed, flagged
    evals = list({r["step"]: r for r in rows if _number(r.get("eval/accuracy"))}.values())
    claimed = [r for r in rows if any(k in r for k in STEP_ROW_MARKERS)]
    # a number, or null (metrics.py writes a non-finite value so: a step skipped for it); loss: "abc" is no step's
    steps = [r for r in claimed if any(k in r and (r[k] is None or _real(r[k])) for k in STEP_ROW_MARKERS)]
    malformed = len(claimed) - len(steps)
    if not steps:
        why = [f"{skipped} line(s) are not metrics rows: a JSON object with an integer step"] if skipped else []
        why += [f"{malformed} row(s) whose {' and '.join(STEP_ROW_MARKERS)} are neither numbers nor null"] if malformed else []
        why += [f"{counts['step']} row(s) with a step beyond ±{MAX_STEP:,}"] if counts["step"] else []
        why += [f"only {len(evals)} held-out eval row(s): a run writes a step's row when the step is done"] * bool(evals)
        raise ReportError(f"{run_dir / 'metrics.jsonl'}: no step rows to plot" + (f" ({'; '.join(why)})" if why else ""))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ReportError("report needs matplotlib: pip install 'lowmem-grpo[plots]'") from None
    out = Path(out_dir) if out_dir else run_dir / "report"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReportError(f"--out {out}: cannot create the folder ({exc})") from None
    fn_keys = sorted({k for r in steps for k in r if k.startswith("reward/") and k.count("/") == 1
                      and k.split("/", 1)[1] not in ROW_REWARD_KEYS})   # (the total's, not a function's)
    figures = [(name, title, [panels[0] + [(k, k.split("/", 1)[1]) for k in fn_keys]] if name == "reward.png"
                else panels) for name, title, panels in FIGURES]
    # success.png: the training rows' success rate, and each step's last-written held-out accuracy
    success_rows = sorted([{"step": r["step"], "success_rate": r.get("success_rate")} for r in steps]
                          + [{"step": r["step"], "eval/accuracy": r["eval/accuracy"]} for r in evals],
                          key=lambda r: r["step"])
    images, failed = [], []

    def draw(name, plot, *args):
        try:
            if plot(plt, *args, out / name):
                images.append(name)
        except OSError as exc:   # reward.png is a folder, the disk is full, no permission
            plt.close("all")
            raise ReportError(f"--out {out}: cannot write {name} ({exc.strerror or exc})") from None
        except (ValueError, OverflowError, FloatingPointError) as exc:   # what matplotlib cannot draw: that plot only
            plt.close("all")
            failed.append(f"{name} ({type(exc).__name__}: {exc})")

    for name, title, panels in figures:
        draw(name, _plot_lines, success_rows if name == "success.png" else steps, panels, title)
        if name == "success.png":
            draw("success_hist.png", _plot_success_hist, steps)
    for name in set(IMAGES) - set(images):   # an earlier report's figure of what this one has no data for: it went
        try:                                 # on showing old data beside the new report.md (a red team's find)
            if (out / name).is_file():
                (out / name).unlink()
        except OSError:
            pass
    left_out = _left_out_note(counts, malformed)
    md = _markdown(run_dir, rows, steps, evals, images, skipped, left_out)
    if failed:
        md += f"\nNot drawn: {', '.join(failed)}.\n"
    try:
        (out / "report.md").write_text(md)
    except OSError as exc:
        raise ReportError(f"--out {out}: cannot write report.md ({exc.strerror or exc})") from None
    return {"report": out / "report.md", "images": [out / i for i in images], "skipped": skipped,
            "left_out": left_out[0] if left_out else None, "not_drawn": failed}


def _recipe(run_dir: Path) -> dict:
    """RUN/recipe.yaml as a mapping for the header, or {} (the header then shows '?'): the report reads metrics,
    and a damaged recipe should not stop it."""
    try:
        recipe = yaml.safe_load((run_dir / "recipe.yaml").read_bytes().decode("utf-8", "replace"))
    except (OSError, yaml.YAMLError):
        return {}
    return recipe if isinstance(recipe, dict) else {}


def _markdown(run_dir: Path, rows, steps, evals, images, bad_lines: int = 0, left_out: Optional[list] = None) -> str:
    recipe = _recipe(run_dir)
    g = lambda sec, key: (recipe.get(sec) if isinstance(recipe.get(sec), dict) else {}).get(key, "?")
    last = steps[-1]
    k = max(1, len(steps) // 10)  # "final" figures: the mean of the last tenth, less noisy than one step
    tail = lambda key: (lambda xs: sum(xs) / len(xs) if xs else None)(_series(steps[-k:], key)[1])
    sx, sy = _series(steps, "success_rate")
    smooth = _smooth(sy) if sy else []
    best = max(range(len(smooth)), key=smooth.__getitem__) if smooth else None
    times = _series(steps, "time/step_s")[1]
    mem = _series(steps, "memory/peak_mib")[1]
    skipped = last.get("nonfinite/skipped_total") if _number(last.get("nonfinite/skipped_total")) else None
    lines = [f"# Run report: {run_dir.resolve().name or run_dir}", "",   # (`report .`: Path(".").name is "")
             f"Model `{g('model', 'name_or_path')}`, {g('train', 'steps')} steps planned, {last['step']} run; "
             f"{g('train', 'prompts_per_step')} prompts x G={g('generation', 'num_generations')} per step; "
             f"advantage `{g('algorithm', 'advantage')}`, KL `{g('algorithm', 'kl_target')}`, lr {g('optimizer', 'lr')}.", "",
             "| | value |", "|---|---|",
             f"| final reward (mean of last {k} steps) | {_fmt(tail('reward/mean'))} |",
             f"| final success rate (last {k} steps) | {_fmt(tail('success_rate'), pct=True)} |",
             "| best success rate (trailing mean) | "
             + (f"{_fmt(smooth[best], pct=True)} at step {sx[best]}" if best is not None else "-") + " |",
             f"| final KL to reference | {_fmt(tail('kl/ref'))} |",
             f"| steps skipped (non-finite) | {_fmt(skipped)} |",
             f"| mean step time | {_fmt(sum(times) / len(times)) + ' s' if times else '-'} |",
             f"| total step time | {_fmt(sum(times) / 60) + ' min' if times else '-'} |",
             f"| peak memory | {f'{max(mem):.0f} MiB' if mem else '-'} |", ""]
    sizes = _group_sizes(steps)
    if len(sizes) > 1:   # a resume with --set generation.num_generations: the header is only the last start's
        stretches = ", ".join(f"G={size} from step {s}" for s, size in sizes)
        lines += [f"(The group size changed during the run: {stretches}. The header shows recipe.yaml, which holds "
                  "the settings of the run's last start or resume.)", ""]
    if bad_lines:
        lines += [f"({bad_lines} line(s) of metrics.jsonl skipped: not a JSON object with an integer step, e.g. a line "
                  "cut by a crash.)", ""]
    lines += left_out or []
    if evals:
        num = lambda v: _fmt(v if _number(v) else None)   # noqa: E731  (text in a metrics row is no figure)
        acc = lambda v: _fmt(v, pct=True) if _usable("eval/accuracy", v) else f"{v:.4g} (outside 0..1: not a share)"  # noqa: E731
        lines += ["## Held-out accuracy", "", "| step | accuracy | mean reward | prompts |", "|---|---|---|---|"]
        lines += [f"| {r['step']} | {acc(r['eval/accuracy'])} | {num(r.get('eval/mean_reward'))} | "
                  f"{num(r.get('eval/n'))} |" for r in evals]
        shares = [r for r in evals if _usable("eval/accuracy", r["eval/accuracy"])]
        if shares:
            best_eval = max(shares, key=lambda r: r["eval/accuracy"])
            lines += ["", f"Best held-out accuracy: {_fmt(best_eval['eval/accuracy'], pct=True)} at step "
                          f"{best_eval['step']}.", ""]
        else:
            lines += [""]
    lines += ["## Plots", ""] + [f"![{i[:-4]}]({i})" for i in images] + [""]
    return "\n".join(lines)
