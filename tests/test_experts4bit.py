"""A mixture of experts' routed experts in NF4 (lowmem_grpo/experts4bit.py): the quantized layer against the model's
own eager layer on the dequantized weights (outputs, input and LoRA gradients), in the three layouts of
tiny.MOE_LAYOUTS; the bytes the experts take; loading through the recipe; a layout it does not handle left alone."""

from __future__ import annotations

import copy

import pytest
import torch

from lowmem_grpo import experts4bit as e4
from lowmem_grpo import memory as mm
from lowmem_grpo import tiny
from lowmem_grpo.model import attach_lora, load_base_model, load_policy
from lowmem_grpo.recipe import LoraConfig, ModelConfig


def _model(cls: str, tmp_path, dtype=torch.float64):
    import transformers

    folder = tiny.save_moe_model(cls, tmp_path / cls)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(dtype)


def _twin(quantized):
    """A copy of the model before quantization, its experts set to the dequantized NF4 weights, run by transformers'
    own eager experts loop: the plain reference."""
    twin = copy.deepcopy(quantized)
    for m in twin.modules():
        if hasattr(m, "nf4_shapes"):
            for proj in e4.PROJECTIONS:
                m.register_parameter(proj, torch.nn.Parameter(e4.dequantized(m, proj).double(), requires_grad=False))
                delattr(m, f"{proj}_nf4"), delattr(m, f"{proj}_absmax")
            del m.nf4_shapes
    twin.set_experts_implementation("eager")
    return twin.double()


@pytest.mark.parametrize("cls", list(tiny.MOE_LAYOUTS))
def test_the_nf4_layer_computes_what_the_models_own_layer_does_on_the_dequantized_weights(tmp_path, cls):
    """float32 NF4 layer vs the eager layer in float64 on the same (dequantized) weights: outputs, the gradient
    of the input embeddings, and LoRA's gradients on attention and routers (which flow back through the experts)."""
    model = _model(cls, tmp_path, torch.float32)
    assert e4.quantize_experts(model) == (2 if cls == "Qwen3MoeConfig" else 3, [])
    assert model.config._experts_implementation == e4.IMPLEMENTATION
    twin = _twin(model)
    lora = LoraConfig(r=4, alpha=8, target_modules="all-linear")
    torch.manual_seed(1)
    policy = attach_lora(model, lora, gradient_checkpointing=False)
    torch.manual_seed(1)
    reference = attach_lora(twin, lora, gradient_checkpointing=False)
    # The same adapters on both (the twin's experts, parameters again, also get peft's: left at their zero B), with
    # B drawn away from its zero init so that they matter.
    trained = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    twin_params = dict(reference.named_parameters())
    assert trained and not any(".experts." in n for n in trained)
    for name, a in trained.items():
        with torch.no_grad():
            a.normal_(0, 0.05)
            twin_params[name].copy_(a.double())
    ids = torch.randint(3, 20, (2, 16), generator=torch.Generator().manual_seed(0))
    outs = []
    for m, dtype in ((policy, torch.float32), (reference, torch.float64)):
        embeds = m.get_input_embeddings()(ids).detach().to(dtype).requires_grad_()
        logits = m(inputs_embeds=embeds).logits
        logits.log_softmax(-1)[..., 5].sum().backward()
        params = dict(m.named_parameters())
        outs.append((logits.double(), embeds.grad.double(), [params[n].grad.double() for n in trained]))
    (lg, eg, lorag), (lg64, eg64, lorag64) = outs
    def close(a, b):   # float32 against float64: within 1e-5 of the reference's largest value
        return (a - b).abs().max() <= 1e-5 * b.abs().max() and b.abs().max() > 0

    assert close(lg, lg64) and close(eg, eg64), ((lg - lg64).abs().max(), (eg - eg64).abs().max())
    assert len(lorag) == len(lorag64) > 0 and all(close(a, b) for a, b in zip(lorag, lorag64))


def test_the_experts_take_the_bytes_the_memory_model_counts(tmp_path):
    model = _model("MixtralConfig", tmp_path, torch.bfloat16)
    shape = mm.ModelShape.from_config(model.config)
    before = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    e4.quantize_experts(model)
    after = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if ".experts." in n)
    assert before == mm.experts_bytes(shape, mm.Workload(compute_bytes=2))
    code = 16 * 4 * shape.moe_layers   # (the 16-value NF4 code each module keeps)
    assert after == mm.experts_bytes(shape, mm.Workload(experts_nf4=True)) + code
    assert before / after > 3.4   # bf16 -> 4 bits + an fp32 absmax per 64


