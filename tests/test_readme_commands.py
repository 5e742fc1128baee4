"""What the README shows a newcomer, run as shown: a reward module beside the recipe, named by
'module:function', is found by the `lowmem-grpo` command from that directory."""

import sys

from click.testing import CliRunner

from lowmem_grpo.cli import main

REWARDS = '''
def accuracy_reward(completions, solution, **kwargs):
    return [1.0 if c == s else 0.0 for c, s in zip(completions, solution)]
'''


def test_a_reward_module_in_the_working_directory_is_importable(tmp_path, monkeypatch):
    # The README's TRL example keeps my_rewards.py beside the recipe and names `my_rewards:accuracy_reward`;
    # an environment is 'importable from where you train'. The console script, unlike `python -m` and
    # torchrun (--nproc), does not put the working directory on sys.path by itself.
    (tmp_path / "readme_cwd_rewards.py").write_text(REWARDS)
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')   # validate reads its first rows
    (tmp_path / "recipe.yaml").write_text(
        "model: {name_or_path: model}\n"
        "data: {train_path: train.jsonl}\n"
        "rewards:\n  functions:\n    - function: readme_cwd_rewards:accuracy_reward\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "readme_cwd_rewards", raising=False)
    res = CliRunner().invoke(main, ["validate", "recipe.yaml"])
    assert res.exit_code == 0, res.output
    assert "readme_cwd_rewards:accuracy_reward): called as TRL's GRPOTrainer calls reward functions" in res.output
