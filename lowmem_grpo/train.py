"""The GRPO training loop, top to bottom.

One step (../shared/design.md):
  1. rollout    G completions per prompt from the current policy (engine)
  2. reward     one float per completion (NaN = skipped), weighted over the reward functions
  3. advantage  one scalar per completion from its group (advantages.py)
  4. pack       completions -> micro-batches of flat per-token tensors with aggregation weights
  5. no-grad    old log-probs (mu > 1) and reference log-probs (beta > 0, adapters disabled)
  6. update     mu x: over micro-batches, log-probs with grad -> loss (loss.py) -> backward; clip; step
  7. log        metrics row; checkpoint every N steps

This file orchestrates; the maths lives in loss.py / advantages.py / logprobs.py.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from . import checkpoint as ckpt
from .advantages import group_advantages, zero_std_groups
from .data import PromptSet, batch_indices
from .logprobs import selective_log_softmax
from .loss import aggregate, aggregation_weights, grpo_token_loss
from .metrics import MetricsWriter, summary_line
from .model import eval_mode, hidden_states, lm_head_params, load_policy, reference_mode, trainable_parameters
from .recipe import Recipe, recipe_to_yaml
from .rewards import Rewards
from .rollout.base import SamplingParams, make_engine


class TrainingError(Exception):
    pass


# ----------------------------------------------------------------------------------------------------
# Packing: completions -> micro-batches of flat per-token tensors
# ----------------------------------------------------------------------------------------------------

@dataclass
class MicroBatch:
    input_ids: torch.Tensor       # [b, width] prompt + completion, right-padded
    attention_mask: torch.Tensor  # [b, width]
    rows: torch.Tensor            # [n_tok] which sequence of the micro-batch each completion token is in
    positions: torch.Tensor       # [n_tok] position whose hidden state predicts the token
    targets: torch.Tensor         # [n_tok] the completion tokens
    advantages: torch.Tensor      # [n_tok] the token's completion's advantage
    weights: torch.Tensor         # [n_tok] aggregation weight (loss.aggregation_weights), float64
    seq_ids: torch.Tensor         # [n_tok] index of the completion in the whole batch
    logp_old: Optional[torch.Tensor] = None
    logp_ref: Optional[torch.Tensor] = None


def pack(prompts: list[list[int]], completions: list[list[int]], advantages: torch.Tensor, micro_batch_size: int,
         aggregation: str, max_completion_length: int, pad_id: int) -> list[MicroBatch]:
    lengths = torch.tensor([len(c) for c in completions])
    seq_of_token = torch.repeat_interleave(torch.arange(len(completions)), lengths)
    all_weights = aggregation_weights(seq_of_token, lengths, aggregation, max_completion_length)
    batches, tok0 = [], 0
    for s0 in range(0, len(completions), micro_batch_size):
        idx = range(s0, min(len(completions), s0 + micro_batch_size))
        seqs = [prompts[i] + completions[i] for i in idx]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        rows, pos, tgt, adv, sid = [], [], [], [], []
        for b, i in enumerate(idx):
            ids[b, : len(seqs[b])] = torch.tensor(seqs[b])
            mask[b, : len(seqs[b])] = 1
            p, c = len(prompts[i]), len(completions[i])
            rows += [b] * c
            pos += list(range(p - 1, p + c - 1))  # hidden state at t predicts token t + 1
            tgt += completions[i]
            adv += [float(advantages[i])] * c
            sid += [i] * c
        n_tok = len(tgt)
        batches.append(MicroBatch(ids, mask, torch.tensor(rows, dtype=torch.long), torch.tensor(pos, dtype=torch.long),
                                  torch.tensor(tgt, dtype=torch.long), torch.tensor(adv, dtype=torch.float32),
                                  all_weights[tok0: tok0 + n_tok], torch.tensor(sid, dtype=torch.long)))
        tok0 += n_tok
    return batches


# ----------------------------------------------------------------------------------------------------
# Log-probs of completion tokens, from hidden states (never full logits)
# ----------------------------------------------------------------------------------------------------

def completion_logprobs(model, mb: MicroBatch, temperature: float, chunk_rows: int, chunk_vocab: int,
                        return_entropy: bool = False):
    device = next(model.parameters()).device
    h = hidden_states(model, mb.input_ids.to(device), mb.attention_mask.to(device))
    h = h[mb.rows.to(device), mb.positions.to(device)]  # only completion positions are projected
    head = lm_head_params(model)
    return selective_log_softmax(h, head.weight, mb.targets.to(device), bias=head.bias, temperature=temperature,
                                 chunk_rows=chunk_rows, chunk_vocab=chunk_vocab, return_entropy=return_entropy)


# ----------------------------------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------------------------------

def lr_lambda(schedule: str, warmup: int, total: int):
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0
    return f


def make_optimizer(params, cfg):
    """torch AdamW, or bitsandbytes AdamW8bit (GPU-only: its kernels are CUDA; not run in CI)."""
    if cfg.name == "adamw_8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


class _StopFlag:
    """First Ctrl-C: finish the step, checkpoint, exit cleanly. Second: abort at once."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\n[lowmem-grpo] stopping after this step (Ctrl-C again to abort now)", flush=True)

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._previous)
        return False


