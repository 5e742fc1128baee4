"""The real model path: bitsandbytes 4-bit + peft LoRA, reference = adapters disabled, merged export."""

import pytest
import torch

from lowmem_grpo.model import (eval_mode, hidden_states, lm_head_params, load_base_model, load_policy,
                               reference_mode)
from lowmem_grpo.recipe import LoraConfig, ModelConfig


def _cfg(path, four_bit=True):
    return ModelConfig(name_or_path=str(path), compute_dtype="float32", load_in_4bit=four_bit)


def _randomize_lora(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_" in name:
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _lora_grads(model, ids):
    model.zero_grad(set_to_none=True)
    hidden_states(model, ids).pow(2).mean().backward()
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters() if "lora_" in n}


def _dequantized_twin(tiny_model_dir, quantized_policy):
    """An unquantized model whose base weights are exactly the 4-bit model's dequantized weights."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    twin, _ = load_policy(_cfg(tiny_model_dir, four_bit=False), LoraConfig(r=4, alpha=8))
    q_modules = dict(quantized_policy.named_modules())
    for name, module in twin.named_modules():
        q = q_modules.get(name)
        if isinstance(q, bnb.nn.Linear4bit):
            with torch.no_grad():
                module.weight.copy_(F.dequantize_4bit(q.weight.data, q.weight.quant_state).to(module.weight.dtype))
    twin.load_state_dict({k: v for k, v in quantized_policy.state_dict().items() if "lora_" in k}, strict=False)
    return twin


def test_4bit_backward_after_eval_forward(tiny_model_dir):
    """bitsandbytes repacks 4-bit weights on a CPU eval/no-grad forward (AVX512-BF16 CPUs), after which
    backward breaks. Our loader disables that; the LoRA gradients after an eval forward must equal the
    gradients of the unquantized path over the same (dequantized) weights."""
    policy, tok = load_policy(_cfg(tiny_model_dir), LoraConfig(r=4, alpha=8))
    _randomize_lora(policy)
    ids = torch.tensor([tok.encode("<s>12+35=47</s>", add_special_tokens=False)] * 2)
    with torch.no_grad(), eval_mode(policy):  # the rollout/reference pass that used to trigger the repack
        hidden_states(policy, ids)
    got = _lora_grads(policy, ids)
    twin = _dequantized_twin(tiny_model_dir, policy)
    want = _lora_grads(twin, ids)
    assert set(got) == set(want) and len(got) > 0
    for name in want:
        assert got[name] is not None, f"{name}: no gradient after an eval forward"
        assert torch.allclose(got[name], want[name], rtol=1e-3, atol=1e-6), name


def test_reference_is_the_adapter_free_base(tiny_model_dir):
    policy, tok = load_policy(_cfg(tiny_model_dir), LoraConfig(r=4, alpha=8))
    _randomize_lora(policy, seed=1)
    base = load_base_model(_cfg(tiny_model_dir))  # the same 4-bit base, no LoRA at all
    ids = torch.tensor([tok.encode("<s>1+2=3", add_special_tokens=False)])
    with torch.no_grad(), eval_mode(policy):
        with reference_mode(policy):
            ref = hidden_states(policy, ids)
        pol = hidden_states(policy, ids)
    with torch.no_grad():
        plain = base.model(input_ids=ids).last_hidden_state
    assert torch.equal(ref, plain)
    assert (pol - plain).abs().max() > 1e-3  # and the adapters really are on outside the context


def test_lm_head_is_plain_and_frozen(tiny_model_dir):
    policy, _ = load_policy(_cfg(tiny_model_dir), LoraConfig(r=4, alpha=8))
    head = lm_head_params(policy)
    assert head.weight.dim() == 2 and not head.weight.requires_grad


def test_missing_model_is_a_clear_error(tmp_path):
    from lowmem_grpo.model import ModelLoadError

    with pytest.raises(ModelLoadError, match="model.name_or_path.*: no such model folder"):
        load_policy(_cfg(tmp_path / "nope"), LoraConfig())
    (tmp_path / "weights.bin").write_bytes(b"")
    for name in ("runs/quickstart/bsae", "./base", str(tmp_path / "weights.bin")):   # paths, not hub ids
        with pytest.raises(ModelLoadError, match="no such model folder"):
            load_policy(_cfg(name), LoraConfig())
