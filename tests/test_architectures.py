"""The trainer's log-probs are each architecture's own: for tiny random shapes of the decoder families a
hobbyist trains (Llama, Mistral, Qwen 2/3 and its MoE, Phi, Gemma 1-3, OLMo 2, Granite, Cohere, SmolLM3,
StableLM, StarCoder2, GPT-NeoX, Falcon, EXAONE 4, GLM-4), with LoRA on and off, the chunked log-probs of the
update's micro-batches (prompts shared where the trainer would share them, §12) equal log_softmax of the
model's own forward. Scaled and soft-capped heads (Cohere, Granite, Gemma 2/3) get logits large enough for
the transform to matter. The whole CLI path (4-bit train, estimate, export) was run on the same shapes once
by hand; this is the fast invariant that keeps holding."""

import pytest
import torch

from lowmem_grpo.batch import SHARED_MAX_WIDTH, completion_logprobs, pack
from lowmem_grpo.model import attach_lora, check_logit_head, eval_mode, reference_mode, takes_shared_prompts
from lowmem_grpo.recipe import LoraConfig
from lowmem_grpo.tiny import ARCH_CLASSES, build_arch_model

KINDS = list(ARCH_CLASSES)


@pytest.mark.parametrize("kind", KINDS)
def test_the_trainers_log_probs_are_the_models_own(kind):
    # Gemma 2 soft-caps its attention scores in eager attention only
    base = build_arch_model(kind, attn_implementation="eager" if kind == "gemma2" else "sdpa")
    model = attach_lora(base, LoraConfig(r=4, alpha=8), gradient_checkpointing=False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    assert check_logit_head(model) < 1e-4
    prompt = torch.randint(1, 300, (10,), generator=g).tolist()
    completions = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (12, 7, 12, 3)]
    share = takes_shared_prompts(model, SHARED_MAX_WIDTH)
    mb = pack([prompt] * 4, completions, torch.ones(4), 4, "token_mean", 12, 0, share_prompts=share)[0]
    for mode in ("policy", "reference"):
        with torch.no_grad(), eval_mode(model), (reference_mode(model) if mode == "reference" else torch.no_grad()):
            ours = completion_logprobs(model, mb, 1.0, 1024, 8192)
            own = []
            for c in completions:
                logits = model(input_ids=torch.tensor([prompt + c])).logits[0, len(prompt) - 1:-1].float()
                own.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(c)[:, None])[:, 0])
        gap = (ours - torch.cat(own)).abs().max().item()
        assert gap < 1e-4, (kind, mode, share, gap)


def test_the_sweep_script_runs_the_cli_on_a_family(tmp_path):
    """scripts/arch_sweep.py, which the README's "Models" figures come from, on one family."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "arch_sweep.py"
    p = subprocess.run([sys.executable, str(script), "gemma2", "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    line = next(line for line in p.stdout.splitlines() if line.startswith("gemma2"))
    assert "train 0  estimate 0  export 0" in line and float(line.split()[-1]) < 1e-4, line
