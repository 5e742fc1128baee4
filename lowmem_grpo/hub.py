"""Hugging Face hub datasets as a prompt source: `data.train_path: hf:NAME[:CONFIG]@SPLIT`.

    hf:openai/gsm8k:main@train
    hf:DigitalLearningGmbH/MATH-lighteval@test
    hf:Jiayi-Pan/Countdown-Tasks-3to4@train[:20000]      (datasets' split slicing)
    hf:/data/my_gsm8k@test                                (a local folder of .jsonl/.parquet files)

The split is loaded with `datasets.load_dataset(NAME, CONFIG, split=SPLIT)`, so the cache, offline mode
(HF_DATASETS_OFFLINE=1) and local folders work as in `datasets`, and kept as its Arrow table, memory-mapped
from datasets' cache: rows are fetched by index when needed (data.py), never all turned into Python
objects. Parquet files go the same way (`load_file`). `datasets` is imported only here, and only when
such a source is used (importing it takes a second or two).

Hub model ids too: `shipped_model_config` finds the copy of a model's config.json that ships in
lowmem_grpo/model_configs, for what needs only the model's shape (the memory estimate); `model_path_problem`
says why a model.name_or_path cannot be loaded (no such folder, no model in it, the hub out of reach) before
transformers tries.
"""

from __future__ import annotations

import functools
import json
import os
import re
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

PREFIX = "hf:"
FORM = "hf:NAME[:CONFIG]@SPLIT, e.g. hf:openai/gsm8k:main@train"
MODEL_CONFIGS = Path(__file__).resolve().parent / "model_configs"  # ORG/NAME/config.json, named like the hub ids
_MODEL_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", re.ASCII)  # ORG/NAME: no '..', no absolute path


class HubSpecError(ValueError):
    pass


@dataclass(frozen=True)
class HubSpec:
    name: str
    config: Optional[str]
    split: str

    def __str__(self) -> str:
        return f"{PREFIX}{self.name}{':' + self.config if self.config else ''}@{self.split}"


def is_hub(source: str) -> bool:
    return isinstance(source, str) and source.startswith(PREFIX)


def parse(source: str) -> HubSpec:
    """The parts of an `hf:` source; HubSpecError saying what is wrong and the allowed form."""
    rest = source[len(PREFIX):]
    head, at, split = rest.rpartition("@")
    if not at:
        raise HubSpecError(f"{source!r} names no split; expected {FORM}")
    # A hub name has at most one '/', never ':', so the first ':' after the last '/' starts the config.
    slash = head.rfind("/")
    colon = head.find(":", slash + 1)
    name, config = (head, None) if colon < 0 else (head[:colon], head[colon + 1:])
    if "@" in head:   # (the split is after the last '@'; a dataset or config name never holds one)
        raise HubSpecError(f"{source!r} has more than one '@'; expected {FORM}")
    if config is not None and ":" in config:
        raise HubSpecError(f"{source!r} has more than one ':' after the dataset name; expected {FORM}")
    if not name.strip():
        raise HubSpecError(f"{source!r} names no dataset; expected {FORM}")
    if config is not None and not config.strip():
        raise HubSpecError(f"{source!r} has an empty config after ':'; expected {FORM}")
    if not split.strip():
        raise HubSpecError(f"{source!r} has an empty split after '@'; expected {FORM}")
    return HubSpec(name.strip(), config.strip() if config else None, split.strip())


def _offline() -> bool:
    try:
        from datasets import config

        return bool(getattr(config, "HF_HUB_OFFLINE", False) or getattr(config, "HF_DATASETS_OFFLINE", False))
    except Exception:
        return False


def _datasets(what: str):
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{what}: reading Hugging Face datasets needs the `datasets` package "
                         "(pip install 'lowmem-grpo[data]')") from None
    return datasets


