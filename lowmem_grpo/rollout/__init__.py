"""Rollout engines: `make_engine` picks one by name (the engines themselves are in hf.py and vllm.py,
their shared interface in base.py)."""

from __future__ import annotations

from .base import EngineConfig, EngineError, RolloutEngine


def make_engine(config: EngineConfig, model, tokenizer) -> RolloutEngine:
    if config.name == "hf":
        from .hf import HFEngine

        return HFEngine(model, tokenizer, max_batch_sequences=config.max_batch_sequences)
    if config.name == "vllm":
        try:
            from .vllm import VLLMEngine  # imported here: vllm is an optional, GPU-first dependency
        except ImportError as exc:
            raise EngineError(f"generation.engine=vllm is not available ({exc}); use generation.engine: hf") from None
        return VLLMEngine(model, tokenizer, config)
    raise EngineError(f"generation.engine={config.name!r} is unknown; allowed: hf, vllm")
