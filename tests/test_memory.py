"""The memory model's counts against the real objects, the `estimate` command, and the preflight."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

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


def test_out_of_memory_advice_is_advise_where_the_model_agrees_and_names_what_it_misses_where_not():
    """After a real out-of-memory: where the memory model says the run does not fit, its advice as preflight gives
    it; where it said the run fits, the memory it does not count (on CUDA the allocator's fragmentation, which
    expandable segments avoid) and half the micro-batch."""
    shape = mm.ModelShape(vocab_size=151_936, hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                          head_dim=128, intermediate_size=8960, tie_word_embeddings=True)
    w = mm.Workload(micro_batch_size=16, prompts_per_step=4, num_generations=8, completion_tokens=1024, device="cuda")
    need = mm.estimate(shape, w).peak
    assert mm.out_of_memory_advice(shape, w, int(need * 0.8)) == mm.advise(shape, w, int(need * 0.8))
    roomy = mm.out_of_memory_advice(shape, w, 2 * need)
    assert not roomy.fits and roomy.micro_batch_size == 8, roomy
    assert f"predicted {mm.fmt(need)} of {mm.fmt(2 * need)}" in roomy.lines[0]
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in roomy.lines[0]
    assert roomy.lines[1].startswith("set train.micro_batch_size: 8")
    cpu = mm.out_of_memory_advice(shape, replace(w, device="cpu", micro_batch_size=1), 64 * mm.GiB)
    assert "other processes on this machine" in cpu.lines[0] and len(cpu.lines) == 1 and cpu.micro_batch_size is None
    assert mm.out_of_memory_advice(shape, w, None).lines == []


@pytest.mark.parametrize("text,expected", [("8GiB", 8 * 2**30), ("12GB", 12 * 2**30), ("512MiB", 512 * 2**20),
                                           ("7.5G", int(7.5 * 2**30)), ("1000", 1000)])
def test_parse_size(text, expected):
    assert mm.parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "inf", "1e400", "-8GiB", "0"])   # float() reads all but the first
def test_parse_size_rejects_garbage(text):
    with pytest.raises(mm.MemoryModelError, match="positive size, e.g. 8GiB"):
        mm.parse_size(text)


@pytest.mark.parametrize("text,expected", [("8", 8 * 2**30), ("0.5", 2**29), ("8GiB", 8 * 2**30), ("12GB", 12 * 2**30),
                                           ("12 gb", 12 * 2**30), ("7.5G", int(7.5 * 2**30)), ("512MiB", 512 * 2**20),
                                           ("65536KiB", 64 * 2**20), ("1TiB", 2**40), ("1TB", 2**40),
                                           ("1e11B", 10**11), ("1024TiB", 2**50), (".5", 2**29), ("+8", 8 * 2**30)])
def test_the_memory_option_reads_a_bare_number_as_gib(text, expected):
    from lowmem_grpo.cli import parse_memory

    assert parse_memory(text) == expected


@pytest.mark.parametrize("text,says", [("8B", "'8B' is 8 bytes, below the 64 MiB"), ("1KiB", "'1KiB' is 1024 bytes"),
                                       ("0.01", "'0.01' is 10 MiB, below the 64 MiB"),
                                       ("8GiBs", "'8GiBs': expected a positive size"),
                                       ("lots", "'lots': expected a positive size"),
                                       ("nan", "'nan': expected a positive size"),
                                       # float() reads these as 80 and 12: a size is a plain decimal number
                                       ("8_0", "'8_0': expected a positive size"),
                                       ("\uff11\uff12", "expected a positive size"),
                                       ("1e30", "'1e30' is 9.766e.26 TiB, more than the 1024 TiB"),
                                       ("1025TiB", "'1025TiB' is 1025 TiB, more than the 1024 TiB")])
def test_the_memory_option_refuses_sizes_no_card_has(text, says):
    from lowmem_grpo.cli import parse_memory

    with pytest.raises(ValueError, match=says) as err:
        parse_memory(text)
    assert "a number without a unit is GiB" in str(err.value) and "KiB, MiB, GiB, TiB" in str(err.value)


def test_estimate_refuses_what_train_refuses(tmp_path, tiny_model_dir, tiny_data):
    """A card smaller than its CUDA context, and --nproc that train --nproc refuses (the same sentence): exit 2."""
    from lowmem_grpo.recipe import prompts_share_problem

    path = write_recipe(tmp_path / "r.yaml", recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run",
                                                         train={"prompts_per_step": 2}))
    res = CliRunner().invoke(main, ["estimate", str(path), "--memory", "500MiB"])
    assert res.exit_code == 2 and "a 500 MiB card leaves the trainer 0 MiB" in res.output, res.output
    assert CliRunner().invoke(main, ["estimate", str(path), "--memory", "500MiB", "--device", "cpu"]).exit_code == 1
    res = CliRunner().invoke(main, ["estimate", str(path), "--nproc", "3", "--memory", "8"])
    assert res.exit_code == 2 and " ".join(prompts_share_problem(2, 3).split()) in " ".join(res.output.split())
    assert "fits" not in res.output
    assert CliRunner().invoke(main, ["estimate", str(path), "--nproc", "2", "--memory", "8"]).exit_code == 0


def test_every_command_with_set_explains_it():
    helps = {name: CliRunner().invoke(main, [name, "--help"]).output for name in ("validate", "train", "estimate", "eval")}
    for name, text in helps.items():
        assert "rewards.functions.0.weight=2" in " ".join(text.split()), (name, text)


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
    res = CliRunner().invoke(main, ["estimate", str(path), "--memory", "256MiB", "--device", "cpu"])
    assert res.exit_code == 1 and "does not fit" in res.output
    # bitsandbytes' 8-bit AdamW runs on CUDA only: the CPU advice names the fields that apply there
    assert "a smaller lora.r" in res.output and "adamw_8bit" not in res.output, res.output
    res = CliRunner().invoke(main, ["estimate", str(path), "--memory", "plenty"])
    assert res.exit_code == 2 and "8GiB" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(main, ["estimate", str(path), "--device", "cpu"])   # no --memory: says what it took
    assert res.exit_code == 0 and "this machine's RAM" in res.output, res.output
    # --memory is a card's size: the budget is what the trainer takes on such a card, less its CUDA context and
    # the allocator's share (the same rule as device_budget on a real one); with --device cpu, the RAM as given
    card = CliRunner().invoke(main, ["estimate", str(path), "--memory", "8GiB"]).output
    assert mm.card_budget(8 * mm.GiB) == int((8 * mm.GiB - mm.CUDA_CONTEXT) * (1 - mm.ALLOCATOR_SLACK))
    assert f"budget: {mm.fmt(mm.card_budget(8 * mm.GiB))} of a 8.00 GiB card" in card
    assert f"of {mm.fmt(mm.card_budget(8 * mm.GiB))} (" in card and "of 8.00 GiB (" not in card
    ram = CliRunner().invoke(main, ["estimate", str(path), "--memory", "8GiB", "--device", "cpu"]).output
    assert "budget:" not in ram and "of 8.00 GiB (" in ram, ram


def _config_folder(tiny_model_dir, folder, **changes):
    """A model folder (config.json, the tokenizer, and a weights file of no tensors: estimate and validate read no
    more) with the tiny model's config.json changed: a value None deletes the key, unless given as `null=[keys]`
    (written as JSON null)."""
    import json
    import shutil

    from safetensors.torch import save_file

    folder.mkdir()
    save_file({}, str(folder / "model.safetensors"))
    for f in tiny_model_dir.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, folder / f.name)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    nulls = changes.pop("null", [])
    for key, value in changes.items():
        config.pop(key, None) if value is None else config.__setitem__(key, value)
    config.update({key: None for key in nulls})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


QWEN2_MOE = dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, shared_expert_intermediate_size=0)


REFUSED_CONFIGS = [
    (dict(num_attention_heads=0), "num_attention_heads is 0; allowed: a whole number >= 1"),
    (dict(hidden_size=-64), "hidden_size is -64; allowed: a whole number >= 1"),
    (dict(num_key_value_heads=3), "num_attention_heads (4) is not a multiple of num_key_value_heads (3)"),
    (dict(null=["intermediate_size"]), "'intermediate_size' expected int"),   # transformers' own check, as it reads it
    (dict(vocab_size="21"), "'vocab_size' expected int, got str"),
    (dict(num_hidden_layers=7), "`num_hidden_layers` (7) must be equal to the number of `layer_types` (2)"),
    ({**QWEN2_MOE, "decoder_sparse_step": 0}, "decoder_sparse_step is 0; allowed: a whole number >= 1"),
    ({**QWEN2_MOE, "num_experts_per_tok": 0}, "num_experts_per_tok is 0; allowed: a whole number >= 1"),
    ({**QWEN2_MOE, "num_experts_per_tok": 5}, "num_experts_per_tok is 5, more than the 4 routed experts"),
    (dict(model_type="bert", architectures=None, layer_types=None), "model_type 'bert' is an encoder"),
    (dict(architectures=["BertForMaskedLM"]), "architectures ['BertForMaskedLM'] names no causal language model"),
    (dict(model_type="t5", architectures=None, d_model=64), "model_type 't5' is an encoder-decoder model"),
]


@pytest.mark.parametrize("changes,says", REFUSED_CONFIGS)
def test_estimate_refuses_a_config_no_model_has_in_one_line(tmp_path, tiny_model_dir, tiny_data, changes, says):
    """An audit found estimate answering "fits" for a BERT encoder and a negative hidden_size ("-0 MiB"), and
    tracebacks for a zero head count, a MoE decoder_sparse_step of 0 (inside transformers) and fields that
    transformers' config checks refuse. Each is now one error line naming the config field, exit 2."""
    folder = _config_folder(tiny_model_dir, tmp_path / "model", **changes)
    d = recipe_dict(folder, tiny_data, tmp_path / "run")
    res = CliRunner().invoke(main, ["estimate", str(write_recipe(tmp_path / "r.yaml", d)), "--memory", "8GiB"])
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == res.output.strip(), res.output
    assert f"model.name_or_path={str(folder)!r}" in errors[0] and says in errors[0], res.output
    assert "fits" not in res.output


