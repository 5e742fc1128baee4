"""`lowmem-grpo eval` on inputs a red team found it mishandled: held-out rows skipped as bad (and prompts the reward
skipped) that the printed line and summary.json did not count, an --out that cannot be written (found only after
the whole eval), a damaged weights file (safetensors' traceback), an adapter applied to a base that already holds it."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import recipe_dict, write_recipe


def _recipe(tiny_model_dir, tiny_data, tmp_path, **sections):
    from lowmem_grpo.recipe import recipe_from_dict

    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run", rewards={"functions": [{"function": "math"}]})
    d["model"]["load_in_4bit"] = False
    for name, values in sections.items():   # (recipe_dict's own `data` is its data files)
        d[name].update(values)
    return recipe_from_dict(d), d


class _Loaded(Exception):
    """Raised in place of loading the model: what was checked before it."""


def _no_load(monkeypatch):
    from lowmem_grpo import evaluate

    def refuse(*a, **k):
        raise _Loaded

    monkeypatch.setattr(evaluate, "_load", refuse)


def test_rows_skipped_as_bad_and_by_the_reward_are_counted(tiny_model_dir, tiny_data, tmp_path):
    """data.on_bad_row=skip: the held-out rows left out are in summary.json and the printed line (with the first);
    a prompt the reward cannot judge (answer '???') is said to be left out of the accuracy, and each pass@k says
    over how many prompts it is."""
    from lowmem_grpo.evaluate import run_eval

    good = [json.loads(line) for line in tiny_data[1].read_text().splitlines()[:4]]
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps(r) + "\n" for r in good) + '{"prompt": "9+9=", "answer": [18]}\n'
                    + 'not json\n{"prompt": "8+8=", "answer": "???"}\n')
    recipe, _ = _recipe(tiny_model_dir, tiny_data, tmp_path, data={"eval_path": str(held), "on_bad_row": "skip"})
    lines: list = []
    s = run_eval(recipe, name="r", ks=(1, 2), out_dir=str(tmp_path / "ev"), log=lines.append)
    assert s["prompts"] == 5 and s["n"] == 4 and s["pass@1/prompts"] == 4 and s["pass@2/prompts"] == 4
    written = json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert written["rows_skipped"] == 2
    assert written["rows_skipped_first"][0].startswith("row 5: the answer field 'answer' holds list [18]")
    assert written["rows_skipped_first"][1].startswith("row 6: not valid JSON")
    assert f"({s['correct']}/4 prompts, mean reward {s['mean_reward']:.3f}; 1 of the 5 prompts not counted: the " \
           "reward skipped its completion; 2 rows skipped as bad: first: row 5: the answer field 'answer' holds " \
           "list [18]" in lines[0], lines[0]
    assert lines[1].startswith(f"pass@1: {100 * s['pass@1']:.1f}% (4/5 prompts)  pass@2: {100 * s['pass@2']:.1f}% "
                               "(4/5 prompts)  (2 samples per prompt at temperature 1.0; a prompt counts for pass@k "
                               "when the reward judged at least k of its samples)"), lines[1]


def test_summary_lines_without_skips_keep_their_form():
    from lowmem_grpo.evaluate import summary_lines

    s = {"accuracy": 0.5, "correct": 2, "n": 4, "prompts": 4, "mean_reward": 0.5, "split": "test", "pass@1": 0.5,
         "pass@1/prompts": 4, "samples_per_prompt": 1, "temperature": 1.0, "out": "o", "rows_skipped": 0}
    assert summary_lines(s, [1])[:2] == ["greedy accuracy: 50.0% (2/4 prompts, mean reward 0.500) on test",
                                         "pass@1: 50.0% (4/4 prompts)  (1 sample per prompt at temperature 1.0)"]


def test_an_out_that_cannot_be_written_fails_before_the_eval(tiny_model_dir, tiny_data, tmp_path, monkeypatch):
    """A summary.json that is a folder, or a folder where no file can be created: one error before the model is
    loaded (it was an IsADirectoryError traceback after the whole eval); through the CLI, one line and exit 2."""
    import tempfile

    from click.testing import CliRunner

    from lowmem_grpo import evaluate
    from lowmem_grpo.cli import main

    recipe, d = _recipe(tiny_model_dir, tiny_data, tmp_path)
    (tmp_path / "ev" / "summary.json").mkdir(parents=True)
    res = CliRunner().invoke(main, ["eval", str(write_recipe(tmp_path / "r.yaml", d)), "--out", str(tmp_path / "ev")])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), (res.output, res.exception)
    assert res.output == (f"error: --out {tmp_path / 'ev'}: {tmp_path / 'ev' / 'summary.json'} is a folder; eval "
                          "writes a file of that name there (remove it, or choose another --out)\n")
    _no_load(monkeypatch)
    with pytest.raises(evaluate.EvalError, match="summary.json is a folder"):
        evaluate.run_eval(recipe, name="r", out_dir=str(tmp_path / "ev"), log=lambda *a: None)

    def read_only(*a, **k):   # (the tests run as root, for whom a read-only folder is writable)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(evaluate.EvalError, match=r"--out .*/ev2: cannot write a file there: Permission denied"):
        evaluate.run_eval(recipe, name="r", out_dir=str(tmp_path / "ev2"), log=lambda *a: None)


def test_a_write_that_fails_after_the_eval_is_one_error_after_the_figures(tiny_model_dir, tiny_data, tmp_path,
                                                                          monkeypatch):
    """The files cannot be written once the eval is done (here a summary.json folder made meanwhile): the figures
    are printed first, then one error naming the file and why."""
    from lowmem_grpo import evaluate

    recipe, _ = _recipe(tiny_model_dir, tiny_data, tmp_path, train={"eval_max_prompts": 2})
    out, real = tmp_path / "ev", evaluate.sampled_counts

    def then_a_folder(*a, **k):
        counts = real(*a, **k)
        (out / "summary.json").mkdir()
        return counts

    monkeypatch.setattr(evaluate, "sampled_counts", then_a_folder)
    lines: list = []
    with pytest.raises(evaluate.EvalError) as err:
        evaluate.run_eval(recipe, name="r", out_dir=str(out), log=lines.append)
    assert str(err.value) == f"cannot write {out / 'summary.json'}: Is a directory (the figures above are not saved)"
    assert lines[0].startswith("greedy accuracy: ") and lines[1].startswith("pass@1: ") and len(lines) == 2


@pytest.mark.parametrize("damage", ["header", "cut"])
def test_damaged_weights_are_one_line_naming_the_file(tiny_model_dir, tiny_data, tmp_path, damage):
    """A model.safetensors with a garbled header, or cut short: safetensors' SafetensorError became a ModelLoadError
    naming the file (load_base_model: train and eval --model both load through it)."""
    from click.testing import CliRunner

    from lowmem_grpo.cli import main
    from lowmem_grpo.model import ModelLoadError, load_base_model
    from lowmem_grpo.recipe import ModelConfig

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"\xff" * 1000 if damage == "header" else data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=rf"cannot load the model: {weights} is unreadable, truncated or corrupt "
                                             r"\(Error while deserializing header"):
        load_base_model(ModelConfig(name_or_path=str(model), load_in_4bit=False))
    _, d = _recipe(tiny_model_dir, tiny_data, tmp_path)
    res = CliRunner().invoke(main, ["eval", str(write_recipe(tmp_path / "r.yaml", d)), "--model", str(model),
                                    "--out", str(tmp_path / "ev")])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), (res.output, res.exception)
    assert res.output.startswith("error: ") and f"{weights} is unreadable" in res.output and res.output.count("\n") == 1


def _adapter(tiny_model_dir, folder, seed=0):
    import torch
    from transformers import AutoModelForCausalLM

    from lowmem_grpo.model import attach_lora
    from lowmem_grpo.recipe import LoraConfig

    torch.manual_seed(seed)
    model = attach_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=4, alpha=8),
                        gradient_checkpointing=False)
    model.save_pretrained(folder)
    return folder


def test_an_adapter_on_another_base_is_warned_and_on_its_own_merge_refused(tiny_model_dir, tiny_data, tmp_path,
                                                                           monkeypatch):
    """--adapter RUN with model.name_or_path naming EXPORT/merged of that adapter applied it twice, silently: now
    refused before loading; a base other than the one the adapter (and its run's recipe.yaml) records is warned of,
    naming both; the same folder spelled otherwise, or a merged export of another adapter, is no refusal."""
    import torch

    from lowmem_grpo.evaluate import check_adapter_base, run_eval
    from lowmem_grpo.model import ModelLoadError

    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step-000001"
    adapter = _adapter(tiny_model_dir, ckpt / "adapter")
    torch.save({"step": 1}, ckpt / "trainer_state.pt")
    _, d = _recipe(tiny_model_dir, tiny_data, tmp_path)
    write_recipe(run / "recipe.yaml", d)
    exp = tmp_path / "exp"   # export.py's layout: EXPORT/adapter (the checkpoint's, copied) and EXPORT/merged
    shutil.copytree(adapter, exp / "adapter")
    shutil.copytree(tiny_model_dir, exp / "merged")
    _no_load(monkeypatch)
    for given in (run, ckpt, adapter, exp):
        recipe, _ = _recipe(tiny_model_dir, tiny_data, tmp_path, model={"name_or_path": str(exp / "merged")})
        with pytest.raises(ModelLoadError, match=rf"is the merged model exported with this adapter \(its weights are "
                                                 rf"those of {exp / 'adapter'}\): the base already contains this adapter"):
            run_eval(recipe, name="r", adapter=str(given), out_dir=str(tmp_path / "ev"), log=lambda *a: None)

    # another base: a warning naming both, and where the adapter's is recorded; then the eval goes on
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    recipe, _ = _recipe(tiny_model_dir, tiny_data, tmp_path, model={"name_or_path": str(other)})
    lines: list = []
    with pytest.raises(_Loaded):
        run_eval(recipe, name="r", adapter=str(run), out_dir=str(tmp_path / "ev"), log=lines.append)
    assert lines == [f"warning: --adapter {adapter} was trained on {str(tiny_model_dir)!r} (in {adapter}/"
                     f"adapter_config.json, {run}/recipe.yaml), not on the recipe's model.name_or_path={str(other)!r}, "
                     "to which it is applied now: unless that is the same model (a moved folder, a hub id and its local "
                     "copy), these figures are not the adapter's (a merged export, for one, already holds an adapter)"]
    # the same folder spelled otherwise: nothing to say
    assert check_adapter_base(adapter, run, str(tiny_model_dir) + "/.") is None
    assert check_adapter_base(adapter, None, str(tiny_model_dir)) is None
    # the merged export of another adapter: a warning, not a refusal
    _adapter(tiny_model_dir, exp / "adapter", seed=1)
    assert check_adapter_base(adapter, run, str(exp / "merged")).startswith(f"warning: --adapter {adapter} was trained")


def test_an_adapter_trained_on_prompts_rendered_otherwise_is_warned(tiny_model_dir, tiny_data, tmp_path, monkeypatch):
    """A run made before the BOS rule changed scored 0% in eval, and nothing said why (a red team's F1): a checkpoint
    now records its first training prompt (row and tokens) in the adapter's folder, and an eval whose data settings
    or tokenizer render that row to other tokens says so, where they first differ; the same settings say nothing."""
    import json

    from lowmem_grpo import evaluate
    from lowmem_grpo.data import PROMPT_RECORD, prompt_drift, prompt_set
    from lowmem_grpo.model import load_tokenizer
    from lowmem_grpo.train import Trainer

    from conftest import QUIET

    recipe, _ = _recipe(tiny_model_dir, tiny_data, tmp_path, train={"steps": 1})
    Trainer(recipe, **QUIET).fit()
    adapter = tmp_path / "run" / "checkpoints" / "step-000001" / "adapter"
    tok = load_tokenizer(recipe.model)
    assert prompt_drift(adapter, prompt_set(recipe.data, tok, "test")) is None   # as trained: nothing to say

    class Stop(Exception):
        pass

    def stop(*a, **k):
        raise Stop

    monkeypatch.setattr(evaluate, "eval_wave", stop)   # (after the check: no generation needed)
    other, _ = _recipe(tiny_model_dir, tiny_data, tmp_path, data={"template": "({prompt})"})
    lines: list = []
    with pytest.raises(Stop):
        evaluate.run_eval(other, name="r", adapter=str(tmp_path / "run"), out_dir=str(tmp_path / "ev"),
                          log=lines.append)
    [warning] = [line for line in lines if "rendered otherwise" in line]
    assert "first differing at token 1" in warning and "here '(" in warning and str(adapter / PROMPT_RECORD) in warning
    # a change of tokenization rule (this tokenizer adds a BOS; say training had none)
    record = json.loads((adapter / PROMPT_RECORD).read_text())
    assert record["prompt_ids"][0] == tok.bos_token_id
    (adapter / PROMPT_RECORD).write_text(json.dumps({**record, "prompt_ids": record["prompt_ids"][1:]}))
    warning = prompt_drift(adapter, prompt_set(recipe.data, tok, "test"))
    assert warning and "first differing at token 0" in warning
    # nothing to compare: no record (an adapter from elsewhere), or a row this data config cannot render
    (adapter / PROMPT_RECORD).unlink()
    assert prompt_drift(adapter, prompt_set(recipe.data, tok, "test")) is None
