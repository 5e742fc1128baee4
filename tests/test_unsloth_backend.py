"""model.backend: unsloth. Without an NVIDIA GPU it is a clear, named error, not a traceback. The glue itself
(lowmem_grpo/model.py:load_unsloth_policy) runs here against a stand-in `unsloth` module: FastLanguageModel's
from_pretrained, get_peft_model and patch_peft_model with the signatures and defaults of Unsloth 2026.7
(unsloth/models/loader.py, llama.py), loading the tiny model with transformers and attaching LoRA with peft, and
recording what they were given. Unsloth itself never runs here (it needs CUDA)."""

import os
import shutil
import subprocess
import sys
import types

import pytest
import torch

from conftest import recipe_dict, write_recipe
from lowmem_grpo import tiny
from lowmem_grpo.model import ModelLoadError, eval_mode, load_policy, reference_mode
from lowmem_grpo.recipe import LoraConfig, ModelConfig, recipe_from_dict

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")


@no_gpu
def test_unsloth_backend_without_gpu_is_a_named_error(tiny_model_dir):
    cfg = ModelConfig(name_or_path=str(tiny_model_dir), compute_dtype="float32", backend="unsloth")
    with pytest.raises(ModelLoadError, match="model.backend=unsloth needs an NVIDIA GPU"):
        load_policy(cfg, LoraConfig())


@no_gpu
def test_unsloth_backend_cli_error(tiny_model_dir, tiny_data, tmp_path):
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run")
    d["model"]["backend"] = "unsloth"
    recipe_from_dict(d)  # a valid recipe: the machine, not the recipe, is the problem
    p = subprocess.run([sys.executable, "-m", "lowmem_grpo.cli", "train", str(write_recipe(tmp_path / "r.yaml", d))],
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert p.returncode == 2 and "model.backend=unsloth needs an NVIDIA GPU" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr


# -- the glue, against a stand-in for Unsloth -------------------------------------------------------------------------

QWEN2_LINEARS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def _forget_checkpointing(model) -> None:
    """What Unsloth's generate does first (FastLlamaModel.for_inference): every module's gradient_checkpointing off,
    the model in eval mode. It turns them back on (for_training) only when the model was training."""
    for module in model.modules():
        if hasattr(module, "gradient_checkpointing"):
            module.gradient_checkpointing = False
    model.eval()


@pytest.fixture
def unsloth(monkeypatch):
    """A stand-in `unsloth` module in sys.modules, and a GPU for load_unsloth_policy's check alone (torch.cuda reads
    False everywhere else, peft's device choice included). Yields the calls: {name: [kwargs, ...]}."""
    from peft import LoraConfig as PeftLoraConfig, get_peft_model as peft_get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    calls = {"from_pretrained": [], "get_peft_model": [], "patch_peft_model": []}

    def from_pretrained(model_name="unsloth/Llama-3.2-1B-Instruct", max_seq_length=2048, dtype=None,
                        load_in_4bit=True, trust_remote_code=False, use_gradient_checkpointing="unsloth",
                        use_exact_model_name=False, **kwargs):
        calls["from_pretrained"].append(dict(model_name=model_name, max_seq_length=max_seq_length, dtype=dtype,
                                             load_in_4bit=load_in_4bit, trust_remote_code=trust_remote_code,
                                             use_gradient_checkpointing=use_gradient_checkpointing,
                                             use_exact_model_name=use_exact_model_name, **kwargs))
        model = AutoModelForCausalLM.from_pretrained(model_name, dtype=dtype or torch.float32)
        model.config.unsloth_version = "2026.7.3"   # (Unsloth's loader records itself so)
        tokenizer = AutoTokenizer.from_pretrained(model_name)
        tokenizer.padding_side = "right"   # where Unsloth's get_peft_model and for_training leave its tokenizer
        plain = model.generate

        def unsloth_fast_generate(*args, **kw):
            _forget_checkpointing(model)
            width = kw["input_ids"].shape[1] if "input_ids" in kw else 0
            if width + kw.get("max_new_tokens", 0) > model.config.max_position_embeddings:   # as Unsloth's refuses
                raise ValueError("Unsloth: input length + max_new_tokens exceeds the maximum sequence length")
            return plain(*args, **kw)

        model.generate = unsloth_fast_generate
        return model, tokenizer

    def _checkpointing(model, mode):
        if mode:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def get_peft_model(model, r=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"),
                       lora_alpha=16, lora_dropout=0.0, bias="none", use_gradient_checkpointing="unsloth",
                       random_state=3407, **kwargs):
        calls["get_peft_model"].append(dict(r=r, target_modules=list(target_modules), lora_alpha=lora_alpha,
                                            lora_dropout=lora_dropout, bias=bias,
                                            use_gradient_checkpointing=use_gradient_checkpointing,
                                            random_state=random_state, **kwargs))
        set_seed(random_state)   # as Unsloth's does
        _checkpointing(model, use_gradient_checkpointing)
        return peft_get_peft_model(model, PeftLoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                                                         bias=bias, target_modules=list(target_modules),
                                                         task_type="CAUSAL_LM"))

    def patch_peft_model(model, use_gradient_checkpointing="unsloth"):
        calls["patch_peft_model"].append(dict(use_gradient_checkpointing=use_gradient_checkpointing))
        _checkpointing(model.get_base_model(), use_gradient_checkpointing)
        return model

    fast = type("FastLanguageModel", (), {"from_pretrained": staticmethod(from_pretrained),
                                          "get_peft_model": staticmethod(get_peft_model),
                                          "patch_peft_model": staticmethod(patch_peft_model)})
    module = types.ModuleType("unsloth")
    module.FastLanguageModel = fast
    monkeypatch.setitem(sys.modules, "unsloth", module)

    real = torch.cuda.is_available
    monkeypatch.setattr(torch.cuda, "is_available",
                        lambda: sys._getframe(1).f_globals.get("__name__") == "lowmem_grpo.model" or real())
    return calls