def shipped_model_config(name_or_path: str) -> Optional[Path]:
    """The folder (lowmem_grpo/model_configs/ORG/NAME) holding this package's copy of hub model ORG/NAME's
    config.json, or None: when `name_or_path` exists as a local path (the user's own copy comes first), is not
    an ORG/NAME id, or names a model whose config is not shipped. The folder holds the shape only (no weights,
    no tokenizer): it is for what needs no more (`lowmem-grpo estimate`), never for loading the model."""
    name = str(name_or_path)
    if not _MODEL_ID.fullmatch(name) or Path(name).expanduser().exists():
        return None
    folder = MODEL_CONFIGS / name
    return folder if (folder / "config.json").is_file() else None


def load(source: str):
    """One split of a hub (or local-folder) dataset, as a `datasets.Dataset` (memory-mapped Arrow). Every
    failure is a ValueError whose message names the dataset and what to do (the caller adds the recipe field)."""
    spec = parse(source)
    datasets = _datasets(source)
    what = f"dataset {spec.name!r}" + (f" (config {spec.config!r})" if spec.config else "") + f", split {spec.split!r}"
    try:
        ds = datasets.load_dataset(spec.name, spec.config, split=spec.split)
    except Exception as exc:  # datasets raises many types (ConnectionError, FileNotFoundError, ValueError, ...)
        first = (str(exc).strip().splitlines() or [""])[0][:400]
        mode = "this machine is offline (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE)" if _offline() else "the hub could not be reached or has no such dataset"
        raise ValueError(
            f"cannot load the Hugging Face {what}: {type(exc).__name__}: {first}\n"
            f"  If {mode}: check the name, config and split on huggingface.co/datasets/{spec.name}; "
            f"or, on a machine with internet, run `python -c \"import datasets; datasets.load_dataset("
            f"{spec.name!r}{', ' + repr(spec.config) if spec.config else ''}, split={spec.split!r})\"` and copy "
            f"its cache (~/.cache/huggingface/datasets, or $HF_DATASETS_CACHE) here; or save the split as a "
            f".jsonl/.parquet file (Dataset.to_json / to_parquet) and point the recipe at that file.") from None
    if not hasattr(ds, "to_list"):
        raise ValueError(f"{what}: load_dataset returned {type(ds).__name__}, not one split; name a split after '@'")
    return ds


def load_file(kind: str, path) -> "object":
    """A data file (kind 'parquet') as a `datasets.Dataset`: converted once into datasets' Arrow cache
    (reused while the file is unchanged) and memory-mapped from there."""
    datasets = _datasets(str(path))
    try:
        return datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as exc:  # a corrupt or unreadable file: pyarrow and datasets raise many types
        first = (str(exc).strip().splitlines() or [""])[0][:400]
        raise ValueError(f"cannot read it as {kind}: {type(exc).__name__}: {first}") from None


def load_rows(source: str) -> list[dict]:
    """The rows of one split of a hub (or local-folder) dataset, as dicts (small splits and tests; the
    trainer reads rows by index from `load`)."""
    return load(source).to_list()


# ----------------------------------------------------------------------------------------------------
# model.name_or_path: a local folder or a hub id, checked before transformers tries it (train, eval, export
# through model.py; estimate through the CLI), so that each says the same thing
# ----------------------------------------------------------------------------------------------------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
PROBE_TIMEOUT_S = 3.0   # a hub that answers at all opens a connection in well under a second


