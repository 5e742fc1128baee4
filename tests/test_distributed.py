"""Several processes under torchrun (gloo on CPU) make the update one process makes (docs/algorithm.md §21),
write one run's metrics and checkpoints, stop together when one dies, and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import recipe_dict, write_recipe
from lowmem_grpo import checkpoint as ckpt
from lowmem_grpo import distributed
from lowmem_grpo.distributed import World

HERE = Path(__file__).parent


def _torchrun(nproc: int, args: list, log: Path, **popen) -> subprocess.Popen:
    """torchrun on this machine; its own session, so that a test can kill the job and find what is left."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                             *args], stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}, **popen)


# -- pure helpers -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 5, 8, 9])
@pytest.mark.parametrize("size", [1, 2, 3])
def test_shards_are_contiguous_disjoint_near_equal_and_in_order(n, size):
    items = list(range(n))
    parts = distributed.shares(items, World(0, size))
    assert sum(parts, []) == items
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert [len(p) for p in parts] == sorted((len(p) for p in parts), reverse=True)
    for r in range(size):
        assert distributed.shard(items, World(r, size)) == parts[r]


def test_sampling_seeds_keep_process_0s_and_differ_across_processes():
    assert distributed.sampling_seed(7, World(0, 4)) == 7
    assert len({distributed.sampling_seed(7, World(r, 4)) for r in range(4)}) == 4


def test_aggregation_weights_with_batch_totals_equal_the_whole_batchs():
    """A share of a batch weighted with the batch's totals gets exactly the whole batch's weights."""
    from lowmem_grpo.loss import aggregation_weights

    lengths = torch.tensor([3, 1, 4, 2])
    seq = torch.repeat_interleave(torch.arange(4), lengths)
    for mode in ("sequence_mean", "token_mean", "constant", "sum"):
        whole = aggregation_weights(seq, lengths, mode, 6)
        first = aggregation_weights(seq[:4], lengths[:2], mode, 6, totals=(4, 10))
        second = aggregation_weights(seq[4:] - 2, lengths[2:], mode, 6, totals=(4, 10))
        assert torch.equal(torch.cat([first, second]), whole), mode
        if mode != "sum":   # and a share weighted on its own would not
            assert not torch.equal(aggregation_weights(seq[:4], lengths[:2], mode, 6), first), mode


def test_combined_eval_shares_equal_the_whole():
    from lowmem_grpo.evaluate import combine_greedy

    parts = [{"accuracy": 2 / 3, "mean_reward": 0.5, "n": 3, "correct": 2, "prompts": 4},
             {"accuracy": 1 / 2, "mean_reward": 0.25, "n": 2, "correct": 1, "prompts": 4}]
    out = combine_greedy(parts)
    assert out["accuracy"] == 3 / 5 and out["n"] == 5 and out["prompts"] == 8 and out["mean_reward"] == 0.375


# -- 2 processes vs 1, same completions: the same update ---------------------------------------------------

