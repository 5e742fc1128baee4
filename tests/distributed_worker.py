"""One process of a torchrun job for tests/test_distributed.py: one training step per case, on a float64 tiny
model, from scripted completions (a pure function of the prompt, so that one process and several see the
same ones). Process 0 writes, per case, the trainable weights, the optimizer's moments and the metrics row.

    python -m torch.distributed.run --nproc_per_node N tests/distributed_worker.py CASES.json OUT.pt
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


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
