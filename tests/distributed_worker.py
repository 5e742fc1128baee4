"""One process of a torchrun job for tests/test_distributed.py: one training step per case, on a float64 tiny
model, from scripted completions (a pure function of the prompt, so that one process and several see the
same ones). Process 0 writes, per case, the trainable weights, the optimizer's moments and the metrics row.

    python -m torch.distributed.run --nproc_per_node N tests/distributed_worker.py CASES.json OUT.pt

`fit RECIPE.json OUT_DIR` instead: Trainer.fit() of the recipe, process 0's checkpoint writes made slow (a slow
disk); each process then writes OUT_DIR/returned.RANK, the step of the run's latest checkpoint when fit returned.
`trl MODEL OUT_DIR`: a TRL-shaped script (lowmem_grpo.trl: train, evaluate, save_model), as `accelerate launch` runs
one; each process writes what evaluate() returned to OUT_DIR/eval.RANK.json.
`grads OUT.pt`: distributed.sum_gradients then an AdamW step (weight decay on) over three parameters: one with a
gradient on every process, one on process 0 only, one on none; process 0 writes the gradients and weights.
"""

from __future__ import annotations

import json
import random
import sys
import types

import torch

from lowmem_grpo import distributed
from lowmem_grpo.model import trainable_parameters
from lowmem_grpo.recipe import recipe_from_dict
from lowmem_grpo.rollout.base import Completion
from lowmem_grpo.train import Trainer


class ScriptedEngine:
    """Completions that depend on the prompt alone: n per prompt, 1..max_new_tokens tokens drawn from the
    vocabulary (digits included, so the rewards have contrast), some ending with EOS."""

    def __init__(self, tokenizer):
        self.vocab = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
        self.eos = tokenizer.eos_token_id

    def generate(self, prompts, params):
        out = []
        for p, prompt in enumerate(prompts):
            rng = random.Random(",".join(map(str, prompt)))
            for _ in range(params.n):
                n = rng.randint(1, params.max_new_tokens)
                ids = [rng.choice(self.vocab) for _ in range(n)]
                stopped = n < params.max_new_tokens and rng.random() < 0.5
                out.append(Completion(p, ids + [self.eos] if stopped else ids, truncated=not stopped))
        return out

    def close(self):
        pass


def float64_norms(model) -> int:
    """transformers' RMSNorm computes in float32 whatever its input (it casts up from half precision, and
    so down from float64). There, rounding that depends on the batch's shape reaches 1e-7; Adam's first step,
    which divides each gradient by its own size, turns that into ~1e-6 differences of the weights. The same
    formula in the input's dtype keeps the whole model in float64."""
    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    for m in norms:
        m.forward = types.MethodType(forward, m)
    assert norms
    return len(norms)


def main(cases_path: str, out_path: str) -> None:
    cases = json.loads(open(cases_path).read())
    results = {}
    for name, d in cases.items():
        # no world given: a Trainer under torchrun joins the job's process group itself
        trainer = Trainer(recipe_from_dict(d), log=lambda *a, **k: None)
        assert trainer.world == distributed.current() and trainer.world.size == distributed.launched_size()
        trainer.model.double()   # float64: the processes' sums differ from one process's in rounding only
        float64_norms(trainer.model)
        trainer.engine = ScriptedEngine(trainer.tokenizer)
        start = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        row = trainer.train_step().row
        params = dict(trainer.model.named_parameters())
        trainable = {n: p for n, p in params.items() if p.requires_grad}
        assert len(trainable) == len(list(trainable_parameters(trainer.model)))
        state = trainer.optimizer.state
        results[name] = {"start": start, "weights": {n: p.detach().clone() for n, p in trainable.items()},
                         "exp_avg": {n: state[p]["exp_avg"].clone() for n, p in trainable.items()},
                         "exp_avg_sq": {n: state[p]["exp_avg_sq"].clone() for n, p in trainable.items()},
                         "row": {k: v for k, v in row.items() if not k.startswith(("time/", "memory/"))}}
        trainer.close()
    if distributed.current().main:
        torch.save(results, out_path)
    distributed.leave()


def fit(recipe_path: str, out_dir: str) -> None:
    import time
    from pathlib import Path

    from lowmem_grpo import checkpoint as ckpt

    written = ckpt.save

    def slow_save(*args, **kwargs):
        time.sleep(2)
        return written(*args, **kwargs)

    ckpt.save = slow_save
    trainer = Trainer(recipe_from_dict(json.loads(open(recipe_path).read())), log=lambda *a, **k: None)
    trainer.fit()
    last = ckpt.latest(trainer.run_dir)
    Path(out_dir, f"returned.{trainer.world.rank}").write_text(str(ckpt.step_of(last) if last else None))
    distributed.leave(finished=True)


def trl_script(model: str, out_dir: str) -> None:
    from pathlib import Path

    from peft import LoraConfig

    from lowmem_grpo.trl import GRPOConfig, GRPOTrainer

    def digits(completions, **kwargs):
        return [float(any(ch.isdigit() for ch in c)) for c in completions]

    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(3)]
    args = GRPOConfig(output_dir=str(Path(out_dir, "run")), bf16=False, learning_rate=1e-3, num_generations=2,
                      per_device_train_batch_size=2, max_completion_length=3, max_steps=2, save_steps=1)
    trainer = GRPOTrainer(model=model, reward_funcs=[digits], args=args, train_dataset=rows, eval_dataset=rows[:5],
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model()
    metrics.pop("eval_runtime")
    Path(out_dir, f"eval.{distributed.current().rank}.json").write_text(json.dumps(metrics))
    distributed.leave(finished=True)


def grads(out_path: str) -> None:
    world = distributed.join(60)
    every, first, none = (torch.nn.Parameter(torch.full((3,), 1.0, dtype=torch.float64)) for _ in range(3))
    every.grad = torch.full((3,), float(world.rank + 1), dtype=torch.float64)
    if world.rank == 0:
        first.grad = torch.full((3,), 0.5, dtype=torch.float64)
    optimizer = torch.optim.AdamW([every, first, none], lr=0.1, weight_decay=0.1)
    distributed.sum_gradients([every, first, none], world)
    seen = {name: None if p.grad is None else p.grad.clone() for name, p in (("every", every), ("first", first),
                                                                           ("none", none))}
    optimizer.step()
    if world.main:
        torch.save({"grads": seen, "weights": {"every": every.detach(), "first": first.detach(), "none": none.detach()},
                    "state": sorted(len(optimizer.state[p]) for p in (every, first, none))}, out_path)
    distributed.leave(finished=True)


if __name__ == "__main__":
    if sys.argv[1] == "grads":
        grads(sys.argv[2])
    elif sys.argv[1] == "fit":
        fit(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "trl":
        trl_script(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1], sys.argv[2])