def _cases(model_dir, data, run_root: Path) -> dict:
    base = dict(model={"load_in_4bit": False}, optimizer={"lr": 1e-2, "max_grad_norm": 0.0},
                train={"steps": 1, "prompts_per_step": 4, "micro_batch_size": 3, "preflight": False},
                generation={"num_generations": 4, "max_new_tokens": 6},
                rewards={"functions": [{"function": "user_rewards:answer_digits"},   # reads the row: a process
                                       # that scored against the wrong row would give other advantages
                                       {"function": "user_rewards:even_code_sum", "weight": 0.5}]})
    variants = {}
    for agg in ("sequence_mean", "token_mean", "constant", "sum"):
        for mu in (1, 2):
            for scale in ("group", "batch"):
                variants[f"{agg}-mu{mu}-{scale}"] = {"aggregation": agg, "mu": mu, "scale_rewards": scale}
    # the options whose statistics are the whole batch's (§13, §16, §17, §18)
    variants["gspo-mu2"] = {"importance_sampling_level": "sequence", "mu": 2}
    variants["top-entropy"] = {"top_entropy_quantile": 0.5}
    variants["gdpo"] = {"reward_aggregation": "normalize_then_sum"}
    variants["dynamic"] = {"dynamic_sampling": True}
    # each mini-batch's normalisers are its own, summed over the processes (§7); LUSPO's 1/N (§5); VESPO's ratio (§14.2)
    variants["minibatches2-mu2"] = {"minibatches": 2, "mu": 2, "aggregation": "token_mean"}
    variants["luspo-mu2"] = {"aggregation": "sequence_sum", "importance_sampling_level": "sequence", "mu": 2}
    variants["vespo-mu2"] = {"clip": "vespo", "mu": 2}
    cases = {}
    for name, algo in variants.items():
        d = recipe_dict(model_dir, data, run_root / name, **base, algorithm={"beta": 0.04, **algo})
        d["data"]["eval_path"] = ""
        cases[name] = d
    return cases


@pytest.mark.slow(50)
def test_two_processes_make_the_one_process_update(tiny_model_dir, tiny_data, tmp_path):
    """After one step from the same completions, 2 gloo processes' LoRA weights and Adam moments equal one
    process's within 1e-10 relative (float64), for every aggregation, mu 1 and 2, group and batch reward
    scaling, the options with batch-wide statistics, mini-batches, LUSPO and VESPO; so do the metrics rows. (Adam's first step hardly
    depends on the gradient's scale, so the moments are what shows a wrong normaliser.)"""
    out = {}
    for nproc in (1, 2):
        cases = tmp_path / f"cases{nproc}.json"
        cases.write_text(json.dumps(_cases(tiny_model_dir, tiny_data, tmp_path / f"runs{nproc}")))
        out[nproc] = tmp_path / f"out{nproc}.pt"
        proc = _torchrun(nproc, [str(HERE / "distributed_worker.py"), str(cases), str(out[nproc])],
                         tmp_path / f"log{nproc}.txt")
        assert proc.wait(timeout=600) == 0, (tmp_path / f"log{nproc}.txt").read_text()[-4000:]
    one, two = (torch.load(out[n], weights_only=False) for n in (1, 2))
    assert one.keys() == two.keys() and len(one) == 23

    def rel(a: dict, b: dict, ref: dict) -> float:
        num = sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5
        den = sum(float(ref[k].norm() ** 2) for k in a) ** 0.5
        assert den > 0
        return num / den

    for name in one:
        a, b = one[name], two[name]
        moved = {k: a["weights"][k] - a["start"][k] for k in a["weights"]}
        assert rel(a["start"], b["start"], a["start"]) == 0, name    # one policy to start from
        # float64 throughout (the worker keeps the norms in float64 too): what is left is summation order,
        # ~1e-14; 1e-10 leaves room and is far below the 1e-6 the issue asks for
        assert rel(a["weights"], b["weights"], a["weights"]) < 1e-10, name
        assert rel(a["weights"], b["weights"], moved) < 1e-10, name    # relative to the update itself
        assert rel(a["exp_avg"], b["exp_avg"], a["exp_avg"]) < 1e-10, name   # the gradient, scale included
        assert rel(a["exp_avg_sq"], b["exp_avg_sq"], a["exp_avg_sq"]) < 1e-10, name
        for key, v in a["row"].items():
            w = b["row"][key]
            if isinstance(v, float) and isinstance(w, float):
                assert w == pytest.approx(v, rel=1e-6, abs=1e-9), (name, key)
            else:
                assert w == v, (name, key)
        assert a["row"]["loss"] is not None and a["row"]["loss"] != 0, name