def test_a_staged_load_is_a_phase_of_its_own_on_the_cpu_only():
    """model.load_base_model holds a mixture's experts in compute dtype until it has quantized them, in host
    memory: on a CPU that was the run's peak (scripts/bench_memory.py on a 4-layer, 64-expert mixture: 1367 MiB
    measured; 859 MiB predicted without this phase, 1065 MiB without the bytes read). The phase is the experts' compute-dtype bytes over their NF4
    bytes, and the checkpoint's bf16 bytes of them read beside (memory-mapped), on the CPU only (on a GPU the
    staging is host memory); none with the experts unquantized."""
    shape = mm.ModelShape(vocab_size=1000, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                          intermediate_size=768, tie_word_embeddings=True, experts=64, experts_per_token=4,
                          expert_intermediate=512, moe_layers=4)
    cpu = mm.Workload(device="cpu", compute_bytes=4, experts_nf4=True)
    load = mm.estimate(shape, cpu).phases["load"]
    assert sum(load.values()) == 4 * 64 * 3 * 256 * 512 * (4 + 2 - (0.5 + 4 / 64))
    assert "load" not in mm.estimate(shape, mm.Workload(device="cuda", compute_bytes=2, experts_nf4=True)).phases
    assert "load" not in mm.estimate(shape, mm.Workload(device="cpu", compute_bytes=4)).phases


def test_the_recipe_loads_the_experts_in_nf4_and_a_run_trains(tmp_path, tiny_data):
    """model.quantize_experts (the default under load_in_4bit): the loaded policy's experts are NF4 buffers and LoRA
    is off them; with it false they stay compute-dtype parameters. Two steps train on the NF4 mixture."""
    from conftest import recipe_dict
    from lowmem_grpo.recipe import recipe_from_dict
    from lowmem_grpo.train import Trainer

    folder = tiny.save_moe_model("Qwen3MoeConfig", tmp_path / "moe")
    for nf4 in (True, False):
        policy, _ = load_policy(ModelConfig(name_or_path=str(folder), compute_dtype="float32", quantize_experts=nf4),
                                LoraConfig(r=4))
        experts = [m for m in policy.modules() if e4.is_experts(m)]
        assert experts and all(hasattr(m, "nf4_shapes") is nf4 for m in experts)
        assert any(".experts." in n for n, p in policy.named_parameters() if p.requires_grad) is not nf4
    from lowmem_grpo.metrics import read_metrics

    d = recipe_dict(folder, tiny_data, tmp_path / "run", train={"steps": 2, "preflight": False})
    assert Trainer(recipe_from_dict(d), log=lambda *a, **k: None).fit()["step"] == 2
    losses = [row["loss"] for row in read_metrics(tmp_path / "run") if "loss" in row]
    assert len(losses) == 2 and all(map(torch.isfinite, torch.tensor(losses))), losses
    # Export merges into the unquantized base, whose experts are parameters again: the adapter's config names no
    # expert (peft set them for all-linear and found none), so no untrained adapter lands on them there.
    import json
    import warnings

    from lowmem_grpo.export import export_run

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = export_run(tmp_path / "run", tmp_path / "exp", log=lambda *a, **k: None)
    assert not [w for w in caught if "missing adapter keys" in str(w.message)], [str(w.message) for w in caught]
    config = json.loads((tmp_path / "exp" / "adapter" / "adapter_config.json").read_text())
    assert not any(t in ("gate_up_proj", "down_proj") for t in config.get("target_parameters") or [])
    assert out["max_logit_diff"] < 1e-4


def test_a_layout_it_does_not_handle_is_left_as_it_is(tmp_path):
    """gpt-oss's experts are transposed, biased and interleaved: not quantized, said, and the model still runs."""
    import transformers

    config = transformers.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                       num_experts_per_tok=2, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(config)
    n, problems = e4.quantize_experts(model)
    assert n == 0 and problems and "is_transposed=True" in problems[0] and "has_bias=True" in problems[0], problems
    assert not any(hasattr(m, "nf4_shapes") for m in model.modules())
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 64)


def test_a_quantized_model_can_be_quantized_again_and_the_meta_copy_only_takes_shapes():
    import transformers

    config = transformers.Qwen3MoeConfig(**{**tiny.ARCH_SIZES, **tiny.MOE_LAYOUTS["Qwen3MoeConfig"]})
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    assert e4.quantize_experts(meta) == (1, [])   # layer 1 is dense (mlp_only_layers)
    assert all(b.is_meta for b in meta.buffers()) and e4.quantize_experts(meta) == (0, [])


def test_a_base_loaded_without_4bit_keeps_its_experts(tmp_path):
    """Export merges into the unquantized base: its experts stay parameters in the compute dtype."""
    folder = tiny.save_moe_model("Qwen2MoeConfig", tmp_path / "moe")
    base = load_base_model(ModelConfig(name_or_path=str(folder), compute_dtype="float32"), quantized=False)
    assert not any(hasattr(m, "nf4_shapes") for m in base.modules())
    assert any(".experts." in n and p.dim() == 3 for n, p in base.named_parameters())