def test_estimate_says_in_one_line_what_transformers_cannot_build(tmp_path, tiny_model_dir, tiny_data, monkeypatch):
    """For a mixture of experts estimate builds the model on the meta device (peft decides its adapters): a config
    value transformers fails on there (as it did on decoder_sparse_step 0) is one error line, not a traceback."""
    def fails(*a, **k):
        raise ZeroDivisionError("integer modulo by zero")

    monkeypatch.setattr(mm, "experts_census_from_config", fails)
    folder = _config_folder(tiny_model_dir, tmp_path / "model", **QWEN2_MOE)
    d = recipe_dict(folder, tiny_data, tmp_path / "run")
    res = CliRunner().invoke(main, ["estimate", str(write_recipe(tmp_path / "r.yaml", d)), "--memory", "8GiB"])
    assert res.exit_code == 2 and res.output == (f"error: model.name_or_path={str(folder)!r}: transformers cannot build "
                                                 "the model its config.json describes (ZeroDivisionError: integer "
                                                 "modulo by zero)\n"), res.output


def test_estimate_notes_what_it_leaves_out(tmp_path, tiny_model_dir, tiny_data):
    """A multimodal config is estimated from its text_config: said, with the tower it leaves out. A prompt and a
    completion past max_position_embeddings: said as the trainer's start-up says it."""
    import json

    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", generation={"max_new_tokens": 100})
    res = CliRunner().invoke(main, ["estimate", str(write_recipe(tmp_path / "r.yaml", d)), "--memory", "8GiB"])
    limit = json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]
    assert res.exit_code == 0 and f"tokens, past the model's max_position_embeddings={limit}" in res.output, res.output
    assert "generation.max_new_tokens=100 come to" in res.output
    d["generation"]["max_new_tokens"] = 4
    res = CliRunner().invoke(main, ["estimate", str(write_recipe(tmp_path / "r.yaml", d)), "--memory", "8GiB"])
    assert res.exit_code == 0 and "max_position_embeddings" not in res.output, res.output
    text = json.loads((tiny_model_dir / "config.json").read_text())
    for key in ("architectures", "layer_types", "transformers_version", "dtype"):
        text.pop(key, None)
    llava = _config_folder(tiny_model_dir, tmp_path / "llava", model_type="llava", architectures=None,
                           text_config={**text, "model_type": "qwen2"}, vision_config={"model_type": "clip_vision_model"})
    d = recipe_dict(llava, tiny_data, tmp_path / "run")
    res = CliRunner().invoke(main, ["estimate", str(write_recipe(tmp_path / "r.yaml", d)), "--memory", "8GiB"])
    assert res.exit_code == 0, res.output
    assert "note: model shape: the language model of this llava config (its text_config) only; its vision tower is " \
           "not counted" in res.output
    shape = mm.ModelShape.from_config(__import__("transformers").AutoConfig.from_pretrained(llava))
    assert shape == _shape_and_config(tiny_model_dir)[0]   # the text part is the tiny model


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


