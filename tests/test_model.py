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


def test_a_folder_without_a_model_in_it_says_what_it_holds(tmp_path, tiny_model_dir):
    """An empty folder, or one without tokenizer files: named, with what the folder holds (transformers blamed a
    missing sentencepiece, or built an empty tokenizer)."""
    import shutil

    from lowmem_grpo.model import ModelLoadError, load_tokenizer

    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError) as err:
        load_policy(_cfg(tmp_path / "empty"), LoraConfig())
    assert str(err.value).startswith(f"model.name_or_path={str(tmp_path / 'empty')!r}: the folder has no config.json")
    assert "(it is empty)" in str(err.value) and "sentencepiece" not in str(err.value)
    weights = tmp_path / "weights"
    weights.mkdir()
    for f in tiny_model_dir.iterdir():
        if not f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, weights / f.name)
    with pytest.raises(ModelLoadError, match=r"no tokenizer files \(tokenizer.json, .*\); it holds: config.json, "):
        load_tokenizer(_cfg(weights))


# -- architectures whose forward transforms the LM head's logits (model.logit_transform) ----------------

@pytest.mark.parametrize("kind", ["gemma2", "gemma3_text", "cohere", "granite"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_scaled_or_soft_capped_head_gives_the_models_own_log_probs(kind, dtype, tmp_path, monkeypatch):
    """Gemma soft-caps its logits, Cohere and Granite scale them: the trainer's log-probs (4-bit base, LoRA on)
    equal log_softmax of the model's own forward (in bf16, within what its bf16 logits round away: the check
    allows 2^-7 x the largest |logit|), and with the transform unknown the start-up check refuses the model
    instead of training a policy other than the one sampled (11 to 57 nats off here, in either dtype)."""
    from lowmem_grpo.tiny import save_arch_model
    from lowmem_grpo import model as model_module
    from lowmem_grpo.model import ModelLoadError, check_logit_head

    cfg = ModelConfig(name_or_path=str(save_arch_model(kind, tmp_path / kind)), compute_dtype=dtype, load_in_4bit=True)
    policy, _ = load_policy(cfg, LoraConfig(r=4, alpha=8))
    _randomize_lora(policy)
    assert check_logit_head(policy) < (1e-4 if dtype == "float32" else 0.2)
    monkeypatch.setattr(model_module, "logit_transform", lambda config: (1.0, None))
    allowed = r"0.001" if dtype == "float32" else r"0\.[0-9]+"
    with pytest.raises(ModelLoadError, match=rf"model type '{kind}': the chunked log-probs differ from the model's "
                                             rf"own by up to [0-9.]+ nats \(allowed {allowed}\)"):
        check_logit_head(policy)


def test_training_a_soft_capped_model_scores_with_the_samplers_log_probs(tiny_data, tmp_path):
    """End to end on a Gemma 2 shape: the trainer's log-probs of the sampled tokens at the rollout weights are
    the transformers engine's own (rollout/logprob_abs_diff ~ 1e-7; 4.2 nats before the soft-cap was applied)."""
    from conftest import QUIET, recipe_dict
    from lowmem_grpo.tiny import save_arch_model
    from lowmem_grpo.metrics import read_metrics
    from lowmem_grpo.recipe import recipe_from_dict
    from lowmem_grpo.train import Trainer

    d = recipe_dict(save_arch_model("gemma2", tmp_path / "gemma2"), tiny_data, tmp_path / "run",
                    rewards={"functions": [{"function": "math"}]}, train={"steps": 2, "eval_every": 0})
    trainer = Trainer(recipe_from_dict(d), **QUIET)
    trainer.fit()
    rows = [r for r in read_metrics(tmp_path / "run") if r.get("rollout/logprob_abs_diff") is not None]
    assert len(rows) == 2 and max(r["rollout/logprob_abs_diff_max"] for r in rows) < 1e-4


@pytest.mark.parametrize("kind", ["gemma3_text", "mistral", "qwen2"])
def test_prompts_are_shared_only_where_no_sliding_window_is_narrower_than_a_row(kind):
    """§12's shared rows carry their own per-query mask, which transformers applies as it is, window or not:
    with a window narrower than a row, a completion would see further back than the model does (the log-probs
    differ by ~0.3 nats here). So sharing is on only where every window is at least a row wide, and the
    trainer's choice always gives the model's own log-probs."""
    import transformers

    from lowmem_grpo.batch import SHARED_MAX_WIDTH, completion_logprobs, pack
    from lowmem_grpo.model import sliding_window, takes_shared_prompts

    sizes = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    make = {"gemma3_text": lambda w: transformers.Gemma3TextConfig(head_dim=16, sliding_window=w, **sizes),
            "mistral": lambda w: transformers.MistralConfig(sliding_window=w, **sizes),
            "qwen2": lambda w: transformers.Qwen2Config(use_sliding_window=True, sliding_window=w, max_window_layers=0,
                                                        **sizes)}[kind]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 300, (10,), generator=g).tolist()
    completions = [torch.randint(1, 300, (12,), generator=g).tolist() for _ in range(4)]
    for window, shares in ((4, False), (SHARED_MAX_WIDTH, True)):
        config = make(window)
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        assert sliding_window(model) == window and takes_shared_prompts(model, SHARED_MAX_WIDTH) is shares
        with torch.no_grad():
            def logprobs(share):
                mb = pack([prompt] * 4, completions, torch.ones(4), 4, "token_mean", 12, 0, share_prompts=share)[0]
                return completion_logprobs(model, mb, 1.0, 1024, 8192)

            ids = torch.tensor([prompt + completions[0]])
            own = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), -1)
            own = own.gather(1, torch.tensor(completions[0])[:, None])[:, 0]
            chosen = logprobs(takes_shared_prompts(model, SHARED_MAX_WIDTH))
            assert (chosen[:12] - own).abs().max() < 1e-5
            if not shares:   # what sharing would have given: another policy's log-probs
                assert (logprobs(True) - chosen).abs().max() > 0.05


