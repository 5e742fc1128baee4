"""Broken model folders, found by a red team: each is refused as it loads, in one message naming the folder and
what to change, instead of a traceback, a run on randomly initialised weights, or completions that never stop."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from lowmem_grpo import hub, tiny
from lowmem_grpo.model import (ModelLoadError, load_base_model, load_policy, load_tokenizer, made_up_eos,
                               stop_token_ids)
from lowmem_grpo.recipe import LoraConfig, ModelConfig, load_recipe

from conftest import recipe_dict, write_recipe

SIZES = tiny.TinyModelSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)


def _cfg(path, four_bit=False):
    return ModelConfig(name_or_path=str(path), compute_dtype="float32", load_in_4bit=four_bit)


def _copy(tiny_model_dir, to: Path) -> Path:
    shutil.copytree(tiny_model_dir, to)
    return to


def _edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _drop_eos(folder: Path, everywhere: bool) -> None:
    """No eos_token in tokenizer_config.json; `everywhere`: no eos_token_id in generation_config/config.json either."""
    _edit(folder / "tokenizer_config.json", lambda j: j.pop("eos_token"))
    if everywhere:
        for name in ("generation_config.json", "config.json"):
            _edit(folder / name, lambda j: j.pop("eos_token_id"))


def _save(folder: Path, tok, spec=SIZES, build=tiny.build_model) -> Path:
    build(tok, spec, seed=0).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _weights(folder: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    weights = folder / "model.safetensors"
    save_file(change(load_file(str(weights))), str(weights), metadata={"format": "pt"})


# -- 1 and 2: the tokenizer's ids and the model's embedding; a made-up end-of-sequence token -------------------------

def test_a_tokenizer_with_more_tokens_than_the_embedding_has_rows_is_refused(tiny_model_dir, tmp_path):
    """Before: load_policy returned, and the first forward of a prompt holding the extra token failed with an
    IndexError traceback."""
    folder = _copy(tiny_model_dir, tmp_path / "m")
    tok = tiny.build_tokenizer()
    tok.add_tokens(["<extra>"])   # saved in the folder, so not made up at load: the embedding was just not resized
    tok.save_pretrained(folder)
    with pytest.raises(ModelLoadError) as err:
        load_policy(_cfg(folder), LoraConfig(r=4, alpha=8))
    assert str(err.value).startswith(f"model.name_or_path={str(folder)!r}: the tokenizer has 22 tokens (eos '</s>' = "
                                     "2) and the model's embedding 21 rows: ids from 21 on index no row")


@pytest.mark.parametrize("everywhere", [False, True])
def test_an_end_of_sequence_token_made_up_at_load_is_refused(tiny_model_dir, tmp_path, everywhere):
    """No eos_token in tokenizer_config.json: transformers 5.19 adds Qwen2Tokenizer's '<|endoftext|>' as a new token
    (id 21). Before: with 21 embedding rows, an IndexError traceback in training; with the generation config's eos
    gone too, the made-up token was the only stop token."""
    folder = _copy(tiny_model_dir, tmp_path / "m")
    _drop_eos(folder, everywhere)
    with pytest.raises(ModelLoadError) as err:
        load_tokenizer(_cfg(folder))
    msg = str(err.value)
    assert msg.startswith(f"model.name_or_path={str(folder)!r}: the tokenizer's end-of-sequence token '<|endoftext|>' "
                          "is not in the folder's vocabulary: transformers added it as a new token (id 21) as it loaded "
                          "the tokenizer, because tokenizer_config.json names no eos_token")
    assert 'Set "eos_token" in tokenizer_config.json' in msg
    assert msg.endswith("(neither generation_config.json nor config.json names its eos_token_id either)" if everywhere
                        else "(generation_config.json's eos_token_id 2 is '</s>')")


def test_an_end_of_sequence_token_declared_but_not_in_the_vocabulary_is_refused(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir, tmp_path / "m")
    _edit(folder / "tokenizer_config.json", lambda j: j.__setitem__("eos_token", "<|im_end|>"))
    with pytest.raises(ModelLoadError, match=r"token '<\|im_end\|>' is not in the folder's vocabulary: transformers "
                                             r"added it as a new token \(id 21\) as it loaded the tokenizer, because "
                                             r"tokenizer_config.json's eos_token '<\|im_end\|>' is not in it\."):
        load_tokenizer(_cfg(folder))


def test_a_padded_vocabulary_does_not_hide_a_made_up_end_of_sequence_token(tmp_path):
    """An embedding padded to 32 rows (as real models pad theirs) holds the made-up id 21: before, training ran
    with stop_token_ids (21,), a token the model never produces, instead of its '</s>' = 2. With eos_token declared
    the same folder loads, and stops on '</s>'."""
    spec = tiny.TinyModelSpec(**{**SIZES.__dict__, "vocab_size": 32})
    padded = _save(tmp_path / "padded", tiny.build_tokenizer(), spec)
    policy, tok = load_policy(_cfg(padded), LoraConfig(r=4, alpha=8))
    assert made_up_eos(tok, padded) is None and stop_token_ids(policy, tok) == (2,)
    _drop_eos(padded, everywhere=True)
    with pytest.raises(ModelLoadError, match=r"'<\|endoftext\|>' is not in the folder's vocabulary: transformers added "
                                             r"it as a new token \(id 21\)"):
        load_policy(_cfg(padded), LoraConfig(r=4, alpha=8))


@pytest.mark.parametrize("tokenizer,build", [(tiny.build_tokenizer, tiny.build_model),   # the quickstart's
                                             (tiny.build_tool_tokenizer, tiny.build_tool_model)])   # the tool demo's
def test_the_tiny_tokenizers_load_with_their_own_end_of_sequence_token(tmp_path, tokenizer, build):
    folder = _save(tmp_path / "m", tokenizer(), tiny.TinyModelSpec(), build)
    policy, tok = load_policy(_cfg(folder), LoraConfig(r=4, alpha=8))
    assert made_up_eos(tok, folder) is None and len(tok) == policy.get_input_embeddings().weight.shape[0]
    assert stop_token_ids(policy, tok) == (tok.convert_tokens_to_ids("</s>"),)


def test_no_end_of_sequence_token_anywhere_is_refused(tmp_path):
    """A Llama folder (its tokenizer class has no default eos) naming no eos in any file: before, stop_token_ids was
    () and every completion ran to max_new_tokens, without a word."""
    folder = tiny.save_arch_model("llama", tmp_path / "llama", vocab_size=21)
    tok = load_tokenizer(_cfg(folder))
    assert tok.eos_token == "</s>"
    _drop_eos(folder, everywhere=True)
    with pytest.raises(ModelLoadError, match=r"neither the tokenizer nor the model names an end-of-sequence token .* "
                                             r"Set \"eos_token\" in tokenizer_config.json"):
        load_policy(_cfg(folder), LoraConfig(r=4, alpha=8))


# -- 3 and 4: weights that do not fill the model, or do not fit its config.json ---------------------------------------

DAMAGE = {
    "misnamed": lambda sd: {"foo." + k: v for k, v in sd.items()},
    "layer gone": lambda sd: {k: v for k, v in sd.items() if "layers.1." not in k},
    "no head": lambda sd: {k: v for k, v in sd.items() if k != "lm_head.weight"},
}


@pytest.mark.parametrize("four_bit", [False, True])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_weights_that_lack_parameters_are_refused_not_initialised_at_random(tiny_model_dir, tmp_path, damage, four_bit):
    """Before: transformers initialised what the weights lack at random, said so in a warning, and training ran."""
    folder = _copy(tiny_model_dir, tmp_path / "m")
    _weights(folder, DAMAGE[damage])
    with pytest.raises(ModelLoadError) as err:
        load_base_model(_cfg(folder, four_bit))
    msg = str(err.value)
    n = {"misnamed": 27, "layer gone": 12, "no head": 1}[damage]
    assert msg.startswith(f"model.name_or_path={str(folder)!r}: the weights lack {n} of the model's parameters (")
    assert "transformers would initialise them at random" in msg and "\n" not in msg
    assert ("e.g. 'foo.lm_head.weight'" in msg) == (damage == "misnamed")


@pytest.mark.parametrize("four_bit", [False, True])
def test_a_tied_head_is_not_missing(tmp_path, four_bit):
    """tie_word_embeddings: the weights hold no lm_head.weight, by design (transformers' missing keys leave it out)."""
    folder = _save(tmp_path / "tied", tiny.build_tokenizer(),
                   tiny.TinyModelSpec(**{**SIZES.__dict__, "tie_word_embeddings": True}))
    model = load_base_model(_cfg(folder, four_bit))
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


@pytest.mark.parametrize("four_bit", [False, True])
@pytest.mark.parametrize("field,value,shown", [
    ("vocab_size", 10, "model.embed_tokens.weight [21, 64] in the weights, [10, 64] by config.json"),
    ("intermediate_size", 256, "model.layers.0.mlp.down_proj.weight [64, 128] in the weights, [64, 256] by config.json"),
])
def test_a_config_json_of_other_shapes_is_one_line(tiny_model_dir, tmp_path, field, value, shown, four_bit):
    """Before: a RuntimeError traceback ("You set `ignore_mismatched_sizes` to `False`"); in 4-bit, no error at all
    (transformers 5.19 compares no shapes with a quantizer) and a model whose layers are not their declared size."""
    folder = _copy(tiny_model_dir, tmp_path / "m")
    _edit(folder / "config.json", lambda j: j.__setitem__(field, value))
    with pytest.raises(ModelLoadError) as err:
        load_base_model(_cfg(folder, four_bit))
    msg = str(err.value)
    assert msg.startswith(f"model.name_or_path={str(folder)!r}: config.json's shapes do not match the weights (")
    assert shown in msg and msg.endswith("the config is from another model; use the config.json that came with these "
                                         "weights")


@pytest.mark.parametrize("text,said", [
    ("[]", "holds a JSON list, not an object of the model's settings"),
    ('{"model_type": "qwen2", ', "is not valid JSON (Expecting property name"),
])
def test_a_config_json_that_is_no_object_is_one_line(tiny_model_dir, tmp_path, text, said):
    """Before: a list went to transformers as it was, which raised "argument after ** must be a mapping" (TypeError
    traceback). validate says it too (model_path_problem, through config_json_problem)."""
    folder = _copy(tiny_model_dir, tmp_path / "m")
    (folder / "config.json").write_text(text)
    assert hub.config_json_problem(folder).startswith(f"{folder / 'config.json'} {said}")
    for load in (load_tokenizer, load_base_model):
        with pytest.raises(ModelLoadError, match=rf"^model.name_or_path='{folder}': {folder}/config.json "
                                                 rf"{re.escape(said)}"):
            load(_cfg(folder))
    assert hub.config_json_problem(tiny_model_dir) is None and hub.config_json_problem(tmp_path / "none") is None


def test_a_config_field_of_the_wrong_type_is_one_line(tiny_model_dir, tmp_path):
    """transformers 5 checks config fields as it reads them: StrictDataclassFieldValidationError, a traceback before."""
    folder = _copy(tiny_model_dir, tmp_path / "m")
    _edit(folder / "config.json", lambda j: j.__setitem__("vocab_size", "many"))
    for load, what in ((load_tokenizer, "a tokenizer"), (load_base_model, "the model")):
        with pytest.raises(ModelLoadError, match=rf"^model.name_or_path='{folder}': cannot load {what} \(Field "
                                                 r"'vocab_size' expected int, got str \(value: 'many'\)\)$"):
            load(_cfg(folder))


# -- 5, 6, 7: where the folder is, what it holds ------------------------------------------------------------------

def test_a_model_path_under_home_is_expanded_once_in_the_recipe(tiny_model_dir, tmp_path, monkeypatch):
    """Before: validate expanded '~' and passed, while train and export gave '~/...' to transformers (a hub id)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    _copy(tiny_model_dir, tmp_path / "base")
    cfg = _cfg("~/base")
    assert cfg.name_or_path == str(tmp_path / "base")
    assert len(load_tokenizer(cfg)) == 21
    assert _cfg("Qwen/Qwen2.5-1.5B").name_or_path == "Qwen/Qwen2.5-1.5B"


def test_a_model_folder_beside_the_recipe_is_found_as_data_files_are(tiny_model_dir, tiny_data, tmp_path, monkeypatch):
    """The data paths' rule (the current directory first, else the recipe's folder) for model.name_or_path too.
    Before: 'mymodel' beside the recipe, run from elsewhere, was asked of the hub."""
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    _copy(tiny_model_dir, recipes / "mymodel")
    path = write_recipe(recipes / "r.yaml", recipe_dict("mymodel", tiny_data, tmp_path / "run"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert load_recipe(path).model.name_or_path == str(recipes / "mymodel")
    _copy(tiny_model_dir, elsewhere / "mymodel")   # one in the current directory comes first
    assert load_recipe(path).model.name_or_path == "mymodel"
    d = recipe_dict("Qwen/Qwen2.5-1.5B", tiny_data, tmp_path / "run")   # a hub id stays one
    assert load_recipe(write_recipe(recipes / "hub.yaml", d)).model.name_or_path == "Qwen/Qwen2.5-1.5B"


def test_tokenizer_config_json_without_a_vocabulary_is_refused(tiny_model_dir, tmp_path, monkeypatch):
    """Before: the check took tokenizer_config.json alone for a tokenizer; transformers built one of special tokens
    only, and train failed later with "the prompt renders to no tokens"."""
    from lowmem_grpo import model as model_module

    folder = _copy(tiny_model_dir, tmp_path / "m")
    (folder / "tokenizer.json").unlink()
    assert hub.tokenizer_files_problem(folder).startswith("tokenizer_config.json but no vocabulary file (tokenizer.json, "
                                                          "tokenizer.model, vocab.txt")
    with pytest.raises(ModelLoadError, match=r"tokenizer_config.json but no vocabulary file .*; it holds: config.json, "):
        load_tokenizer(_cfg(folder))
    (folder / "vocab.json").write_text("{}")
    assert hub.tokenizer_files_problem(folder).startswith("vocab.json but no merges.txt beside it")
    (folder / "merges.txt").write_text("")
    assert hub.tokenizer_files_problem(folder) is None
    # and once loaded, a tokenizer that turns text into nothing is refused too (whatever files it came from)
    (folder / "vocab.json").unlink()
    (folder / "merges.txt").unlink()
    monkeypatch.setattr(model_module, "tokenizer_files_problem", lambda folder: None)
    with pytest.raises(ModelLoadError, match=r"the tokenizer turns text into no tokens \(it holds 5, its special tokens "
                                             r"at most\)"):
        load_tokenizer(_cfg(folder))


def test_an_adapter_folder_given_as_the_base_model_names_its_base(tmp_path):
    """Before: "the folder has no config.json, so it is no model folder"."""
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "org/base"}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError) as err:
        load_tokenizer(_cfg(folder))
    assert str(err.value).startswith(f"model.name_or_path={str(folder)!r}: the folder is a LoRA adapter "
                                     "(adapter_config.json), not a base model: its base model is 'org/base' "
                                     "(adapter_config.json's base_model_name_or_path). Give the base model as "
                                     "model.name_or_path")


def test_model_code_of_its_own_asks_for_the_recipe_field(tiny_model_dir, tmp_path):
    """Before: transformers' "pass the argument `trust_remote_code=True`", with https://hf.co//tmp/... as the URL."""
    folder = _copy(tiny_model_dir, tmp_path / "m")
    auto_map = {"AutoConfig": "configuration_my.MyConfig", "AutoModelForCausalLM": "modeling_my.MyModelForCausalLM"}
    _edit(folder / "config.json", lambda j: j.update(model_type="mymodel", architectures=["MyModelForCausalLM"],
                                                     auto_map=auto_map))
    with pytest.raises(ModelLoadError) as err:
        load_base_model(_cfg(folder))
    assert str(err.value) == (f"model.name_or_path={str(folder)!r}: its config names model code of its own (auto_map), "
                              "which runs only with model.trust_remote_code: true in the recipe; set it only for a "
                              "model whose code you trust")


