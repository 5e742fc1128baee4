"""The GRPO training loop, top to bottom.

One step (Trainer.train_step):
  1. select     the step's prompts, a pure function of (seed, step) (data.batch_indices)
  2. rollout    G completions per prompt from the current policy (rollout/); with an environment, multi-turn
                episodes it answers between the model's turns (rollout/turns.py, docs/algorithm.md §20)
  3. reward     one score per completion (NaN = skipped), weighted over the functions (rewards/); then one
                advantage per completion from its group (advantages.py, docs/algorithm.md §2)
  4. pack       completions -> algorithm.minibatches mini-batches, each in micro-batches of flat per-token
                tensors (batch.py)
  5. no-grad    old log-probs (more than one update per step) and reference log-probs (a KL to the reference;
                adapters disabled)
  6. update     mu passes over the mini-batches (fewer on an early stop, §7), an update each: log-probs with
                grad -> loss (loss.py) -> backward over its micro-batches; clip; step
  7. diagnose   no grad: how far the batch's completions moved (§8)
  8. log        the metrics row (every statistic from diagnostics.py); a checkpoint every N steps, with the
                loop's own state (LoopState)

Under torchrun (distributed.py, docs/algorithm.md §21) each process samples and scores its share of the
step's prompts, then every process holds the whole batch: steps 3-5 and every statistic are computed as one
process would, each process updates on its share of the completions with the batch's normalisers, and the
trainable gradients are summed. Process 0 writes the metrics and checkpoints.

This file orchestrates: the maths is in loss.py, advantages.py, logprobs.py and diagnostics.py; whether a run
may start or resume in its folder in resume.py; the optimizer and schedule in optim.py; Ctrl-C in interrupts.py.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import psutil
import torch

from . import checkpoint as ckpt
from . import diagnostics as diag
from . import distributed
from . import resume as resume_rules
from .advantages import group_advantages, mode_options, normalize_then_sum_advantages
from .batch import (SHARED_MAX_WIDTH, BatchShare, MicroBatch, completion_logprobs, minibatches, pack,
                    trained_completions)
from .data import PROMPT_RECORD, batch_indices, hold_to_engine_context, prompt_record, prompt_sets
from .dynamic_sampling import Rollouts, extra_indices, fill_with_contrast
from .environment import EnvironmentFactory
from .evaluate import accuracy_text, combine_greedy
from .evaluate import greedy as greedy_eval
from .loss import (LossOptions, adapt_entropy_coef, aggregate, entropy_threshold, grpo_token_loss,
                   off_policy_sequence_mask, sampler_correction_weights, top_entropy_mask)
from .interrupts import StopFlag
from .memory import (MemoryModelError, ModelShape, Waves, Workload, advise, context_note, current_memory_mib,
                     decode_waves, device_budget, estimate, experts_note, fmt, host_memory_problem,
                     micro_batch_completions, model_workload, oom_gist, out_of_memory_advice, peak_memory_mib,
                     release_memory, return_freed_memory_to_os)
from .metrics import PhaseTimer, read_metrics, summary_line, text_ends
from .optim import apply_settings, make_optimizer, make_scheduler
from .model import (check_logit_head, context_tokens, eval_mode, load_policy, reference_mode, takes_shared_prompts,
                    trainable_parameters)
from .progress import Progress, library_bars, use_bar
from .recipe import Recipe, prompts_share_problem, recipe_to_yaml
from .resume import ResumeError, anchored, fixed_values
from .rewards import Rewards
from .rewards.judging import judging_notes
from .rollout import make_engine
from .rollout.base import EVAL_BATCH, EngineConfig, SamplingParams
from .rollout.turns import (TurnLimits, completion_texts, context_tokens as engine_context, model_tokens, prompt_ids,
                            prompt_text, runner, score, segments)
from .sinks import SinkError, Sinks, open_sinks


class TrainingError(Exception):
    pass


@dataclass
class LoopState:
    """What the loop carries across steps besides weights, optimizer and RNG; saved in every checkpoint
    and restored on resume."""

    nonfinite_run: int = 0           # steps in a row up to now whose loss or gradient was NaN/inf
    nonfinite_total: int = 0         # such steps in the whole run
    p_ref: Optional[float] = None    # the reference's success rate (§4): step 1 samples from fresh adapters
    entropy_coef: Optional[float] = None  # algorithm.entropy_target: the adapted coefficient (§16); None: the recipe's

    def count_step(self, finite: bool) -> None:
        self.nonfinite_run = 0 if finite else self.nonfinite_run + 1
        self.nonfinite_total += not finite


@dataclass
class Step:
    row: dict           # the metrics row
    samples: Optional[list]  # the sample table (diag.sample_table) on steps that write one (output.samples_every)


class Trainer:
    def __init__(self, recipe: Recipe, run_dir: Optional[Path] = None, resume: bool = False, log=print,
                 world: Optional[distributed.World] = None):
        # §21: one process, unless torchrun started several (then this joins their group if nobody did)
        self.world = world if world is not None else distributed.join(recipe.train.collective_timeout_s)
        self.recipe = recipe
        self.log = log if self.world.main else (lambda *args, **kwargs: None)
        if problem := prompts_share_problem(recipe.train.prompts_per_step, self.world.size):
            raise TrainingError(problem)
        self.run_dir = Path(run_dir or recipe.output.dir)
        self.stop_requested = False   # set (by code, not a signal) to end the run after the current step, checkpointed
        # set by code (TRL-API callbacks' control.should_evaluate / should_save) for the current step: evaluate and
        # checkpoint after it, as transformers' Trainer does after on_step_end
        self.eval_requested = self.save_requested = False
        self.stopped_by: Optional[int] = None   # the signal that stopped the run, if one did
        self._lock = self._take_run_dir() if self.world.main else None
        problem = (resume_rules.recipe_change_problem(self.run_dir, recipe) if resume
                   else resume_rules.new_run_problem(self.run_dir, self.resume_command))
        if problem:
            raise TrainingError(problem)
        ckpt.seed_all(recipe.seed)
        start_ckpt = ckpt.latest(self.run_dir) if resume else None
        # A run stopped before its first checkpoint has nothing to continue from: it starts again (its metrics go)
        self._restart = resume and start_ckpt is None
        if self._restart:
            self.log(f"[lowmem-grpo] {self.run_dir} holds no complete checkpoint yet (output.save_every="
                     f"{recipe.output.save_every}): the run starts again from step 0")
        if start_ckpt is not None and (problem := resume_rules.adapter_problem(start_ckpt, recipe.lora)):
            raise TrainingError(problem)
        with library_bars(self.world.main and use_bar(recipe.output.progress)):   # ("Loading weights")
            # the anchored path: peft writes it into every adapter_config.json, where a relative one read as a hub id
            # from anywhere else (a red team's find: plain peft could not load the export's adapter)
            self.model, self.tokenizer = load_policy(anchored(recipe).model, recipe.lora,
                                                     adapter_path=str(start_ckpt / "adapter") if start_ckpt else None)
        if check_logit_head(self.model) is None:   # the kernel's log-probs are the model's own, or a refusal
            self.log("[lowmem-grpo] note: the model's forward returned no logits to check the chunked log-probs "
                     "against (rollout/logprob_abs_diff compares them with the engine's every step)")
        self.model.train()
        self.device_type = "cuda" if next(self.model.parameters()).is_cuda else "cpu"
        # One policy: every process starts from process 0's adapter weights, then samples with its own stream.
        distributed.broadcast_parameters(trainable_parameters(self.model), self.world)
        if self.world.rank:
            ckpt.seed_all(distributed.sampling_seed(recipe.seed, self.world))
        if self.device_type == "cpu":
            return_freed_memory_to_os()
        self.rewards = Rewards.from_recipe(recipe)
        self.env = EnvironmentFactory(recipe.environment) if recipe.environment.name else None   # §20
        self._env_error_logged = False
        self._env_worked = False   # an episode has ended without an environment error (_check_env_errors)
        self._no_reward_logged = False   # a step whose every completion had no reward: said once (_log_no_reward)
        for note in self.env.notes if self.env else []:
            self.log(f"[lowmem-grpo] {note}")
        # eval_set: data.eval_path, or data.eval_fraction's held-out split (None when neither is set). Rows
        # need data.answer_field only when a reward reads it.
        sets = prompt_sets(recipe.data, self.tokenizer, require_answer=self.rewards.reads_answer,
                           context_tokens=context_tokens(self.model),   # (a prompt that fills it: a bad row)
                           reset_fills=self.env is not None)
        self.train_set, self.eval_set = sets["train"], sets["test"]
        self.rewards.train_rows = len(self.train_set)   # TRL-shaped rewards' trainer_state.epoch
        for note in self.rewards.notes + judging_notes(recipe):  # e.g. the code sandbox's active protections
            self.log(f"[lowmem-grpo] {note}")
        self.sampling = SamplingParams.from_generation(recipe.generation)
        self.share_prompts = recipe.train.share_prompts == "auto" and takes_shared_prompts(self.model, SHARED_MAX_WIDTH)
        self.memory_budget = device_budget(self.device_type)
        self.waves = self._decode_waves()
        self._note_experts()
        self._note_context()
        engine_cfg = EngineConfig.from_recipe(recipe, self.waves.max_batch_sequences if self.waves else None)
        self.engine = make_engine(replace(engine_cfg, seed=distributed.sampling_seed(engine_cfg.seed, self.world)),
                                  self.model, self.tokenizer)
        try:
            self._hold_rows_to_engine_context()
            self.check_sampler_agreement()
            self._init_loop(start_ckpt)
        except BaseException:
            self.engine.close()
            raise
        for name, part in (("training", self.train_set), ("held-out", self.eval_set)):   # (held-out: a red team's find)
            if part is not None and part.skipped:
                self.log(f"[lowmem-grpo] skipped {len(part.skipped)} bad {name} rows (first: {part.skipped[0]})")

    def _take_run_dir(self):
        """The run folder, made and locked for this process (checkpoint.lock_run): a clear error where it cannot
        be made, or where another live process trains in it."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            return ckpt.lock_run(self.run_dir)
        except ckpt.RunInUse as exc:
            raise TrainingError(f"{self.run_dir} is in use: another lowmem-grpo process (pid {exc}) is training there. "
                                "Wait for it, or stop it (Ctrl-C checkpoints it) and continue with `"
                                f"{self.resume_command}`; or train into another folder (--set output.dir=...)") from None
        except OSError as exc:
            raise TrainingError(f"output.dir={str(self.run_dir)!r}: cannot make or write the run folder there "
                                f"({exc.strerror or exc}); choose another (--set output.dir=...)") from None

    def _init_loop(self, start_ckpt: Optional[Path]) -> None:
        """Optimizer, schedule, loop state and sinks: fresh, or as the checkpoint left them."""
        r = self.recipe
        self.optimizer = make_optimizer(trainable_parameters(self.model), r.optimizer)
        self.scheduler = make_scheduler(self.optimizer, r.optimizer, r.train.steps * r.algorithm.updates_per_step)
        self.step, self.state = 0, LoopState()
        self.optimizer_steps = 0  # taken by this process: whether a failed step has moved the weights yet
        # through a weak reference: a closure over self made the optimizer hold the Trainer (model, optimizer state,
        # open data files) until a full garbage collection, after fit() and del (found by a red team)
        this = weakref.ref(self)
        self.optimizer.register_step_pre_hook(lambda *_: _count_optimizer_step(this))
        if start_ckpt is not None:
            try:
                saved = resume_rules.read_trainer_state(start_ckpt, r, set(asdict(LoopState())),
                                                        trainable_parameters(self.model), self.log)
            except ResumeError as exc:
                raise TrainingError(str(exc)) from None
            self.optimizer.load_state_dict(saved["optimizer"])
            self.scheduler.load_state_dict(saved["scheduler"])
            apply_settings(self.optimizer, self.scheduler, r.optimizer)
            self.step = saved["step"]
            self._restore_rng(ckpt.rng_states(saved))
            self.state = LoopState(**saved["extra"].get("loop", {}))
            if note := resume_rules.data_change_note(saved, len(self.train_set), self.step):
                self.log(note)
            self.log(f"[lowmem-grpo] resumed from {start_ckpt} at step {self.step}")
        if not self.world.main:   # process 0 writes the run's metrics and samples (§21)
            self.metrics = Sinks([])
            return
        try:  # metrics.jsonl always; TensorBoard / W&B as the recipe asks (sinks.py)
            # a resume drops the rows after its checkpoint's step; a restart all of them (-1)
            self.metrics = open_sinks(self.run_dir, r.output, r.model_dump(mode="json"), log=self.log,
                                      resume_step=self.step if start_ckpt else -1 if self._restart else None)
        except SinkError as exc:   # (before recipe.yaml: the same command can start again once it is fixed)
            raise TrainingError(str(exc)) from None
        # fresh, or a resume's --set changes: the next plain --resume (and report) keep them
        path, text = self.run_dir / "recipe.yaml", recipe_to_yaml(anchored(r))
        if start_ckpt is not None and path.is_file() and path.read_text() != text:
            self.log(f"[lowmem-grpo] {path} now holds this resume's settings")
        try:
            ckpt.write_text_atomic(path, text)
        except OSError as exc:   # (a full disk between the lock and this write: a red team's find)
            raise TrainingError(f"cannot write {path} ({exc.strerror or exc}): free some space there, then run the "
                                "same command again") from None

    def _restore_rng(self, states: list) -> None:
        """Each process's RNG state as the checkpoint kept it; from a run of another process count, process
        0's, and each other process a fresh stream of its own (so not the run that count would have made)."""
        if len(states) == self.world.size:
            ckpt.set_rng_state(states[self.world.rank])
            return
        self.log(f"[lowmem-grpo] the checkpoint was written by {len(states)} process(es), this run has "
                 f"{self.world.size}: the data order continues, the sampling streams start afresh")
        ckpt.set_rng_state(states[0])
        if self.world.rank:   # (all three streams: Python's and numpy's were process 0's in every process, a red team)
            ckpt.seed_all(distributed.sampling_seed(self.recipe.seed, self.world) + self.step)

    # -- the phases of a step ----------------------------------------------------------------------------

    def select_prompts(self, draw: int = 0) -> list:
        """The step's prompts (draw 0), or those of dynamic sampling's extra draw `draw` (§18): each a pure
        function of (seed, step, draw)."""
        r = self.recipe
        n, size = len(self.train_set), r.train.prompts_per_step
        at = (batch_indices(n, size, self.step, r.seed) if draw == 0
              else extra_indices(n, size, self.step, draw, r.seed))
        return [self.train_set.examples[i] for i in at]

    def generator(self, prompts) -> Callable:
        """generate(examples, params) -> completions, for examples of the PromptSet `prompts`: the engine's, or
        with an environment its episodes (rollout/turns.py, §20; the set renders reset()'s first messages)."""
        if self.env is None:
            return lambda examples, params: self.engine.generate([e.prompt_ids for e in examples], params)
        return runner(self.engine, self.tokenizer, self.env, TurnLimits.from_recipe(self.recipe.environment),
                      prompts.render_message)

    @property
    def completion_cap(self) -> int:
        """The most tokens a completion holds: max_new_tokens, or with an environment max_total_tokens (§20)."""
        return self.recipe.environment.max_total_tokens if self.env is not None else self.recipe.generation.max_new_tokens

    def rollout(self, examples, clock: PhaseTimer) -> Rollouts:
        """G completions per prompt, decoded (with an environment: its observations too) and scored. Each
        process samples and scores its share of the prompts; every process gets them all (§21)."""
        mine = distributed.shard(examples, self.world)
        with clock("rollout"):
            completions = self.generator(self.train_set)(mine, self.sampling)
        with clock("reward"):
            texts = completion_texts(self.tokenizer, completions)
            result = score(self.rewards, texts, completions, [mine[c.prompt_index] for c in completions], self.step, tokenizer=self.tokenizer)
        if self.world.size == 1:
            out = Rollouts(examples, completions, texts, result)
        else:
            with clock("gather"):
                parts = distributed.gather((completions, texts, result), self.world)
            out = Rollouts.cat([Rollouts(share, *part) for share, part in
                                zip(distributed.shares(examples, self.world), parts)], self.recipe.generation.num_generations)
        self._check_env_errors(out.completions)   # the whole step's: one process's share alone stopped a run that
        return out                                # one process would go on with (found by a red team)

    def _check_env_errors(self, completions) -> None:
        """Stops the run (a TrainingError) at a step whose every episode ended in an environment error while no
        episode of the run has yet ended without one: an environment that always fails (its constructor, reset()
        or step()) gave every step no reward, to the end, without a word past the first (found by audits). Else
        logs the run's first environment error, once (all of them are counted in env/errors)."""
        bad = next((c.env.error for c in completions if c.env is not None and c.env.error), None)
        worked = any(c.env is None or not c.env.error for c in completions)
        if not self._env_worked and not worked and completions:
            name, step = self.recipe.environment.name, self.step + 1
            if not any(c.env.turns > 0 for c in completions):
                raise TrainingError(f"environment {name!r} could not start any episode of step {step}: {bad}")
            raise TrainingError(f"environment {name!r}: every episode of step {step} ended in an environment error, "
                                "and no episode has ended without one yet: fix the environment (model text it cannot "
                                f"use calls for an observation saying so, not an error); the first: {bad}")
        self._env_worked = self._env_worked or worked
        if bad and not self._env_error_logged:
            self._env_error_logged = True
            self.log(f"[lowmem-grpo] environment {self.recipe.environment.name!r}: {bad} (that completion's episode "
                     "ended there; such errors are counted in env/errors, and only this first one is printed)")

    def _log_no_reward(self, completions, total: torch.Tensor) -> None:
        """The run's first step whose every completion was skipped for want of any reward, once: such a step
        learns nothing, and without a word the run would go on so, step after step (reward/skipped counts them)."""
        if self._no_reward_logged:
            return
        note = no_reward_note(self.recipe, completions, total, self.step + 1)
        if note:
            self._no_reward_logged = True
            self.log(note)

    def rollouts_with_contrast(self, first: Rollouts, clock: PhaseTimer) -> tuple[Rollouts, dict]:
        """§18: more draws until prompts_per_step groups have contrast (or the bound); those groups."""
        a, g = self.recipe.algorithm, self.recipe.generation.num_generations
        wanted, draws = self.recipe.train.prompts_per_step, [first]
        found = int(first.contrast(g).sum())
        for draw in range(1, a.dynamic_sampling_max_draws + 1):
            if found >= wanted:
                break
            with clock("select"):
                examples = self.select_prompts(draw)
            draws.append(self.rollout(examples, clock))
            found += int(draws[-1].contrast(g).sum())
        return fill_with_contrast(draws, wanted, g)

    def advantages(self, result) -> torch.Tensor:
        """[groups, G] advantages from the rewards (§2, §17)."""
        a, g = self.recipe.algorithm, self.recipe.generation.num_generations
        extra = mode_options(a)
        if a.reward_aggregation == "normalize_then_sum" and len(result.per_function) > 1:
            return normalize_then_sum_advantages([v.view(-1, g) for v in result.per_function.values()],
                                                 self.rewards.weights, a.advantage, a.scale_rewards,
                                                 scored=~torch.isnan(result.total.view(-1, g)), **extra)
        return group_advantages(result.total.view(-1, g), a.advantage, scale=a.scale_rewards, **extra)

    def pack(self, examples, completions, advantages: torch.Tensor, keep: list[int]) -> list[MicroBatch]:
        """This process's share of the completions `keep` (all of them for one process), in micro-batches
        weighted by the whole batch's normalisers (§5, §21)."""
        r = self.recipe
        start, stop = distributed.shard_bounds(len(keep), self.world)
        part = BatchShare(start, len(keep), sum(model_tokens(completions[i]) for i in keep))
        mine = keep[start:stop]
        if not mine:   # more processes than completions to train on: this one only adds zero gradients
            return []
        sampler = [completions[i].logprobs for i in mine]
        if self.recipe.algorithm.sampler_correction != "none" and any(s is None for s in sampler):
            raise TrainingError(f"algorithm.sampler_correction={self.recipe.algorithm.sampler_correction!r} needs the "
                                "rollout engine's log-probs, and this engine did not report them")
        return pack([prompt_ids(completions[i], examples[completions[i].prompt_index]) for i in mine],
                    [completions[i].token_ids for i in mine], advantages[mine], r.train.micro_batch_size,
                    r.algorithm.aggregation, self.completion_cap, self.tokenizer.pad_token_id,
                    sampler_logprobs=sampler if all(s is not None for s in sampler) else None,
                    share_prompts=self.share_prompts, env_masks=[completions[i].env_mask for i in mine], part=part)

    def logprobs(self, mb: MicroBatch, return_entropy: bool = False, entropy_grad: bool = False):
        t = self.recipe.train
        return completion_logprobs(self.model, mb, self.recipe.generation.temperature, t.logprob_chunk_tokens,
                                   t.logprob_chunk_vocab, return_entropy=return_entropy, entropy_grad=entropy_grad,
                                   offload=t.offload_activations,
                                   autocast=torch.bfloat16 if self.recipe.model.bf16_autocast else None)

    def no_grad_logprobs(self, batches: list[MicroBatch]) -> dict:
        """Old log-probs (several updates a step: the ratio's denominator), reference log-probs (a KL to the reference), and
        with top_entropy_quantile < 1 the tokens whose entropy at the rollout weights is in the batch's top
        quantile (§16): the only ones given policy gradient."""
        a = self.recipe.algorithm
        need_old, need_ref, need_entropy = (a.updates_per_step > 1, a.kl_target in ("ref", "both"),
                                            a.top_entropy_quantile < 1)
        entropies = []
        with torch.no_grad(), eval_mode(self.model):
            for mb in batches:
                if need_old or need_entropy:
                    logp, entropy = self.logprobs(mb, return_entropy=True)
                    if need_old:
                        mb.logp_old = logp
                    entropies.append(entropy.cpu())
                if need_ref:
                    with reference_mode(self.model):
                        mb.logp_ref = self.logprobs(mb)
        if not need_entropy:
            return {}
        everyone = distributed.gather_lists(entropies, self.world)   # the threshold is the whole batch's (§21)
        threshold = entropy_threshold(torch.cat(everyone), a.top_entropy_quantile)
        for mb, entropy in zip(batches, entropies):
            mb.pg_mask = top_entropy_mask(entropy, threshold)
        return {"entropy/threshold": threshold,
                "entropy/kept_fraction": float(torch.cat([top_entropy_mask(e, threshold) for e in everyone]).float().mean())}

    def entropy_coef(self) -> float:
        a = self.recipe.algorithm
        return self.state.entropy_coef if self.state.entropy_coef is not None else a.entropy_coef

    def policy_weights(self, mb: MicroBatch, logp: torch.Tensor, logp_old: torch.Tensor):
        """The per-token multiplier of the policy term (§15, §16): the top-entropy mask times the off-policy
        sequence mask times the sampler-mismatch weight; None when none is on. And that weight's figures for
        the row."""
        a = self.recipe.algorithm
        weight = mb.pg_mask.to(logp_old.device, logp_old.dtype) if mb.pg_mask is not None else None
        if a.off_policy_mask_threshold is not None:   # against the engine's log-probs where it reported them
            sampler = mb.logp_sampler.to(logp.device) if mb.logp_sampler is not None else logp_old
            keep = off_policy_sequence_mask(logp, sampler, mb.advantages.to(logp.device), mb.seq_ids.to(logp.device),
                                            a.off_policy_mask_threshold)
            weight = keep if weight is None else weight * keep
        if a.sampler_correction == "none":
            return weight, None
        w, masked = sampler_correction_weights(logp_old, mb.logp_sampler.to(logp_old.device), mb.seq_ids.to(logp_old.device),
                                               a.sampler_correction, a.sampler_correction_min, a.sampler_correction_max)
        if a.clip == "vespo":   # §14.2: the weight enters VESPO's completion ratio (update() passes it), not the term
            return weight, (w.detach().cpu(), masked.cpu())
        return (w if weight is None else weight * w), (w.detach().cpu(), masked.cpu())

    def memory_figures(self) -> dict:
        """The step row's memory: the peak (the fullest device's) and what is in use now (where a leak shows), from
        every process in one exchange."""
        both = distributed.gather((peak_memory_mib(), current_memory_mib()), self.world)
        return {"memory/peak_mib": max(peak for peak, _ in both), "memory/now_mib": max(now for _, now in both)}

    def update(self, batches: list[MicroBatch], prev_objective: Optional[float] = None) -> dict:
        """One optimizer step over all micro-batches (gradient accumulation). With mu > 1, §7's early stop may
        find the batch spent after this pass (forward and backward): then no step is taken, and the row holds
        only why ("update/stop") and the unclipped fraction that was measured."""
        a = self.recipe.algorithm
        options = LossOptions.from_algorithm(a)   # here, not in __init__: a resume's --set may change the recipe
        coef = self.entropy_coef()
        self.optimizer.zero_grad(set_to_none=True)
        parts, sampler, vespo = [], [], []
        for mb in batches:
            logp, entropy = self.logprobs(mb, return_entropy=True, entropy_grad=coef > 0)
            if mb.logp_start is None:   # §8's "before": the rollout weights (a later mini-batch's first pass is not)
                mb.logp_start = mb.logp_old.cpu() if mb.logp_old is not None else logp.detach().cpu()
            logp_old = mb.logp_old if mb.logp_old is not None else logp.detach()  # one update a step: ratio == 1
            adv = mb.advantages.to(logp.device)
            pg_weight, correction = self.policy_weights(mb, logp, logp_old)
            if correction is not None:
                sampler.append(correction)
            vespo_correction = correction[0] if options.clip == "vespo" and correction is not None else None  # §14.2
            tl = grpo_token_loss(logp, logp_old, mb.logp_ref, adv, options, seq_index=mb.seq_ids.to(logp.device),
                                 pg_weight=pg_weight, entropy=entropy if coef > 0 else None, entropy_coef=coef,
                                 sampler_weight=vespo_correction)
            loss = aggregate(tl.loss, mb.weights.to(logp.device))
            loss.backward()
            parts.append(diag.TokenStats(loss.item(), entropy.detach(), tl.clipped_low, tl.clipped_high, adv,
                                         tl.kl_ref, tl.kl_mirror))
            if tl.vespo_weight is not None:
                vespo.append((tl.vespo_weight.detach().cpu(), mb.seq_ids.cpu()))
        # §21: the gradients summed over the processes are the batch's; its figures are every process's parts
        distributed.sum_gradients(trainable_parameters(self.model), self.world)
        parts, sampler = distributed.gather_lists(parts, self.world), distributed.gather_lists(sampler, self.world)
        vespo = distributed.gather_lists(vespo, self.world)
        stats = diag.update_stats(parts, kl_ref_on=a.kl_target in ("ref", "both"),
                                  kl_mirror_on=a.kl_target in ("mirror", "both"))
        extra = {**diag.sampler_correction_stats(sampler), **diag.vespo_stats(vespo), "entropy/coef": coef}
        stop = diag.early_stop_reason(stats.unclipped_fraction, -stats.loss, prev_objective,
                                      a.early_stop_unclipped_fraction, a.early_stop_min_improvement)
        if stop is not None:
            self.optimizer.zero_grad(set_to_none=True)
            return {"update/stop": stop, "update/unclipped_fraction": stats.unclipped_fraction, **extra}
        max_norm = self.recipe.optimizer.max_grad_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable_parameters(self.model),
                                                   max_norm if max_norm > 0 else float("inf"))
        finite = math.isfinite(stats.loss) and bool(torch.isfinite(grad_norm))
        if finite:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {**stats.row(), **extra, "grad_norm": float(grad_norm), "update/stop": None, "nonfinite": not finite}

    def run_updates(self, parts: list[list[MicroBatch]]) -> dict:
        """mu passes over the batch's mini-batches `parts`, an update each (§7); fewer when §7's early stop
        fires, which compares a mini-batch's objective with its own on the pass before. The row's update
        figures are the last pass's, averaged over its mini-batches."""
        a = self.recipe.algorithm
        row, ran, prev, stopped = {}, 0, [None] * len(parts), False
        for _ in range(a.mu):
            outs = []
            for i, batches in enumerate(parts):
                outs.append(self.update(batches, prev_objective=prev[i]))
                if outs[-1]["update/stop"] is not None:
                    stopped = True
                    break
                ran, prev[i] = ran + 1, -outs[-1]["loss"]
            row.update(diag.mean_row(outs))
            if stopped:
                break
        for _ in range(a.updates_per_step - ran):
            self.scheduler.step()  # updates not run still tick the schedule, which counts every update
        return {**row, "update/mu_ran": ran}

    def update_diagnostics(self, batches: list[MicroBatch]) -> dict:
        """§8 on the batch just used: how each completion's log-prob moved from before its first update to
        now, for A > 0 and A < 0 (one no-grad forward)."""
        with torch.no_grad(), eval_mode(self.model):
            after = [self.logprobs(mb).cpu() for mb in batches]
        mine = [(mb.logp_start, a, mb.seq_ids, mb.advantages) for mb, a in zip(batches, after)]
        before, after, seq_ids, advantages = zip(*distributed.gather_lists(mine, self.world))  # batch indices (§21)
        return diag.logp_moved(before, after, seq_ids, advantages)

    def train_step(self, clock: Optional[PhaseTimer] = None) -> Step:
        r, gen, a = self.recipe, self.recipe.generation, self.recipe.algorithm
        clock = clock if clock is not None else PhaseTimer()
        row = dict.fromkeys(diag.STEP_KEYS)  # every key in every row; None where it does not apply
        with clock("select"):                                                          # 1. select
            examples = self.select_prompts()
        drawn = self.rollout(examples, clock)                                          # 2-3. rollout, reward
        if a.dynamic_sampling:                                                         #   (§18: refill)
            drawn, found = self.rollouts_with_contrast(drawn, clock)
            row.update(found)
        examples, completions, texts, result = drawn.examples, drawn.completions, drawn.texts, drawn.result
        self._log_no_reward(completions, result.total)
        with clock("reward"):
            advantages = self.advantages(result)
        truncated = torch.tensor([c.truncated for c in completions], dtype=torch.bool)
        row.update(diag.rollout_stats(result, torch.tensor([model_tokens(c) for c in completions]), truncated,
                                      gen.num_generations, advantages))
        row.update(diag.environment_stats([c.env for c in completions], truncated))   # §20 ({} without one)
        if self.step == 0 and self.state.p_ref is None:
            self.state.p_ref = row["success_rate"]
        row.update(diag.p_star(self.state.p_ref, result.total, a.kl_target, a.beta, a.advantage, gen.num_generations))
        keep = trained_completions(result.total, gen.num_generations, a.skip_zero_std_groups,
                                   exclude=truncated if a.mask_truncated_completions else None)   # §16
        if keep:
            with clock("pack"):                                                        # 4. pack
                parts = [self.pack(examples, completions, advantages.view(-1), part)
                         for part in minibatches(keep, a.minibatches)]
                batches = [mb for part in parts for mb in part]
            with clock("no_grad"):                                                     # 5. no-grad passes
                row.update(self.no_grad_logprobs(batches))
            with clock("update"):                                                      # 6. update(s)
                row.update(self.run_updates(parts))
            if a.entropy_target is not None and row.get("entropy") is not None:        # §16: adapt the bonus
                self.state.entropy_coef = adapt_entropy_coef(self.entropy_coef(), row["entropy"], a.entropy_target,
                                                             a.entropy_coef_lr)
            every = r.train.update_diagnostics_every  # a forward costs ~a tenth of a step: not every step
            if every and (self.step + 1) % every == 0:
                with clock("diagnostics"):                                             # 7. diagnose
                    row.update(self.update_diagnostics(batches))
            row.update(diag.sampler_agreement(distributed.gather_lists(
                [(mb.logp_at_rollout, mb.logp_sampler) for mb in batches
                 if mb.logp_sampler is not None and mb.logp_at_rollout is not None], self.world)))
        row.update({"step": self.step + 1, "lr": self.scheduler.get_last_lr()[0], **clock.row(),
                    "time/rollout_tokens_per_s": sum(model_tokens(c) for c in completions)
                    / max(clock.seconds["rollout"], 1e-9),
                    **self.memory_figures(),
                    "sample": text_ends(texts[0]) if texts else "",   # (whole in the sample tables)
                    "data/skipped_rows": len(self.train_set.skipped)})  # grows as lazy data meets bad rows
        every = r.output.samples_every  # the table is built only for the steps that write it
        # each completion's own prompt: an environment's reset() may have replaced the dataset's (§20)
        samples = (diag.sample_table([prompt_text(c, examples[c.prompt_index]) for c in completions], texts, result,
                                     segments=[segments(c, self.tokenizer) for c in completions[:diag.SAMPLE_ROWS]])
                   if every and (self.step + 1) % every == 0 else None)
        return Step(row, samples)

    # -- start-up checks -----------------------------------------------------------------------------

    def check_sampler_agreement(self, tokens: int = 8) -> Optional[float]:
        """The engine's log-probs of a few tokens it samples from the first training prompt against the
        trainer's (§11): an engine that runs the architecture otherwise than transformers (vLLM's own model
        code, on shared modules) would have the update correct a policy other than the one sampled. In float32
        they agree to ~1e-6 on CPU (CUDA's kernels for a cached decode and a full forward differ more), so more
        than 1e-2 is refused, unless algorithm.sampler_correction is on (then it is reported, as a mean over 0.1
        nats is in bf16/fp16, where the kernels differ). The torch RNG is left as
        it was. Returns the largest difference, or None when the engine reports no log-probs."""
        gen = self.recipe.generation
        prompt = self.train_set.examples[0].prompt_ids
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
            done = self.engine.generate([prompt], SamplingParams(n=2, max_new_tokens=tokens,
                                                                 temperature=gen.temperature))
        done = [c for c in done if c.token_ids]
        if not done or any(c.logprobs is None for c in done):
            return None
        mb = pack([prompt] * len(done), [c.token_ids for c in done], torch.zeros(len(done)), len(done), "token_mean",
                  tokens, self.tokenizer.pad_token_id)[0]
        with torch.no_grad(), eval_mode(self.model):
            ours = self.logprobs(mb).float().cpu()
        gap = (ours - torch.tensor([x for c in done for x in c.logprobs], dtype=torch.float32)).abs()
        where = (f"generation.engine={gen.engine}: its log-probs of its own samples differ from the trainer's by "
                 f"{float(gap.mean()):.3g} nats on average, {float(gap.max()):.3g} at most")
        exact = self.recipe.model.compute_dtype == "float32" and not self.recipe.model.bf16_autocast
        if not (float(gap.max()) <= 1e-2 if exact else float(gap.mean()) <= 0.1):
            if exact and self.recipe.algorithm.sampler_correction == "none":
                raise TrainingError(f"{where} (allowed 1e-2 in float32): the engine runs this model type "
                                    f"({getattr(self.model.config, 'model_type', '?')!r}) otherwise than transformers "
                                    "does, so the update would correct a policy other than the one sampled; use "
                                    "generation.engine: hf (or weigh the difference knowingly with "
                                    "algorithm.sampler_correction, docs/algorithm.md §15)")
            self.log(f"[lowmem-grpo] warning: {where}; watch rollout/logprob_abs_diff"
                     + ("" if self.recipe.algorithm.sampler_correction != "none" else
                        ", and consider algorithm.sampler_correction (docs/algorithm.md §15)"))
        return float(gap.max())

    # -- preflight -----------------------------------------------------------------------------------

    def preflight(self) -> dict:
        """One forward/backward of a full micro-batch at the longest prompt + max_new_tokens, before step 1,
        so that an out-of-memory shows in the first minute with the memory model's advice rather than
        after an hour (unsloth#1624). Leaves no trace: RNG state restored, gradients dropped."""
        r = self.recipe
        longest = self.train_set.longest_prompt()
        n = micro_batch_completions(r, self.world.size)   # (one process's share under torchrun)
        filler = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        cap = self.completion_cap
        mb = pack([longest] * n, [[filler] * cap] * n, torch.ones(n), n, r.algorithm.aggregation,
                  cap, self.tokenizer.pad_token_id)[0]
        device = self.device_type
        try:
            shape, workload = self.memory_model(len(longest))
        except MemoryModelError as exc:   # an architecture it does not know: the forward/backward still runs
            shape, unknown = None, str(exc)
        if shape is not None:
            predicted = estimate(shape, workload, self.memory_budget).peak   # at the waves the run decodes in
            host = host_memory_problem(shape, workload, psutil.virtual_memory().available, self.world.size)
            if host is not None:  # before the forward pins it: past free RAM the OOM killer would end the run
                raise TrainingError(f"preflight: {host}")
        cuda = [torch.cuda.current_device()] if device == "cuda" else []
        try:
            with torch.random.fork_rng(devices=cuda):
                logp, _ = self.logprobs(mb, return_entropy=True)
                aggregate(logp, mb.weights.to(logp.device)).backward()
        except (torch.OutOfMemoryError, MemoryError) as exc:
            budget = device_budget(device)
            advice = advise(shape, workload, budget).lines if budget and shape is not None else []
            model_says = (f"{fmt(predicted)} predicted" + (f" of {fmt(budget)}" if budget else "") if shape is not None
                          else f"n/a ({unknown})")
            raise TrainingError(
                f"preflight: a micro-batch of {n} x ({len(longest)} prompt + {cap} completion) tokens "
                f"ran out of memory ({type(exc).__name__}). Memory model: {model_says}.\n" + "\n".join(advice)) from None
        finally:
            self.optimizer.zero_grad(set_to_none=True)
        peak = peak_memory_mib()
        model_says = f"whole run: {predicted / 2**20:.0f} MiB" if shape is not None else f"n/a: {unknown}"
        self.log(f"[lowmem-grpo] preflight ok: micro-batch {n} x {len(longest) + cap} tokens, "
                 f"peak so far {peak:.0f} MiB (memory model, {model_says})")
        return {"peak_mib": peak, "predicted_mib": predicted / 2**20 if shape is not None else None}

    def memory_model(self, prompt_tokens: int) -> tuple[ModelShape, Workload]:
        """The memory model's view of this run: the model's shape, one process's workload at `prompt_tokens`."""
        return model_workload(self.recipe, self.model, prompt_tokens, self.device_type, self.world.size)

    def _note_experts(self) -> None:
        """For a mixture of experts, what its experts cost (memory.experts_note): NF4 and frozen, or in compute
        dtype and perhaps adapted by peft."""
        try:
            shape, workload = self.memory_model(1)
        except MemoryModelError:
            return
        if shape.experts:
            self.log(f"[lowmem-grpo] note: {experts_note(shape, workload)}")

    def _note_context(self) -> None:
        """Say so when the longest prompt and completion pass the model's context (memory.context_note): an audit
        found that silent (transformers' "friendly reminder" aside); a RoPE model then runs on positions it was not
        trained on, a model with learned positions fails."""
        prompt = max(len(s.longest_prompt()) for s in (self.train_set, self.eval_set) if s is not None)
        if note := context_note(self.model.config, prompt, self.recipe, "the longest, training or held-out"):
            self.log(f"[lowmem-grpo] note: {note}")

    def _hold_rows_to_engine_context(self) -> None:
        if note := hold_to_engine_context([self.train_set, self.eval_set], engine_context(self.engine),
                                          context_tokens(self.model), self.recipe.generation.engine,
                                          self.recipe.data.max_prompt_tokens):
            self.log(f"[lowmem-grpo] note: {note}")

    def whole_run_memory_model(self) -> tuple[ModelShape, Workload]:
        """memory_model at the longest prompt, training or held-out: what every phase of the run is sized for."""
        sets = [s for s in (self.train_set, self.eval_set) if s is not None]
        return self.memory_model(max(len(s.longest_prompt()) for s in sets))

    def _decode_waves(self) -> Optional[Waves]:
        """Sequences per generate call in a rollout and in eval, sized to this device's memory at the longest
        prompt, training or held-out (memory.decode_waves); None without a budget or for a model the memory
        model does not know."""
        if self.memory_budget is None:
            return None
        try:
            shape, workload = self.whole_run_memory_model()
        except MemoryModelError:
            return None
        waves = decode_waves(shape, workload, self.memory_budget)
        split = [f"{phase} {waves.describe(phase)}" for phase in ("rollout", "eval") if waves.split(phase)]
        if split:
            self.log(f"[lowmem-grpo] decoding in waves to fit {fmt(self.memory_budget)} (memory model): " + "; ".join(split))
        return waves

    # -- evaluation ----------------------------------------------------------------------------------

    def evaluate(self) -> Optional[dict]:
        """Greedy held-out accuracy; each process takes its share of the prompts, and the counts are summed (§21)."""
        if self.eval_set is None:
            return None
        examples = distributed.shard(self.eval_set.examples[: self.recipe.train.eval_max_prompts], self.world)
        batch = self.waves.eval if self.waves is not None and self.waves.split("eval") else EVAL_BATCH
        mine = greedy_eval(self.engine, self.tokenizer, self.rewards, examples, self.recipe.generation.max_new_tokens,
                           batch_size=batch, rollout=self.generator(self.eval_set), step=self.step)
        return combine_greedy(distributed.gather(mine, self.world))

    def _write_eval(self, result: Optional[dict]) -> None:
        if result:
            self.metrics.write({"step": self.step, **{f"eval/{k}": v for k, v in result.items()}})

    def _final_eval_logged(self) -> bool:
        """Whether metrics.jsonl holds the eval of the last step (only the final eval writes one there: eval_every
        skips the last step)."""
        # only those keys held: a 100,000-step file read whole took 760 MB (found by a red team)
        rows = read_metrics(self.run_dir, keep=lambda k: k == "step" or k.startswith("eval/"))
        return any(row["step"] == self.step and len(row) > 1 for row in rows)

    # -- the loop --------------------------------------------------------------------------------------

    def fit(self) -> dict:
        """Train to train.steps (or a Ctrl-C), evaluating before and after. The engine and the sinks are
        closed on every way out."""
        try:
            try:
                out = self._fit()
                # what process 0 alone writes (the last checkpoint) is on disk before any process returns: a TRL
                # script's evaluate() on process 1 scored the checkpoint before it (found by a red team; §21)
                distributed.barrier(self.world, "finishing the run")
                return out
            except (torch.OutOfMemoryError, MemoryError) as exc:  # outside a step (a step's: step_or_checkpoint)
                what = oom_gist(exc)
            release_memory()
            raise TrainingError(self.out_of_memory(what, "held-out evaluation", None)) from None
        finally:
            self.close()

    def step_or_checkpoint(self) -> Step:
        """train_step; on an out-of-memory, one error with the memory model's advice, and nothing lost where that
        can be: before the step's first optimizer step the weights and optimizer are still the previous step's,
        so they are checkpointed with the RNG and loop state that step left, and a resume repeats this step as
        an uninterrupted run would have made it. One process only: several would be waiting in a collective."""
        rng, state, clock = ckpt.rng_state(), replace(self.state), PhaseTimer()
        updates = (self.optimizer_steps, self.scheduler.last_epoch)
        try:
            return self.train_step(clock)
        except (torch.OutOfMemoryError, MemoryError) as exc:
            what = oom_gist(exc)
        release_memory()   # out of the except block: the failed step's tensors went with its traceback
        saved = None
        if (self.optimizer_steps, self.scheduler.last_epoch) == updates and self.world.size == 1 and self.step > 0:
            ckpt.set_rng_state(rng)
            self.state = state
            last = ckpt.latest(self.run_dir)
            try:
                saved = last if last is not None and ckpt.step_of(last) == self.step else self.save()
            except TrainingError:   # (a full disk too: the out-of-memory error is the one to tell)
                saved = None
        raise TrainingError(self.out_of_memory(what, f"{clock.failed or 'step'} phase of step {self.step + 1}",
                                               saved)) from None

    def out_of_memory(self, what: str, where: str, saved: Optional[Path]) -> str:
        """The out-of-memory error's text: where, the memory model's view and advice, and what was kept."""
        budget = self.memory_budget   # the budget the run's waves were sized for
        lines = [f"ran out of memory in the {where} ({what}); peak {fmt(peak_memory_mib() * 2**20)}"
                 + (f" of a {fmt(budget)} budget" if budget else "") + "."]
        fix = ""
        try:
            advice = out_of_memory_advice(*self.whole_run_memory_model(), budget)
        except MemoryModelError as exc:
            lines.append(f"(no advice: {exc})")
        else:
            lines += advice.lines
            if advice.micro_batch_size:   # advice with a micro-batch always names its tile too (memory.advise)
                fix = f" --set train.micro_batch_size={advice.micro_batch_size}"
                if advice.chunk_tokens != self.recipe.train.logprob_chunk_tokens:
                    fix += f" --set train.logprob_chunk_tokens={advice.chunk_tokens}"
        last = ckpt.latest(self.run_dir)
        if saved is not None:
            lines.append(f"Nothing lost: {saved} holds the {self.step} finished step(s). Resume with: "
                         f"{self.resume_command}{fix}")
        else:
            lines.append(f"Last checkpoint: {last} (resume with: {self.resume_command}{fix})" if last else
                         "No checkpoint yet.")
        return "\n".join(lines)

    def _fit(self) -> dict:
        r = self.recipe
        if self.step >= r.train.steps:   # a resumed run that had finished its steps
            final = None
            if self.eval_set is not None and distributed.any_true(self.world.main and not self._final_eval_logged(),
                                                                  self.world):   # (process 0 keeps the metrics)
                # stopped in its final eval (the last checkpoint comes first): run it now (found by a red team)
                self.log(f"[lowmem-grpo] the run finished its {self.step} steps, not its final held-out eval: "
                         "running it")
                final = self.evaluate()
                self._write_eval(final)
            else:
                self.log(f"[lowmem-grpo] the run is complete: step {self.step} of train.steps={r.train.steps}; to "
                         f"train further, raise it: {self.resume_command} --set train.steps=N")
            return {"first_eval": None, "final_eval": final, "stopped": False, "step": self.step, "signal": None}
        if r.train.preflight:
            self.preflight()
        first_eval = None
        if self.step == 0 and r.train.eval_at_start:
            first_eval = self.evaluate()
            self._write_eval(first_eval)
            if first_eval:
                self.log(f"[lowmem-grpo] held-out accuracy at step 0: {accuracy_text(first_eval)}")
        stopped = False
        progress = Progress(r.train.steps, self.step, r.output.progress if self.world.main else "lines", self.log)
        with StopFlag(self.log) as stop, progress:
            while self.step < r.train.steps:
                self.metrics.step_begin(self.step + 1)
                step = self.step_or_checkpoint()
                row = step.row
                self.step += 1
                bad = bool(row.get("nonfinite"))
                self.state.count_step(finite=not bad)
                row.update({"nonfinite/consecutive": self.state.nonfinite_run,
                            "nonfinite/skipped_total": self.state.nonfinite_total})
                if r.train.eval_every and self.step % r.train.eval_every == 0 and self.step < r.train.steps:
                    row.update({f"eval/{k}": v for k, v in (self.evaluate() or {}).items()})
                self.metrics.write(row)
                if step.samples is not None:
                    self.metrics.samples(self.step, step.samples)
                progress.update(row)
                if self.step % r.output.log_every == 0:
                    progress.log(summary_line(row))
                if self.state.nonfinite_run >= r.train.max_nonfinite_steps:
                    last = ckpt.latest(self.run_dir)
                    raise TrainingError(
                        f"{self.state.nonfinite_run} steps in a row (up to step {self.step}) had a non-finite loss or "
                        f"gradient (train.max_nonfinite_steps={r.train.max_nonfinite_steps}); stopped. Last "
                        "checkpoint (its weights the last finite update's): "
                        + (f"{last} (resume with: {self.resume_command})" if last else "none")
                        + ". Try a lower optimizer.lr, or optimizer.max_grad_norm > 0.")
                if bad:
                    progress.log(f"[lowmem-grpo] step {self.step}: non-finite loss or gradient, update skipped "
                                 f"({self.state.nonfinite_run} in a row)")
                # requests in code (TRL-API callbacks): an eval first (its on_evaluate may ask to stop, as transformers'
                # EarlyStoppingCallback does), not at the last step (the final eval follows) nor twice
                if distributed.any_true(self.eval_requested, self.world) and self.step < r.train.steps \
                        and not any(k.startswith("eval/") for k in row):
                    self._write_eval(self.evaluate())
                # a Ctrl-C that reached any process, or a request in code (stop_requested: TRL-API callbacks)
                stopping = distributed.any_true(stop.requested or self.stop_requested, self.world)
                asked = distributed.any_true(self.save_requested, self.world)
                self.eval_requested = self.save_requested = False
                # A skipped step is checkpointed too: its weights are the last good update's, and a last or
                # stopping step left unsaved lost that update (found by a red team; save() refuses NaN weights)
                if stopping or asked or self.step % r.output.save_every == 0 or self.step == r.train.steps:
                    self.save()
                if stopping:
                    stopped, self.stopped_by = True, stop.signal
                    break
        final = None
        if not stopped:
            final = self.evaluate()
            self._write_eval(final)
        else:
            self.log(f"[lowmem-grpo] stopped at step {self.step}; resume with: {self.resume_command}")
        return {"first_eval": first_eval, "final_eval": final, "stopped": stopped, "step": self.step,
                "signal": self.stopped_by}

    @property
    def resume_command(self) -> str:
        return resume_rules.resume_command(self.run_dir, self.world.size)

    def save(self) -> Optional[Path]:
        """A checkpoint of this step, written by process 0 with every process's RNG state (§21); its path
        there, None on the other processes."""
        # Never persist a broken state: resume would start from it.
        if not all(bool(torch.isfinite(p).all()) for p in trainable_parameters(self.model)):
            raise TrainingError(f"step {self.step}: the trainable weights hold NaN/inf; no checkpoint written "
                                f"(last good: {ckpt.latest(self.run_dir)})")
        rng = distributed.gather(ckpt.rng_state(), self.world)
        if not self.world.main:
            return None
        # "fixed": what the checkpoint was made with, checked on resume (recipe.yaml can be edited: a red team's find)
        try:
            record = prompt_record(self.train_set.examples[0])   # (eval checks its prompts against it)
            path = ckpt.save(self.run_dir, self.step, self.model, self.optimizer, self.scheduler,
                             extra={"loop": asdict(self.state), "fixed": fixed_values(self.recipe),
                                    "train_rows": len(self.train_set)},   # (resume.data_change_note)
                             keep_last=self.recipe.output.keep_last, rng=rng,
                             adapter_files={PROMPT_RECORD: record} if record else None)
        except ckpt.CheckpointWriteError as exc:   # a full disk: one clear line, and how to go on
            if not self.run_dir.is_dir():   # deleted or moved mid-run: no space to free (found by a red team)
                raise TrainingError(f"step {self.step}: {exc}") from None
            last = ckpt.latest(self.run_dir)
            raise TrainingError(f"step {self.step}: {exc}. " + (
                f"Free some space there, then resume with: {self.resume_command}" if last
                else "Free some space there and start the run again")) from None
        self.metrics.saved(self.step, path)
        return path

    def close(self) -> None:
        """Release the rollout engine, close the sinks and unlock the run folder (idempotent)."""
        try:
            self.engine.close()
        finally:
            self.metrics.close()
            if self._lock is not None:
                ckpt.unlock_run(self._lock)
                self._lock = None


