"""bf16 autocast for the decoder's training passes (model.autocast, docs/algorithm.md §24), on CPU: log-probs and
LoRA gradients as close to a float64 evaluation of the same weights as without autocast, no fp32 copy of a LoRA
input kept for backward, the grad and no-grad passes equal (an on-policy ratio of exactly 1), the trainer's
rule, and the memory model's term against its formula. The CUDA figures are tests/gpu and scripts/gpu_check.py."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from lowmem_grpo import memory as mm
from lowmem_grpo import tiny
from lowmem_grpo.batch import completion_logprobs, pack
from lowmem_grpo.loss import aggregate
from lowmem_grpo.model import hidden_states, load_policy
from lowmem_grpo.recipe import LoraConfig, ModelConfig, recipe_from_dict

from conftest import QUIET, recipe_dict

SPEC = tiny.TinyModelSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("autocast_model")
    tok = tiny.build_tokenizer()
    tiny.build_model(tok, SPEC, seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def bf16_policy(model_dir, four_bit=False, checkpointing=True):
    """The trainer's load in bf16 (base bf16 or NF4, LoRA fp32), with a non-zero LoRA B so both factors get
    gradients and the branch changes the log-probs."""
    model, tok = load_policy(ModelConfig(name_or_path=str(model_dir), compute_dtype="bfloat16", load_in_4bit=four_bit,
                                         gradient_checkpointing=checkpointing), LoraConfig(r=8, alpha=16))
    g = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.05
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    model.train()
    return model, tok


def micro_batch(tok, rows=4, length=24):
    g = torch.Generator().manual_seed(1)
    completions = [torch.randint(4, len(tok), (length,), generator=g).tolist() for _ in range(rows)]
    return pack([[5, 6, 7]] * rows, completions, torch.tensor([1.0, -1.0, 0.5, -0.5][:rows]), rows, "token_mean",
                length, tok.pad_token_id)[0]


def logprobs_and_grads(model, mb, autocast):
    model.zero_grad(set_to_none=True)
    logp = completion_logprobs(model, mb, 1.0, 1024, 8192, autocast=autocast)
    aggregate(logp, mb.weights).backward()
    grads = torch.cat([p.grad.double().flatten() for _, p in sorted(model.named_parameters()) if p.grad is not None])
    return logp.detach().double(), grads


def test_autocast_is_as_close_to_float64_as_the_plain_bf16_path(model_dir):
    """The reference is the same weights (bf16 base values, fp32 LoRA) evaluated in float64. Autocast moves the
    LoRA matmuls to bf16; its log-probs and gradients must stay within bf16's error of that reference, no further
    from it than twice the plain path's error."""
    model, tok = bf16_policy(model_dir)
    mb = micro_batch(tok)
    ref_logp, ref_grads = logprobs_and_grads(copy.deepcopy(model).double(), mb, None)
    plain_logp, plain_grads = logprobs_and_grads(model, mb, None)
    mixed_logp, mixed_grads = logprobs_and_grads(model, mb, torch.bfloat16)

    def errors(logp, grads):
        return (logp - ref_logp).abs().max().item(), ((grads - ref_grads).norm() / ref_grads.norm()).item()

    (plain_lp, plain_g), (mixed_lp, mixed_g) = errors(plain_logp, plain_grads), errors(mixed_logp, mixed_grads)
    print(f"vs float64: plain bf16 log-prob {plain_lp:.2e}, grad {plain_g:.2e}; "
          f"autocast {mixed_lp:.2e}, grad {mixed_g:.2e}")
    assert not torch.equal(mixed_logp, plain_logp)    # autocast took effect
    assert mixed_lp < 1e-2 and mixed_g < 2e-2         # bf16's error (8 mantissa bits), not a different function
    assert mixed_lp <= 2 * plain_lp + 1e-4 and mixed_g <= 2 * plain_g + 1e-4


def test_autocast_runs_on_the_4bit_base(model_dir):
    """The NF4 base (bitsandbytes' CPU path) under autocast: finite, and within bf16's error of the plain path."""
    model, tok = bf16_policy(model_dir, four_bit=True)
    mb = micro_batch(tok)
    plain_logp, plain_grads = logprobs_and_grads(model, mb, None)
    mixed_logp, mixed_grads = logprobs_and_grads(model, mb, torch.bfloat16)
    assert torch.isfinite(mixed_logp).all() and torch.isfinite(mixed_grads).all()
    assert (mixed_logp - plain_logp).abs().max() < 1e-2
    assert (mixed_grads - plain_grads).norm() / plain_grads.norm() < 2e-2


def test_the_grad_and_no_grad_passes_agree_under_autocast(model_dir):
    """The old-policy / reference passes (no grad) and the update pass (grad, checkpointed) run the same
    numerics, so an on-policy importance ratio is exactly 1."""
    model, tok = bf16_policy(model_dir)
    mb = micro_batch(tok)
    with torch.no_grad():
        old = completion_logprobs(model, mb, 1.0, 1024, 8192, autocast=torch.bfloat16)
    new = completion_logprobs(model, mb, 1.0, 1024, 8192, autocast=torch.bfloat16)
    assert torch.equal(old, new.detach())


