"""The CUDA path. GPU-only: every test here skips, saying why, on a machine without CUDA (CI never runs
them); scripts/gpu_check.py runs them on a GPU machine and docs/benchmarks.md holds what they showed.

Each mirrors a CPU test where one exists: NF4 + LoRA backward against the dequantized twin (tests/test_model.py),
a mixture's NF4 experts loaded onto the GPU against their dequantized twin (tests/test_experts4bit.py),
the chunked log-prob kernel against log_softmax + gather (tests/test_logprobs.py), activation offload
(tests/test_offload.py), preflight's advice and rollout waves on a small card (tests/test_memory.py) and the
quickstart learning."""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")]


def _bnb_cuda_reason():
    try:
        import bitsandbytes  # noqa: F401
        from bitsandbytes.cextension import lib
    except Exception as exc:  # its import raises many kinds of errors on a machine without its CUDA library
        return f"bitsandbytes does not import: {exc}"
    return None if lib is not None else "bitsandbytes has no CUDA library here"


needs_bnb = pytest.mark.skipif(torch.cuda.is_available() and _bnb_cuda_reason() is not None,
                               reason=str(torch.cuda.is_available() and _bnb_cuda_reason()))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------------------
# NF4 + LoRA backward on CUDA equals the dequantized twin's
# ------------------------------------------------------------------------------------------------------