def test_lora_targets_the_model_lacks_are_named_with_the_ones_it_has(tiny_model_dir):
    """Phi-3 fuses q/k/v into qkv_proj, so a recipe written for Llama names modules it lacks: one line naming
    the field and the model's own linear layers, not peft's traceback."""
    from lowmem_grpo.model import ModelLoadError

    with pytest.raises(ModelLoadError, match=r"lora.target_modules=\['qkv_proj'\]: Target modules \{'qkv_proj'\} not "
                                             r"found in the base model.* This model's linear layers are named down_proj, "
                                             r"gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj; or write 'all-linear'"):
        load_policy(_cfg(tiny_model_dir), LoraConfig(r=4, alpha=8, target_modules=["qkv_proj"]))


def test_a_forward_without_full_logits_leaves_the_head_unchecked(tiny_model_dir, monkeypatch):
    """Unsloth's patched forward may return no logits (an empty tensor): nothing to compare with, so the check
    returns None (the trainer says so) instead of failing on the shape."""
    from types import SimpleNamespace

    from lowmem_grpo.model import check_logit_head

    policy, _ = load_policy(_cfg(tiny_model_dir), LoraConfig(r=4, alpha=8))
    assert check_logit_head(policy) < 1e-4
    monkeypatch.setattr(type(policy), "__call__", lambda self, **kw: SimpleNamespace(logits=torch.empty(0)))
    assert check_logit_head(policy) is None


def test_peft_s_own_moe_pattern_warning_is_not_shown(tmp_path):
    """peft 0.21 warns, on a Qwen3-MoE with 'all-linear' (the default), that a rank pattern it added itself for the
    fused experts matched nothing; attach_lora keeps that from the user and lets other warnings through."""
    import warnings

    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    from lowmem_grpo.model import attach_lora, load_base_model
    from lowmem_grpo.tiny import save_arch_model

    folder = save_arch_model("qwen3_moe", tmp_path / "moe")
    targets = "all-linear"

    def warned(attach) -> list[str]:
        base = load_base_model(ModelConfig(name_or_path=str(folder), compute_dtype="float32"), quantized=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            attach(base)
        return [str(w.message) for w in caught if "pattern keys did not match" in str(w.message)]

    assert warned(lambda m: get_peft_model(m, PeftLoraConfig(r=4, target_modules=targets, task_type="CAUSAL_LM")))
    assert not warned(lambda m: attach_lora(m, LoraConfig(r=4, target_modules=targets)))


def test_disable_dropout(tiny_model_dir, tmp_path):
    """A model whose config has attention dropout: in training mode (the update's forward) two passes differ unless
    model.disable_dropout zeroes it, which leaves the adapters' own dropout (lora.dropout) as set."""
    import json
    import shutil

    folder = tmp_path / "dropout"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    for disable, same in ((False, False), (True, True)):
        cfg = ModelConfig(name_or_path=str(folder), compute_dtype="float32", load_in_4bit=True, disable_dropout=disable)
        policy, tok = load_policy(cfg, LoraConfig(r=4, alpha=8, dropout=0.25))
        _randomize_lora(policy, seed=1)   # (fresh adapters add 0, whatever their dropout)
        ids = torch.tensor([tok.encode("<s>1+2=3+4=7", add_special_tokens=False)])
        policy.train()
        torch.manual_seed(0)
        with torch.no_grad():
            first, second = hidden_states(policy, ids), hidden_states(policy, ids)
        lora = [m.p for n, m in policy.named_modules() if isinstance(m, torch.nn.Dropout) and "lora_dropout" in n]
        assert lora and all(p == 0.25 for p in lora)
        if same:   # only the adapters' dropout is left: with the adapters off the passes agree
            with reference_mode(policy), torch.no_grad():
                assert torch.equal(hidden_states(policy, ids), hidden_states(policy, ids))
        else:
            with reference_mode(policy), torch.no_grad():
                assert not torch.equal(hidden_states(policy, ids), hidden_states(policy, ids))
        assert not torch.equal(first, second)   # lora.dropout 0.25 still acts in both cases


@pytest.mark.parametrize("positions,rope,context", [
    (512, None, 512),
    # found by a red team: YaRN's factor 8 on 512 pretrained positions makes 4,096 (data rejected prompts of 512)
    (512, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512}, 4096),
    (32768, {"type": "yarn", "factor": 4.0}, 131072),   # Qwen2.5's documented rope_scaling (original: the positions)
    (163840, {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096}, 163840),   # DeepSeek-V3's
    (131072, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}, 131072),   # Llama 3.1's positions already count it
    (2048, {"rope_type": "dynamic", "factor": 2.0}, 4096),
    (131072, {"rope_type": "linear", "factor": 8.0}, 131072),   # Gemma 3's positions already count it
])
def test_the_context_is_what_rope_scaling_extends_it_to(positions, rope, context):
    """model.context_tokens (the data's bad-row check, the transformers engine's end of a completion), estimate and
    validate (model.context_limit, one rule): max_position_embeddings, or the longer context the RoPE scaling makes."""
    from types import SimpleNamespace

    import transformers

    from lowmem_grpo.model import context_limit
    from lowmem_grpo.model import context_tokens

    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=positions,
                                      **({"rope_scaling": rope} if rope else {}))
    assert context_tokens(SimpleNamespace(config=config)) == context_limit(config) == context
    assert context_tokens(SimpleNamespace(config=None)) is None