def folder_contents(path: Path, most: int = 8) -> str:
    """'it is empty' or 'it holds: a, b/, ...' (the first `most` names), for messages about a folder."""
    try:
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    except OSError as exc:   # e.g. no permission to list it
        return f"it cannot be listed: {exc.strerror or exc}"
    if not names:
        return "it is empty"
    return "it holds: " + ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def tokenizer_files_problem(folder: Path) -> Optional[str]:
    """Why a model folder has no tokenizer to load (transformers would build an empty one, or blame a missing
    sentencepiece), or None."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return (f"no tokenizer files ({', '.join(TOKENIZER_FILES)}); {folder_contents(folder)}. Copy them from the "
                "base model's folder")
    # tokenizer_config.json alone (found by a red team): transformers builds a tokenizer of its special tokens only,
    # and every prompt then renders to no tokens
    if _vocabulary_file(folder) or _custom_tokenizer(folder):
        return None
    if (folder / "vocab.json").is_file():
        return (f"vocab.json but no merges.txt beside it (a BPE vocabulary needs both, or tokenizer.json); "
                f"{folder_contents(folder)}. Copy the tokenizer's files from the base model's folder")
    return (f"tokenizer_config.json but no vocabulary file ({', '.join(VOCABULARY_FILES)}, or vocab.json with "
            f"merges.txt); {folder_contents(folder)}. Copy the tokenizer's files from the base model's folder")


# The files transformers 5.19 reads a tokenizer's vocabulary from (its tokenizers' vocab_files_names): the fast
# tokenizer's tokenizer.json, a sentencepiece model, a WordPiece vocab.txt; or, as patterns, any *.model
# (sentencepiece) or *.tiktoken file. vocab.json counts with merges.txt only (BPE).
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.txt", "spiece.model", "sentencepiece.bpe.model",
                    "tekken.json")


def _vocabulary_file(folder: Path) -> bool:
    if any((folder / name).is_file() for name in VOCABULARY_FILES):
        return True
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        return True
    return any(p.is_file() for pattern in ("*.model", "*.tiktoken") for p in folder.glob(pattern))


def _custom_tokenizer(folder: Path) -> bool:
    """Whether tokenizer_config.json names its own tokenizer code (auto_map), whose files this cannot know."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("auto_map"))


def config_json_problem(folder: Path) -> Optional[str]:
    """Why a model folder's config.json cannot be read as a model's config (not UTF-8, not JSON, or JSON but no
    object: transformers raised a TypeError traceback for a list, found by a red team), or None (also when the folder
    has none: model_path_problem says that)."""
    path = Path(folder).expanduser() / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        return f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason})"
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror or exc})"
    except ValueError as exc:
        return f"{path} is not valid JSON ({exc}); copy config.json from the base model's folder"
    if not isinstance(config, dict):
        return (f"{path} holds a JSON {type(config).__name__}, not an object of the model's settings "
                "({\"model_type\": ..., ...}); copy config.json from the base model's folder")
    return None


WEIGHTS_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")   # what transformers 5.19 loads a model folder from, in its order