@needs_bnb
def test_nf4_lora_backward_on_cuda_equals_the_dequantized_twin(tiny_model_dir):
    """fp32 compute, so the only difference between the two paths is bitsandbytes' CUDA dequantize + matmul:
    LoRA gradients within 1e-4 relative (norm) of the twin's, hidden states within 1e-5."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    from lowmem_grpo.model import hidden_states, load_policy
    from lowmem_grpo.recipe import LoraConfig, ModelConfig

    def cfg(four_bit):
        return ModelConfig(name_or_path=str(tiny_model_dir), compute_dtype="float32", load_in_4bit=four_bit)

    policy, tok = load_policy(cfg(True), LoraConfig(r=4, alpha=8))
    assert next(policy.parameters()).is_cuda
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in policy.modules())
    g = torch.Generator().manual_seed(0)
    for name, p in policy.named_parameters():
        if "lora_" in name:
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g).to(p.device) * 0.05)
    twin, _ = load_policy(cfg(False), LoraConfig(r=4, alpha=8))
    twin.to("cuda")
    q = dict(policy.named_modules())
    with torch.no_grad():
        for name, module in twin.named_modules():
            if isinstance(q.get(name), bnb.nn.Linear4bit):
                w = q[name].weight
                module.weight.copy_(F.dequantize_4bit(w.data, w.quant_state).to(module.weight.dtype))
    twin.load_state_dict({k: v for k, v in policy.state_dict().items() if "lora_" in k}, strict=False)
    ids = torch.tensor([tok.encode("<s>12+35=47</s>", add_special_tokens=False)] * 3, device="cuda")

    def run(model):
        model.zero_grad(set_to_none=True)
        h = hidden_states(model, ids)
        h.pow(2).mean().backward()
        return h.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n and p.grad is not None}

    h_q, g_q = run(policy)
    h_t, g_t = run(twin)
    assert _rel(h_q, h_t) < 1e-5
    assert g_q.keys() == g_t.keys() and len(g_q) > 0
    for n in g_t:
        assert _rel(g_q[n], g_t[n]) < 1e-4, (n, _rel(g_q[n], g_t[n]))


# ------------------------------------------------------------------------------------------------------
# A mixture's experts in NF4 on CUDA (experts4bit.py): staged loading, and the layer against the twin
# ------------------------------------------------------------------------------------------------------

@needs_bnb
def test_nf4_experts_load_staged_onto_cuda_and_equal_the_dequantized_twin(tmp_path):
    """The loader stages a mixture in host memory, stores its experts in NF4 on the GPU and moves the rest there
    (model.load_base_model: the path CI cannot run); fp32, so the NF4 layer's outputs are within 1e-5 (relative,
    norm) of transformers' own layer on the dequantized weights, and LoRA's gradients within 1e-4."""
    import copy

    from lowmem_grpo import experts4bit as e4
    from lowmem_grpo import tiny
    from lowmem_grpo.model import attach_lora, hidden_states, load_base_model
    from lowmem_grpo.recipe import LoraConfig, ModelConfig

    folder = tiny.save_moe_model("Qwen3MoeConfig", tmp_path / "moe")
    model = load_base_model(ModelConfig(name_or_path=str(folder), compute_dtype="float32"), device="cuda")
    experts = [m for m in model.modules() if e4.is_experts(m)]
    assert experts and all(m.gate_up_proj_nf4.is_cuda for m in experts) and all(p.is_cuda for p in model.parameters())
    twin = copy.deepcopy(model)
    for m in twin.modules():
        if hasattr(m, "nf4_shapes"):
            for proj in e4.PROJECTIONS:
                m.register_parameter(proj, torch.nn.Parameter(e4.dequantized(m, proj), requires_grad=False))
                delattr(m, f"{proj}_nf4"), delattr(m, f"{proj}_absmax")
            del m.nf4_shapes
    twin.set_experts_implementation("eager")
    lora = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    policy, reference = attach_lora(model, lora, False), attach_lora(twin, lora, False)
    g = torch.Generator().manual_seed(0)
    for (name, p), q in zip(policy.named_parameters(), reference.parameters()):
        if "lora_" in name:
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g).to(p.device) * 0.05)
                q.copy_(p)
    ids = torch.randint(3, 20, (2, 24), generator=g).cuda()

    def run(m):
        h = hidden_states(m, ids)
        h.pow(2).mean().backward()
        return h.detach(), [p.grad for n, p in m.named_parameters() if "lora_" in n]

    (h_q, g_q), (h_t, g_t) = run(policy), run(reference)
    assert _rel(h_q, h_t) < 1e-5 and len(g_q) == len(g_t) > 0
    assert all(_rel(a, b) < 1e-4 for a, b in zip(g_q, g_t))


# ------------------------------------------------------------------------------------------------------
# The chunked log-prob kernel on CUDA, fp32 and bf16
# ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunked_logprobs_on_cuda_match_log_softmax_and_gather(dtype):
    """Against float64 log_softmax + gather of the same (dtype-rounded) inputs: the kernel computes its tiles in
    fp32 whatever the input dtype, so its log-probs are within 2e-4 absolute and its gradient within 1e-3
    relative in both dtypes. The plain path in bf16 rounds its logits to bf16: it is the less accurate one."""
    from lowmem_grpo.logprobs import reference_log_probs, selective_log_softmax

    torch.manual_seed(0)
    n, d, vocab = 3000, 512, 50_000  # rows and vocabulary not multiples of the tiles
    hidden = (torch.randn(n, d, device="cuda") * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, d, device="cuda") * 0.05).to(dtype)
    targets = torch.randint(0, vocab, (n,), device="cuda")
    weights = torch.randn(n, device="cuda")

    logp = selective_log_softmax(hidden, weight, targets, chunk_rows=1024, chunk_vocab=8192)
    (logp * weights).sum().backward()
    grad = hidden.grad.clone()

    h64 = hidden.detach().double().requires_grad_()
    ref = torch.log_softmax(h64 @ weight.double().T, dim=-1).gather(1, targets[:, None]).squeeze(1)
    (ref * weights.double()).sum().backward()
    assert torch.isfinite(logp).all()
    assert (logp.double() - ref).abs().max() < 2e-4
    assert _rel(grad, h64.grad) < 1e-3 if dtype == torch.float32 else _rel(grad, h64.grad) < 1e-2  # grad in dtype
    plain = reference_log_probs(hidden.detach(), weight, targets)
    assert (logp.double() - ref).abs().max() <= (plain.double() - ref).abs().max() + 1e-6


# ------------------------------------------------------------------------------------------------------
# Activation offload: lower peak VRAM, same gradients
# ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layers,rows,tokens,saved_at_least", [(12, 2, 4096, 9), (24, 4, 1024, 20)],
                         ids=["12-layers-2x4096", "24-layers-4x1024"])
def test_activation_offload_lowers_peak_vram_and_keeps_gradients_equal(layers, rows, tokens, saved_at_least):
    """A bf16 model of hidden 512: the update's forward + backward with the checkpointed layer inputs in pinned
    host memory peaks lower by at least `saved_at_least` of its layer inputs (each rows x tokens x 512 x 2 B),
    and gives the same LoRA-like gradients (eager attention: a deterministic backward). The 24-layer case is
    copy-bound (small layers, 4 MiB copies): under record_stream it saved 11.5 of 24 on an H100, most likely
    because the blocks counted as allocated until the allocator saw their copies done; offload.py now holds one
    and has the compute stream wait on its copy's event. Not run on a GPU since (docs/benchmarks.md)."""
    from lowmem_grpo import tiny
    from lowmem_grpo.model import hidden_states
    from lowmem_grpo.offload import ActivationOffload

    tok = tiny.build_tokenizer()
    spec = tiny.TinyModelSpec(hidden_size=512, num_layers=layers, num_heads=8, num_kv_heads=2,
                              intermediate_size=1024, max_position_embeddings=tokens)
    model = tiny.build_model(tok, spec, seed=0).to("cuda", torch.bfloat16)
    model.config._attn_implementation = "eager"
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    for name, p in model.named_parameters():
        p.requires_grad_("layers" in name and name.endswith("o_proj.weight"))
    ids = torch.randint(0, len(tok), (rows, tokens), device="cuda")

    def run(offload: bool):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        ctx = ActivationOffload(model) if offload else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with ctx:
            h = hidden_states(model, ids)
        h.float().pow(2).mean().backward()
        torch.cuda.synchronize()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return torch.cuda.max_memory_allocated() - before, grads

    run(False)  # warm-up: cuBLAS workspaces, the pinned-memory pool
    run(True)
    peak_off, g_off = run(False)
    peak_on, g_on = run(True)
    layer = rows * tokens * 512 * 2
    print(f"peak above the weights: offload off {peak_off / 2**20:.0f} MiB, on {peak_on / 2**20:.0f} MiB "
          f"(one layer input: {layer / 2**20:.0f} MiB; saved {(peak_off - peak_on) / layer:.1f} of {layers})")
    assert peak_off - peak_on >= saved_at_least * layer, (peak_off, peak_on)
    assert g_off.keys() == g_on.keys() and len(g_off) == layers
    for n in g_off:
        assert torch.equal(g_off[n], g_on[n]), n


