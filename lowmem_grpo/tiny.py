"""A tiny, locally built model, tokenizer and verifiable task, for the offline quickstart and the tests.

No hub access is possible (or needed): the tokenizer is a character-level `PreTrainedTokenizerFast` and
the model a small Qwen2-architecture causal LM, both saved as ordinary Hugging Face folders, so the
trainer loads them through the same `from_pretrained` code it uses for real models.

The task is two-number addition written as text ("47+38=" -> "85"): the answer is checkable exactly and
a small model learns it partially after a short supervised pass, which leaves room for RL to improve.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

CHARS = list("0123456789+-*=() ")
SPECIAL = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>"}


def build_tokenizer():
    """Character-level fast tokenizer with pad/bos/eos, as a transformers tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(list(SPECIAL.values()) + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL["unk"]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=SPECIAL["pad"], bos_token=SPECIAL["bos"], eos_token=SPECIAL["eos"], unk_token=SPECIAL["unk"],
        padding_side="left",
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

    torch.manual_seed(seed)
    config = Qwen2Config(
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
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


# --- the addition task -------------------------------------------------------------------------------

def addition_rows(n: int, seed: int, lo: int = 0, hi: int = 99) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def split_addition_data(n_train: int = 2000, n_test: int = 200, seed: int = 1234) -> tuple[list[dict], list[dict]]:
    """Disjoint train/held-out problems: held-out prompts never appear in training."""
    rows, seen = [], set()
    for row in addition_rows(20 * (n_train + n_test), seed):
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
        if len(rows) == n_train + n_test:
            break
    return rows[:n_train], rows[n_train:]


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


# --- supervised warm start ---------------------------------------------------------------------------

def sft_batch(tokenizer, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompt+answer+eos with labels only on the answer and eos."""
    seqs, labels = [], []
    for r in rows:
        p = [tokenizer.bos_token_id] + tokenizer.encode(r["prompt"], add_special_tokens=False)
        a = tokenizer.encode(r["answer"], add_special_tokens=False) + [tokenizer.eos_token_id]
        seqs.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])
    lab = torch.tensor([[-100] * (width - len(s)) + s for s in labels])
    att = (torch.arange(width)[None, :] >= torch.tensor([width - len(s) for s in seqs])[:, None]).long()
    return ids, att, lab


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
    """Supervised pass until greedy accuracy on `probe_rows` (a slice of training data, never the held-out
    set) first lands inside `target`. Returns (probe accuracy, steps)."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    acc = 0.0
    for step in range(1, max_steps + 1):
        ids, att, lab = sft_batch(tokenizer, rng.sample(train_rows, batch_size))
        loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % check_every == 0:
            acc = greedy_accuracy(model, tokenizer, probe_rows)
            log(f"  warm-start step {step}: loss {loss.item():.3f}, probe accuracy {100 * acc:.1f}%")
            if acc >= target[0]:
                return acc, step
    return acc, max_steps