def test_preflight_runs_for_an_architecture_the_memory_model_does_not_know(tmp_path, tiny_model_dir, tiny_data,
                                                                              monkeypatch):
    """The memory model is advice: a config it cannot read (Falcon's, with no intermediate_size) leaves the
    run to the preflight's real forward/backward, and says so; an out-of-memory there still names the micro-batch."""
    import lowmem_grpo.train as train_mod

    trainer = _trainer(tmp_path, tiny_model_dir, tiny_data)
    lines = []
    trainer.log = lines.append

    def unknown(config):
        raise mm.MemoryModelError("the memory model knows decoder-only LLaMA-style configs; this one lacks x")

    monkeypatch.setattr(train_mod.ModelShape, "from_config", unknown)
    out = trainer.preflight()
    assert out["peak_mib"] > 0 and out["predicted_mib"] is None
    assert any("preflight ok" in line and "memory model, n/a: the memory model knows" in line for line in lines)

    def boom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(train_mod, "completion_logprobs", boom)
    with pytest.raises(train_mod.TrainingError, match=r"preflight: a micro-batch of 3 .* ran out of memory "
                                                      r"\(OutOfMemoryError\)\. Memory model: n/a \(the memory model"):
        trainer.preflight()


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


# ----------------------------------------------------------------------------------------------------
# Decoding in waves sized to the budget (memory.decode_waves)
# ----------------------------------------------------------------------------------------------------

SHIPPED_CONFIGS = sorted((__import__("pathlib").Path(mm.__file__).parent / "model_configs").glob("*/*/config.json"))
LLAMA_8B = next(p.parent for p in SHIPPED_CONFIGS if p.parent.name == "Llama-3.1-8B-Instruct")


