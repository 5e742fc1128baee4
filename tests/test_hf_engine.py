"""The transformers engine decoding in waves (EngineConfig.max_batch_sequences, memory.decode_waves): the same
completions, in the same order with the same prompt_index, as one generate call; and without a cap, or with
one that covers the request, exactly the one call it always made."""

from __future__ import annotations

import pytest
import torch

from lowmem_grpo.model import load_base_model, load_tokenizer
from lowmem_grpo.recipe import ModelConfig
from lowmem_grpo.rollout import make_engine
from lowmem_grpo.rollout.base import EngineConfig, SamplingParams, largest_wave, wave_plan
from lowmem_grpo.rollout.hf import HFEngine

PROMPTS = ["12+7=", "3+4=", "100+250=", "9+9=", "45+6="]   # different lengths: each wave pads differently


@pytest.fixture(scope="module")
def model_tok(tiny_model_dir):
    cfg = ModelConfig(name_or_path=str(tiny_model_dir), compute_dtype="float32", load_in_4bit=False)
    tok = load_tokenizer(cfg)
    return load_base_model(cfg, quantized=False), tok


def _ids(tok):
    return [tok(p)["input_ids"] for p in PROMPTS]


def _calls(monkeypatch, model) -> list:
    """Records (rows of input_ids, num_return_sequences) of every model.generate call."""
    calls, real = [], model.generate

    def recording(*args, **kwargs):
        calls.append((kwargs["input_ids"].shape[0], kwargs["num_return_sequences"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "generate", recording)
    return calls


def _view(completions):
    return [(c.prompt_index, c.token_ids, c.truncated) for c in completions]


def test_greedy_waves_equal_one_call(model_tok, monkeypatch):
    model, tok = model_tok
    params = SamplingParams(n=1, max_new_tokens=6, greedy=True)
    one = HFEngine(model, tok).generate(_ids(tok), params)
    calls = _calls(monkeypatch, model)
    waved = HFEngine(model, tok, max_batch_sequences=2).generate(_ids(tok), params)
    assert calls == [(2, 1), (2, 1), (1, 1)]             # whole prompts, at most 2 sequences a call
    assert [c.prompt_index for c in waved] == list(range(len(PROMPTS)))
    assert _view(waved) == _view(one)
    assert len({tuple(c.token_ids) for c in one}) > 1     # the prompts' completions differ: order is checked


@pytest.mark.parametrize("cap,expected_calls", [(4, [(1, 3)] * 5),                       # n <= cap: one prompt a call
                                                (2, [(1, 2), (1, 1)] * 5),               # n > cap: samples split
                                                (7, [(2, 3), (2, 3), (1, 3)]),           # two prompts a call
                                                (12, [(3, 3), (2, 3)])])                 # 3 + 2 prompts, not 4 + 1
def test_sampled_waves_keep_count_order_and_prompt_index(model_tok, monkeypatch, cap, expected_calls):
    """top_k = 1 makes sampling deterministic through the sampling path (warpers, log-prob recorder): the waves'
    completions must then be one call's, grouped by prompt; at temperature 1 the count and grouping."""
    model, tok = model_tok
    n = 3
    argmax = SamplingParams(n=n, max_new_tokens=6, top_k=1)
    one = HFEngine(model, tok).generate(_ids(tok), argmax)
    calls = _calls(monkeypatch, model)
    engine = HFEngine(model, tok, max_batch_sequences=cap)
    waved = engine.generate(_ids(tok), argmax)
    assert calls == expected_calls
    assert _view(waved) == _view(one)
    assert [c.prompt_index for c in waved] == [i for i in range(len(PROMPTS)) for _ in range(n)]
    assert all(c.logprobs is not None and len(c.logprobs) == len(c.token_ids) for c in waved)
    assert all(abs(lp) < 1e-5 for c in waved for lp in c.logprobs)   # the only token kept: log-prob 0
    torch.manual_seed(0)
    sampled = engine.generate(_ids(tok), SamplingParams(n=n, max_new_tokens=6))
    assert len(sampled) == len(PROMPTS) * n
    assert [c.prompt_index for c in sampled] == [i for i in range(len(PROMPTS)) for _ in range(n)]


def test_one_wave_is_the_one_call_it_always_was(model_tok, monkeypatch):
    """No cap (the default) and a cap that covers the request: one generate call of every prompt with
    num_return_sequences = n, the same RNG draws, so the same sampled completions for a seed."""
    model, tok = model_tok
    params = SamplingParams(n=4, max_new_tokens=6, temperature=1.3)
    calls = _calls(monkeypatch, model)
    runs = []
    for cap in (None, len(PROMPTS) * 4, 1000):
        engine = make_engine(EngineConfig(max_batch_sequences=cap), model, tok)
        assert engine.max_batch_sequences == cap
        torch.manual_seed(11)
        runs.append([(c.prompt_index, c.token_ids, c.logprobs) for c in engine.generate(_ids(tok), params)])
    assert calls == [(len(PROMPTS), 4)] * 3
    assert runs[0] == runs[1] == runs[2]
    torch.manual_seed(11)   # a cap below the request: other calls, other draws (so the comparison above can fail)
    split = HFEngine(model, tok, max_batch_sequences=4).generate(_ids(tok), params)
    assert [(c.prompt_index, c.token_ids, c.logprobs) for c in split] != runs[0]


def test_the_wave_is_vllms_max_num_seqs():
    """vLLM schedules at most max_num_seqs sequences at once (its scheduler splits larger requests, and its KV
    cache is the fixed generation.kv_cache_memory_bytes): the wave maps onto it. Without one, as before."""
    from lowmem_grpo.recipe import recipe_from_dict

    recipe = recipe_from_dict({"model": {"name_or_path": "m"}, "data": {"train_path": "d.jsonl"},
                               "generation": {"engine": "vllm", "num_generations": 8}, "train": {"prompts_per_step": 4}})
    default = EngineConfig.from_recipe(recipe)
    assert (default.max_num_seqs, default.max_batch_sequences) == (64, None)   # max(4 x 8, EVAL_BATCH)
    waved = EngineConfig.from_recipe(recipe, 5)
    assert (waved.max_num_seqs, waved.max_batch_sequences) == (5, 5)


def test_wave_plans_take_the_fewest_calls_made_even():
    """rollout.base.wave_plan, which the engine follows and the memory model prices: every sample of every prompt
    once, in order; no call over the cap; whole prompts when n <= cap; the fewest calls that allows; their sizes
    differ by at most one prompt (or one sample). 8 samples under a cap of 7: 4 + 4, not 7 + 1."""
    assert wave_plan(1, 8, 7) == [(0, 1, 4), (0, 1, 4)] and largest_wave(1, 8, 7) == 4
    assert wave_plan(4, 8, 24) == [(0, 2, 8), (2, 2, 8)]        # 2 + 2 prompts, not 3 + 1
    assert wave_plan(5, 3, None) == wave_plan(5, 3, 15) == [(0, 5, 3)]
    checked = 0
    for prompts in range(1, 9):
        for n in range(1, 11):
            for cap in range(1, prompts * n + 2):
                plan = wave_plan(prompts, n, cap)
                samples = [0] * prompts                               # each prompt's n samples, once
                for first, count, each in plan:
                    for p in range(first, first + count):
                        samples[p] += each
                assert samples == [n] * prompts, (prompts, n, cap, plan)
                starts = [first for first, _, _ in plan]
                assert starts == sorted(starts) and starts[0] == 0   # in prompt order
                assert max(count * each for _, count, each in plan) <= cap or len(plan) == 1
                if len(plan) > 1 and n <= cap:                        # whole prompts, the fewest calls, even
                    assert all(each == n for _, _, each in plan)
                    assert len(plan) == -(-prompts // (cap // n))
                    assert max(c for _, c, _ in plan) - min(c for _, c, _ in plan) <= 1
                elif len(plan) > 1:                                   # each prompt's samples split, even
                    assert all(count == 1 for _, count, _ in plan)
                    assert len(plan) == prompts * -(-n // cap)
                    assert max(e for _, _, e in plan) - min(e for _, _, e in plan) <= 1
                checked += 1
    assert checked > 1000


def test_min_p_cuts_as_recipes_ask_and_the_models_own_setting_does_not(model_tok):
    """generation.min_p: at 1.0 only the most likely token survives (the draws equal top_k = 1's, each log-prob 0);
    a min_p in the model's own generation config is switched off like its temperature and top-k, so the
    recipe's settings alone decide the draws and the recorded log-probs."""
    model, tok = model_tok
    engine = HFEngine(model, tok)
    torch.manual_seed(0)
    top1 = engine.generate(_ids(tok), SamplingParams(n=2, max_new_tokens=6, top_k=1))
    torch.manual_seed(0)
    minp = engine.generate(_ids(tok), SamplingParams(n=2, max_new_tokens=6, min_p=1.0))
    assert _view(minp) == _view(top1) and all(abs(lp) < 1e-5 for c in minp for lp in c.logprobs)
    params = SamplingParams(n=3, max_new_tokens=6, temperature=1.5)
    torch.manual_seed(5)
    plain = [(c.token_ids, c.logprobs) for c in engine.generate(_ids(tok), params)]
    greedy = SamplingParams(n=1, max_new_tokens=6, greedy=True)
    plain_greedy = _view(engine.generate(_ids(tok), greedy))
    # what a model's generation_config.json may hold (Qwen2.5-Instruct: repetition_penalty 1.05-1.1)
    own = dict(min_p=1.0, repetition_penalty=3.0, no_repeat_ngram_size=1, min_new_tokens=6, typical_p=0.2,
               epsilon_cutoff=0.5, suppress_tokens=[tok.eos_token_id])
    saved = {k: getattr(model.generation_config, k) for k in own}
    try:
        for k, v in own.items():
            setattr(model.generation_config, k, v)
        torch.manual_seed(5)
        assert [(c.token_ids, c.logprobs) for c in engine.generate(_ids(tok), params)] == plain
        assert _view(engine.generate(_ids(tok), greedy)) == plain_greedy
    finally:
        for k, v in saved.items():
            setattr(model.generation_config, k, v)
    assert len({tuple(t) for t, _ in plain}) > len(PROMPTS)   # sampled: a min_p of 1 would have made them argmax


def _penalised_log_probs(model, seq: list, penalty: float) -> torch.Tensor:
    """The next token's log-probs after `seq` with transformers' repetition penalty, written out: a token already
    in `seq` has its logit divided by the penalty when positive, multiplied when negative."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq])).logits[0, -1].double()
    for t in set(seq):
        logits[t] = logits[t] / penalty if logits[t] > 0 else logits[t] * penalty
    return torch.log_softmax(logits, -1)


def test_repetition_penalty_is_the_recipes_and_reaches_the_recorded_log_probs(model_tok):
    """generation.repetition_penalty, as transformers defines it (every token of the prompt and the completion so
    far): greedy decoding follows the penalised logits, and a sample's recorded log-probs are the penalised
    distribution's (what algorithm.sampler_correction compares with the trainer's)."""
    model, tok = model_tok
    engine = HFEngine(model, tok)
    ids, penalty = _ids(tok), 2.0
    greedy = engine.generate(ids, SamplingParams(n=1, max_new_tokens=6, greedy=True, repetition_penalty=penalty))
    plain = engine.generate(ids, SamplingParams(n=1, max_new_tokens=6, greedy=True))
    assert _view(greedy) != _view(plain)
    for c in greedy:
        seq = list(ids[c.prompt_index])
        for t in c.token_ids:
            assert t == int(_penalised_log_probs(model, seq, penalty).argmax())
            seq.append(t)
    torch.manual_seed(1)
    sampled = engine.generate(ids[:2], SamplingParams(n=2, max_new_tokens=6, repetition_penalty=penalty))
    for c in sampled:
        seq = list(ids[c.prompt_index])
        for t, lp in zip(c.token_ids, c.logprobs):
            assert abs(lp - _penalised_log_probs(model, seq, penalty)[t].item()) < 1e-4
            seq.append(t)


def test_a_completion_ends_at_any_eos_the_models_generation_config_lists(model_tok, monkeypatch):
    """Instruct models end a turn with a token the tokenizer may not call EOS (Gemma's <end_of_turn>, Phi-3's
    <|end|>); their generation_config.json lists it. Greedy decoding that emits token t (not the tokenizer's
    EOS) runs on to max_new_tokens, truncated; with t listed it ends there, not truncated, as with EOS."""
    from lowmem_grpo.model import stop_token_ids
    from lowmem_grpo.rollout.hf import _cut

    model, tok = model_tok
    params = SamplingParams(n=1, max_new_tokens=8, greedy=True)
    runs = HFEngine(model, tok).generate(_ids(tok), params)
    i, before = next((i, c) for i, c in enumerate(runs) if c.truncated)   # a prompt whose greedy text has no EOS
    prompts = _ids(tok)[i: i + 1]
    t = before.token_ids[2]
    k = before.token_ids.index(t)
    monkeypatch.setattr(model.generation_config, "eos_token_id", [tok.eos_token_id, t])
    assert stop_token_ids(model, tok) == (tok.eos_token_id, t)
    after = HFEngine(model, tok).generate(prompts, params)[0]
    assert after.token_ids == before.token_ids[: k + 1] and not after.truncated
    # the cut is at the first of the ids, and a stop string after it does not count
    assert _cut([5, 7, 9, 7], (9, 7), (4, "x")) == ([5, 7], False, None)
    assert _cut([5, 6], (9, 7), None) == ([5, 6], True, None)


def test_the_engine_says_how_many_tokens_its_model_takes(tiny_model_dir):
    """rollout/turns.py ends an episode where the model's context does: the transformers engine reads it from the
    model's config (max_position_embeddings)."""
    from lowmem_grpo.recipe import ModelConfig
    from lowmem_grpo.rollout.hf import HFEngine
    from lowmem_grpo.model import load_base_model, load_tokenizer

    cfg = ModelConfig(name_or_path=str(tiny_model_dir), compute_dtype="float32")
    model = load_base_model(cfg, quantized=False)
    assert HFEngine(model, load_tokenizer(cfg)).context_tokens() == model.config.max_position_embeddings > 0


def test_min_p_comes_before_top_k_and_top_p_as_in_vllm():
    """Found by a red team: min-p applied after top-p (transformers' order) keeps other tokens than vLLM, which
    applies it right after temperature, so the engines sampled different distributions with the same recipe. Here
    p = [.5, .2, .15, .15], min_p .35, top_p .6: min-p first keeps {0, 1} (renormalised .714, .286), and top-p then
    keeps {0}; top-p first would keep {0, 1} and min-p (threshold .25) both of them."""
    from functools import partial

    from lowmem_grpo.rollout.hf import _warpers

    params_of = partial(SamplingParams, n=1, max_new_tokens=1)
    scores = torch.tensor([[0.5, 0.2, 0.15, 0.15]]).log()
    for params, kept in ((params_of(min_p=0.35, top_p=0.6), [0]),
                         (params_of(min_p=0.35, top_k=3), [0, 1]),          # top-k after min-p: nothing more
                         (params_of(min_p=0.2, top_k=2, top_p=0.8), [0, 1])):
        out = scores.clone()
        for warper in _warpers(params):
            out = warper(torch.zeros(1, 1, dtype=torch.long), out)
        assert torch.isfinite(out[0]).nonzero().flatten().tolist() == kept, params
    # temperature comes first: at T = 2 the min-p cut .35 x max sees flatter probabilities and keeps more
    out = scores.clone()
    for warper in _warpers(params_of(temperature=2.0, min_p=0.35)):
        out = warper(torch.zeros(1, 1, dtype=torch.long), out)
    flat = torch.softmax(scores / 2, -1)[0]
    assert torch.isfinite(out[0]).tolist() == (flat >= 0.35 * flat.max()).tolist() == [True] * 4


def _byte_level_tokenizer():
    """A byte-level BPE tokenizer with no merges (GPT-2/Qwen/Llama-3 style, one token per byte): a character takes
    one to four tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                             merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=t)


@pytest.mark.parametrize("stop", ["</answer>", "答案：", "。。。。", "🙂🙂🙂"])
def test_a_stop_string_of_more_tokens_than_characters_ends_the_row_where_it_is_completed(stop):
    """Found by a red team: the stop-string window was 2 x characters + 4 tokens, too few for "🙂🙂🙂" in a
    byte-level tokenizer (3 characters, 12 tokens), which then never ended its row (vLLM's detokenizer matches
    it). Fed the tokens one generate step at a time, the row ends at the token that completes the string."""
    from lowmem_grpo.rollout.hf import _StopStrings

    tok = _byte_level_tokenizer()
    head = tok("abc", add_special_tokens=False)["input_ids"]
    ids = head + tok(stop, add_special_tokens=False)["input_ids"] + head
    assert tok.decode(ids) == "abc" + stop + "abc"
    prompt = [7, 8]
    crit = _StopStrings(tok, ("zz", stop), prompt_width=len(prompt))
    ends = [k for k in range(1, len(ids) + 1) if crit(torch.tensor([prompt + ids[:k]]), None)[0]]
    done = len(tok("abc" + stop, add_special_tokens=False)["input_ids"])
    assert ends[0] == done and crit.ended == {0: (done, stop)}


def test_a_row_ends_at_the_models_context_as_vllm_ends_it(model_tok, monkeypatch):
    """generate decoded past the model's positions when a prompt + max_new_tokens did not fit (a red team): each
    row now ends where the context does, truncated, as vLLM ends it; rows with room are as they were."""
    model, tok = model_tok
    prompts = [tok("1+1=")["input_ids"], tok("100+250=")["input_ids"]]
    eos_never = SamplingParams(n=2, max_new_tokens=12, temperature=1.0)
    monkeypatch.setattr("lowmem_grpo.rollout.hf.stop_token_ids", lambda *a: ())   # rows run to their limit
    torch.manual_seed(0)
    free = HFEngine(model, tok).generate(prompts, eos_never)
    assert [len(c.token_ids) for c in free] == [12] * 4 and all(c.truncated for c in free)
    context = len(prompts[1]) + 5   # the longer prompt has room for 5 tokens, the shorter for more
    room = context - len(prompts[0])
    assert 5 < room < 12
    monkeypatch.setattr(HFEngine, "context_tokens", lambda self: context)
    torch.manual_seed(0)
    cut = HFEngine(model, tok).generate(prompts, eos_never)
    assert [len(c.token_ids) for c in cut] == [room, room, 5, 5] and all(c.truncated for c in cut)
    assert [c.token_ids for c in cut[:2]] == [c.token_ids[:room] for c in free[:2]]   # the same draws, cut
    assert all(len(c.logprobs) == len(c.token_ids) for c in cut)
    assert all(len(prompts[c.prompt_index]) + len(c.token_ids) <= context for c in cut)