def test_the_launcher_checks_the_recipe_once_and_gives_torchrun_time_to_checkpoint(tiny_model_dir, tiny_data, tmp_path,
                                                                                    monkeypatch):
    """`--nproc N` reads the recipe before any process starts: a bad one, or a step whose prompts N processes cannot
    share, is one error, said once (each process said it, then torchrun its own lines). And torchrun waits for the
    processes to finish their step and checkpoint it after a Ctrl-C: its default 30 s killed a longer step, unsaved."""
    from click.testing import CliRunner

    from lowmem_grpo import cli
    from torch.distributed import run as torchrun

    launched = []
    monkeypatch.setattr(distributed, "launch", lambda nproc, argv, timeout: launched.append((nproc, argv, timeout)))
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", train={"prompts_per_step": 4,
                                                                         "collective_timeout_s": 600.5})
    recipe = str(write_recipe(tmp_path / "r.yaml", d))
    runner = CliRunner()
    out = runner.invoke(cli.main, ["train", "--nproc", "2", recipe])
    assert out.exit_code == 0 and launched == [(2, ["train", recipe], 601 + 120)], out.output
    out = runner.invoke(cli.main, ["train", "--nproc", "3", recipe])
    assert out.exit_code == 2 and "train.prompts_per_step=4 does not divide among 3 processes" in out.output
    out = runner.invoke(cli.main, ["train", "--nproc", "2", recipe, "--set", "train.nonsense=1"])
    assert out.exit_code == 2 and out.output.count("train.nonsense") == 1 and len(launched) == 1, out.output
    out = runner.invoke(cli.main, ["eval", recipe, "--nproc", "3"])   # eval shares prompts, not steps: any N
    assert out.exit_code == 0 and launched[-1][0] == 3 and launched[-1][2] == 721
    # the timeout reaches torchrun as its own flag
    seen = []
    monkeypatch.undo()   # (the real distributed.launch, on a torchrun that records what it is given)
    monkeypatch.setattr(torchrun, "run", seen.append)
    distributed.launch(2, ["train", recipe], 721)
    assert seen[0].shutdown_timeout == 721 and seen[0].nproc_per_node == "2"


@pytest.mark.parametrize("command, sig, says", [
    ("eval", signal.SIGINT, "each process writes the completions it has to the eval folder"),
    ("eval", signal.SIGTERM, "SIGTERM ended the processes at once: nothing of this eval was written"),
    ("train", signal.SIGTERM, "the processes finish their step and checkpoint it"),   # (interrupts.StopFlag)
    ("train", signal.SIGHUP, "SIGHUP ended the processes at once, their step not checkpointed")])
