"""model.backend: unsloth is GPU-only: without an NVIDIA GPU it is a clear, named error, not a traceback.
(The GPU path itself is untested: no GPU was available; see lowmem_grpo/model.py:load_unsloth_policy.)"""

import os
import subprocess
import sys

import pytest
import torch

from conftest import recipe_dict, write_recipe
from lowmem_grpo.model import ModelLoadError, load_policy
from lowmem_grpo.recipe import LoraConfig, ModelConfig, recipe_from_dict

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")


def test_unsloth_backend_without_gpu_is_a_named_error(tiny_model_dir):
    cfg = ModelConfig(name_or_path=str(tiny_model_dir), compute_dtype="float32", backend="unsloth")
    with pytest.raises(ModelLoadError, match="model.backend=unsloth needs an NVIDIA GPU"):
        load_policy(cfg, LoraConfig())


def test_unsloth_backend_cli_error(tiny_model_dir, tiny_data, tmp_path):
    d = recipe_dict(tiny_model_dir, tiny_data, tmp_path / "run")
    d["model"]["backend"] = "unsloth"
    recipe_from_dict(d)  # a valid recipe: the machine, not the recipe, is the problem
    p = subprocess.run([sys.executable, "-m", "lowmem_grpo.cli", "train", str(write_recipe(tmp_path / "r.yaml", d))],
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert p.returncode == 2 and "model.backend=unsloth needs an NVIDIA GPU" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
