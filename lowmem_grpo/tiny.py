"""A tiny, locally built model, tokenizer and verifiable task, for the offline quickstart and the tests.

No hub access is possible (or needed): the tokenizer is a character-level `PreTrainedTokenizerFast` and
the model a small Qwen2-architecture causal LM, both saved as ordinary Hugging Face folders, so the
trainer loads them through the same `from_pretrained` code it uses for real models.

The task is two-number addition written as text ("47+38=" -> "85"): the answer is checkable exactly and
a small model learns it partially after a short supervised pass, which leaves room for RL to improve.
"""

from __future__ import annotations

import json
import operator
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

CHARS = list("0123456789+-*=() ")
SPECIAL = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>"}


def build_tokenizer():
    """Character-level fast tokenizer with pad/bos/eos, as a transformers tokenizer. It covers CHARS alone (the
    addition task's digits and `+-*=() `): other text, letters and newlines included, is <unk> here and, loaded
    back from a saved folder, no tokens at all. An environment experiment needs a tokenizer that covers its
    observations' text, or the model never sees them (rollout/turns.py warns once): build_tool_tokenizer (printable
    ASCII and newline) for the tiny model."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(list(SPECIAL.values()) + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL["unk"]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=SPECIAL["pad"], bos_token=SPECIAL["bos"], eos_token=SPECIAL["eos"], unk_token=SPECIAL["unk"],
        padding_side="left", add_bos_token=True,   # tokenizer(text) starts with BOS, as Llama's does
    )


@dataclass
class TinyModelSpec:
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 64
    vocab_size: int | None = None  # None: the tokenizer's size (tests may ask for a larger one)
    tie_word_embeddings: bool = False


def build_model(tokenizer, spec: TinyModelSpec = TinyModelSpec(), seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _build(Qwen2Config, Qwen2ForCausalLM, tokenizer, spec, seed)


def _build(config_cls, model_cls, tokenizer, spec: TinyModelSpec, seed: int, **extra):
    """A randomly initialised model of `spec`'s sizes, its token ids and generation config the tokenizer's."""
    torch.manual_seed(seed)
    config = config_cls(
        vocab_size=spec.vocab_size or len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **extra,
    )
    model = model_cls(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


# --- the addition task -------------------------------------------------------------------------------

def addition_rows(n: int, seed: int, lo: int = 0, hi: int = 99) -> list[dict]:
    return _arithmetic_rows("+", operator.add, n, seed, lo, hi)


def _arithmetic_rows(sign: str, op, n: int, seed: int, lo: int, hi: int) -> list[dict]:
    """n seeded problems "a<sign>b=" with a, b in [lo, hi] and the answer op(a, b)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        rows.append({"prompt": f"{a}{sign}{b}=", "answer": str(op(a, b))})
    return rows


def split_addition_data(n_train: int = 2000, n_test: int = 200, seed: int = 1234) -> tuple[list[dict], list[dict]]:
    """Disjoint train/held-out problems: held-out prompts never appear in training."""
    return _disjoint_split(addition_rows(20 * (n_train + n_test), seed), n_train, n_test)


def warm_start_split(exclude: list[dict], n_probe: int = 200, seed: int = 0, lo: int = 0,
                     hi: int = 99) -> tuple[list[dict], list[dict]]:
    """(pool, probe) for the quickstart's warm start: every addition problem on [lo, hi] but those of `exclude`
    (the held-out and the GRPO training problems), shuffled, the first n_probe of them the probe and the rest the
    supervised pool. The probe then measures what the model has learned of addition, not what it remembers, and
    GRPO trains on problems the warm start never saw. With the 2,000 GRPO training rows as both pool and probe, the
    probe read 30% on an AMX machine where the held-out set read 16.5%, and GRPO from that memorising base gained 4
    points (docs/benchmarks.md, quickstart)."""
    held = {r["prompt"] for r in exclude}
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(lo, hi + 1) for b in range(lo, hi + 1)
            if f"{a}+{b}=" not in held]
    random.Random(seed).shuffle(rows)
    return rows[n_probe:], rows[:n_probe]