def test_the_launchers_line_after_a_signal_says_what_the_processes_did_with_it(monkeypatch, command, sig, says):
    """torchrun passes on the signal it got. The line said what a Ctrl-C does whatever the signal: a SIGTERM to `eval
    --nproc` (which ends its processes at once, nothing written) said each process had written its share to part
    files (found by a red team)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def run(args):
        raise SignalException("signal", sig)

    monkeypatch.setattr(torchrun, "run", run)
    with pytest.raises(distributed.DistributedError) as info:
        distributed.launch(2, [command, "r.yaml"], 30)
    assert str(info.value).startswith(f"torchrun got {sig.name} and passed it on: ") and says in str(info.value)


def test_a_worker_whose_agent_is_killed_is_stopped_as_by_ctrl_c(tmp_path):
    """torchrun's agent killed with SIGKILL cannot stop its workers, which ran on as orphans holding the run folder
    (found by a red team): a worker that sees its parent gone Ctrl-Cs itself (it finishes its step, checkpoints it).
    Here: a parent starts a child that watches it, and exits; the child gets SIGINT."""
    mark, ready = tmp_path / "interrupted", tmp_path / "watching"
    child = ("import signal, sys, time\n"
             "from lowmem_grpo import distributed\n"
             "distributed.stop_when_orphaned(poll_s=0.05)\n"
             f"open({str(ready)!r}, 'w').close()\n"
             "try:\n"
             "    time.sleep(60)\n"
             "except KeyboardInterrupt:\n"
             f"    open({str(mark)!r}, 'w').write('SIGINT')\n")
    # the parent exits once the child watches it (importing torch under load took longer than a fixed 2 s wait)
    parent = (f"import os, subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}])\n"
              f"end = time.monotonic() + 50\n"
              f"while not os.path.exists({str(ready)!r}) and time.monotonic() < end: time.sleep(0.05)")
    subprocess.run([sys.executable, "-c", parent], timeout=60, check=True)
    end = time.monotonic() + 30
    while not mark.exists():
        assert time.monotonic() < end, "the orphaned child was not interrupted"
        time.sleep(0.05)
    assert mark.read_text() == "SIGINT"


def test_a_resume_with_another_process_count_gives_each_process_its_own_streams():
    """From a checkpoint of another process count, every process restores process 0's state and the others start
    streams of their own: Python's and numpy's too (a reward or environment that draws from random or numpy drew
    alike in every process; found by a red team)."""
    import random
    from types import SimpleNamespace

    import numpy as np

    from lowmem_grpo.train import Trainer

    ckpt.seed_all(0)
    states = [ckpt.rng_state()]   # a one-process run's checkpoint
    draws = []
    for rank in (0, 1):
        trainer = SimpleNamespace(world=World(rank, 2), recipe=SimpleNamespace(seed=3), step=5, log=lambda *a: None)
        Trainer._restore_rng(trainer, states)
        draws.append((random.random(), float(np.random.rand()), float(torch.rand(1))))
    assert all(a != b for a, b in zip(*draws))
    Trainer._restore_rng(SimpleNamespace(world=World(0, 2), recipe=None, step=5, log=lambda *a: None), states)
    assert random.random() == draws[0][0]   # process 0 continues the checkpoint's streams


def test_gradients_summed_over_processes_keep_none_where_no_process_has_one(tmp_path):
    """A parameter with a gradient on some processes holds the sum; one with none on any process keeps none, as with
    one process, so that AdamW skips it: summed as zeros it got moments and weight decay moved it, an update one
    process never makes (found by a red team)."""
    out = tmp_path / "out.pt"
    proc = _torchrun(2, [str(HERE / "distributed_worker.py"), "grads", str(out)], tmp_path / "log.txt")
    assert proc.wait(timeout=120) == 0, (tmp_path / "log.txt").read_text()[-4000:]
    got = torch.load(out, weights_only=False)
    assert got["grads"]["every"].tolist() == [3.0] * 3 and got["grads"]["first"].tolist() == [0.5] * 3
    assert got["grads"]["none"] is None
    assert got["weights"]["none"].tolist() == [1.0] * 3 and got["state"] == [0, 3, 3]   # untouched, no moments
    assert got["weights"]["first"].tolist() != [1.0] * 3


def test_world_size_without_torchrun_is_one_error_not_a_traceback(monkeypatch):
    """WORLD_SIZE set, MASTER_ADDR not (a shell left with a job's variables, or a launcher other than torchrun):
    torch's rendezvous raised a ValueError, shown as a traceback (found by a red team); now one DistributedError,
    which the CLI prints as one line."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(distributed.DistributedError, match=r"WORLD_SIZE=2 is set.*MASTER_ADDR.*unset WORLD_SIZE"):
        distributed.join(5)
    assert not torch.distributed.is_initialized()


@pytest.mark.slow(15)
def test_fit_returns_on_every_process_once_process_0_has_written_the_last_checkpoint(tiny_model_dir, tiny_data,
                                                                                    tmp_path):
    """Trainer.fit() returned on process 1 as soon as it had sent its RNG state for the last checkpoint, while
    process 0 was still writing it (found by a red team): what a script does next there (the TRL API's evaluate()
    and save_model() read the latest checkpoint) saw the step before: `GRPOTrainer.evaluate()` on process 1
    evaluated step N-1 and wrote eval/step-N-1-eval. Here process 0's writes take 2 s (a slow disk) and no final
    eval (a collective) follows the last save."""
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", model={"load_in_4bit": False},
                    train={"steps": 2, "prompts_per_step": 2, "preflight": False},
                    output={"save_every": 1, "keep_last": 2})
    d["data"]["eval_path"] = ""
    (tmp_path / "r.json").write_text(json.dumps(d))
    proc = _torchrun(2, [str(HERE / "distributed_worker.py"), "fit", str(tmp_path / "r.json"), str(tmp_path)],
                     tmp_path / "log.txt")
    assert proc.wait(timeout=300) == 0, (tmp_path / "log.txt").read_text()[-4000:]
    assert [(tmp_path / f"returned.{rank}").read_text() for rank in (0, 1)] == ["2", "2"]