def _phase(est, name) -> int:
    return sum(est.phases[name].values())


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_waves_keep_the_peak_within_the_budget(engine):
    """For every shipped shape, completion length, G and budget where the static memory plus the train phase,
    and plus a one-sequence decode, each fit: the predicted peak with waves is within the budget, eval is no
    larger than the rollout or the train phase, the rollout takes the fewest calls that fit, made even, and eval's
    wave is the largest that fits (one more does not)."""
    from transformers import AutoConfig

    assert len(SHIPPED_CONFIGS) >= 5
    shapes = [mm.ModelShape.from_config(AutoConfig.from_pretrained(p.parent)) for p in SHIPPED_CONFIGS]
    checked = split = 0
    for shape in shapes:
        for completion in (512, 2048, 8192, 20000, 32000):
            for g in (4, 8, 16):
                w = mm.Workload(prompts_per_step=4, num_generations=g, micro_batch_size=1, prompt_tokens=512,
                                completion_tokens=completion, eval_prompts=200, optimizer="adamw_8bit", engine=engine,
                                kv_cache_bytes=4 * mm.GiB if engine == "vllm" else None)
                static = sum(mm.static_terms(shape, w).values())
                train = sum(mm.train_phase(shape, w, mm.lora_params(shape, w)).values())

                def decode(k):
                    return sum(mm.decode_phase(shape, w, k, "").values())

                for gib in (8, 12, 16, 24, 32, 48, 80):
                    budget = gib * mm.GiB
                    if static + max(train, decode(1)) > budget:
                        continue
                    est = mm.estimate(shape, w, budget)
                    assert est.peak <= budget, (shape, completion, g, gib)
                    assert _phase(est, "eval") <= max(_phase(est, "rollout"), _phase(est, "train"))
                    assert est.peak_phase != "eval"
                    waves = est.waves
                    if waves.rollout < waves.rollout_seqs:
                        fit = max(k for k in range(1, waves.rollout_seqs + 1) if static + decode(k) <= budget)
                        # the fewest calls that fit (one more sequence a call would not), made even
                        assert waves.rollout == mm.largest_wave(4, g, fit) <= fit
                        fewest = -(-4 // (fit // g)) if g <= fit else 4 * -(-g // fit)   # whole prompts, or split
                        assert waves.rollout_calls == len(mm.wave_plan(4, g, fit)) == fewest
                    if waves.eval < min(mm.EVAL_BATCH, 200):
                        more = decode(waves.eval + 1)
                        assert static + more > budget or more > max(decode(waves.rollout), train)
                    assert est.peak <= mm.estimate(shape, w).peak   # never more than without waves
                    checked += 1
                    split += waves.split("rollout") or waves.split("eval")
    assert checked > 100 and split > 20, (checked, split)


def _llama_20k(budget=None):
    """The long-completion case: Llama-3.1-8B, 20,000-token completions, G = 8, one prompt a step, a micro-batch
    of 1, 200 held-out prompts (recipes/gsm8k.yaml otherwise)."""
    from lowmem_grpo.recipe import load_recipe

    r = load_recipe("recipes/gsm8k.yaml", [f"model.name_or_path={LLAMA_8B}", "generation.max_new_tokens=20000",
                                           "generation.num_generations=8", "train.prompts_per_step=1",
                                           "train.micro_batch_size=1"])
    return mm.estimate_recipe(r, "cuda", prompt_tokens=384, budget=budget)


def test_long_completions_no_longer_peak_at_the_eval_batch(monkeypatch):
    monkeypatch.chdir(__import__("pathlib").Path(__file__).parent.parent)
    before, shape, w = _llama_20k()
    # Without a budget (as before waves): 64 held-out prompts decoded at once, their KV cache the peak.
    assert before.peak_phase == "eval" and before.peak > 150 * mm.GiB
    terms = {**before.static, **before.phases["eval"]}
    assert max(terms, key=terms.get).startswith("eval KV cache (64 seqs")
    after, _, _ = _llama_20k(32 * mm.GiB)
    assert after.peak <= 32 * mm.GiB and after.peak_phase != "eval"
    assert after.waves.rollout == 8 and 1 <= after.waves.eval <= 8
    assert _phase(after, "eval") <= max(_phase(after, "rollout"), _phase(after, "train"))
    assert "eval phase (200 seqs in 25 waves of 8)" in "\n".join(after.lines())
    tight, _, _ = _llama_20k(24 * mm.GiB)   # the rollout itself splits too
    assert tight.waves.split("rollout") and tight.peak <= 24 * mm.GiB
    assert f"rollout phase (8 seqs in 2 waves of {tight.waves.rollout})" in "\n".join(tight.lines())
    assert mm.advise(shape, w, 24 * mm.GiB).fits and mm.advise(shape, w, 32 * mm.GiB).fits


def _named_fields(line: str) -> list[str]:
    import re

    return re.findall(r"[a-z_]+\.[a-z_]+", line)


def test_only_cuda_advice_names_the_8bit_optimizer():
    assert "adamw_8bit" in mm._fields_for("optimizer state (adamw)", mm.Workload(device="cuda"))
    assert mm._fields_for("optimizer state (adamw)", mm.Workload(device="cpu")) == "a smaller lora.r"


def test_advise_never_names_a_field_twice(monkeypatch):
    # What advise printed before for the 20K case: the eval KV cache and its prefill named one field twice.
    old = [mm._fields_for("eval KV cache (64 seqs x 20384 tok)", mm.Workload()), "a smaller model.name_or_path",
           mm._fields_for("eval prefill activations", mm.Workload())]
    assert len(set(_named_fields(", ".join(old)))) < len(_named_fields(", ".join(old)))
    once = mm._each_field_once(old)
    assert len(once) == 2 and len(set(_named_fields(", ".join(once)))) == len(_named_fields(", ".join(once)))
    assert mm._each_field_once(["a / b.c", "b.c or d.e", "(fixed cost)"]) == ["a / b.c", "d.e", "(fixed cost)"]
    monkeypatch.chdir(__import__("pathlib").Path(__file__).parent.parent)
    _, shape, w = _llama_20k()
    seen = 0
    for change in ({}, {"device": "cpu"}, {"gradient_checkpointing": False}, {"quantized": False}, {"engine": "vllm"}):
        for gib in (4, 8, 12, 14):
            advice = mm.advise(shape, replace(w, **change), gib * mm.GiB)
            if advice.fits or advice.micro_batch_size is not None:
                continue
            fields = _named_fields(advice.lines[-1])
            assert advice.lines[-1].startswith("change one of") and len(fields) == len(set(fields)), advice.lines
            assert "eval_max_prompts" not in advice.lines[-1]   # eval decodes in waves: never why it does not fit
            seen += 1
    assert seen >= 5


def _decode_budget(shape, w, seqs: int) -> int:
    """The budget that holds exactly `seqs` sequences per generate call beside the static memory."""
    return sum(mm.static_terms(shape, w).values()) + sum(mm.decode_phase(shape, w, seqs, "").values())


def test_the_trainer_decodes_in_the_waves_its_budget_holds(tmp_path, tiny_model_dir, tiny_data, monkeypatch):
    """On this machine's memory one wave covers everything: the engine is built as before (no cap). With a
    budget that holds 3 sequences per call, the rollout (2 prompts x 4) and eval (8 prompts) decode at most 3
    at once, the trainer says so once, and eval's greedy result is the one-call result."""
    import lowmem_grpo.train as train_mod
    from lowmem_grpo.rollout.hf import HFEngine

    plain = _trainer(tmp_path, tiny_model_dir, tiny_data)
    assert plain.waves is not None and not plain.waves.split("rollout") and not plain.waves.split("eval")
    assert plain.waves.max_batch_sequences is None and plain.engine.max_batch_sequences is None
    before = plain.evaluate()
    shape, w = plain.memory_model(max(len(s.longest_prompt()) for s in (plain.train_set, plain.eval_set)))
    plain.close()

    monkeypatch.setattr(train_mod, "device_budget", lambda device: _decode_budget(shape, w, 3))
    sizes, real, logs = [], HFEngine._generate, []

    def recording(self, prompts, params):
        sizes.append(len(prompts) * params.n)
        return real(self, prompts, params)

    monkeypatch.setattr(HFEngine, "_generate", recording)
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run2")
    t = train_mod.Trainer(recipe_from_dict(d), log=logs.append)
    try:
        # a prompt's 4 samples take 2 calls under a cap of 3: 2 + 2, not 3 + 1 (rollout.base.wave_plan)
        assert (t.waves.rollout, t.waves.eval) == (2, 3) and t.engine.max_batch_sequences == 3
        assert [line for line in logs if "waves" in line] == [
            f"[lowmem-grpo] decoding in waves to fit {mm.fmt(t.memory_budget)} (memory model): "
            "rollout 8 seqs in 4 waves of 2; eval 8 seqs in 3 waves of at most 3"]
        assert sizes == [2]   # the start-up check's two samples (Trainer.check_sampler_agreement)
        sizes.clear()
        assert t.evaluate() == before and sizes == [3, 3, 2]
        sizes.clear()
        t.train_step()
        assert sizes == [2, 2, 2, 2]   # what the memory model's rollout wave says
        shape, w = t.memory_model(len(t.train_set.longest_prompt()))   # the preflight predicts at the waves
        assert t.preflight()["predicted_mib"] * mm.MiB == mm.estimate(shape, w, t.memory_budget).peak
    finally:
        t.close()


def test_the_cuda_budget_is_what_the_process_can_reach_less_the_allocators_share(monkeypatch):
    """A gaming card runs a desktop too: the budget is the memory this process can still get plus what its
    allocator holds (the model's weights), capped by a per-process fraction, less ALLOCATOR_SLACK; never the
    card's total. (torch.cuda's queries stubbed: CI has no GPU; tests/gpu checks the fraction on a real card.)"""
    import torch

    card, desktop, context, ours = 24 * mm.GiB, 1.5 * mm.GiB, 0.5 * mm.GiB, 3 * mm.GiB
    fraction = {"value": 1.0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=None: (int(card - desktop - context - ours), int(card)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i=None: int(ours))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i=None: fraction["value"])
    reachable = card - desktop - context          # 22 GiB: the free memory plus this process's 3 GiB
    assert mm.device_budget("cuda") == int(reachable * (1 - mm.ALLOCATOR_SLACK))
    fraction["value"] = 0.25                      # a shared card: 6 GiB for this process
    assert mm.device_budget("cuda") == int(card * 0.25 * (1 - mm.ALLOCATOR_SLACK))
    note = mm.budget_note("cuda", mm.device_budget("cuda"))   # what `lowmem-grpo estimate` says of it
    assert note.startswith("budget: 5.40 GiB of this GPU's 24.00 GiB") and "less 10%" in note, note
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert mm.device_budget("cuda") is None


def _trace_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "trace_memory.py"
    spec = importlib.util.spec_from_file_location("trace_memory", path)
    trace = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trace)
    return trace


@pytest.mark.parametrize("softcap", [False, True])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_the_log_prob_tiles_the_model_counts_are_the_kernels(softcap, entropy_grad):
    """The memory model's log-prob tile term against the storages the kernel keeps alive (forward and backward,
    traced): two tiles, three with both an entropy bonus's gradient and a soft-capped head (Gemma)."""
    from lowmem_grpo.logprobs import selective_log_softmax

    trace = _trace_module()
    n, d, chunk, vocab = 512, 8, 4096, 8192   # d small: the tiles are nearly all of it
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(n, d, generator=g).requires_grad_(), torch.randn(vocab, d, generator=g)
    t = torch.randint(0, vocab, (n,), generator=g)
    with trace.LiveTensors() as live:
        logp, ent = selective_log_softmax(h, w, t, chunk_rows=n, chunk_vocab=chunk, return_entropy=True,
                                          entropy_grad=entropy_grad, softcap=30.0 if softcap else None)
        (logp.sum() + (ent.sum() if entropy_grad else 0)).backward()
    shape = mm.ModelShape(vocab_size=vocab, hidden_size=d, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=d,
                          intermediate_size=d, tie_word_embeddings=False, logit_softcap=softcap)
    w_ = mm.Workload(micro_batch_size=1, completion_tokens=n, chunk_tokens=n, chunk_vocab=chunk, compute_bytes=4,
                     entropy_grad=entropy_grad, device="cpu")
    parts = mm.train_phase(shape, w_, mm.lora_params(shape, w_))
    tile = next(b for name, b in parts.items() if name.startswith("log-prob tile"))
    assert tile == (3 if softcap and entropy_grad else 2) * n * chunk * 4
    assert abs(live.peak - tile) <= 0.01 * tile, (live.peak, tile)