def _disjoint_split(rows: list[dict], n_train: int, n_test: int) -> tuple[list[dict], list[dict]]:
    """The first n_train + n_test distinct prompts of `rows`, split in order: no held-out prompt is trained on."""
    out, seen = [], set()
    for row in rows:
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            out.append(row)
        if len(out) == n_train + n_test:
            break
    return out[:n_train], out[n_train:]


def write_jsonl(rows: list[dict], path) -> None:
    path = Path(path)   # (a str too)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


# --- supervised warm start ---------------------------------------------------------------------------

def sft_batch(tokenizer, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded bos + prompt + answer + eos with labels only on the answer and eos."""
    return segments_batch(tokenizer, [[(r["prompt"], False), (r["answer"], True)] for r in rows])


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int = 5, batch_size: int = 256) -> float:
    """Exact-match accuracy of greedy completions (the number before EOS) on rows."""
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        enc = tokenizer([tokenizer.bos_token + r["prompt"] for r in chunk], return_tensors="pt",
                        padding=True, add_special_tokens=False)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        correct += sum(t.strip() == r["answer"] for t, r in zip(texts, chunk))
    model.train(was_training)
    return correct / max(1, len(rows))


def warm_start(model, tokenizer, train_rows, probe_rows, target=(0.15, 0.40), lr=3e-3, batch_size=64,
               max_steps=4000, check_every=25, seed=0, log=print) -> tuple[float, int]:
    """Supervised pass on `train_rows` until greedy accuracy on `probe_rows` (problems it never trains on, and
    never the held-out set: warm_start_split) first lands inside `target`. Returns (probe accuracy, steps). The rate decays linearly to 0 over
    max_steps: at a constant 3e-3 the probe's accuracy swung by 10 points between checks, so where it first
    crossed the band, and the base the quickstart's GRPO starts from, depended on the CPU's float rounding
    (an AVX2 machine ended 4,000 steps at 17% held-out where an earlier one had stopped at 26.5%)."""
    rng = random.Random(seed)
    acc = 0.0

    def done(step: int, loss: float) -> bool:
        nonlocal acc
        acc = greedy_accuracy(model, tokenizer, probe_rows)
        log(f"  warm-start step {step}: loss {loss:.3f}, probe accuracy {100 * acc:.1f}%")
        return acc >= target[0]

    steps = _supervised(model, lambda: sft_batch(tokenizer, rng.sample(train_rows, batch_size)), done, lr, max_steps,
                        check_every, decay=True)
    return acc, steps


def _supervised(model, next_batch, done, lr: float, max_steps: int, check_every: int, decay: bool = False) -> int:
    """AdamW steps (gradients clipped to norm 1) on next_batch()'s (ids, attention mask, labels) until
    done(step, loss), asked every check_every steps, says so; the number of steps taken. decay: the rate falls
    linearly to 0 at max_steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / max_steps if decay else 1.0)
    model.train()
    for step in range(1, max_steps + 1):
        ids, att, lab = next_batch()
        loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        if step % check_every == 0 and done(step, loss.item()):
            return step
    return max_steps


# --- the tool-use task: 3-digit products, with the built-in python tool (scripts/tool_demo.py) ----------------
#
# A completion either answers directly ("123*456=" -> "56088") or hands the product to the tool:
#
#     <python>print(123*456)</python>          the model's first turn, ending at the tool's stop string
#     \n<output>\n56088\n</output>\n           the environment's observation (environment.py's PythonTool, through
#                                              the default observation_template): context, never trained
#     56088                                    the model's second turn: the number copied from the output
#
# A 2-layer model cannot multiply 3-digit numbers in its head, but it can learn to copy digits.

TOOL_CHARS = CHARS + [c for c in (chr(i) for i in range(32, 127)) if c not in CHARS] + ["\n"]
TOOL_OPEN, TOOL_CLOSE = "<python>", "</python>"
OUTPUT_CLOSE = "</output>"
# Whole-word tokens for the tool's markup (as a real tokenizer has for its tool tags): shorter sequences, so a
# faster demo on CPU. Any other text is one token per character.
TOOL_WORDS = [TOOL_OPEN, TOOL_CLOSE, "<output>", OUTPUT_CLOSE, "print("]