def _count_optimizer_step(trainer_ref) -> None:
    """The optimizer's step pre-hook: one more step taken by this process (Trainer.optimizer_steps)."""
    trainer = trainer_ref()
    if trainer is not None:
        trainer.optimizer_steps += 1


def no_reward_note(recipe: Recipe, completions, total: torch.Tensor, step: int) -> Optional[str]:
    """What happened and what to do when every completion of step `step` was skipped and some for want of any
    reward (not an environment error: the first of those is logged on its own); None when any was scored."""
    if not len(total) or not bool(torch.isnan(total).all()):
        return None
    failed = [c.env is not None and bool(c.env.error) for c in completions]
    if all(failed):
        return None
    functions = ("rewards.functions is empty" if not recipe.rewards.functions
                 else "no reward function scored them (each returned None)")
    if recipe.environment.name:
        ran = [c for c, bad in zip(completions, failed) if not bad]
        cut = sum(c.truncated for c in ran)
        limits = (f" ({cut} of {len(ran)} episodes were cut by a limit: environment.max_turns, "
                  "environment.max_total_tokens or a turn's generation.max_new_tokens)" if cut else "")
        what = f"the environment {recipe.environment.name!r} gave no reward{limits}, and {functions}"
        fix = ("give the environment a final_reward() (read once when an episode ends, whatever ended it), or "
               "a reward in step() on every turn, not only when done (or raise those limits), or list a reward "
               "function under rewards.functions")
    else:
        what, fix = functions, "check that the reward functions can score these completions (None is a skip)"
    return (f"[lowmem-grpo] step {step}: every completion was skipped for want of any reward: {what}; the step "
            f"learned nothing. To learn, {fix}. (Said once: reward/skipped counts such completions each step.)")
