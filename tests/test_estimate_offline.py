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
    monkeypatch.setattr(hub, "_in_cache", lambda name: True)   # as if downloaded: the loader, not the check, is asked
    cfg = ModelConfig(name_or_path="Qwen/Qwen2.5-7B-Instruct")
    with pytest.raises(ModelLoadError):
        load_tokenizer(cfg)
    with pytest.raises(ModelLoadError):
        load_base_model(cfg, quantized=False)
    assert asked == ["Qwen/Qwen2.5-7B-Instruct"] * 2


# -- a hub model out of reach: said at once, with what to do ----------------------------------------------

@pytest.fixture
def online(monkeypatch):
    """HF_HUB_OFFLINE off (the tests set it on), restored after; the hub's reachability is set by each test."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    return constants


def test_an_unreachable_hub_is_said_at_once_not_after_retries(online, monkeypatch):
    import transformers

    asked = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda name, *a, **k: asked.append(name))
    monkeypatch.setattr(hub, "hub_reachable", lambda: False)
    with pytest.raises(ModelLoadError) as err:
        load_tokenizer(ModelConfig(name_or_path="someorg/not-cached-7B"))
    msg = str(err.value)
    assert msg.startswith("model.name_or_path='someorg/not-cached-7B': the Hugging Face hub (https://huggingface.co) "
                          "cannot be reached from this machine, and the model is not in the local cache")
    assert "HF_HUB_OFFLINE=1" in msg and "local model folder" in msg and "hf download someorg/not-cached-7B" in msg
    assert asked == []   # transformers (and its ~50 s of retries) never started
    # with HF_HUB_OFFLINE set, no probe: the cache alone is asked
    monkeypatch.setattr(online, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "hub_reachable", lambda: pytest.fail("probed the hub in offline mode"))
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE is set and the model is not in the local cache"):
        load_tokenizer(ModelConfig(name_or_path="someorg/not-cached-7B"))


def test_a_cached_model_loads_offline_when_the_hub_is_out_of_reach(online, monkeypatch):
    monkeypatch.setattr(hub, "hub_reachable", lambda: False)
    monkeypatch.setattr(hub, "_in_cache", lambda name: True)
    assert hub.model_path_problem("someorg/cached-7B") is None
    assert online.HF_HUB_OFFLINE is True   # transformers then reads the cache without trying the network
    import os

    assert os.environ["HF_HUB_OFFLINE"] == "1"   # and so do the processes this one starts


def test_a_reachable_hub_or_one_behind_a_proxy_is_left_to_transformers(online, monkeypatch):
    monkeypatch.setattr(hub, "hub_reachable", lambda: True)
    assert hub.model_path_problem("someorg/not-cached-7B") is None
    monkeypatch.setattr(hub, "hub_reachable", lambda: None)
    assert hub.model_path_problem("someorg/not-cached-7B") is None and online.HF_HUB_OFFLINE is False


def test_the_probe_opens_a_connection_to_the_endpoint(monkeypatch):
    """hub_reachable on loopback: a listening port is reachable, a closed one is not, and within the timeout."""
    import time

    from huggingface_hub import constants

    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert hub.hub_reachable.__wrapped__() is True
        closed = server.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed}")
    started = time.monotonic()
    assert hub.hub_reachable.__wrapped__() is False and time.monotonic() - started < hub.PROBE_TIMEOUT_S + 1
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert hub.hub_reachable.__wrapped__() is None   # through a proxy a direct probe says nothing


def test_estimate_says_what_train_says_of_a_missing_model_folder(tmp_path, monkeypatch):
    """recipes/quickstart.yaml before the quickstart built runs/quickstart/base: estimate said "Repo id must be in
    the form 'repo_name'", train "no such model folder". Now both say the latter, from one check."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["estimate", str(recipe_path("quickstart")), "--memory", "8GiB"])
    with pytest.raises(ModelLoadError) as err:
        load_tokenizer(ModelConfig(name_or_path="runs/quickstart/base"))
    assert result.exit_code == 2 and f"error: {err.value}" in result.output, result.output
    assert "no such model folder" in result.output and "Repo id" not in result.output