def build_tool_tokenizer():
    """A fast tokenizer like build_tokenizer, one token per character over printable ASCII and newline (enough
    for the tool's error messages too), plus one token for each of TOOL_WORDS."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(list(SPECIAL.values()) + TOOL_CHARS + TOOL_WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL["unk"]))
    words = "|".join(w.replace("(", "\\(") for w in TOOL_WORDS)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(words + r"|[\s\S]"), behavior="isolated")   # "\n" too
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=SPECIAL["pad"], bos_token=SPECIAL["bos"], eos_token=SPECIAL["eos"], unk_token=SPECIAL["unk"],
        padding_side="left", add_bos_token=True,   # tokenizer(text) starts with BOS, as Llama's does
    )


def build_tool_model(tokenizer, spec: TinyModelSpec = TinyModelSpec(max_position_embeddings=128), seed: int = 0):
    """build_model's network (same sizes, with attention biases), as a Llama-architecture model. Why not
    Qwen2: transformers' AutoTokenizer loads a folder whose config says qwen2 as Qwen2's byte-level BPE,
    rebuilt from the vocabulary, which drops "\n" and " " and splits the tool tags; with a Llama config it loads
    build_tool_tokenizer's folder as it was saved."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _build(LlamaConfig, LlamaForCausalLM, tokenizer, spec, seed, attention_bias=True, rms_norm_eps=1e-6)


def product_rows(n: int, seed: int, lo: int = 100, hi: int = 999) -> list[dict]:
    return _arithmetic_rows("*", operator.mul, n, seed, lo, hi)


def split_product_data(n_train: int = 4000, n_test: int = 200, seed: int = 4321) -> tuple[list[dict], list[dict]]:
    """Disjoint train/held-out 3-digit products: held-out prompts never appear in training."""
    return _disjoint_split(product_rows(4 * (n_train + n_test), seed), n_train, n_test)


def tool_call(prompt: str) -> str:
    """The model's tool call for a product prompt "123*456=": <python>print(123*456)</python>."""
    return f"{TOOL_OPEN}print({prompt.rstrip('=')}){TOOL_CLOSE}"


def tool_observation(output: str) -> str:
    """What the environment appends after a call whose run printed `output` (a line): PythonTool's observation
    through the default observation_template ("\\n{observation}\\n")."""
    return f"\n<output>\n{output}\n{OUTPUT_CLOSE}\n"


def prefers_tool(prompt: str) -> bool:
    """The warm start's habit: it calls the tool on products whose first factor starts with 1, 2 or 3 (about a
    third of them), and guesses the rest (but for a small share, see tool_sft_rows)."""
    return prompt[0] in "123"


def tool_sft_rows(rows: list[dict], seed: int = 0, other_share: float = 0.1) -> list[list[tuple[str, bool]]]:
    """Supervised examples as segments (text, trained): the prompt (context), then either a direct answer (the
    true product, trained) or a tool call (trained), the tool's observation (context: environment text is never
    trained, as in GRPO) and the copied number (trained). Tool use on prefers_tool's prompts, and on a random
    `other_share` of the others, so that sampling still calls the tool there now and then."""
    rng = random.Random(seed)
    out = []
    for r in rows:
        if prefers_tool(r["prompt"]) or rng.random() < other_share:
            out.append([(r["prompt"], False), (tool_call(r["prompt"]), True),
                        (tool_observation(r["answer"]), False), (r["answer"], True)])
        else:
            out.append([(r["prompt"], False), (r["answer"], True)])
    return out