@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast"])
@pytest.mark.slow(25)
def test_the_update_per_token_matches_a_tensor_level_trace(tmp_path, autocast):
    """The memory model's update cost per completion token (the train phase's slope between two lengths) against
    scripts/trace_memory.py's tracer, which adds up the storages the trainer's update pass keeps alive: a 4-bit
    bf16 model, one sequence, with and without the decoder under bf16 autocast (model.autocast; on CPU peft's
    LoRA inputs become bf16 copies, which the model counts at 2 bytes). On CUDA the same comparison was made with
    the allocator's peak (docs/benchmarks.md, "On a GPU")."""
    from lowmem_grpo.batch import pack

    trace = _trace_module()
    trace.build(tmp_path, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=2048, layers=4, positions=2100)
    model, tok = load_policy(ModelConfig(name_or_path=str(tmp_path), compute_dtype="bfloat16", load_in_4bit=True),
                             LoraConfig(r=16, alpha=32))
    model.train()
    # 1,024 and 2,048 give the slope 2,048 and 4,096 do (to the byte), at a third of the time: the attention's
    # L^2 work in bf16 is most of it on a CPU without native bf16. Below 1,024 the loss tiles' fixed size shows.
    lengths, peaks = (1024, 2048), []
    for t in lengths:
        ids = torch.randint(4, len(tok), (t,), generator=torch.Generator().manual_seed(t)).tolist()
        mb = pack([[5, 6, 7]], [ids], torch.ones(1), 1, "token_mean", t, tok.pad_token_id)[0]
        model.zero_grad(set_to_none=True)
        with trace.LiveTensors() as live:
            trace.update_pass(model, mb, torch.device("cpu"), autocast)
        peaks.append(live.peak)
    traced = (peaks[1] - peaks[0]) / (lengths[1] - lengths[0])
    shape = mm.ModelShape.from_config(model.config)
    w = mm.Workload(micro_batch_size=1, prompt_tokens=3, bf16_autocast=autocast, device="cpu")
    n_lora = mm.lora_params(shape, w)
    train = [sum(mm.train_phase(shape, replace(w, completion_tokens=t), n_lora).values()) for t in lengths]
    predicted = (train[1] - train[0]) / (lengths[1] - lengths[0])
    print(f"per token: traced {traced / 1024:.1f} KiB, memory model {predicted / 1024:.1f} KiB")
    assert abs(predicted - traced) <= 0.2 * traced, (predicted, traced)


MOE_CONFIGS = tiny.MOE_LAYOUTS
_save_moe = tiny.save_moe_model


@pytest.mark.parametrize("cls", list(MOE_CONFIGS))
def test_a_mixture_of_experts_is_counted_as_it_loads(tmp_path, cls):
    """The routed experts are 3-D tensors that bitsandbytes leaves in compute dtype (checked on the loaded model:
    this fails when a bitsandbytes or transformers release starts quantizing them, and the memory model must
    follow), or NF4 where experts4bit.py stores them so; and the adapters peft puts on experts and routers are
    counted on the meta-device copy as on the model, either way."""
    _save_moe(cls, tmp_path)
    shape, config = _shape_and_config(tmp_path)
    assert shape.experts == 4 and shape.moe_layers == (2 if cls == "Qwen3MoeConfig" else 3)
    for nf4 in (False, True):
        cfg = ModelConfig(name_or_path=str(tmp_path), compute_dtype="float32", quantize_experts=nf4)
        model = load_base_model(cfg, quantized=True, device="cpu")
        experts = [p for name, p in model.named_parameters() if ".experts." in name]
        assert bool(experts) is not nf4 and all(p.dtype == torch.float32 and p.dim() == 3 for p in experts)
        real = sum(p.numel() * p.element_size() for p in [*model.parameters(), *model.buffers()])
        for qs in [getattr(getattr(m, "weight", None), "quant_state", None) for m in model.modules()]:
            if qs is not None:   # the 4-bit linears' scales: 8-bit absmax plus an fp32 one per 256 (double quant)
                real += qs.absmax.numel() * qs.absmax.element_size()
                real += qs.state2.absmax.numel() * 4 if qs.nested else 0
        predicted = mm.base_weight_bytes(shape, mm.Workload(quantized=True, double_quant=True, compute_bytes=4,
                                                            experts_nf4=nf4))
        assert abs(predicted - real) <= 0.03 * real, (nf4, predicted, real)   # Qwen3's q/k norms are not counted
        for targets in ("all-linear", ["q_proj", "k_proj", "v_proj", "o_proj"], ["q_proj", "down_proj"]):
            lora = LoraConfig(r=4, target_modules=targets)
            policy, _ = load_policy(cfg, lora)
            census = mm.experts_census(policy)
            assert mm.experts_census_from_config(config, cfg, lora) == census, (nf4, targets)
            assert census["experts_nf4"] is nf4
            if targets == "all-linear" and cls != "Qwen2MoeConfig":   # peft 0.21 maps these two onto bf16 experts
                assert census["lora_on_experts"] is not nf4
                if not nf4:
                    assert census["lora_params"] > mm.lora_params(shape, mm.Workload(lora_r=4, lora_targets=("all-linear",)))