def weights_problem(folder: Path) -> Optional[str]:
    """Why a local model folder's weights cannot be loaded, found before transformers tries (found by a red team:
    validate passed such folders, and train failed on them): no weights file transformers reads (WEIGHTS_FILES), an
    index (*.index.json) that is unreadable or names shard files that are not there, or a *.safetensors file whose
    header safetensors cannot read (cut short, damaged). None otherwise, and for a folder that is not there."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        return None
    present = [name for name in WEIGHTS_FILES if (folder / name).is_file()]
    if not present:
        return (f"no weights file ({', '.join(WEIGHTS_FILES)}); {folder_contents(folder)}. Copy the model's weights "
                "into the folder")
    name = present[0]   # transformers' own order: safetensors first, a single file before an index
    files = [folder / name]
    if name.endswith(".index.json"):
        try:
            index = json.loads((folder / name).read_text(encoding="utf-8"))
            shards = sorted(set(index["weight_map"].values()))
            if not shards or not all(isinstance(s, str) for s in shards):
                raise ValueError("its weight_map names no shard files")
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            why = "no weight_map" if isinstance(exc, (KeyError, TypeError, AttributeError)) else exc
            return f"{folder / name} cannot be read as a weights index ({why}); copy it from the model's folder"
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            return (f"{folder / name} names {len(shards)} weight shard file(s), {len(missing)} of them not in the "
                    f"folder: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; copy them from the model's "
                    "folder")
        files = [folder / s for s in shards]
    if name.startswith("model.safetensors"):
        from .checkpoint import safetensors_problem

        for f in files:
            if (why := safetensors_problem(f)) is not None:
                return f"{f} is unreadable, truncated or corrupt ({' '.join(why.split())})"
    return None


def model_path_problem(name: str) -> Optional[str]:
    """Why model.name_or_path cannot be loaded, found before transformers tries it, or None: a path that does not
    exist (transformers only says the name is no valid repo id), a folder without config.json (transformers
    blames a missing sentencepiece; a LoRA adapter's is said to be one), a config.json that is no JSON object
    (config_json_problem), a hub id that is not in the local cache while the hub cannot be reached
    (transformers retries for ~50 s first). Where the hub cannot be reached and the model is cached, this turns
    on offline mode for the process, so that loading it from the cache does not wait on those retries."""
    name = str(name)
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            problem = config_json_problem(path)
            return f"model.name_or_path={name!r}: {problem}" if problem else None
        if (path / "adapter_config.json").is_file():   # found by a red team: said only "no config.json"
            return f"model.name_or_path={name!r}: {_adapter_folder(path)}"
        return (f"model.name_or_path={name!r}: the folder has no config.json, so it is no model folder "
                f"({folder_contents(path)}); a model folder holds config.json, the weights (*.safetensors) and the "
                f"tokenizer's files ({', '.join(TOKENIZER_FILES)})")
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or path.exists():
        return (f"model.name_or_path={name!r}: no such model folder (a hub model is written as namespace/name, "
                "e.g. Qwen/Qwen2.5-1.5B-Instruct)")
    return _hub_model_problem(name)


def _adapter_folder(path: Path) -> str:
    """What to say of a LoRA adapter folder given as the base model: which base it was trained on."""
    try:
        base = json.loads((path / "adapter_config.json").read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    on = (f"its base model is {base!r} (adapter_config.json's base_model_name_or_path)" if isinstance(base, str) and base
          else "adapter_config.json names no base model (base_model_name_or_path)")
    return (f"the folder is a LoRA adapter (adapter_config.json), not a base model: {on}. Give the base model as "
            "model.name_or_path (an adapter is evaluated with `lowmem-grpo eval --adapter`; a merged model, the "
            "merged/ folder of `lowmem-grpo export`, can be a base)")


def _hub_model_problem(name: str) -> Optional[str]:
    """A hub id: None when it can be loaded (cached, or the hub is reachable), else what to do."""
    from huggingface_hub import constants

    cached = _in_cache(name)
    if constants.HF_HUB_OFFLINE:
        if cached:
            return None
        return (f"model.name_or_path={name!r}: HF_HUB_OFFLINE is set and the model is not in the local cache "
                f"({constants.HF_HUB_CACHE}). {_get_it(name)}")
    reachable = hub_reachable()
    if reachable is not False:   # reachable, or not known (behind a proxy): transformers tries as usual
        return None
    if cached:
        _go_offline()
        return None
    return (f"model.name_or_path={name!r}: the Hugging Face hub ({constants.ENDPOINT}) cannot be reached from this "
            f"machine, and the model is not in the local cache ({constants.HF_HUB_CACHE}). {_get_it(name)}. Without "
            "internet, set HF_HUB_OFFLINE=1: every hub lookup then uses the cache alone, without trying the network")


def _get_it(name: str) -> str:
    return (f"Give a local model folder as model.name_or_path, or download the model on a machine with internet "
            f"(`hf download {name}`) and copy its cache folder here")


def _in_cache(name: str) -> bool:
    """Whether the hub model's config.json is in the local hub cache."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:   # not a valid repo id, an unreadable cache: not usable from the cache, either way
        return False


@functools.lru_cache(maxsize=1)
def hub_reachable() -> Optional[bool]:
    """Whether a connection to the hub's endpoint (HF_ENDPOINT) opens within PROBE_TIMEOUT_S; None where a proxy
    is set (the hub is then reached through it, and a direct probe would say nothing). Once a process."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    address = (url.hostname, url.port or (443 if url.scheme == "https" else 80))
    opened: list = []

    def probe():   # in a thread: a name lookup that hangs does not obey the socket's timeout
        try:
            socket.create_connection(address, timeout=PROBE_TIMEOUT_S).close()
            opened.append(True)
        except (OSError, ValueError):
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(PROBE_TIMEOUT_S + 0.5)
    return bool(opened)


def _go_offline() -> None:
    """Offline mode for this process and those it starts (torchrun's, vLLM's): the hub cannot be reached, and
    every lookup would otherwise retry for ~50 s before using the cache."""
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True
    os.environ["HF_HUB_OFFLINE"] = "1"
