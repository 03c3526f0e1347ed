"""make_engine: build a generation backend by name from an EngineConfig.

``BACKENDS`` maps ``cfg.backend`` to a constructor ``(cfg, model_dir) -> Engine``. Optional
backends import their dependencies inside the constructor, so ``import`` of this module never
needs vLLM.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from workers.generation.config import EngineConfig
from workers.types import Engine


def _native(cfg: EngineConfig, model_dir: str) -> Engine:
    from workers.generation.engine import NativeEngine

    return NativeEngine(cfg, model_dir)


def _vllm(cfg: EngineConfig, model_dir: str) -> Engine:
    # workers/generation/vllm_engine.py (engineer H) provides VLLMEngine(cfg, model_dir)
    from workers.generation.vllm_engine import VLLMEngine

    return VLLMEngine(cfg, model_dir)


BACKENDS: dict[str, Callable[[EngineConfig, str], Engine]] = {"native": _native, "vllm": _vllm}


def make_engine(cfg: EngineConfig, model_dir: str, eos_ids=None) -> Engine:
    """Engine of backend ``cfg.backend`` over the HF model folder ``model_dir``.
    ``eos_ids`` (int or ints) overrides ``cfg.eos_ids`` and the model config's EOS."""
    if cfg.backend not in BACKENDS:
        raise ValueError(f"engine.backend: {cfg.backend!r} is not one of {sorted(BACKENDS)}")
    if eos_ids is not None:
        eos = (eos_ids,) if isinstance(eos_ids, int) else tuple(int(e) for e in eos_ids)
        cfg = dataclasses.replace(cfg, eos_ids=eos)
    return BACKENDS[cfg.backend](cfg, model_dir)