@pytest.mark.slow(15)
def test_a_mixture_of_experts_update_matches_a_tensor_level_trace(tmp_path):
    """As the dense trace test: the update's cost per token (the MoE layer's routed copies, router, expert loop), and
    the fixed cost of peft's adapters on the experts: each MoE layer's forward builds its experts merged with LoRA,
    alive until its backward (measured as the difference between LoRA on everything and on attention only)."""
    from lowmem_grpo.batch import pack

    trace = _trace_module()

    def traced_and_predicted(folder, targets, lengths):
        model, tok = load_policy(ModelConfig(name_or_path=str(folder), compute_dtype="bfloat16", quantize_experts=False),
                                 LoraConfig(r=16, alpha=32, target_modules=targets))
        model.train()
        census = mm.experts_census(model)
        n, on_experts = census["lora_params"], census["lora_on_experts"]
        w = mm.Workload(micro_batch_size=1, prompt_tokens=3, device="cpu", **census)
        shape, rows = mm.ModelShape.from_config(model.config), []
        for t in lengths:
            ids = torch.randint(4, 200, (t,), generator=torch.Generator().manual_seed(t)).tolist()
            mb = pack([[5, 6, 7]], [ids], torch.ones(1), 1, "token_mean", t, tok.pad_token_id)[0]
            model.zero_grad(set_to_none=True)
            with trace.LiveTensors() as live:
                trace.update_pass(model, mb, torch.device("cpu"))
            rows.append((live.peak, sum(mm.train_phase(shape, replace(w, completion_tokens=t), n).values())))
        return rows, on_experts

    # Per token: 1,024 and 2,048 tokens (past the log-prob tile's growth), 8 experts of 128, top-2.
    wide = _save_moe("Qwen3MoeConfig", tmp_path / "wide", hidden_size=256, head_dim=64, num_experts=8,
                     moe_intermediate_size=128, mlp_only_layers=[], num_hidden_layers=2, vocab_size=2048)
    (a, b), _ = traced_and_predicted(wide, "all-linear", (1024, 2048))
    traced, predicted = (b[0] - a[0]) / 1024, (b[1] - a[1]) / 1024
    assert abs(predicted - traced) <= 0.2 * traced, (predicted, traced)
    # Fixed: 64 experts of 256 on 32 tokens, where the merged experts (12 MiB a layer) dwarf the activations.
    many = _save_moe("Qwen3MoeConfig", tmp_path / "many", hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                     head_dim=64, num_experts=64, moe_intermediate_size=256, mlp_only_layers=[], num_hidden_layers=2,
                     vocab_size=512)
    (everything,), on = traced_and_predicted(many, "all-linear", (32,))
    (attention,), off = traced_and_predicted(many, ["q_proj", "k_proj", "v_proj", "o_proj"], (32,))
    assert on and not off
    traced, predicted = everything[0] - attention[0], everything[1] - attention[1]
    assert abs(predicted - traced) <= 0.1 * traced, (predicted, traced)


def test_estimate_says_what_a_mixture_of_experts_costs(tmp_path, tiny_data):
    from lowmem_grpo.tiny import save_arch_model

    for kind, moe, nf4 in (("qwen3_moe", True, True), ("qwen3_moe", True, False), ("llama", False, True)):
        d = recipe_dict(save_arch_model(kind, tmp_path / kind), tiny_data, tmp_path / "run")
        d["model"]["quantize_experts"] = nf4
        est, shape, w = mm.estimate_recipe(recipe_from_dict(d), "cuda")
        said = [n for n in est.notes if "a mixture of 4 experts, 2 per token" in n]
        assert bool(said) is moe, (kind, est.notes)
        if moe and nf4:   # the recipe's default: 4-bit experts too, frozen, all-linear LoRA on the rest
            assert "in NF4 (model.quantize_experts), frozen" in said[0] and "peft adapts" not in said[0], said
            assert w.experts_nf4 and not w.lora_on_experts and mm.merged_experts_bytes(shape, w) == 0
            assert any("experts NF4" in name for name in est.static), est.static
        elif moe:   # experts in compute dtype: peft puts all-linear LoRA on them too
            assert "bitsandbytes does not quantize" in said[0] and "peft adapts them too" in said[0], said
            assert w.lora_on_experts and mm.merged_experts_bytes(shape, w) > 0
            assert any("merged with LoRA" in name for name in est.phases["rollout"]), est.phases["rollout"]


@pytest.mark.slow(10)
def test_the_readmes_figures_for_qwen3_30b_a3b():
    """The README's Models paragraph quotes these for Qwen3-30B-A3B's shape (its config.json's numbers): with the
    experts in NF4 (the default) the base weights and the predicted peak at G = 8 and 512 completion tokens;
    with them in bf16 the experts' bytes, peft's LoRA at r = 16 on all linear layers (experts and routers
    included), and one layer's experts merged with LoRA."""
    import transformers
    from pathlib import Path

    config = transformers.Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                         num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                                         num_experts_per_tok=8, moe_intermediate_size=768, tie_word_embeddings=False)
    shape = mm.ModelShape.from_config(config)
    lora = LoraConfig(r=16, alpha=32)
    bf16 = mm.Workload(**mm.experts_census_from_config(config, ModelConfig(name_or_path="m", quantize_experts=False), lora))
    nf4 = mm.Workload(**mm.experts_census_from_config(config, ModelConfig(name_or_path="m"), lora),
                      prompt_tokens=256, completion_tokens=512, num_generations=8, prompts_per_step=1, micro_batch_size=1)
    peak = mm.estimate(shape, nf4).peak
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    figures = (f"experts are {shape.expert_params() * 2 / mm.GiB:.0f} GiB in bf16",
               f"({bf16.lora_params / 1e6:.1f}M LoRA parameters", f"({mm.fmt(mm.merged_experts_bytes(shape, bf16))} a layer",
               f"base weights {mm.fmt(mm.base_weight_bytes(shape, nf4))}", f"predicted peak {mm.fmt(peak)}",
               f"{nf4.lora_params / 1e6:.1f}M LoRA parameters on attention and routers")
    assert [f for f in figures if f not in " ".join(readme.split())] == [], figures


# ----------------------------------------------------------------------------------------------------
# Found by a red team: advice, micro-batch, prompts, LoRA names, latent attention, validate, RoPE context
# ----------------------------------------------------------------------------------------------------

QWEN_15B = next(p.parent for p in SHIPPED_CONFIGS if p.parent.name == "Qwen2.5-1.5B-Instruct")


def _estimate_cli(tmp_path, d: dict, *args) -> Result:
    return CliRunner().invoke(main, ["estimate", str(write_recipe(tmp_path / "r.yaml", d)), *args])


def _qwen_recipe(tmp_path, tiny_data, **sections) -> dict:
    """The red team's recipes: Qwen2.5-1.5B (its shipped config, read offline), bf16, prompts of 256 tokens at most."""
    d = recipe_dict("Qwen/Qwen2.5-1.5B-Instruct", tiny_data, tmp_path / "run", model={"compute_dtype": "bfloat16"},
                    lora={"r": 16}, **sections)
    d["data"].update(max_prompt_tokens=256, eval_path="")
    return d