def _unsloth_cfg(path, **fields) -> ModelConfig:
    return ModelConfig(name_or_path=str(path), compute_dtype="float32", backend="unsloth", **fields)


def test_unsloth_gets_the_recipes_settings(unsloth, tiny_model_dir):
    """Before: no max_seq_length (Unsloth's 2048: a linear RoPE stretch of this 64-position model, and a truncation
    of every longer sequence of a longer model), Unsloth's pre-quantized copy of a hub model in place of the named
    one, 'all-linear' as a fixed list of Llama names, and Unsloth's fixed seed 3407 for the adapters' init, whatever
    the recipe's seed."""
    torch.manual_seed(1)
    model, tok = load_policy(_unsloth_cfg(tiny_model_dir), LoraConfig(r=4, alpha=8, dropout=0.05))
    assert unsloth["from_pretrained"] == [dict(model_name=str(tiny_model_dir), max_seq_length=64, dtype=torch.float32,
                                               load_in_4bit=True, trust_remote_code=False,
                                               use_gradient_checkpointing="unsloth", use_exact_model_name=True)]
    (peft_call,) = unsloth["get_peft_model"]
    assert {k: v for k, v in peft_call.items() if k != "random_state"} == dict(
        r=4, target_modules=QWEN2_LINEARS, lora_alpha=8, lora_dropout=0.05, bias="none",
        use_gradient_checkpointing="unsloth")
    assert unsloth["patch_peft_model"] == []
    # the transformers path's tokenizer rules, not the tokenizer Unsloth hands back
    assert tok.padding_side == "left" and tok.pad_token == "<pad>"
    # the reference: the same model with its adapters off
    assert hasattr(model, "disable_adapter")
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad(), eval_mode(model):
        policy = model(input_ids=ids).logits
        with reference_mode(model):
            reference = model(input_ids=ids).logits
    assert not torch.allclose(policy, reference)
    # the adapters' initial values follow the recipe's seed (the trainer seeds torch's stream before loading)
    torch.manual_seed(1)
    load_policy(_unsloth_cfg(tiny_model_dir), LoraConfig(r=4, alpha=8))
    torch.manual_seed(2)
    load_policy(_unsloth_cfg(tiny_model_dir), LoraConfig(r=4, alpha=8))
    seeds = [c["random_state"] for c in unsloth["get_peft_model"]]
    assert seeds[0] == seeds[1] != seeds[2]


def test_unsloth_gets_named_modules_and_no_checkpointing(unsloth, tiny_model_dir):
    load_policy(_unsloth_cfg(tiny_model_dir, gradient_checkpointing=False, load_in_4bit=False),
                LoraConfig(r=8, alpha=16, target_modules=["q_proj", "v_proj"]))
    (load,) = unsloth["from_pretrained"]
    assert load["use_gradient_checkpointing"] is False and load["load_in_4bit"] is False
    (peft_call,) = unsloth["get_peft_model"]
    assert peft_call["target_modules"] == ["q_proj", "v_proj"] and peft_call["use_gradient_checkpointing"] is False
    assert (peft_call["r"], peft_call["lora_alpha"]) == (8, 16)


def test_unsloth_refuses_a_tokenizer_past_the_embedding(unsloth, tiny_model_dir, tmp_path):
    """As the transformers path does (tests/test_model_folders.py). Before: loaded, and the first forward of a
    prompt holding the extra token would fail with an IndexError on the GPU."""
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    tok = tiny.build_tokenizer()
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(folder)
    with pytest.raises(ModelLoadError) as err:
        load_policy(_unsloth_cfg(folder), LoraConfig(r=4, alpha=8))
    assert str(err.value).startswith(f"model.name_or_path={str(folder)!r}: the tokenizer has 22 tokens (eos '</s>' = "
                                     "2) and the model's embedding 21 rows: ids from 21 on index no row")


