"""Training through the in-process vLLM engine (generation.engine: vllm), on CPU.

Fed the same completions, a run through the vLLM engine and one through the transformers engine give
the same losses: the engine changes how rollouts are sampled, nothing else. Resume replays the same
samples, the CLI path works, and the engine-vs-trainer log-prob agreement lands in the metrics.
Needs vllm (see tests/test_vllm_engine.py for when these skip and when they must run).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest

from conftest import QUIET, losses_by_step, recipe_dict, straight_and_resumed, write_recipe
from lowmem_grpo.metrics import read_metrics
from lowmem_grpo.recipe import recipe_from_dict
from test_vllm_engine import _import_engine



@pytest.fixture(scope="module", autouse=True)
def _vllm():
    return _import_engine()


def _recipe(model_dir, data, run_dir, engine="vllm", **sections):
    d = recipe_dict(model_dir, data, run_dir, generation={"engine": engine, "num_generations": 4, "max_new_tokens": 4,
                                                          "kv_cache_memory_bytes": 32 << 20}, **sections)
    return d


def test_same_completions_same_losses_through_either_engine(vllm_model_dir, tiny_data, tmp_path):
    from lowmem_grpo.train import Trainer

    d = _recipe(vllm_model_dir, tiny_data, tmp_path / "vllm", train={"steps": 3, "eval_max_prompts": 4})
    t_vllm = Trainer(recipe_from_dict(d), **QUIET)
    recorded = []
    generate = t_vllm.engine.generate

    def record(prompts, params):
        out = generate(prompts, params)
        recorded.append(copy.deepcopy(out))
        return out

    t_vllm.engine.generate = record
    t_vllm.fit()
    t_vllm.engine.close()

    d["generation"]["engine"] = "hf"
    d["output"]["dir"] = str(tmp_path / "hf")
    t_hf = Trainer(recipe_from_dict(d), **QUIET)
    replay = iter(recorded)

    def replayed(prompts, params):  # what the vLLM engine sampled, as the transformers engine reports it
        out = copy.deepcopy(next(replay))
        assert len(out) == len(prompts) * params.n
        for c in out:
            c.logprobs = None
        return out

    t_hf.engine.generate = replayed
    t_hf.fit()

    losses_vllm, losses_hf = losses_by_step(tmp_path / "vllm"), losses_by_step(tmp_path / "hf")
    assert sorted(losses_vllm) == [1, 2, 3]
    assert losses_vllm == losses_hf
    assert any(v != 0 for v in losses_vllm.values())
    rows_vllm = [r for r in read_metrics(tmp_path / "vllm") if r.get("loss") is not None]
    rows_hf = [r for r in read_metrics(tmp_path / "hf") if r.get("loss") is not None]
    for row in rows_vllm:  # the engine's log-probs agree with the trainer's
        assert row["rollout/logprob_abs_diff"] is not None and row["rollout/logprob_abs_diff"] < 1e-4, row
        assert row["rollout/logprob_abs_diff_max"] < 1e-3
    assert all(row.get("rollout/logprob_abs_diff") is None for row in rows_hf)


@pytest.mark.slow
def test_resume_through_vllm_replays_the_same_samples(vllm_model_dir, tiny_data, tmp_path):
    """Sampling draws from torch's global RNG, which checkpoints save: 2 steps + resume to 4 = 4 straight."""
    d = _recipe(vllm_model_dir, tiny_data, tmp_path / "full", train={"steps": 4, "eval_max_prompts": 4},
                output={"save_every": 2})
    full, cut, resumed = straight_and_resumed(d, tmp_path)
    resumed.engine.close()
    assert sorted(cut) == [1, 2, 3, 4]
    for step in (3, 4):
        assert cut[step] == full[step], (step, cut[step], full[step])


@pytest.mark.slow(20)
def test_cli_train_with_vllm_engine(vllm_model_dir, tiny_data, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", _recipe(vllm_model_dir, tiny_data, tmp_path / "run",
                                                       train={"steps": 2, "eval_max_prompts": 4}))
    p = subprocess.run([sys.executable, "-m", "lowmem_grpo.cli", "train", str(recipe)], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "held-out accuracy before:" in p.stdout and "held-out accuracy after:" in p.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("loss") is not None] == [1, 2]


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_sampler_correction_through_vllm(vllm_model_dir, tiny_data, tmp_path, mode):
    """The vLLM engine reports its log-probs: the correction of docs/algorithm.md §15 weights each token by the
    trainer/sampler ratio at the rollout weights, which here is near 1 (the same modules, float32)."""
    d = _recipe(vllm_model_dir, tiny_data, tmp_path / "run", train={"steps": 2, "eval_max_prompts": 4},
                algorithm={"sampler_correction": mode, "sampler_correction_min": 0.5})
    from lowmem_grpo.train import Trainer

    t = Trainer(recipe_from_dict(d), **QUIET)
    t.fit()
    rows = [r for r in read_metrics(tmp_path / "run") if r.get("loss") is not None]
    assert len(rows) == 2
    for r in rows:
        assert r["sampler/weight_mean"] == pytest.approx(1.0, abs=0.05), r["sampler/weight_mean"]
        assert r["sampler/masked_fraction"] == 0
        assert r["rollout/logprob_abs_diff"] is not None


@pytest.mark.slow(30)
def test_two_processes_each_with_its_own_engine_train_on_the_current_weights(vllm_model_dir, tiny_data, tmp_path):
    """Under torchrun (gloo, 2 processes, docs/algorithm.md §21) each process builds its own in-process engine
    inside the job's process group; the run completes, and at every step the engines' log-probs of what they
    sampled match the trainer's (so each process samples from the current, shared policy)."""
    from test_distributed import _rows, _train

    d = _recipe(vllm_model_dir, tiny_data, tmp_path / "run", train={"steps": 3, "prompts_per_step": 4,
                                                                    "preflight": False, "eval_max_prompts": 4})
    proc = _train([str(write_recipe(tmp_path / "r.yaml", d))], tmp_path / "log.txt")
    assert proc.wait(timeout=600) == 0, (tmp_path / "log.txt").read_text()[-4000:]
    rows = _rows(tmp_path / "run")
    steps = [rows[(s, "train")] for s in (1, 2, 3)]
    assert all(r["rollout/logprob_abs_diff_max"] is not None and r["rollout/logprob_abs_diff_max"] < 1e-3 for r in steps)
    assert rows[(3, "eval")]["eval/n"] == 4