def segments_batch(tokenizer, examples: list[list[tuple[str, bool]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded bos + segments + eos, labels on the trained segments and on eos."""
    seqs, labels = [], []
    for segs in examples:
        ids, lab = [tokenizer.bos_token_id], [-100]
        for text, trained in segs:
            t = tokenizer.encode(text, add_special_tokens=False)
            ids += t
            lab += t if trained else [-100] * len(t)
        ids.append(tokenizer.eos_token_id)
        lab.append(tokenizer.eos_token_id)
        seqs.append(ids)
        labels.append(lab)
    width = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])
    lab = torch.tensor([[-100] * (width - len(s)) + s for s in labels])
    att = (torch.arange(width)[None, :] >= torch.tensor([width - len(s) for s in seqs])[:, None]).long()
    return ids, att, lab


def final_answer(text: str) -> str:
    """The completion's answer: its text after the last tool output (or after the last call when no output
    came back), stripped. The tool's own output is never read as the answer: the model must copy it."""
    for marker in (OUTPUT_CLOSE, TOOL_CLOSE):
        if marker in text:
            return text.rsplit(marker, 1)[1].strip()
    return text.strip()


def tool_answer_reward(completions: list[str], *, prompts: list[str], rows: list[dict]) -> list[float]:
    """1.0 when final_answer(completion) is exactly the row's answer, else 0.0 (as 'lowmem_grpo.tiny:tool_answer_reward')."""
    return [float(final_answer(c) == str(r["answer"])) for c, r in zip(completions, rows)]


def is_tool_call(text: str) -> bool:
    """The completion holds a complete <python>...</python> call (whether or not a tool ran it)."""
    return TOOL_OPEN in text and TOOL_CLOSE in text.split(TOOL_OPEN, 1)[1]


def simulated_tool(turn: str) -> str:
    """The observation for warm-start probes, without the sandbox: print(A*B) of two integers is computed
    here (in-process, no code run); anything else gives an error line."""
    import re

    m = re.fullmatch(r"[\s\S]*<python>print\((\d{1,4})\*(\d{1,4})\)</python>", turn)
    return tool_observation(str(int(m.group(1)) * int(m.group(2))) if m else "error")


@torch.no_grad()
def _greedy_until(model, tokenizer, texts: list[str], max_new_tokens: int, stop: Optional[str] = None) -> list[str]:
    enc = tokenizer([tokenizer.bos_token + t for t in texts], return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    new = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    if stop is not None:
        new = [t.split(stop, 1)[0] + stop if stop in t else t for t in new]
    return new


def greedy_tool_eval(model, tokenizer, rows: list[dict], max_new_tokens: int = 40, batch_size: int = 256) -> dict:
    """Greedy two-turn episodes on rows with simulated_tool standing in for the sandbox (a quick probe for the
    warm start; the demo's figures come from the trainer's eval with the real tool): accuracy, tool_call_rate,
    and tool_accuracy (accuracy where the tool was called)."""
    was_training = model.training
    model.eval()
    correct = calls = tool_correct = 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        first = _greedy_until(model, tokenizer, [r["prompt"] for r in chunk], max_new_tokens, stop=TOOL_CLOSE)
        called = [j for j, t in enumerate(first) if t.endswith(TOOL_CLOSE)]
        texts = list(first)
        if called:
            ctx = [chunk[j]["prompt"] + first[j] + simulated_tool(first[j]) for j in called]
            second = _greedy_until(model, tokenizer, ctx, 10)
            for j, s in zip(called, second):
                texts[j] = first[j] + simulated_tool(first[j]) + s
        for j, (t, r) in enumerate(zip(texts, chunk)):
            ok = final_answer(t) == r["answer"]
            correct += ok
            if j in called:
                calls += 1
                tool_correct += ok
    model.train(was_training)
    n = max(1, len(rows))
    return {"accuracy": correct / n, "tool_call_rate": calls / n, "tool_accuracy": tool_correct / max(1, calls)}


def warm_start_tool(model, tokenizer, train_rows, probe_rows, rate_band=(0.2, 0.45), min_tool_accuracy=0.9,
                    other_share=0.1, lr=3e-3, batch_size=32, max_steps=4000, check_every=50, seed=0,
                    log=print) -> tuple[dict, int]:
    """Supervised pass on tool_sft_rows until, on `probe_rows` (training problems, never the held-out set), the
    greedy tool-call rate lies in `rate_band` and the calls it makes end in the right number at least
    `min_tool_accuracy` of the time. Returns (the probe's greedy_tool_eval, steps)."""
    rng = random.Random(seed)
    examples = tool_sft_rows(train_rows, seed=seed, other_share=other_share)
    probe = {"accuracy": 0.0, "tool_call_rate": 0.0, "tool_accuracy": 0.0}

    def done(step: int, loss: float) -> bool:
        nonlocal probe
        probe = greedy_tool_eval(model, tokenizer, probe_rows)
        log(f"  warm-start step {step}: loss {loss:.3f}, probe accuracy {100 * probe['accuracy']:.1f}%, "
            f"tool calls {100 * probe['tool_call_rate']:.1f}% ({100 * probe['tool_accuracy']:.1f}% of them right)")
        return rate_band[0] <= probe["tool_call_rate"] <= rate_band[1] and probe["tool_accuracy"] >= min_tool_accuracy

    steps = _supervised(model, lambda: segments_batch(tokenizer, rng.sample(examples, batch_size)), done, lr,
                        max_steps, check_every)
    return probe, steps


# -- tiny random models of the decoder families a hobbyist trains (tests/test_architectures.py, scripts/arch_sweep.py)

ARCH_SIZES = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0)
# Scaled and soft-capped heads get their transform switched on (with a cap low enough to bend these logits)
ARCH_EXTRA = {"gemma2": dict(final_logit_softcapping=2.0), "gemma3_text": dict(final_logit_softcapping=2.0, sliding_window=8),
              "granite": dict(logits_scaling=0.25), "cohere": dict(logit_scale=4.0),
              "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)}
ARCH_UNSET = {"falcon": ("head_dim", "intermediate_size", "num_key_value_heads")}   # Falcon derives or lacks these
ARCH_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
                "qwen3_moe": "Qwen3MoeConfig", "phi3": "Phi3Config", "phi": "PhiConfig", "gemma": "GemmaConfig",
                "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig", "olmo2": "Olmo2Config",
                "granite": "GraniteConfig", "cohere": "CohereConfig", "smollm3": "SmolLM3Config",
                "stablelm": "StableLmConfig", "starcoder2": "Starcoder2Config", "gpt_neox": "GPTNeoXConfig",
                "exaone4": "Exaone4Config", "glm4": "Glm4Config", "falcon": "FalconConfig"}


def build_arch_model(kind: str, seed: int = 0, **sizes):
    """A random `kind` causal LM of ARCH_SIZES (updated by `sizes`), its head scaled up tenfold so that the
    logits are large enough for a scale or soft-cap to matter."""
    import transformers

    values = {**ARCH_SIZES, **ARCH_EXTRA.get(kind, {}), **sizes}
    config = getattr(transformers, ARCH_CLASSES[kind])(**{k: v for k, v in values.items()
                                                            if k not in ARCH_UNSET.get(kind, ())})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(10)
    return model


def save_arch_model(kind: str, path: Path, **sizes) -> Path:
    """build_arch_model with the char tokenizer's ids (vocab_size: at least its tokens), saved as a model folder."""
    tok = build_tokenizer()
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = build_arch_model(kind, **{"vocab_size": len(tok), **ids, **sizes})
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


# Tiny mixtures of experts in transformers 5's three layouts (tests/test_memory.py, tests/test_experts4bit.py):
# Qwen3-MoE with a dense layer among the MoE ones (mlp_only_layers), Qwen2-MoE with a shared expert and its gate,
# Mixtral (every layer MoE, intermediate_size is the expert's width).
MOE_LAYOUTS = {"Qwen3MoeConfig": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1]),
               "Qwen2MoeConfig": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=48),
               "MixtralConfig": dict(num_local_experts=4, num_experts_per_tok=2)}


def save_moe_model(cls: str, path: Path, **sizes) -> Path:
    """A random 3-layer mixture of MOE_LAYOUTS[cls] (updated by `sizes`) with the char tokenizer, saved in bf16."""
    import transformers

    tok = build_tokenizer()
    values = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=2200, pad_token_id=tok.pad_token_id,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **MOE_LAYOUTS[cls])
    torch.manual_seed(0)
    config = getattr(transformers, cls)(**{**values, **sizes})
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path)
    tok.save_pretrained(path)
    return path