def test_unsloth_resumes_a_saved_adapter(unsloth, tiny_model_dir, tmp_path):
    """A checkpoint's adapter loads with its weights, through Unsloth's patch_peft_model (its LoRA kernels and
    checkpointing, as Unsloth's own loader does with an adapter). Before: a plain peft model, checkpointing off."""
    from peft import LoraConfig as PeftLoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    saved = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                           PeftLoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    for name, p in saved.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    saved.save_pretrained(tmp_path / "adapter")
    want = {n: p.detach().clone() for n, p in saved.named_parameters() if "lora_" in n}

    model, _ = load_policy(_unsloth_cfg(tiny_model_dir), LoraConfig(r=4, alpha=8),
                           adapter_path=str(tmp_path / "adapter"))
    assert unsloth["get_peft_model"] == []
    assert unsloth["patch_peft_model"] == [dict(use_gradient_checkpointing="unsloth")]
    got = dict(model.named_parameters())
    assert want and all(torch.equal(got[n], w) and got[n].requires_grad for n, w in want.items())
    assert hasattr(model, "disable_adapter")


def test_unsloth_generate_keeps_gradient_checkpointing(unsloth, tiny_model_dir):
    """Unsloth's generate turns checkpointing off and back on only from training mode; the rollouts generate in
    eval mode. Before: training ran without checkpointing from the first rollout on."""
    model, tok = load_policy(_unsloth_cfg(tiny_model_dir), LoraConfig(r=4, alpha=8))
    model.train()
    on = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    assert on
    with eval_mode(model):
        model.generate(input_ids=torch.tensor([[1, 5, 6]]), attention_mask=torch.ones(1, 3, dtype=torch.long),
                       max_new_tokens=2, do_sample=False, pad_token_id=tok.pad_token_id)
    assert model.training and all(m.gradient_checkpointing for m in on)


@pytest.mark.parametrize("field", ["double_quant", "quantize_experts"])
def test_unsloth_refuses_model_settings_it_would_not_apply(unsloth, tiny_model_dir, monkeypatch, field):
    """Unsloth's 4-bit loading always nests the quantization, and stores a mixture's experts its own way: a recipe
    that asks otherwise is refused, naming the field. Before: silently not applied."""
    from lowmem_grpo import model as model_module

    monkeypatch.setattr(model_module, "_routed_experts", lambda cfg: True)   # as for a mixture of experts
    fields = {"double_quant": False} if field == "double_quant" else {}
    with pytest.raises(ModelLoadError, match=f"model.{field}=.* is not available with model.backend=unsloth"):
        load_policy(_unsloth_cfg(tiny_model_dir, **fields), LoraConfig(r=4, alpha=8))
    assert unsloth["from_pretrained"] == []
    # what it asks for once the field is changed
    load_policy(_unsloth_cfg(tiny_model_dir, quantize_experts=False), LoraConfig(r=4, alpha=8))


def test_an_unsloth_model_takes_no_shared_prompts_and_decodes_within_its_positions(unsloth, tiny_model_dir):
    """Unsloth's training forward drops the attention mask, which the shared-prompt layout (§12) depends on: off
    for an Unsloth model. Its generate refuses a padded width + max_new_tokens past max_position_embeddings (64 here):
    the transformers engine's batch ends where its longest prompt's room does (each row was cut at its own room
    before, the batch asking for the shortest prompt's)."""
    from lowmem_grpo.model import takes_shared_prompts
    from lowmem_grpo.rollout.base import EngineConfig, SamplingParams
    from lowmem_grpo.rollout import make_engine

    model, tok = load_policy(_unsloth_cfg(tiny_model_dir), LoraConfig(r=4, alpha=8))
    assert not takes_shared_prompts(model, 64)
    plain, _ = load_policy(ModelConfig(name_or_path=str(tiny_model_dir), compute_dtype="float32", load_in_4bit=False),
                           LoraConfig(r=4, alpha=8))
    assert takes_shared_prompts(plain, 64)   # (the same model through transformers: on)
    engine = make_engine(EngineConfig("hf"), model, tok)
    prompts = [[tok.bos_token_id] + [5] * 59, [tok.bos_token_id] + [5] * 9]   # 60 and 10 tokens
    out = engine.generate(prompts, SamplingParams(n=1, max_new_tokens=20, greedy=True))
    assert len(out) == 2 and all(len(c.token_ids) <= 4 for c in out)