class Trainer:
    def __init__(self, recipe: Recipe, run_dir: Optional[Path] = None, resume: bool = False, log=print):
        self.recipe, self.log = recipe, log
        self.run_dir = Path(run_dir or recipe.output.dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(recipe.seed)
        start_ckpt = ckpt.latest(self.run_dir) if resume else None
        if resume and start_ckpt is None:
            raise TrainingError(f"{self.run_dir}: no complete checkpoint to resume from")
        self.model, self.tokenizer = load_policy(recipe.model, recipe.lora,
                                                 adapter_path=str(start_ckpt / "adapter") if start_ckpt else None)
        self.model.train()
        self.train_set = PromptSet(recipe.data.train_path, recipe.data, self.tokenizer)
        self.eval_set = PromptSet(recipe.data.eval_path, recipe.data, self.tokenizer) if recipe.data.eval_path else None
        self.rewards = Rewards(recipe.rewards)
        self.engine = make_engine(recipe.generation.engine, self.model, self.tokenizer, recipe)
        total_updates = recipe.train.steps * recipe.algorithm.mu
        self.optimizer = make_optimizer(trainable_parameters(self.model), recipe.optimizer)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(recipe.optimizer.schedule, recipe.optimizer.warmup_steps, total_updates))
        self.step = 0
        if start_ckpt is not None:
            state = ckpt.load_trainer_state(start_ckpt)
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            ckpt.set_rng_state(state["rng"])
            self.step = state["step"]
            log(f"[lowmem-grpo] resumed from {start_ckpt} at step {self.step}")
        else:
            (self.run_dir / "recipe.yaml").write_text(recipe_to_yaml(recipe))
        self.metrics = MetricsWriter(self.run_dir, resume_step=self.step if start_ckpt else None)
        if self.train_set.skipped:
            log(f"[lowmem-grpo] skipped {len(self.train_set.skipped)} bad training rows (first: {self.train_set.skipped[0]})")

    # -- phases --------------------------------------------------------------------------------------

    def rollout(self, examples):
        g = self.recipe.generation
        params = SamplingParams(n=g.num_generations, max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                                top_p=g.top_p, top_k=g.top_k)
        return self.engine.generate([e.prompt_ids for e in examples], params)

    def score(self, examples, completions):
        texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        rows = [examples[c.prompt_index].row for c in completions]
        prompts = [examples[c.prompt_index].prompt_text for c in completions]
        return self.rewards(texts, prompts, rows), texts

    def no_grad_logprobs(self, batches: list[MicroBatch], need_old: bool, need_ref: bool) -> None:
        t = self.recipe.train
        temp = self.recipe.generation.temperature
        with torch.no_grad(), eval_mode(self.model):
            for mb in batches:
                if need_old:
                    mb.logp_old = completion_logprobs(self.model, mb, temp, t.logprob_chunk_tokens, t.logprob_chunk_vocab)
                if need_ref:
                    with reference_mode(self.model):
                        mb.logp_ref = completion_logprobs(self.model, mb, temp, t.logprob_chunk_tokens, t.logprob_chunk_vocab)

    def update(self, batches: list[MicroBatch]) -> dict:
        """One optimizer step over all micro-batches (gradient accumulation)."""
        a, t = self.recipe.algorithm, self.recipe.train
        temp = self.recipe.generation.temperature
        params = trainable_parameters(self.model)
        self.optimizer.zero_grad(set_to_none=True)
        total_loss, kl_sum, ent_sum, n_tok, clip_lo, clip_hi = 0.0, 0.0, 0.0, 0, 0, 0
        for mb in batches:
            logp, entropy = completion_logprobs(self.model, mb, temp, t.logprob_chunk_tokens, t.logprob_chunk_vocab,
                                                return_entropy=True)
            logp_old = mb.logp_old if mb.logp_old is not None else logp.detach()  # mu = 1: ratio == 1
            tl = grpo_token_loss(logp, logp_old, mb.logp_ref, mb.advantages.to(logp.device), beta=a.beta,
                                 eps_low=a.epsilon_low, eps_high=a.epsilon_high)
            loss = aggregate(tl.loss, mb.weights.to(logp.device))
            loss.backward()
            total_loss += loss.item()
            n_tok += logp.numel()
            ent_sum += entropy.sum().item()
            kl_sum += tl.kl.sum().item() if tl.kl is not None else 0.0
            clip_lo += int(tl.clipped_low.sum())
            clip_hi += int(tl.clipped_high.sum())
        grad_norm = torch.nn.utils.clip_grad_norm_(
            params, self.recipe.optimizer.max_grad_norm if self.recipe.optimizer.max_grad_norm > 0 else float("inf"))
        finite = math.isfinite(total_loss) and bool(torch.isfinite(grad_norm))
        if finite:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": total_loss, "grad_norm": float(grad_norm), "kl": kl_sum / max(1, n_tok) if a.beta > 0 else None,
                "entropy": ent_sum / max(1, n_tok), "clip/low": clip_lo / max(1, n_tok),
                "clip/high": clip_hi / max(1, n_tok), "clip/fraction": (clip_lo + clip_hi) / max(1, n_tok),
                "nonfinite": not finite}

    def train_step(self) -> dict:
        r, g, a = self.recipe, self.recipe.generation, self.recipe.algorithm
        t0 = time.perf_counter()
        examples = [self.train_set.examples[i]
                    for i in batch_indices(len(self.train_set), r.train.prompts_per_step, self.step, r.seed)]
        completions = self.rollout(examples)                                    # 1. rollout
        t_rollout = time.perf_counter() - t0
        result, texts = self.score(examples, completions)                      # 2. reward
        rewards = result.total.view(len(examples), g.num_generations)
        advantages = group_advantages(rewards, a.advantage).view(-1)           # 3. advantage
        flat = zero_std_groups(rewards)
        keep = [i for i in range(len(completions))
                if not math.isnan(result.total[i]) and not (a.skip_zero_std_groups and flat[i // g.num_generations])]
        row = self._rollout_metrics(completions, result, rewards, flat)
        if keep:
            batches = pack([examples[completions[i].prompt_index].prompt_ids for i in keep],  # 4. pack
                           [completions[i].token_ids for i in keep], advantages[keep],
                           r.train.micro_batch_size, a.aggregation, g.max_new_tokens, self.tokenizer.pad_token_id)
            self.no_grad_logprobs(batches, need_old=a.mu > 1, need_ref=a.beta > 0)  # 5. no-grad passes
            for _ in range(a.mu):                                               # 6. update(s)
                row.update(self.update(batches))
        row.update({"step": self.step + 1, "lr": self.scheduler.get_last_lr()[0], "time/rollout_s": t_rollout,
                    "time/step_s": time.perf_counter() - t0, "memory/peak_mib": peak_memory_mib(),
                    "sample": texts[0] if texts else ""})
        return row

    def _rollout_metrics(self, completions, result, rewards, flat) -> dict:
        lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float32)
        total = result.total
        valid = ~torch.isnan(total)
        primary = result.per_function[self.rewards.names[0]].view_as(rewards)
        row = {"reward/mean": float(total[valid].mean()) if valid.any() else None,
               "reward/std": float(total[valid].std()) if valid.sum() > 1 else None,
               "success_rate": float((primary >= 1.0).float().mean()),
               "zero_std_fraction": float(flat.float().mean()),
               "completion/mean_length": float(lengths.mean()),
               "completion/truncated_fraction": sum(c.truncated for c in completions) / len(completions),
               "reward/skipped": result.skipped}
        for name, values in result.per_function.items():
            ok = ~torch.isnan(values)
            row[f"reward/{name}"] = float(values[ok].mean()) if ok.any() else None
        for name, n in result.errors.items():
            row[f"reward_errors/{name}"] = n
        return row

    # -- evaluation ----------------------------------------------------------------------------------

    def evaluate(self) -> Optional[dict]:
        if self.eval_set is None:
            return None
        return evaluate(self.engine, self.tokenizer, self.rewards, self.eval_set.examples[: self.recipe.train.eval_max_prompts],
                        self.recipe.generation.max_new_tokens)

    # -- the loop --------------------------------------------------------------------------------------

    def fit(self) -> dict:
        r = self.recipe
        first_eval = None
        if self.step == 0:
            first_eval = self.evaluate()
            if first_eval:
                self.metrics.write({"step": 0, **{f"eval/{k}": v for k, v in first_eval.items()}})
                self.log(f"[lowmem-grpo] held-out accuracy at step 0: {100 * first_eval['accuracy']:.1f}%")
        stopped = False
        with _StopFlag() as stop:
            while self.step < r.train.steps:
                row = self.train_step()
                self.step += 1
                if r.train.eval_every and self.step % r.train.eval_every == 0 and self.step < r.train.steps:
                    row.update({f"eval/{k}": v for k, v in (self.evaluate() or {}).items()})
                self.metrics.write(row)
                if self.step % r.output.log_every == 0:
                    self.log(summary_line(row))
                if stop.requested or self.step % r.output.save_every == 0 or self.step == r.train.steps:
                    self.save()
                if stop.requested:
                    stopped = True
                    break
        final = None
        if not stopped:
            final = self.evaluate()
            if final:
                self.metrics.write({"step": self.step, **{f"eval/{k}": v for k, v in final.items()}})
        else:
            self.log(f"[lowmem-grpo] stopped at step {self.step}; resume with: lowmem-grpo train --resume {self.run_dir}")
        self.metrics.close()
        return {"first_eval": first_eval, "final_eval": final, "stopped": stopped, "step": self.step}

    def save(self) -> Path:
        return ckpt.save(self.run_dir, self.step, self.model, self.optimizer, self.scheduler,
                         keep_last=self.recipe.output.keep_last)


def evaluate(engine, tokenizer, rewards: Rewards, examples, max_new_tokens: int, batch_size: int = 64) -> dict:
    """Greedy completions on held-out prompts. accuracy: the fraction whose first reward function scores
    >= 1 (a correct answer for the built-in verifiable rewards); skipped rows are not counted."""
    correct, counted, reward_sum = 0, 0, 0.0
    for i in range(0, len(examples), batch_size):
        chunk = examples[i: i + batch_size]
        completions = engine.generate([e.prompt_ids for e in chunk], SamplingParams(n=1, max_new_tokens=max_new_tokens, greedy=True))
        texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        result = rewards(texts, [e.prompt_text for e in chunk], [e.row for e in chunk])
        primary = result.per_function[rewards.names[0]]
        ok = ~torch.isnan(primary)
        correct += int((primary[ok] >= 1.0).sum())
        counted += int(ok.sum())
        reward_sum += float(torch.nan_to_num(result.total).sum())
    return {"accuracy": correct / max(1, counted), "mean_reward": reward_sum / max(1, len(examples)), "n": counted}


def peak_memory_mib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
