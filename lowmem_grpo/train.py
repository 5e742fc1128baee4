"""The GRPO training loop, top to bottom.

One step (../shared/design.md):
  1. rollout    G completions per prompt from the current policy (engine)
  2. reward     one float per completion (NaN = skipped), weighted over the reward functions
  3. advantage  one scalar per completion from its group (advantages.py)
  4. pack       completions -> micro-batches of flat per-token tensors with aggregation weights
  5. no-grad    old log-probs (mu > 1) and reference log-probs (kl_target ref/both, adapters disabled)
  6. update     mu x (or fewer: spec 7 early stop): over micro-batches, log-probs with grad -> loss (loss.py)
                -> backward; clip; step. Then, no grad, how far the batch's completions moved (spec 8)
  7. log        metrics row (diagnostics.py); checkpoint every N steps

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
from . import diagnostics as diag
from .advantages import group_advantages, zero_std_groups
from .data import batch_indices, prompt_sets
from .evaluate import greedy as greedy_eval
from .logprobs import selective_log_softmax
from .loss import aggregate, aggregation_weights, grpo_token_loss
from .memory import (ModelShape, advise, device_budget, estimate, fmt, peak_rss_mib, return_freed_memory_to_os,
                     workload_from_recipe)
from .metrics import read_metrics, summary_line
from .progress import Progress
from .model import eval_mode, hidden_states, lm_head_params, load_policy, reference_mode, trainable_parameters
from .recipe import Recipe, recipe_to_yaml
from .sinks import SinkError, open_sinks
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
    logp_start: Optional[torch.Tensor] = None  # log-probs before the batch's first update (spec 8 diagnostics)
    logp_sampler: Optional[torch.Tensor] = None  # [n_tok] the rollout engine's own log-probs, when it reports them


def pack(prompts: list[list[int]], completions: list[list[int]], advantages: torch.Tensor, micro_batch_size: int,
         aggregation: str, max_completion_length: int, pad_id: int,
         sampler_logprobs: Optional[list[list[float]]] = None) -> list[MicroBatch]:
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
        if sampler_logprobs is not None:
            batches[-1].logp_sampler = torch.tensor([x for i in idx for x in sampler_logprobs[i]], dtype=torch.float32)
        tok0 += n_tok
    return batches


def sampler_agreement(batches: list[MicroBatch]) -> dict:
    """How far the rollout engine's log-probs of the sampled tokens are from the trainer's, both at the
    rollout's weights (old log-probs with mu > 1, else those of the first update): mean and max |diff|."""
    diffs = [((mb.logp_old if mb.logp_old is not None else mb.logp_start).detach().float().cpu() - mb.logp_sampler).abs()
             for mb in batches if mb.logp_sampler is not None and (mb.logp_old is not None or mb.logp_start is not None)]
    if not diffs or not sum(d.numel() for d in diffs):
        return {}
    d = torch.cat(diffs)
    return {"rollout/logprob_abs_diff": float(d.mean()), "rollout/logprob_abs_diff_max": float(d.max())}


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
        if not next(self.model.parameters()).is_cuda:
            return_freed_memory_to_os()
        # eval_set: data.eval_path, or data.eval_fraction's held-out split (None when neither is set)
        sets = prompt_sets(recipe.data, self.tokenizer)
        self.train_set, self.eval_set = sets["train"], sets["test"]
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
        try:  # metrics.jsonl always; TensorBoard / W&B as the recipe asks (sinks.py)
            self.metrics = open_sinks(self.run_dir, recipe.output, recipe.model_dump(mode="json"),
                                      resume_step=self.step if start_ckpt else None)
        except SinkError as exc:
            raise TrainingError(str(exc)) from None
        # Skipped (non-finite) steps: in a row now, and in all; a resumed run counts them from its kept rows.
        kept_rows = read_metrics(self.run_dir) if start_ckpt else []
        self.nonfinite_run, self.nonfinite_total = 0, 0
        for row in kept_rows:
            if "loss" in row or "nonfinite" in row:
                self._count_nonfinite(bool(row.get("nonfinite")))
        # The success rate of the reference, for spec 4's p*: step 1 samples from fresh adapters, i.e. from
        # pi_ref. A resumed run reads it back from step 1's metrics row.
        self.p_ref = next((row.get("success_rate") for row in kept_rows if row.get("step") == 1 and "loss" in row), None)
        if self.train_set.skipped:
            log(f"[lowmem-grpo] skipped {len(self.train_set.skipped)} bad training rows (first: {self.train_set.skipped[0]})")

    def _count_nonfinite(self, skipped: bool) -> None:
        self.nonfinite_run = self.nonfinite_run + 1 if skipped else 0
        self.nonfinite_total += skipped

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

    def update(self, batches: list[MicroBatch], prev_objective: Optional[float] = None) -> dict:
        """One optimizer step over all micro-batches (gradient accumulation). With mu > 1, spec 7's early stop
        may find the batch spent after this pass (forward and backward): then no step is taken, and the row
        holds only why ("update/stop") and the unclipped fraction that was measured."""
        a, t = self.recipe.algorithm, self.recipe.train
        temp = self.recipe.generation.temperature
        params = trainable_parameters(self.model)
        self.optimizer.zero_grad(set_to_none=True)
        total_loss, ent_sum, n_tok, clip_lo, clip_hi, n_signed, n_unclipped = 0.0, 0.0, 0, 0, 0, 0, 0
        kl_sum = {"ref": 0.0, "mirror": 0.0}
        for mb in batches:
            logp, entropy = completion_logprobs(self.model, mb, temp, t.logprob_chunk_tokens, t.logprob_chunk_vocab,
                                                return_entropy=True)
            if mb.logp_start is None:
                mb.logp_start = logp.detach().cpu()
            logp_old = mb.logp_old if mb.logp_old is not None else logp.detach()  # mu = 1: ratio == 1
            adv = mb.advantages.to(logp.device)
            tl = grpo_token_loss(logp, logp_old, mb.logp_ref, adv, beta=a.beta, eps_low=a.epsilon_low,
                                 eps_high=a.epsilon_high, clip=a.clip, kl_target=a.kl_target,
                                 beta_mirror=a.beta_mirror, kl_estimator=a.kl_estimator)
            loss = aggregate(tl.loss, mb.weights.to(logp.device))
            loss.backward()
            total_loss += loss.item()
            n_tok += logp.numel()
            ent_sum += entropy.sum().item()
            kl_sum["ref"] += tl.kl_ref.sum().item() if tl.kl_ref is not None else 0.0
            kl_sum["mirror"] += tl.kl_mirror.sum().item() if tl.kl_mirror is not None else 0.0
            clip_lo += int(tl.clipped_low.sum())
            clip_hi += int(tl.clipped_high.sum())
            n_signed += int((adv != 0).sum())
            n_unclipped += int(((adv != 0) & ~tl.clipped_low & ~tl.clipped_high).sum())
        unclipped = n_unclipped / n_signed if n_signed else None
        stop = diag.early_stop_reason(unclipped, -total_loss, prev_objective, a.early_stop_unclipped_fraction,
                                      a.early_stop_min_improvement)
        if stop is not None:
            self.optimizer.zero_grad(set_to_none=True)
            return {"update/stop": stop, "update/unclipped_fraction": unclipped}
        grad_norm = torch.nn.utils.clip_grad_norm_(
            params, self.recipe.optimizer.max_grad_norm if self.recipe.optimizer.max_grad_norm > 0 else float("inf"))
        finite = math.isfinite(total_loss) and bool(torch.isfinite(grad_norm))
        if finite:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        kl = {k: v / max(1, n_tok) if on else None
              for (k, v), on in zip(kl_sum.items(), (a.kl_target in ("ref", "both"), a.kl_target in ("mirror", "both")))}
        return {"loss": total_loss, "grad_norm": float(grad_norm), "kl": kl["ref"], "kl/ref": kl["ref"],
                "kl/mirror": kl["mirror"], "entropy": ent_sum / max(1, n_tok), "clip/low": clip_lo / max(1, n_tok),
                "clip/high": clip_hi / max(1, n_tok), "clip/fraction": (clip_lo + clip_hi) / max(1, n_tok),
                "update/unclipped_fraction": unclipped, "update/stop": None, "nonfinite": not finite}

    def run_updates(self, batches: list[MicroBatch]) -> dict:
        """The mu updates of one batch (fewer when spec 7's early stop fires), then what they did (spec 8)."""
        a = self.recipe.algorithm
        row, ran, prev = {}, 0, None
        for _ in range(a.mu):
            out = self.update(batches, prev_objective=prev)
            row.update(out)
            if out["update/stop"] is not None:
                break
            ran, prev = ran + 1, -out["loss"]
        for _ in range(a.mu - ran):
            self.scheduler.step()  # updates not run still tick the schedule, which counts steps * mu updates
        row["update/mu_ran"] = ran
        if self.recipe.train.update_diagnostics:
            row.update(self.update_diagnostics(batches))
        return row

    def update_diagnostics(self, batches: list[MicroBatch]) -> dict:
        """Spec 8, on the batch just used: the change of each completion's sequence log-prob from before its
        first update to now, for A > 0 and A < 0 (one no-grad forward)."""
        t, temp = self.recipe.train, self.recipe.generation.temperature
        ids, before, after, adv = [], [], [], []
        with torch.no_grad(), eval_mode(self.model):
            for mb in batches:
                after.append(completion_logprobs(self.model, mb, temp, t.logprob_chunk_tokens, t.logprob_chunk_vocab).cpu())
                ids.append(mb.seq_ids)
                before.append(mb.logp_start)
                adv.append(mb.advantages)
        ids = torch.cat(ids)
        n = int(ids.max()) + 1 if ids.numel() else 0
        seq_adv = torch.zeros(n, dtype=torch.float64).index_copy_(0, ids, torch.cat(adv).to(torch.float64))
        return diag.logp_change(diag.sequence_sums(torch.cat(before), ids, n),
                                diag.sequence_sums(torch.cat(after), ids, n), seq_adv)

    def train_step(self) -> dict:
        r, g, a = self.recipe, self.recipe.generation, self.recipe.algorithm
        t0 = time.perf_counter()
        examples = [self.train_set.examples[i]
                    for i in batch_indices(len(self.train_set), r.train.prompts_per_step, self.step, r.seed)]
        completions = self.rollout(examples)                                    # 1. rollout
        t_rollout = time.perf_counter() - t0
        result, texts = self.score(examples, completions)                      # 2. reward
        rewards = result.total.view(len(examples), g.num_generations)
        extra = {"dead_band": a.sign_dead_band} if a.advantage == "sign" else {}
        advantages = group_advantages(rewards, a.advantage, **extra).view(-1)  # 3. advantage
        flat = zero_std_groups(rewards)
        keep = [i for i in range(len(completions))
                if not math.isnan(result.total[i]) and not (a.skip_zero_std_groups and flat[i // g.num_generations])]
        row = dict.fromkeys(diag.STEP_KEYS)  # every key in every row; None where it does not apply
        row.update(self._rollout_metrics(completions, result, rewards, flat, advantages.view_as(rewards)))
        row.update(self._p_star(row["success_rate"], result.total))
        if keep:
            batches = pack([examples[completions[i].prompt_index].prompt_ids for i in keep],  # 4. pack
                           [completions[i].token_ids for i in keep], advantages[keep],
                           r.train.micro_batch_size, a.aggregation, g.max_new_tokens, self.tokenizer.pad_token_id,
                           sampler_logprobs=[completions[i].logprobs for i in keep]
                           if all(completions[i].logprobs is not None for i in keep) else None)
            self.no_grad_logprobs(batches, need_old=a.mu > 1,                   # 5. no-grad passes
                                  need_ref=a.kl_target in ("ref", "both"))
            row.update(self.run_updates(batches))                               # 6. update(s)
            row.update(sampler_agreement(batches))
        row.update({"step": self.step + 1, "lr": self.scheduler.get_last_lr()[0], "time/rollout_s": t_rollout,
                    "time/rollout_tokens_per_s": sum(len(c.token_ids) for c in completions) / max(t_rollout, 1e-9),
                    "time/step_s": time.perf_counter() - t0, "memory/peak_mib": peak_memory_mib(),
                    "sample": texts[0] if texts else ""})
        self.last_samples = self._sample_table(examples, completions, texts, result)
        return row

    def _sample_table(self, examples, completions, texts, result, limit: int = 16) -> list[dict]:
        """The step's first `limit` completions with their rewards, per function (output.samples_every)."""
        out = []
        for i, c in enumerate(completions[:limit]):
            rec = {"prompt": examples[c.prompt_index].prompt_text, "completion": texts[i],
                   "reward": None if math.isnan(result.total[i]) else float(result.total[i])}
            for name, values in result.per_function.items():
                rec[f"reward/{name}"] = None if math.isnan(values[i]) else float(values[i])
            out.append(rec)
        return out

    def _p_star(self, success_rate: float, total: torch.Tensor) -> dict:
        """Spec 4: where exact KL-regularised GRPO would take the success rate, from the reference's rate.
        Only for a reference KL and binary rewards, the recurrence's assumptions."""
        a = self.recipe.algorithm
        if self.step == 0 and self.p_ref is None:
            self.p_ref = success_rate
        if a.kl_target not in ("ref", "both") or self.p_ref is None or not diag.is_binary(total):
            return {"kl/p_ref": None, "kl/p_star": None}
        return {"kl/p_ref": self.p_ref,
                "kl/p_star": diag.kl_fixed_point(self.p_ref, a.beta, a.advantage, self.recipe.generation.num_generations)}

    def _rollout_metrics(self, completions, result, rewards, flat, advantages=None) -> dict:
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
            row[f"reward/{name}/std"] = float(values[ok].std()) if ok.sum() > 1 else None
        if advantages is not None:
            row.update(diag.rollout_diagnostics(primary >= 1.0, ~torch.isnan(primary), advantages))
        for name, n in result.errors.items():
            row[f"reward_errors/{name}"] = n
        return row

    # -- preflight -----------------------------------------------------------------------------------

    def preflight(self) -> dict:
        """One forward/backward of a full micro-batch at the longest prompt + max_new_tokens, before step 1,
        so that an out-of-memory shows in the first minute with the memory model's advice rather than
        after an hour (unsloth#1624). Leaves no trace: RNG state restored, gradients dropped."""
        r, g = self.recipe, self.recipe.generation
        longest = max(self.train_set.examples, key=lambda e: len(e.prompt_ids)).prompt_ids
        n = min(r.train.micro_batch_size, r.train.prompts_per_step * g.num_generations)
        filler = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        mb = pack([longest] * n, [[filler] * g.max_new_tokens] * n, torch.ones(n), n, r.algorithm.aggregation,
                  g.max_new_tokens, self.tokenizer.pad_token_id)[0]
        device = "cuda" if next(self.model.parameters()).is_cuda else "cpu"
        shape = ModelShape.from_config(self.model.config)
        workload = workload_from_recipe(r, len(longest), device)
        predicted = estimate(shape, workload).peak
        cuda = [torch.cuda.current_device()] if device == "cuda" else []
        try:
            with torch.random.fork_rng(devices=cuda):
                logp, _ = completion_logprobs(self.model, mb, g.temperature, r.train.logprob_chunk_tokens,
                                              r.train.logprob_chunk_vocab, return_entropy=True)
                aggregate(logp, mb.weights.to(logp.device)).backward()
        except (torch.OutOfMemoryError, MemoryError) as exc:
            budget = device_budget(device)
            advice = advise(shape, workload, budget).lines if budget else []
            raise TrainingError(
                f"preflight: a micro-batch of {n} x ({len(longest)} prompt + {g.max_new_tokens} completion) tokens "
                f"ran out of memory ({type(exc).__name__}). Memory model: {fmt(predicted)} predicted"
                + (f" of {fmt(budget)}" if budget else "") + ".\n" + "\n".join(advice)) from None
        finally:
            self.optimizer.zero_grad(set_to_none=True)
        peak = peak_memory_mib()
        self.log(f"[lowmem-grpo] preflight ok: micro-batch {n} x {len(longest) + g.max_new_tokens} tokens, "
                 f"peak so far {peak:.0f} MiB (memory model, whole run: {predicted / 2**20:.0f} MiB)")
        return {"peak_mib": peak, "predicted_mib": predicted / 2**20}

    # -- evaluation ----------------------------------------------------------------------------------

    def evaluate(self) -> Optional[dict]:
        if self.eval_set is None:
            return None
        return greedy_eval(self.engine, self.tokenizer, self.rewards, self.eval_set.examples[: self.recipe.train.eval_max_prompts],
                           self.recipe.generation.max_new_tokens)

    # -- the loop --------------------------------------------------------------------------------------

    def fit(self) -> dict:
        r = self.recipe
        if r.train.preflight:
            self.preflight()
        first_eval = None
        if self.step == 0:
            first_eval = self.evaluate()
            if first_eval:
                self.metrics.write({"step": 0, **{f"eval/{k}": v for k, v in first_eval.items()}})
                self.log(f"[lowmem-grpo] held-out accuracy at step 0: {100 * first_eval['accuracy']:.1f}%")
        stopped = False
        progress = Progress(r.train.steps, self.step, r.output.progress, self.log)
        with _StopFlag() as stop, progress:
            while self.step < r.train.steps:
                row = self.train_step()
                self.step += 1
                bad = bool(row.get("nonfinite"))
                self._count_nonfinite(bad)
                row.update({"nonfinite/consecutive": self.nonfinite_run, "nonfinite/skipped_total": self.nonfinite_total})
                if r.train.eval_every and self.step % r.train.eval_every == 0 and self.step < r.train.steps:
                    row.update({f"eval/{k}": v for k, v in (self.evaluate() or {}).items()})
                self.metrics.write(row)
                if r.output.samples_every and self.step % r.output.samples_every == 0:
                    self.metrics.samples(self.step, self.last_samples)
                progress.update(row)
                if self.step % r.output.log_every == 0:
                    progress.log(summary_line(row))
                if self.nonfinite_run >= r.train.max_nonfinite_steps:
                    self.metrics.close()
                    last = ckpt.latest(self.run_dir)
                    raise TrainingError(
                        f"{self.nonfinite_run} steps in a row (up to step {self.step}) had a non-finite loss or gradient "
                        f"(train.max_nonfinite_steps={r.train.max_nonfinite_steps}); stopped. Last good checkpoint: "
                        + (f"{last} (resume with: lowmem-grpo train --resume {self.run_dir})" if last else "none")
                        + ". Try a lower optimizer.lr, or optimizer.max_grad_norm > 0.")
                # A skipped (non-finite) step writes no checkpoint: the latest one stays the last good step's.
                if not bad and (stop.requested or self.step % r.output.save_every == 0 or self.step == r.train.steps):
                    self.save()
                elif bad:
                    progress.log(f"[lowmem-grpo] step {self.step}: non-finite loss or gradient, update skipped "
                                 f"({self.nonfinite_run} in a row)")
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
        # Never persist a broken state: resume would start from it.
        if not all(bool(torch.isfinite(p).all()) for p in trainable_parameters(self.model)):
            raise TrainingError(f"step {self.step}: the trainable weights hold NaN/inf; no checkpoint written "
                                f"(last good: {ckpt.latest(self.run_dir)})")
        return ckpt.save(self.run_dir, self.step, self.model, self.optimizer, self.scheduler,
                         keep_last=self.recipe.output.keep_last)


def peak_memory_mib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return peak_rss_mib()