def test_advise_tries_a_smaller_tile_at_the_recipes_own_micro_batch(tmp_path, tiny_data):
    """advise searched from micro_batch_size - 1 down: at 1 it tried nothing and said "does not fit even with
    train.micro_batch_size: 1 and train.logprob_chunk_tokens: 128 (predicted 4.44 GiB > 12.15 GiB)", and at 2 it
    halved the micro-batch where a smaller tile alone fit. Now the largest micro-batch from the recipe's own down, with
    the largest tile (the recipe's or smaller) that fits; "even with" only for a setting that does not fit."""
    from transformers import AutoConfig

    shape = mm.ModelShape.from_config(AutoConfig.from_pretrained(QWEN_15B))
    w = mm.Workload(prompts_per_step=1, num_generations=4, micro_batch_size=1, prompt_tokens=256, completion_tokens=8192,
                    chunk_tokens=8192, chunk_vocab=151936)
    budget = 12 * mm.GiB
    for mb in (1, 2):
        advice = mm.advise(shape, replace(w, micro_batch_size=mb), budget)
        assert not advice.fits and (advice.micro_batch_size, advice.chunk_tokens) == (mb, 512), advice.lines
        assert advice.lines[1] == "set train.logprob_chunk_tokens: 512 (same result, more passes)."
        assert mm.estimate(shape, replace(w, micro_batch_size=mb, chunk_tokens=512), budget).peak <= budget
    # no fit at all: a tile already below 128 is named as the recipe has it, and the figure said is over the budget
    hopeless = mm.advise(shape, replace(w, chunk_tokens=64), 2 * mm.GiB)
    said = mm.estimate(shape, replace(w, chunk_tokens=64), 2 * mm.GiB).peak
    assert hopeless.lines[0] == (f"does not fit even with train.micro_batch_size: 1 and train.logprob_chunk_tokens: 64 "
                                 f"(predicted {mm.fmt(said)} > {mm.fmt(2 * mm.GiB)}). Largest terms:") and said > 2 * mm.GiB
    # the command as the red team ran it (the shipped config: offline)
    d = _qwen_recipe(tmp_path, tiny_data, generation={"max_new_tokens": 8192},
                     train={"prompts_per_step": 1, "micro_batch_size": 1, "logprob_chunk_tokens": 8192,
                            "logprob_chunk_vocab": 151936})
    res = _estimate_cli(tmp_path, d, "--memory", "14GiB")
    assert res.exit_code == 1 and "set train.logprob_chunk_tokens: 512 (same result" in res.output, res.output
    assert "even with" not in res.output


def test_a_micro_batch_larger_than_a_processes_completions_is_counted_as_them(tmp_path, tiny_model_dir, tiny_data):
    """The trainer packs at most one process's completions of a step into a micro-batch (batch.pack over its share):
    a larger train.micro_batch_size was counted as given (21.31 GiB, "does not fit", advice 40, where 32 fit)."""
    from lowmem_grpo.memory import workload_from_recipe

    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", generation={"num_generations": 8},
                    train={"prompts_per_step": 4, "micro_batch_size": 64})
    one, two = (workload_from_recipe(recipe_from_dict(d), 8, "cpu", processes=n) for n in (1, 2))
    assert (one.micro_batch_size, two.micro_batch_size) == (32, 16)   # 4 x 8 completions; 2 x 8 a process
    d["train"]["micro_batch_size"] = 32
    assert workload_from_recipe(recipe_from_dict(d), 8, "cpu") == one
    d = _qwen_recipe(tmp_path, tiny_data, generation={"num_generations": 8, "max_new_tokens": 1024},
                     train={"prompts_per_step": 4, "micro_batch_size": 64})
    res = _estimate_cli(tmp_path, d, "--memory", "16GiB")
    assert res.exit_code == 0 and "micro-batch 32 x 1280 tok" in res.output and "fits: " in res.output, res.output
    res = _estimate_cli(tmp_path, d, "--memory", "16GiB", "--nproc", "2")
    assert res.exit_code == 0 and "micro-batch 16 x 1280 tok" in res.output, res.output


def test_estimate_sizes_every_phase_for_the_longest_prompt_training_or_held_out(tmp_path, tiny_model_dir):
    """As the trainer (whole_run_memory_model): the longest prompt of data.train_path and data.eval_path. estimate read
    the training file only, so a longer held-out prompt went uncounted, and so did the context it passes."""
    from lowmem_grpo.data import PromptSet
    from lowmem_grpo.model import load_tokenizer

    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    tiny.write_jsonl([{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)], train)
    tiny.write_jsonl([{"prompt": "1" * 40 + "+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}], held)
    d = recipe_dict(tiny_model_dir, (train, held), tmp_path / "run", generation={"max_new_tokens": 30})
    r = recipe_from_dict(d)
    tok = load_tokenizer(r.model)
    short, long = (len(PromptSet(str(p), r.data, tok).longest_prompt()) for p in (train, held))
    assert short + 30 <= 64 < long + 30   # the tiny model's max_position_embeddings: passed by the held-out prompt only
    est, _, w = mm.estimate_recipe(r, "cpu")
    assert w.prompt_tokens == long
    assert f"note: prompt length {long} tokens: longest prompt in {held}, of the training and held-out prompts" in \
           "\n".join(est.lines())
    assert any(n.startswith(f"context: a prompt of {long} tokens") for n in est.notes), est.notes
    d["data"]["eval_path"] = ""
    est, _, w = mm.estimate_recipe(recipe_from_dict(d), "cpu")
    assert w.prompt_tokens == short and not any(n.startswith("context:") for n in est.notes)


def _model_folder(tiny_model_dir, folder, config) -> Path:
    """A model folder holding `config` (a transformers config) as config.json, the tiny model's tokenizer, and a
    weights file of no tensors (what validate reads of one: its header)."""
    import json
    import shutil

    from safetensors.torch import save_file

    folder.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, folder / f.name)
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    save_file({}, str(folder / "model.safetensors"))
    return folder


def test_lora_on_layers_with_other_names_is_counted_as_peft_adapts_them(tmp_path, tiny_model_dir, tiny_data,
                                                                       monkeypatch):
    """GPT-NeoX names its linears query_key_value, dense, dense_h_to_4h, dense_4h_to_h: the LLaMA-name rule counted 0
    LoRA parameters (peft: 196,608 at r 16). estimate counts them on a meta-device copy with peft, as for a mixture;
    where transformers cannot build that copy, the name rule, said in a note; targets the model lacks, as train says."""
    from peft import LoraConfig as PeftLoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt_neox", vocab_size=1000, hidden_size=256, num_attention_heads=8,
                                  num_hidden_layers=4, intermediate_size=512)
    config.architectures = ["GPTNeoXForCausalLM"]
    folder = _model_folder(tiny_model_dir, tmp_path / "neox", config)
    targets = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]
    d = recipe_dict(folder, tiny_data, tmp_path / "run", lora={"r": 16, "target_modules": targets})
    est, shape, w = mm.estimate_recipe(recipe_from_dict(d), "cuda", prompt_tokens=8)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    peft = get_peft_model(model, PeftLoraConfig(r=16, target_modules=targets))
    assert mm.lora_params(shape, w) == sum(p.numel() for p in peft.parameters() if p.requires_grad) == 196_608
    assert "LoRA parameters (0.2M, fp32)" in est.static

    def cannot_build(*a, **k):
        raise RuntimeError("no meta device here")

    monkeypatch.setattr(mm, "experts_census_from_config", cannot_build)
    est, shape, w = mm.estimate_recipe(recipe_from_dict(d), "cuda", prompt_tokens=8)
    assert mm.lora_params(shape, w) == 0 and est.notes[-1] == (
        "LoRA parameters: counted by LLaMA-style layer names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
        "down_proj), as transformers cannot build this model on the meta device (RuntimeError: no meta device here); "
        f"lora.target_modules={targets} matches none of them"), est.notes
    monkeypatch.undo()
    d["lora"]["target_modules"] = ["q_proj"]
    res = _estimate_cli(tmp_path, d, "--memory", "8GiB")
    assert res.exit_code == 2 and res.output.startswith("error: lora.target_modules=['q_proj']: Target modules") \
        and "layers are named dense, dense_4h_to_h, dense_h_to_4h, query_key_value" in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1