@pytest.mark.slow(20)
def test_a_trl_script_under_torchrun_evaluates_the_last_checkpoint_once(tiny_model_dir, tmp_path):
    """A TRL-shaped script under torchrun (the README: `accelerate launch` becomes torchrun): process 1's train()
    returned before process 0 had written the last checkpoint, so its evaluate() evaluated the step before, into
    eval/step-000001-eval, and its save_model() copied that step's adapter into output_dir beside process 0's copy
    of the last one (found by a red team). And every process ran the whole eval and wrote it: one eval, its prompts
    shared, process 0 writing, as `lowmem-grpo eval --nproc`."""
    proc = _torchrun(2, [str(HERE / "distributed_worker.py"), "trl", str(tiny_model_dir), str(tmp_path)],
                     tmp_path / "log.txt")
    assert proc.wait(timeout=300) == 0, (tmp_path / "log.txt").read_text()[-4000:]
    evals = [json.loads((tmp_path / f"eval.{rank}.json").read_text()) for rank in (0, 1)]
    assert evals[0] == evals[1] and evals[0]["eval_prompts"] == 5
    assert sorted(p.name for p in (tmp_path / "run" / "eval").iterdir()) == ["step-000002-eval"]
    text = (tmp_path / "log.txt").read_text()
    assert text.count("greedy accuracy:") == 1 and text.count("[lowmem-grpo] adapter (step-000002)") == 1, text[-3000:]


def test_prompts_per_step_that_does_not_divide_among_the_processes_is_an_error(tiny_model_dir, tiny_data, tmp_path):
    from lowmem_grpo.recipe import recipe_from_dict
    from lowmem_grpo.train import Trainer, TrainingError

    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", train={"prompts_per_step": 3})
    with pytest.raises(TrainingError, match=r"train.prompts_per_step=3 does not divide among 2 processes"):
        Trainer(recipe_from_dict(d), world=World(0, 2))


# -- a 2-process run: one run's metrics and checkpoints; kill -9 of one process; resume --------------------

