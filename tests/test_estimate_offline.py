"""`lowmem-grpo estimate` on the shipped recipes answers offline: the model's shape comes from the copy of
its config.json in lowmem_grpo/model_configs, the prompt length is the recipe's cap, and nothing asks the hub
(any attempt fails the test at once). Training still loads the model from the hub."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from lowmem_grpo import hub
from lowmem_grpo import memory as mm
from lowmem_grpo.cli import main
from lowmem_grpo.model import ModelLoadError, load_base_model, load_tokenizer
from lowmem_grpo.recipe import ModelConfig, load_recipe

from test_recipes import RECIPES, recipe_path  # recipe -> (model id it names, VRAM tier in GiB)

SHIPPED = sorted(p.parent.relative_to(hub.MODEL_CONFIGS).as_posix() for p in hub.MODEL_CONFIGS.glob("*/*/config.json"))


@pytest.fixture
def no_network(monkeypatch) -> list:
    """Every way the estimate could reach the hub raises "network touched" (and is recorded, in case a caller
    swallows the error): sockets, transformers' from_pretrained with a name that is not a local path, and
    `hf:` datasets."""
    import transformers

    touched = []

    def refuse(what):
        touched.append(what)
        raise AssertionError(f"network touched: {what}")

    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: refuse(f"getaddrinfo{a[:2]}"))
    monkeypatch.setattr(socket.socket, "connect", lambda self, address: refuse(f"connect {address}"))
    for cls in (transformers.AutoConfig, transformers.AutoTokenizer):
        real = cls.from_pretrained

        def guarded(name, *args, _real=real, _cls=cls.__name__, **kwargs):
            if not Path(str(name)).exists():
                refuse(f"{_cls}.from_pretrained({name!r})")
            return _real(name, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", guarded)
    monkeypatch.setattr(hub, "load", lambda source: refuse(f"hub.load({source!r})"))
    return touched


@pytest.mark.parametrize("name", RECIPES)
def test_estimate_answers_offline_from_the_shipped_config(name, no_network):
    model_id, tier = RECIPES[name]
    path = recipe_path(name)
    result = CliRunner().invoke(main, ["estimate", str(path), "--memory", f"{tier}GB"])
    assert not no_network, no_network
    assert result.exit_code == 0, result.output
    assert (f"note: model shape: the shipped copy of {model_id}'s config.json "
            f"(lowmem_grpo/model_configs; nothing downloaded)") in result.output
    # the breakdown is the one from the config folder itself (as model.name_or_path) at the recipe's prompt cap
    r = load_recipe(path, [f"model.name_or_path={hub.MODEL_CONFIGS / model_id}"])
    ref, _, _ = mm.estimate_recipe(r, "cuda", prompt_tokens=r.data.max_prompt_tokens,
                                   budget=mm.card_budget(mm.parse_size(f"{tier}GB")))
    breakdown = "\n".join(line for line in ref.lines() if not line.lstrip().startswith("note:"))
    assert breakdown in result.output
    assert f"predicted peak {mm.fmt(ref.peak)}" in " ".join(result.output.split())
    assert f"prompt length {r.data.max_prompt_tokens} tokens: data.max_prompt_tokens, an upper bound" in result.output


def test_the_shipped_configs_are_found_by_hub_id(tmp_path, monkeypatch):
    assert set(SHIPPED) >= {m for m, _ in RECIPES.values()} | {"meta-llama/Llama-3.1-8B-Instruct"}
    for model_id in SHIPPED:
        assert hub.shipped_model_config(model_id) == hub.MODEL_CONFIGS / model_id
    for other in ("Qwen/Qwen2.5-72B-Instruct", "Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct/", "../model_configs/Qwen",
                  "Qwen/../Qwen", str(hub.MODEL_CONFIGS / "Qwen" / "Qwen2.5-7B-Instruct"), ""):
        assert hub.shipped_model_config(other) is None, other
    # a local folder of that name is the user's own copy, and comes first
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Qwen" / "Qwen2.5-7B-Instruct").mkdir(parents=True)
    assert hub.shipped_model_config("Qwen/Qwen2.5-7B-Instruct") is None


def test_an_id_not_shipped_still_asks_the_hub(monkeypatch):
    import transformers

    asked = []

    def from_pretrained(name, *args, **kwargs):
        asked.append(name)
        raise OSError("offline")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)
    r = load_recipe(recipe_path("gsm8k"), ["model.name_or_path=someorg/not-shipped-7B"])
    with pytest.raises(ModelLoadError, match="cannot read its config"):
        mm.estimate_recipe(r, "cuda")
    assert asked == ["someorg/not-shipped-7B"]


def test_training_loads_the_model_from_the_hub_not_the_shipped_config(monkeypatch):
    import transformers

    asked = []

    def from_pretrained(name, *args, **kwargs):
        asked.append(str(name))
        raise OSError("offline")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    cfg = ModelConfig(name_or_path="Qwen/Qwen2.5-7B-Instruct")
    with pytest.raises(ModelLoadError):
        load_tokenizer(cfg)
    with pytest.raises(ModelLoadError):
        load_base_model(cfg, quantized=False)
    assert asked == ["Qwen/Qwen2.5-7B-Instruct"] * 2