def _deepseek_v3_config():
    from transformers import AutoConfig

    config = AutoConfig.for_model("deepseek_v3", vocab_size=1000, hidden_size=256, num_attention_heads=8,
                                  num_hidden_layers=4, intermediate_size=512, num_key_value_heads=8, n_routed_experts=8,
                                  num_experts_per_tok=2, moe_intermediate_size=128, n_shared_experts=1,
                                  first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16,
                                  qk_nope_head_dim=32, v_head_dim=32, n_group=1, topk_group=1)
    config.architectures = ["DeepseekV3ForCausalLM"]
    return config


def test_multi_head_latent_attention_is_refused_in_one_line_and_still_validates(tmp_path, tiny_model_dir, tiny_data):
    """DeepSeek-V3's attention was counted as LLaMA's (its KV cache 5x over). transformers caches the latent, checked
    here, but each layer expands all of it to every head's keys and values at each step, which no term counts: the
    memory model refuses it (estimate: one line, exit 2). Training runs it, so validate does not refuse it."""
    from transformers import AutoModelForCausalLM

    config = _deepseek_v3_config()
    with pytest.raises(mm.UnknownArchitecture, match=r"^config.json: kv_lora_rank is 32: multi-head latent attention"):
        mm.ModelShape.from_config(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        cache = model(torch.randint(3, 900, (1, 10)), use_cache=True).past_key_values
    cached = sum(t.numel() for layer in cache.layers for t in (layer.keys, layer.values))
    assert cached == 4 * 10 * (32 + 16)   # layers x tokens x (kv_lora_rank + qk_rope_head_dim): the latent
    folder = _model_folder(tiny_model_dir, tmp_path / "dsv3", config)
    d = recipe_dict(folder, tiny_data, tmp_path / "run")
    res = _estimate_cli(tmp_path, d, "--memory", "8GiB")
    assert res.exit_code == 2 and res.output.startswith(f"error: model.name_or_path={str(folder)!r}: config.json: "
                                                        "kv_lora_rank is 32: multi-head latent attention"), res.output
    assert len(res.output.strip().splitlines()) == 1 and "allowed: LLaMA-style attention" in res.output
    res = CliRunner().invoke(main, ["validate", str(tmp_path / "r.yaml")])
    assert res.exit_code == 0 and ": ok (" in res.output, res.output


@pytest.mark.parametrize("changes,says", REFUSED_CONFIGS + [(dict(vocab_size="abc"), "'vocab_size' expected int")])
def test_validate_refuses_what_estimate_refuses(tmp_path, tiny_model_dir, tiny_data, changes, says):
    """validate said ok for a config.json that estimate (and so the trainer's memory model) refuses: a BERT, a
    vocab_size "abc", 0 layers. It now reads the config as estimate does, and names model.name_or_path."""
    folder = _config_folder(tiny_model_dir, tmp_path / "model", **changes)
    d = recipe_dict(folder, tiny_data, tmp_path / "run")
    res = CliRunner().invoke(main, ["validate", str(write_recipe(tmp_path / "r.yaml", d))])
    assert res.exit_code == 2 and f"model.name_or_path: {str(folder)!r}: " in res.output and says in res.output, \
        res.output
    assert "Traceback" not in res.output


def test_validate_refuses_a_config_that_is_no_json(tmp_path, tiny_model_dir, tiny_data):
    folder = _config_folder(tiny_model_dir, tmp_path / "model")
    (folder / "config.json").write_text('{"model_type": "qwen2", ')
    d = recipe_dict(folder, tiny_data, tmp_path / "run")
    res = CliRunner().invoke(main, ["validate", str(write_recipe(tmp_path / "r.yaml", d))])
    assert res.exit_code == 2 and "model.name_or_path: " in res.output and "JSON" in res.output, res.output
    assert "Traceback" not in res.output


def test_validate_and_estimate_take_the_context_rope_scaling_makes(tmp_path, tiny_model_dir, tiny_data):
    """A YaRN config (factor 8 on the tiny model's 64 positions, original_max_position_embeddings 64) takes 512
    tokens: validate and estimate held it to 64 (model.context_tokens too: tests/test_model.py)."""
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    folder = _config_folder(tiny_model_dir, tmp_path / "model", rope_parameters=yarn)
    d = recipe_dict(folder, tiny_data, tmp_path / "run", generation={"max_new_tokens": 100})
    path = write_recipe(tmp_path / "r.yaml", d)
    res = CliRunner().invoke(main, ["validate", str(path)])
    assert res.exit_code == 0 and "note:" not in res.output, res.output
    res = CliRunner().invoke(main, ["estimate", str(path), "--memory", "8GiB"])
    assert res.exit_code == 0 and "context:" not in res.output, res.output
    d["generation"]["max_new_tokens"] = 600
    res = CliRunner().invoke(main, ["validate", str(write_recipe(tmp_path / "r.yaml", d))])
    assert ("note: generation.max_new_tokens=600 alone comes to the model's context of 512 tokens, by its rope scaling "
            "of max_position_embeddings=64 (its config.json) or past it") in res.output, res.output
    res = CliRunner().invoke(main, ["estimate", str(tmp_path / "r.yaml"), "--memory", "8GiB"])
    assert "past the model's context of 512 tokens, by its rope scaling of max_position_embeddings=64: lower" in \
           " ".join(res.output.split()), res.output