def _sharded(tiny_model_dir, folder: Path) -> Path:
    from safetensors.torch import load_file, save_file

    _copy(tiny_model_dir, folder)
    sd = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    keys = sorted(sd)
    shards = {k: f"model-0000{1 + (i >= len(keys) // 2)}-of-00002.safetensors" for i, k in enumerate(keys)}
    for shard in sorted(set(shards.values())):
        save_file({k: sd[k] for k in keys if shards[k] == shard}, str(folder / shard), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    return folder


def test_weights_problem_finds_what_the_load_would_fail_on(tiny_model_dir, tmp_path):
    """hub.weights_problem (for validate; load_base_model asks it first): before, validate passed each of these."""
    assert hub.weights_problem(tiny_model_dir) is None
    sharded = _sharded(tiny_model_dir, tmp_path / "sharded")
    assert hub.weights_problem(sharded) is None
    assert load_base_model(_cfg(sharded)).get_input_embeddings().weight.shape[0] == 21
    second = sharded / "model-00002-of-00002.safetensors"
    data = second.read_bytes()
    second.write_bytes(data[:-100])
    assert hub.weights_problem(sharded) == (f"{second} is unreadable, truncated or corrupt (Error while deserializing "
                                            "header: incomplete metadata, file not fully covered)")
    second.unlink()
    assert hub.weights_problem(sharded) == (f"{sharded / 'model.safetensors.index.json'} names 2 weight shard file(s), "
                                            "1 of them not in the folder: model-00002-of-00002.safetensors; copy them "
                                            "from the model's folder")
    with pytest.raises(ModelLoadError, match=r"cannot load the model: .*names 2 weight shard file\(s\), 1 of them not"):
        load_base_model(_cfg(sharded))
    (sharded / "model.safetensors.index.json").write_text('{"weight_map": ')
    said = hub.weights_problem(sharded)
    assert "model.safetensors.index.json cannot be read as a weights index (Expecting value" in said
    for f in sharded.glob("model*"):
        f.unlink()
    assert hub.weights_problem(sharded).startswith("no weights file (model.safetensors, model.safetensors.index.json, "
                                                   "pytorch_model.bin, pytorch_model.bin.index.json); it holds: "
                                                   "config.json, ")
    torch.save({}, sharded / "pytorch_model.bin")
    assert hub.weights_problem(sharded) is None and hub.weights_problem(tmp_path / "none") is None


def test_validate_says_what_train_would_refuse_in_the_model_folder(tiny_model_dir, tiny_data, tmp_path):
    """validate said ok for a folder without weights and one whose end-of-sequence token transformers made up; train
    refused both (a red team's find): validate names each under model.name_or_path, and passes the intact folder."""
    from click.testing import CliRunner

    from lowmem_grpo.cli import main

    def validate(folder):
        path = write_recipe(tmp_path / f"{folder.name}.yaml", recipe_dict(folder, tiny_data, tmp_path / "run"))
        return CliRunner().invoke(main, ["validate", str(path)])

    assert validate(_copy(tiny_model_dir, tmp_path / "intact")).exit_code == 0
    no_weights = _copy(tiny_model_dir, tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    res = validate(no_weights)
    assert res.exit_code != 0 and "model.name_or_path" in res.output and "no weights file" in res.output, res.output
    made_up = _copy(tiny_model_dir, tmp_path / "made_up")
    _drop_eos(made_up, everywhere=False)
    res = validate(made_up)
    assert res.exit_code != 0 and "transformers added it as a new token" in res.output, res.output