def _train(args: list, log: Path) -> subprocess.Popen:
    """`lowmem-grpo train --nproc 2 ...` (it becomes torchrun, in its own session)."""
    return subprocess.Popen([sys.executable, "-m", "lowmem_grpo", "train", "--nproc", "2", *args],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _descendants(pid: int) -> list[int]:
    kids = _children(pid)
    return kids + [d for k in kids for d in _descendants(k)]


def _alive(pid: int) -> bool:
    """Running (a zombie, or a pid that is gone, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _rank(pid: int) -> int:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(e for e in env if e.startswith(b"RANK="))[5:])


def _rows(run: Path) -> dict:
    """The run's metrics rows by (step, kind), without wall-clock time and memory."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        key = (row["step"], "eval" if "eval/accuracy" in row else "train")
        assert key not in out, f"{key} twice in {run}"
        out[key] = {k: v for k, v in row.items() if not k.startswith(("time/", "memory/"))}
    return out


STEPS = 8


def _run_recipe(model_dir, data, run: Path, **extra) -> dict:
    d = recipe_dict(model_dir, data, run, train={"steps": STEPS, "prompts_per_step": 4, "preflight": False,
                                                 "eval_max_prompts": 10},
                    output={"save_every": 1, "keep_last": 2}, **extra)
    d["rewards"] = {"functions": [{"function": "user_rewards:even_code_sum"}]}   # flips with any changed token
    return d


@pytest.fixture(scope="module")
def straight_run(tiny_model_dir, tiny_data, tmp_path_factory) -> tuple[dict, Path]:
    tmp = tmp_path_factory.mktemp("straight")
    d = _run_recipe(tiny_model_dir, tiny_data, tmp / "run")
    proc = _train([str(write_recipe(tmp / "r.yaml", d))], tmp / "log.txt")
    assert proc.wait(timeout=300) == 0, (tmp / "log.txt").read_text()[-4000:]
    return d, tmp


@pytest.mark.slow(40)  # as the kill -9 test below, which shares straight_run: collected side by side
def test_two_process_run_writes_one_runs_metrics_checkpoints_and_eval(straight_run, tmp_path):
    d, tmp = straight_run
    run, log = tmp / "run", (tmp / "log.txt").read_text()
    rows = _rows(run)
    assert sorted(k for k in rows if k[1] == "train") == [(s, "train") for s in range(1, STEPS + 1)]  # once each
    assert log.count("held-out accuracy after") == 1 and log.count("| reward") == STEPS   # process 0 prints
    saved = ckpt.load_trainer_state(ckpt.latest(run))
    assert saved["step"] == STEPS and len(saved["rng_per_process"]) == 2
    assert not torch.equal(saved["rng_per_process"][0]["torch"], saved["rng_per_process"][1]["torch"])
    assert any(r.get("loss") for r in rows.values())
    # The 2-process eval (each process half the prompts) equals one process's on the same adapter.
    from lowmem_grpo.evaluate import run_eval
    from lowmem_grpo.recipe import recipe_from_dict

    two = rows[(STEPS, "eval")]
    one = run_eval(recipe_from_dict(d), name="r", adapter=str(run), out_dir=str(tmp_path / "eval"), log=lambda *a: None,
                   ks=(1, 2))
    assert (one["accuracy"], one["n"]) == (two["eval/accuracy"], two["eval/n"]) and two["eval/n"] == 10
    assert two["eval/mean_reward"] == pytest.approx(one["mean_reward"], abs=1e-12)
    # `lowmem-grpo eval --nproc 2`: each process a share of the prompts; process 0 writes the whole
    proc = subprocess.run([sys.executable, "-m", "lowmem_grpo", "eval", "--nproc", "2", str(tmp / "r.yaml"),
                           "--adapter", str(run), "--k", "1,2", "--out", str(tmp_path / "eval2")],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("greedy accuracy:") == 1
    summary = json.loads((tmp_path / "eval2" / "summary.json").read_text())
    assert (summary["accuracy"], summary["n"], summary["correct"]) == (one["accuracy"], one["n"], one["correct"])
    assert summary["pass@2/prompts"] == 10 and 0 <= summary["pass@2"] <= 1
    records = [json.loads(line) for line in (tmp_path / "eval2" / "samples.jsonl").read_text().splitlines()]
    greedy = [r for r in records if r["mode"] == "greedy"]
    assert [r["prompt_index"] for r in greedy] == list(range(10))
    ones = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert [r["completion"] for r in greedy] == [r["completion"] for r in ones if r["mode"] == "greedy"]
    assert sorted((r["prompt_index"], r["sample"]) for r in records if r["mode"] == "sample") == \
        [(i, j) for i in range(10) for j in range(2)]


@pytest.mark.slow(40)
def test_kill9_of_one_process_stops_the_job_then_resume_matches_the_straight_run(straight_run, tiny_model_dir,
                                                                                 tiny_data, tmp_path):
    """kill -9 of process 1 mid-run: torchrun ends the job non-zero within 60 s and no process is left;
    --resume with 2 processes ends with every step's metrics equal to the uninterrupted run's."""
    d, straight = straight_run
    run = tmp_path / "run"
    d = {**d, "output": {**d["output"], "dir": str(run)}}
    log = tmp_path / "log.txt"
    proc = _train([str(write_recipe(tmp_path / "r.yaml", d))], log)
    end = time.monotonic() + 240
    while (ckpt.latest(run) is None or ckpt.load_trainer_state(ckpt.latest(run))["step"] < 3) and proc.poll() is None:
        assert time.monotonic() < end, log.read_text()[-3000:]
        time.sleep(0.05)
    workers = _children(proc.pid)
    everything = workers + [p for w in workers for p in _descendants(w)]
    assert proc.poll() is None and len(workers) == 2, log.read_text()[-3000:]
    t0 = time.monotonic()
    os.kill(next(w for w in workers if _rank(w) == 1), signal.SIGKILL)
    rc = proc.wait(timeout=60)
    took = time.monotonic() - t0
    assert rc != 0 and took < 60, (rc, took)
    text = log.read_text()
    assert "error: process 1 of 2 ended with signal SIGKILL" in text and "Traceback" not in text, text[-3000:]
    time.sleep(1)
    assert not [p for p in everything if _alive(p)], "processes left behind"
    assert ckpt.load_trainer_state(ckpt.latest(run))["step"] < STEPS   # it was stopped mid-run

    resumed = _train(["--resume", str(run)], tmp_path / "resume.txt")
    assert resumed.wait(timeout=300) == 0, (tmp_path / "resume.txt").read_text()[-4000:]
    assert "resumed from" in (tmp_path / "resume.txt").read_text()
    assert _rows(run) == _rows(straight / "run")


def _failed_job(model_dir, data, tmp_path: Path, reward: str, **train) -> str:
    """A 2-process run whose reward is `reward`: it must end non-zero with nothing left running; its log."""
    d = _run_recipe(model_dir, data, tmp_path / "run")
    d["rewards"] = {"functions": [{"function": reward}]}
    d["data"]["eval_path"] = ""
    d["train"].update(train)
    log = tmp_path / "log.txt"
    proc = _train([str(write_recipe(tmp_path / "r.yaml", d))], log)
    assert proc.wait(timeout=120) != 0
    assert not _children(proc.pid)
    return log.read_text()


@pytest.mark.slow
def test_a_process_that_raises_stops_the_job_with_its_error(tiny_model_dir, tiny_data, tmp_path):
    text = _failed_job(tiny_model_dir, tiny_data, tmp_path, "user_rewards:raises_in_process_1")
    assert "boom in process 1" in text, text[-3000:]
    assert "error: process 1 of 2 ended with exit code 2" in text and "Traceback" not in text, text[-3000:]


@pytest.mark.slow(20)
def test_a_process_that_hangs_fails_the_job_after_the_collective_timeout(tiny_model_dir, tiny_data, tmp_path):
    """Process 1 never returns from its reward function: process 0 waits train.collective_timeout_s at the
    exchange, then stops with a one-line error, and torchrun stops process 1."""
    text = _failed_job(tiny_model_dir, tiny_data, tmp_path, "user_rewards:hangs_in_process_1", collective_timeout_s=5)
    assert "error: process 0: gathering a step's results with the other processes failed" in text, text[-3000:]
    assert "train.collective_timeout_s" in text and "Traceback" not in text, text[-3000:]


@pytest.mark.slow
def test_ctrl_c_under_nproc_finishes_the_step_checkpoints_it_and_says_how_to_resume(tiny_model_dir, tiny_data, tmp_path):
    """Ctrl-C reaches torchrun (the processes have their own sessions); it passes SIGINT on, and the processes
    agree to stop after the same step, which process 0 checkpoints."""
    d = _run_recipe(tiny_model_dir, tiny_data, tmp_path / "run")
    d["train"]["steps"], d["output"]["save_every"] = 500, 1000
    d["data"]["eval_path"] = ""
    log, run = tmp_path / "log.txt", tmp_path / "run"
    proc = _train([str(write_recipe(tmp_path / "r.yaml", d))], log)
    end = time.monotonic() + 240
    while log.read_text().count("| reward") < 3:
        assert time.monotonic() < end and proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) != 0
    text = log.read_text()
    stopped = int(text.split("stopped at step ")[1].split(";")[0])
    assert ckpt.load_trainer_state(ckpt.latest(run))["step"] == stopped >= 3
    assert f"resume with: lowmem-grpo train --nproc 2 --resume {run}" in text
    assert text.count("stopping after this step") == 1 and "Traceback" not in text, text[-3000:]


def test_ctrl_c_under_eval_nproc_leaves_each_processs_share_in_part_files(tiny_model_dir, tiny_data, tmp_path):
    """Ctrl-C during `eval --nproc 2`: nothing is gathered, so each process writes the completions it has to its own
    part files, each with a summary that says interrupted; the job ends with one line saying where they are."""
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", train={"eval_max_prompts": 40},
                    generation={"max_new_tokens": 8})
    d["rewards"] = {"functions": [{"function": "user_rewards:marks_its_calls"}]}
    mark, out, log = tmp_path / "scored", tmp_path / "eval", tmp_path / "log.txt"
    out.mkdir()   # an earlier eval's results there: not this one's (they passed for it; found by a red team)
    for name in ("summary.json", "samples.jsonl", "summary.part-0-of-3.json", "samples.part-2-of-3.jsonl"):
        (out / name).write_text("{}\n")
    proc = subprocess.Popen([sys.executable, "-m", "lowmem_grpo", "eval", str(write_recipe(tmp_path / "r.yaml", d)),
                             "--nproc", "2", "--k", "1000", "--out", str(out)],   # 20 x 1,000 samples each: minutes
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "LOWMEM_TEST_MARK": str(mark)})

    def scored(rank: int) -> int:
        path = Path(f"{mark}.{rank}")
        return sum(int(n) for n in path.read_text().split()) if path.exists() else 0

    end = time.monotonic() + 240
    while not all(scored(rank) >= 20 for rank in (0, 1)):   # both have scored their 20 greedy completions (a memory
        # wave may split them into several calls: waiting for the first call alone failed in CI)
        assert time.monotonic() < end and proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=90) != 0
    text = log.read_text()
    assert "each process writes the completions it has to the eval folder" in text and "Traceback" not in text, text[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["samples.part-0-of-2.jsonl", "samples.part-1-of-2.jsonl",
                                                      "summary.part-0-of-2.json", "summary.part-1-of-2.json"]
    for rank in (0, 1):
        summary = json.loads((out / f"summary.part-{rank}-of-2.json").read_text())
        lines = (out / f"samples.part-{rank}-of-2.jsonl").read_text().splitlines()
        assert summary["interrupted"] is True and summary["process"] == rank and summary["prompts_here"] == 20
        assert len(lines) == summary["greedy_done"] + summary["samples_done"] and "accuracy" not in summary
        assert summary["greedy_done"] == 20 and summary["samples_done"] < 20 * 1000


def test_the_ctrl_c_note_is_said_by_process_0_alone(monkeypatch):
    """The note after a Ctrl-C outside a step is printed by process 0 only: it is read from torchrun's RANK, since the
    process group is left by then (every process counted as process 0 once it was)."""
    monkeypatch.setenv("RANK", "1")
    assert not distributed.launched_main()
    monkeypatch.setenv("RANK", "0")
    assert distributed.launched_main()
    monkeypatch.delenv("RANK")
    assert distributed.launched_main() and distributed.current().main
