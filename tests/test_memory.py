"""The memory model's counts against the real objects, the `estimate` command, and the preflight."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner

from conftest import recipe_dict, write_recipe
from lowmem_grpo import memory as mm
from lowmem_grpo import tiny
from lowmem_grpo.cli import main
from lowmem_grpo.model import load_base_model, load_policy, trainable_parameters
from lowmem_grpo.recipe import LoraConfig, ModelConfig, recipe_from_dict


def _shape_and_config(model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return mm.ModelShape.from_config(config), config


def _model_bytes(model) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen or t.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.uint8):
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("tied", [False, True])
def test_unquantized_weight_bytes_match_the_loaded_model(tmp_path, tied):
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, tiny.TinyModelSpec(hidden_size=64, intermediate_size=96, num_layers=3,
                                                     tie_word_embeddings=tied, vocab_size=1000), seed=0)
    model.save_pretrained(tmp_path)
    shape, _ = _shape_and_config(tmp_path)
    w = mm.Workload(quantized=False, compute_bytes=4)
    params = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once
    assert mm.base_weight_bytes(shape, w) == params


def test_4bit_weight_bytes_close_to_the_loaded_model(tiny_model_dir):
    shape, _ = _shape_and_config(tiny_model_dir)
    model = load_base_model(ModelConfig(name_or_path=str(tiny_model_dir), compute_dtype="float32"), quantized=True, device="cpu")
    real = sum(p.numel() * p.element_size() for p in model.parameters())
    real += sum(sum(t.numel() * t.element_size() for t in (m.weight.quant_state.absmax,) if t is not None)
                for m in model.modules() if hasattr(getattr(m, "weight", None), "quant_state") and m.weight.quant_state)
    predicted = mm.base_weight_bytes(shape, mm.Workload(quantized=True, double_quant=True, compute_bytes=4))
    assert abs(predicted - real) / real < 0.05, (predicted, real)


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]])
def test_lora_parameter_count_is_exact(tiny_model_dir, targets):
    shape, _ = _shape_and_config(tiny_model_dir)
    model, _ = load_policy(ModelConfig(name_or_path=str(tiny_model_dir), compute_dtype="float32", load_in_4bit=False),
                           LoraConfig(r=4, target_modules=targets))
    real = sum(p.numel() for p in trainable_parameters(model))
    w = mm.Workload(lora_r=4, lora_targets=("all-linear",) if targets == "all-linear" else tuple(targets))
    assert mm.lora_params(shape, w) == real
    assert all(p.dtype == torch.float32 for p in trainable_parameters(model))  # the model's 4-byte assumption


def test_kv_cache_bytes_match_transformers_cache(tiny_model_dir):
    shape, _ = _shape_and_config(tiny_model_dir)
    model = load_base_model(ModelConfig(name_or_path=str(tiny_model_dir), compute_dtype="float32"), quantized=False)
    seqs, tokens = 3, 11
    out = model(input_ids=torch.randint(3, 20, (seqs, tokens)), use_cache=True)
    cache = out.past_key_values
    real = sum(layer.keys.numel() * 4 + layer.values.numel() * 4 for layer in cache.layers)
    assert mm.kv_cache_bytes(shape, mm.Workload(compute_bytes=4), seqs, tokens) == real


def test_peak_grows_with_what_should_grow():
    shape = mm.ModelShape(vocab_size=151_936, hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                          head_dim=128, intermediate_size=8960, tie_word_embeddings=True, attention_bias=True)
    w = mm.Workload()
    base = mm.estimate(shape, w)

    def train(e):
        return sum(e.phases["train"].values())

    for change in (dict(micro_batch_size=8), dict(completion_tokens=1024), dict(chunk_tokens=4096, chunk_vocab=65536),
                   dict(gradient_checkpointing=False)):
        assert train(mm.estimate(shape, replace(w, **change))) > train(base), change
    for change in (dict(lora_r=64), dict(quantized=False), dict(completion_tokens=1024), dict(prompts_per_step=8)):
        assert mm.estimate(shape, replace(w, **change)).peak > base.peak, change
    base = base.peak
    # A Qwen2.5-1.5B-shaped 4-bit run at the defaults is a gaming-GPU run: well under 8 GiB.
    assert 1 * mm.GiB < base < 8 * mm.GiB


def test_advise_finds_a_micro_batch_or_names_fields():
    shape = mm.ModelShape(vocab_size=151_936, hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                          head_dim=128, intermediate_size=8960, tie_word_embeddings=True)
    w = mm.Workload(micro_batch_size=16, prompts_per_step=4, num_generations=8, completion_tokens=1024)
    need = mm.estimate(shape, w).peak
    tight = mm.advise(shape, w, int(need * 0.8))
    assert not tight.fits and tight.micro_batch_size is not None and tight.micro_batch_size < 16
    assert mm.estimate(shape, replace(w, micro_batch_size=tight.micro_batch_size, chunk_tokens=tight.chunk_tokens)).peak <= need * 0.8
    assert "train.micro_batch_size" in "\n".join(tight.lines)
    hopeless = mm.advise(shape, w, 200 * mm.MiB)
    assert not hopeless.fits and hopeless.micro_batch_size is None
    assert "change one of" in hopeless.lines[-1] and "model" in hopeless.lines[-1]
    roomy = mm.advise(shape, replace(w, micro_batch_size=1), 64 * mm.GiB)
    assert roomy.fits and roomy.micro_batch_size == 32


@pytest.mark.parametrize("text,expected", [("8GiB", 8 * 2**30), ("12GB", 12 * 2**30), ("512MiB", 512 * 2**20),
                                           ("7.5G", int(7.5 * 2**30)), ("1000", 1000)])
def test_parse_size(text, expected):
    assert mm.parse_size(text) == expected


def test_parse_size_rejects_garbage():
    with pytest.raises(mm.MemoryModelError, match="8GiB"):
        mm.parse_size("lots")


def test_eval_counts_for_a_held_out_file_or_split(tiny_model_dir, tiny_data, tmp_path):
    from lowmem_grpo.memory import workload_from_recipe

    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run")
    with_file = workload_from_recipe(recipe_from_dict(d), 8, "cpu")
    d["data"]["eval_path"] = ""
    without = workload_from_recipe(recipe_from_dict(d), 8, "cpu")
    d["data"]["eval_fraction"] = 0.1
    with_split = workload_from_recipe(recipe_from_dict(d), 8, "cpu")
    assert with_file.eval_prompts > 0 and with_split.eval_prompts == with_file.eval_prompts
    assert without.eval_prompts == 0


def test_environment_tokens_size_the_completions(tiny_model_dir, tiny_data, tmp_path):
    """With an environment a completion is up to environment.max_total_tokens tokens (model + environment,
    docs/algorithm.md §20): the estimate sizes every phase with that and grows with it; without one,
    max_total_tokens changes nothing and generation.max_new_tokens sizes the completions."""
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", generation={"max_new_tokens": 16})

    def peak(**environment):
        d["environment"] = environment
        est, _, w = mm.estimate_recipe(recipe_from_dict(d), "cpu", prompt_tokens=8)
        return est, w

    plain, w_plain = peak()
    unused, w_unused = peak(max_total_tokens=4096)
    assert w_plain.completion_tokens == w_unused.completion_tokens == 16 and not w_plain.environment
    assert unused.peak == plain.peak and unused.phases == plain.phases
    small, w_small = peak(name="toy_envs:TwoTurns", max_total_tokens=64)
    large, w_large = peak(name="toy_envs:TwoTurns", max_total_tokens=4096)
    assert (w_small.completion_tokens, w_large.completion_tokens) == (64, 4096) and w_large.environment
    assert plain.peak < small.peak < large.peak
    for phase in ("rollout", "train"):
        assert sum(small.phases[phase].values()) < sum(large.phases[phase].values())
    assert any("4104 tok" in name for name in large.phases["rollout"])   # 8 prompt + 4096 completion tokens
    assert "environment.max_total_tokens" in mm._fields_for("rollout KV cache", w_large)
    assert "generation.max_new_tokens" in mm._fields_for("rollout KV cache", w_plain)


def test_estimate_cli(tmp_path, tiny_model_dir, tiny_data):
    path = write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run"))
    res = CliRunner().invoke(main, ["estimate", str(path), "--memory", "8GiB"])
    assert res.exit_code == 0, res.output
    assert "base weights" in res.output and "log-prob tile" in res.output and "predicted peak" in res.output
    assert "fits" in res.output and "longest prompt" in res.output
    res = CliRunner().invoke(main, ["estimate", str(path), "--memory", "1000"])
    assert res.exit_code == 1 and "does not fit" in res.output
    res = CliRunner().invoke(main, ["estimate", str(path), "--memory", "plenty"])
    assert res.exit_code == 2 and "8GiB" in res.output and "Traceback" not in res.output


def _trainer(tmp_path, tiny_model_dir, tiny_data, **train):
    from lowmem_grpo.train import Trainer

    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run")
    d["train"].update(train)
    return Trainer(recipe_from_dict(d), log=lambda *a: None)


def test_preflight_leaves_no_trace(tmp_path, tiny_model_dir, tiny_data):
    trainer = _trainer(tmp_path, tiny_model_dir, tiny_data)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    rng = torch.get_rng_state()
    out = trainer.preflight()
    assert out["peak_mib"] > 0 and out["predicted_mib"] > 0
    assert torch.equal(rng, torch.get_rng_state())
    for n, p in trainer.model.named_parameters():
        if p.requires_grad:
            assert p.grad is None and torch.equal(p, before[n])


def test_preflight_turns_oom_into_advice(tmp_path, tiny_model_dir, tiny_data, monkeypatch):
    import lowmem_grpo.train as train_mod

    trainer = _trainer(tmp_path, tiny_model_dir, tiny_data)

    def boom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(train_mod, "completion_logprobs", boom)
    with pytest.raises(train_mod.TrainingError) as err:
        trainer.fit()
    msg = str(err.value)
    assert "preflight" in msg and "micro-batch of 3" in msg and "Memory model" in msg
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or (tmp_path / "run" / "metrics.jsonl").read_text() == ""


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="VmHWM is Linux's; elsewhere ru_maxrss")
def test_peak_rss_is_the_process_own_not_its_parents():
    """A process started by a big parent must not report the parent's RSS as its peak (ru_maxrss does on
    Linux: the kernel keeps the old address space's high-water mark across execve)."""
    import subprocess
    import sys

    ballast = bytearray(1536 * 2**20)  # touched: 1.5 GiB resident in this (parent) process
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    code = "from lowmem_grpo.memory import peak_rss_mib; print(peak_rss_mib())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    del ballast
    child = float(out.strip().splitlines()[-1])
    assert 10 < child < 1024, child  # the child imports torch (~250 MiB), never the parent's 1.5 GiB
    assert mm.peak_rss_mib() >= 1536  # and this process's own peak did include the ballast


def test_each_of_several_processes_is_modelled_with_its_share(tiny_model_dir, tiny_data, tmp_path):
    """Under torchrun (docs/algorithm.md §21) a process samples prompts_per_step / N prompts and evaluates its
    share of the held-out ones: its workload, and so its estimate, is that of a one-process recipe with those."""
    from lowmem_grpo.memory import ModelShape, estimate, workload_from_recipe

    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", train={"prompts_per_step": 8, "eval_max_prompts": 101})
    two = workload_from_recipe(recipe_from_dict(d), 8, "cpu", processes=2)
    d["train"].update(prompts_per_step=4, eval_max_prompts=51)
    half = workload_from_recipe(recipe_from_dict(d), 8, "cpu")
    assert two == half and two.prompts_per_step == 4 and two.eval_prompts == 51
    shape = ModelShape(vocab_size=32000, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4,
                       head_dim=64, intermediate_size=4096, tie_word_embeddings=False)
    d["train"].update(prompts_per_step=8, eval_max_prompts=101)
    one = workload_from_recipe(recipe_from_dict(d), 8, "cpu")
    rollout = [sum(estimate(shape, w).phases["rollout"].values()) for w in (one, two)]
    assert rollout[1] < rollout[0]
