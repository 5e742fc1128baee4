"""TRL's own GRPO script (the installed trl/scripts/grpo.py: TrlParser over its dataclasses, get_peft_config,
get_quantization_config, trl.rewards, model_init_kwargs from ModelConfig, train(resume_from_checkpoint=...),
save_model, accelerator.print, end()) run with lowmem_grpo.trl's GRPOTrainer in TRL's place, as a user swaps the
import. Its `main` is called as the script's __main__ calls it, so a change in TRL's script shows here."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import yaml

from lowmem_grpo.trl import GRPOTrainer, TRLCompatError

# TRL's own flags for a run this small; --bf16 false because transformers refuses bf16 on a machine without a GPU
# (TRL's bf16 defaults to True), the command line a TRL user passes on a CPU-only one
TINY_RUN = ["--per_device_train_batch_size", "2", "--num_generations", "2", "--max_completion_length", "4",
            "--bf16", "false", "--reward_funcs", "accuracy_reward", "think_format_reward"]


@pytest.fixture
def script(tiny_model_dir, tmp_path, monkeypatch):
    """Runs TRL's script with its command line (a list of str) on a chat copy of the tiny model and a local dataset
    in TRL's columns (prompt as chat messages, solution), our GRPOTrainer patched in; the dataset cache in
    tmp_path."""
    import datasets
    import trl
    from trl.scripts import grpo

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())   # conversational prompts need a template
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    data = tmp_path / "data"
    data.mkdir()
    for split, n in (("train", 8), ("test", 2)):
        rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "solution": f"${i + 1}$"} for i in range(n)]
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    monkeypatch.setattr(trl, "GRPOTrainer", GRPOTrainer)

    def run(*flags: str):
        parser = grpo.make_parser()
        grpo.main(*parser.parse_args_and_config(["--model_name_or_path", str(model), "--dataset_name", str(data),
                                                 *TINY_RUN, *flags], fail_with_unknown_args=False))
    return run


def test_trls_grpo_script_trains_evaluates_saves_and_resumes_here(script, tmp_path, capsys):
    out = tmp_path / "out"
    script("--output_dir", str(out), "--max_steps", "2", "--use_peft", "--load_in_4bit", "--lora_r", "8",
           "--lora_target_modules", "all-linear", "--eval_strategy", "steps", "--eval_steps", "1", "--logging_steps",
           "1", "--save_steps", "1", "--seed", "3", "--log_completions", "true", "--report_to", "none",
           "--attn_implementation", "sdpa")
    assert "Training completed." in capsys.readouterr().out   # trainer.accelerator.print
    recipe = yaml.safe_load((out / "recipe.yaml").read_text())
    assert (recipe["lora"]["r"], recipe["lora"]["target_modules"], recipe["seed"]) == (8, "all-linear", 3)
    assert recipe["model"]["load_in_4bit"] and recipe["output"]["samples_every"] == 1
    assert [f["function"].rsplit(":", 1)[1] for f in recipe["rewards"]["functions"]] == \
        ["accuracy_reward", "think_format_reward"]   # trl.rewards' own functions, called TRL's way
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/accuracy" in r for r in rows) and "reward/accuracy_reward" in rows[0]
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 8   # trainer.save_model(output_dir)
    # the rerun as TRL's docs write it: --resume_from_checkpoint true, which the script passes on as the text "true"
    # (was refused as "true is not the last checkpoint")
    resume = ["--output_dir", str(out), "--max_steps", "4", "--use_peft", "--load_in_4bit", "--lora_target_modules",
              "all-linear", "--save_steps", "1", "--seed", "3", "--resume_from_checkpoint", "true"]
    # what the checkpoints were made with, changed: named by the script's argument (was: "--set output.dir=...")
    with pytest.raises(TRLCompatError, match=r"^resume_from_checkpoint: a resumed run keeps .* this one changes "
                                             r"peft_config.r \(8 -> 16\): pass the first run's values again"):
        script(*resume)
    script(*resume, "--lora_r", "8")
    assert (out / "checkpoint-4").is_dir() and "resumed from" in capsys.readouterr().out


def test_trls_script_with_several_unsupported_flags_learns_them_all_in_one_error(script, tmp_path):
    """Each refusal names the script's flag; all of them before anything is trained (was: one a run)."""
    out = tmp_path / "out"
    with pytest.raises(TRLCompatError) as caught:
        script("--output_dir", str(out), "--max_steps", "2", "--use_peft", "--use_dora", "--push_to_hub",
               "--report_to", "trackio", "--model_revision", "v2", "--load_in_4bit", "--dtype", "bfloat16")
    message = str(caught.value)
    assert message.startswith("5 arguments cannot be run here (fix each):\n")
    assert len(caught.value.problems) == 5 and len(message.splitlines()) == 6   # one line per problem
    for named in ("peft_config: use_dora not supported .*drop --use_dora", "push_to_hub: not here.*drop --push_to_hub",
                  "report_to: trackio is not here", "revision='v2' is not here.*drop --model_revision",
                  # --dtype sets both model_init_kwargs' and the 4-bit config's dtype: named once
                  r"dtype=bfloat16 differs from the compute dtype bf16/fp16 choose \(float32\).*--dtype bfloat16 "
                  "with --bf16 true"):
        assert sum(bool(re.search(named, line)) for line in caught.value.problems) == 1, named
    assert not (out / "checkpoints").exists()