def test_offload_under_autocast_gives_the_same_gradients(model_dir, monkeypatch):
    """Activation offload (§22) through its host-copy path, as a GPU run takes it, with the decoder under
    autocast: the bf16 layer inputs come back as they went, so the gradients are bit for bit those without it."""
    from lowmem_grpo.offload import ActivationOffload

    model, tok = bf16_policy(model_dir)
    mb = micro_batch(tok)
    plain_logp, plain_grads = logprobs_and_grads(model, mb, torch.bfloat16)
    taken = []

    def forced(m):
        off = ActivationOffload(m, min_bytes=1, copy_host_tensors=True)
        taken.append(off)
        return off

    monkeypatch.setattr("lowmem_grpo.batch.ActivationOffload", forced)
    model.zero_grad(set_to_none=True)
    logp = completion_logprobs(model, mb, 1.0, 1024, 8192, offload=True, autocast=torch.bfloat16)
    aggregate(logp, mb.weights).backward()
    grads = torch.cat([p.grad.double().flatten() for _, p in sorted(model.named_parameters()) if p.grad is not None])
    assert taken and taken[0].offloaded_bytes > 0
    assert torch.equal(logp.detach().double(), plain_logp) and torch.equal(grads, plain_grads)


def saved_copies(model, ids, autocast: bool) -> Counter:
    """(width, dtype) of the distinct [tokens x width] tensors autograd saves for backward, width hidden or
    intermediate (checkpointing off, so every layer's saved tensors are seen)."""
    h, i, n = SPEC.hidden_size, SPEC.intermediate_size, ids.numel()
    seen, storages = Counter(), set()

    def pack_hook(x):
        if x.is_floating_point() and x.shape[-1] in (h, i) and x.numel() == n * x.shape[-1]:
            if x.untyped_storage().data_ptr() not in storages:
                storages.add(x.untyped_storage().data_ptr())
                seen[(x.shape[-1], x.dtype)] += 1
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda x: x), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        hidden_states(model, ids).float().sum().backward()
    return seen


def test_autocast_keeps_no_fp32_copy_of_a_lora_input(model_dir):
    """What the memory model's copies term counts (lowmem_grpo/memory.py, train_phase): without autocast each
    layer keeps its two norms' fp32 inputs and an fp32 copy of every LoRA input (six of hidden width, down_proj's
    of intermediate width); under autocast the norms' fp32 inputs alone, and lora_A's inputs in bf16."""
    model, tok = bf16_policy(model_dir, checkpointing=False)
    ids = torch.randint(4, len(tok), (2, 24))
    h, i, layers = SPEC.hidden_size, SPEC.intermediate_size, SPEC.num_layers
    plain, mixed = saved_copies(model, ids, False), saved_copies(model, ids, True)
    assert plain[(h, torch.float32)] == layers * (2 + 6) and plain[(i, torch.float32)] == layers, plain
    assert mixed[(h, torch.float32)] == layers * 2 and mixed[(i, torch.float32)] == 0, mixed
    assert mixed[(h, torch.bfloat16)] == layers * 6, mixed   # bf16 copies of the LoRA inputs (CPU: peft still casts)


def test_the_trainer_runs_its_decoder_passes_under_autocast_only_in_bf16(tiny_model_dir, tiny_data, tmp_path,
                                                                          monkeypatch):
    """model.autocast applies with compute_dtype bfloat16 only; every decoder pass of a step (reference, update,
    diagnostics) goes through Trainer.logprobs and so runs under the same rule."""
    import lowmem_grpo.batch as batch
    from lowmem_grpo.train import Trainer

    states = []
    plain = batch.hidden_states

    def spy(model, *args, **kwargs):
        states.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return plain(model, *args, **kwargs)

    monkeypatch.setattr(batch, "hidden_states", spy)
    for dtype, autocast, expected in (("bfloat16", True, True), ("bfloat16", False, False), ("float32", True, False),
                                      ("float16", True, False)):
        states.clear()
        d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / f"{dtype}-{autocast}",
                        model={"compute_dtype": dtype, "autocast": autocast, "load_in_4bit": False},
                        train={"steps": 1, "eval_max_prompts": 2, "update_diagnostics_every": 1})
        recipe = recipe_from_dict(d)
        assert recipe.model.bf16_autocast is expected
        Trainer(recipe, **QUIET).fit()
        assert len(states) >= 3   # preflight, the reference pass, the update, the diagnostics pass
        assert all(on is expected for on, _ in states), (dtype, autocast, states)
        if expected:
            assert all(dt == torch.bfloat16 for _, dt in states)


def test_memory_model_counts_the_copies_by_its_formula():
    """The copies term by hand: b x t x (4 x 2h + c x (LoRA in-features + intermediate)) bytes, c = 4 without
    autocast and 2 with it; none in float32; the advice names model.autocast where the term is among the largest."""
    shape = mm.ModelShape(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
                          num_kv_heads=2, head_dim=128, tie_word_embeddings=True)
    w = mm.Workload(micro_batch_size=4, prompt_tokens=7, completion_tokens=512)
    h, i, bt = 1536, 8960, 4 * 519
    lora_in = 6 * h + i                     # q, k, v, o, gate, up take hidden-wide inputs; down intermediate
    term = "one layer's copies (fp32 norms, LoRA inputs)"
    n_lora = 1
    assert mm.train_phase(shape, w, n_lora)[term] == bt * (4 * 2 * h + 4 * (lora_in + i))
    w.bf16_autocast = True
    assert mm.train_phase(shape, w, n_lora)[term] == bt * (4 * 2 * h + 2 * (lora_in + i))
    w.compute_bytes = 4
    assert term not in mm.train_phase(shape, w, n_lora)


def test_advice_names_model_autocast_when_the_copies_are_large():
    shape = mm.ModelShape(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                          num_kv_heads=8, head_dim=128, tie_word_embeddings=False)
    w = mm.Workload(micro_batch_size=1, prompt_tokens=512, completion_tokens=20000, prompts_per_step=1)
    text = "\n".join(mm.advise(shape, w, budget=16 * mm.GiB).lines)
    assert "model.autocast: true" in text, text
    w.bf16_autocast = True
    assert "model.autocast" not in "\n".join(mm.advise(shape, w, budget=16 * mm.GiB).lines)