# ------------------------------------------------------------------------------------------------------
# Preflight on a simulated small card
# ------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def simulated_card(card: int):
    """This process sees a card of `card` bytes: torch.cuda.set_per_process_memory_fraction, after emptying the
    caching allocator. The fraction is checked only when the allocator asks CUDA for a new segment, never when
    it reuses one it holds, so the blocks an earlier test left cached (the offload test's reach 4.2 GiB) would
    serve a simulated 2 GiB card past its 2 GiB: most likely why the first preflight recipes fit
    (docs/benchmarks.md)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved()
    assert held <= card / 2, f"{held / 2**20:.0f} MiB still held by live tensors: no {card / 2**20:.0f} MiB card to simulate"
    torch.cuda.set_per_process_memory_fraction(card / torch.cuda.get_device_properties(0).total_memory)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def _small_card_recipe(tmp_path, spec, num_generations: int, max_new_tokens: int, micro_batch_size: int):
    """A tiny model of `spec` and a one-prompt recipe on it, saved under tmp_path, for the simulated-card tests."""
    from lowmem_grpo import tiny
    from lowmem_grpo.recipe import recipe_from_dict

    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, spec, seed=0)
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    tiny.write_jsonl([{"prompt": "1+2=", "answer": "3"}] * 4, tmp_path / "train.jsonl")
    return recipe_from_dict({
        "model": {"name_or_path": str(tmp_path / "model"), "compute_dtype": "bfloat16"},
        "data": {"train_path": str(tmp_path / "train.jsonl")},
        "rewards": {"functions": [{"function": "exact"}]},
        "generation": {"num_generations": num_generations, "max_new_tokens": max_new_tokens},
        "train": {"steps": 1, "prompts_per_step": 1, "micro_batch_size": micro_batch_size},
        "output": {"dir": str(tmp_path / "run")},
    })


@needs_bnb
def test_preflight_on_a_simulated_small_card_fails_with_advice_that_then_fits(tmp_path):
    """torch.cuda.set_per_process_memory_fraction makes the card look small (2 GiB); a recipe whose micro-batch
    cannot fit stops in preflight with one error that carries the memory model's advice, sized for the simulated
    card, not the real one; and the recipe as advised (a smaller train.micro_batch_size) passes preflight on the
    same card, its peak within the budget the advice was sized for."""
    import gc

    from lowmem_grpo import memory as mm
    from lowmem_grpo import tiny
    from lowmem_grpo.train import Trainer, TrainingError

    spec = tiny.TinyModelSpec(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=1024,
                              max_position_embeddings=16400, vocab_size=32768)
    recipe = _small_card_recipe(tmp_path, spec, num_generations=16, max_new_tokens=16000, micro_batch_size=16)
    with simulated_card(2 * mm.GiB):
        budget = 2 * mm.GiB * (1 - mm.ALLOCATOR_SLACK)  # the simulated card, less the allocator's share
        assert abs(mm.device_budget("cuda") - budget) < mm.MiB  # the budget the advice is sized for
        trainer = Trainer(recipe, log=lambda *a: None)
        predicted, _, _ = mm.estimate_recipe(recipe, "cuda")
        # Not only the memory model's whole figure: the terms no implementation avoids, the checkpointed layer
        # inputs and the kernel's fp32 hidden rows with their gradient, are more than the card by themselves.
        train = predicted.phases["train"]
        unavoidable = sum(v for k, v in train.items() if k.startswith(("checkpointed", "log-prob rows")))
        assert unavoidable > 2 * mm.GiB, train
        shape, workload = trainer.memory_model(len(trainer.train_set.longest_prompt()))
        advice = mm.advise(shape, workload, trainer.memory_budget)
        with pytest.raises(TrainingError) as err:
            trainer.preflight()
        text = str(err.value)
        assert "preflight" in text and "ran out of memory" in text
        assert f"of {mm.fmt(budget)}" in text            # the simulated card
        assert "train.micro_batch_size" in text           # the advice names what to change
        assert not advice.fits and advice.micro_batch_size and advice.lines[-1] in text, (advice, text)
        trainer.close()
        del trainer
        gc.collect()
        torch.cuda.empty_cache()

        advised = _small_card_recipe(tmp_path, spec, num_generations=16, max_new_tokens=16000,
                                     micro_batch_size=advice.micro_batch_size)
        advised.train.logprob_chunk_tokens = advice.chunk_tokens
        advised.output.dir = str(tmp_path / "run-advised")
        trainer = Trainer(advised, log=lambda *a: None)
        torch.cuda.reset_peak_memory_stats()
        report = trainer.preflight()   # raises TrainingError if the advice was wrong
        peak = torch.cuda.max_memory_allocated()
        print(f"preflight as advised (micro-batch {advice.micro_batch_size}): peak {mm.fmt(peak)}, memory model "
              f"{report['predicted_mib']:.0f} MiB for the whole run, budget {mm.fmt(budget)}")
        assert peak <= budget
        trainer.close()


# ------------------------------------------------------------------------------------------------------
# Rollout waves on a simulated small card
# ------------------------------------------------------------------------------------------------------

@needs_bnb
def test_rollout_waves_fit_a_simulated_small_card(tmp_path, monkeypatch):
    """A 1.25 GiB card (torch.cuda.set_per_process_memory_fraction): one call of a step's 8 sequences of 2,000
    tokens would need about 1.3 GiB by the memory model (320 MiB static + a 1 GiB KV cache), 4 about 0.8. The
    trainer decodes in two even waves of 4 (memory.decode_waves, rollout.base.wave_plan), and torch's allocated peak over the
    rollout stays within the budget it sized them for. Not run on a GPU yet (docs/benchmarks.md)."""
    from lowmem_grpo import memory as mm
    from lowmem_grpo import tiny
    from lowmem_grpo.metrics import PhaseTimer
    from lowmem_grpo.rollout.hf import HFEngine
    from lowmem_grpo.train import Trainer

    # wide KV (32 KV heads x 128 x 4 layers: 64 KiB a token a sequence), little else
    recipe = _small_card_recipe(tmp_path, tiny.TinyModelSpec(hidden_size=4096, num_layers=4, num_heads=32,
                                                              num_kv_heads=32, intermediate_size=1024,
                                                              max_position_embeddings=2100, vocab_size=8192),
                                num_generations=8, max_new_tokens=2000, micro_batch_size=1)
    card = int(1.25 * mm.GiB)
    sizes, real = [], HFEngine._generate

    def recording(self, prompts, params):
        sizes.append(len(prompts) * params.n)
        return real(self, prompts, params)

    with simulated_card(card):
        trainer = Trainer(recipe, log=lambda *a: None)
        assert (trainer.waves.rollout, trainer.waves.rollout_calls) == (4, 2), trainer.waves
        shape, w = trainer.memory_model(len(trainer.train_set.longest_prompt()))
        predicted = mm.estimate(shape, w, trainer.memory_budget)
        rollout_peak = sum(predicted.static.values()) + sum(predicted.phases["rollout"].values())
        monkeypatch.setattr(HFEngine, "_generate", recording)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        trainer.rollout(trainer.select_prompts(), PhaseTimer())
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        print(f"rollout in waves {sizes}: peak {mm.fmt(peak)}, memory model {mm.fmt(rollout_peak)}, "
              f"budget {mm.fmt(trainer.memory_budget)} of the {mm.fmt(card)} card")
        assert sizes == [4, 4]
        assert peak <= trainer.memory_budget
        trainer.close()


# ------------------------------------------------------------------------------------------------------
# A short quickstart on CUDA learns
# ------------------------------------------------------------------------------------------------------

@needs_bnb
@pytest.mark.slow
def test_short_quickstart_on_cuda_learns(tmp_path):
    """recipes/quickstart.yaml on CUDA in bf16 (4-bit base + LoRA), 120 steps: held-out accuracy rises by at least
    8 points. The warm-started base is runs/quickstart/base when a quickstart has built one, else built here."""
    from lowmem_grpo.recipe import load_recipe
    from lowmem_grpo.train import Trainer

    spec = importlib.util.spec_from_file_location("quickstart", ROOT / "scripts" / "quickstart.py")
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    out = ROOT / "runs" / "quickstart"
    if not (out / "base" / "config.json").is_file() or not (out / "data" / "test.jsonl").is_file():
        out = tmp_path
        quickstart.build_base(out / "base", out / "data", print)
    recipe = load_recipe(ROOT / "recipes" / "quickstart.yaml", [
        f"model.name_or_path={out / 'base'}", f"data.train_path={out / 'data' / 'train.jsonl'}",
        f"data.eval_path={out / 'data' / 'test.jsonl'}", f"output.dir={tmp_path / 'run'}",
        "model.compute_dtype=bfloat16", "train.steps=120", "train.eval_every=0", "output.save_every=1000"])
    result = Trainer(recipe, log=lambda *a: None).fit()
    before, after = result["first_eval"]["accuracy"], result["final_eval"]["accuracy"]
    print(f"quickstart on CUDA, 120 steps: held-out accuracy {100 * before:.1f}% -> {100 * after:.1f}%")
    assert after >= before + 0.08
