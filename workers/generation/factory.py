"""make_engine: build a generation backend by name from an EngineConfig.

``engine.backend`` names the constructor ``(cfg, model_dir) -> Engine``:

* ``native``: this project's engine (``engine.py``);
* ``vllm``: vLLM (``vllm_engine.py``; imported inside its constructor, so ``import`` of this
  module never needs vLLM);
* your own, ``module:Name`` or ``file.py:Name`` (as ``task.name``): a class (or function) called
  with the ``EngineConfig`` and the HF model folder, whose result has the ``Engine`` Protocol's
  methods (``workers/types.py``: ``add``, ``step``, ``has_work``, ``abort``, ``load_weights``,
  ``set_max_batch_size``, ``stats`` returning an ``EngineStats``, ``close``, and a
  ``max_model_len``). Its settings go in ``engine.backend_options``. Loaded, and a class's
  methods checked, when the config loads (``check_backend``: one config error naming the key);
  what it builds is checked again (``_check_built``).
  ``tests/test_engine_conformance.py`` is the behaviour an engine owes the runtime.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

from workers.generation.config import EngineConfig
from workers.types import Engine, EngineStats


def _native(cfg: EngineConfig, model_dir: str) -> Engine:
    from workers.generation.engine import NativeEngine

    return NativeEngine(cfg, model_dir)


def _vllm(cfg: EngineConfig, model_dir: str) -> Engine:
    from workers.generation.vllm_engine import VLLMEngine

    return VLLMEngine(cfg, model_dir)


BACKENDS: dict[str, Callable[[EngineConfig, str], Engine]] = {"native": _native, "vllm": _vllm}
# what the runtime calls on an engine (the Engine Protocol's methods)
ENGINE_METHODS = ("add", "step", "has_work", "abort", "load_weights", "set_max_batch_size", "stats", "close")


def _missing(obj) -> list[str]:
    return [m for m in ENGINE_METHODS if not callable(getattr(obj, m, None))]


def engine_factory(name: str) -> Callable[[EngineConfig, str], Engine]:
    """The constructor ``engine.backend: name`` selects: a built-in one, or your own loaded
    (a ValueError naming ``engine.backend``; a class missing an Engine method is one too)."""
    from workers.tasks.plugins import builtin_or_plugin

    factory = builtin_or_plugin(name, BACKENDS, "engine.backend", ", nor module:Name / file.py:Name of your own engine")
    # (a class that forwards with __getattr__ has its methods on each object only: checked once built)
    if inspect.isclass(factory) and not hasattr(factory, "__getattr__") and (missing := _missing(factory)):
        raise ValueError(f"engine.backend: {name!r} is a class without {', '.join(missing)}: an engine needs the "
                         f"Engine Protocol's methods ({', '.join(ENGINE_METHODS)}; workers/types.py; methods set "
                         "on each object in __init__: name a function that builds it)")
    return factory


def check_backend(name: str) -> None:
    """``engine.backend`` loads (your own: imported, a class's methods checked); nothing is built."""
    engine_factory(name)


def make_engine(cfg: EngineConfig, model_dir: str, eos_ids=None, multi_turn=None, tokenizer=None) -> Engine:
    """Engine of backend ``cfg.backend`` over the HF model folder ``model_dir``.
    ``eos_ids`` (int or ints) overrides ``cfg.eos_ids`` and the model config's EOS.
    ``multi_turn`` (the run's ``multi_turn`` section): with an ``env``, the engine is wrapped in a
    ``MultiTurnEngine`` (``multi_turn.py``) with ``tokenizer``, the one the prompts were encoded
    with (None: the folder's, showing the section's tools, as the controller loads it)."""
    factory = engine_factory(cfg.backend)
    if eos_ids is not None:
        eos = (eos_ids,) if isinstance(eos_ids, int) else tuple(int(e) for e in eos_ids)
        cfg = dataclasses.replace(cfg, eos_ids=eos)
    engine = factory(cfg, model_dir)
    if cfg.backend not in BACKENDS:
        _check_built(engine, cfg.backend)
    if multi_turn is not None and multi_turn.env:
        engine = _multi_turn(engine, model_dir, multi_turn, tokenizer)
    return engine


def _multi_turn(engine: Engine, model_dir: str, section, tokenizer=None) -> Engine:
    from workers.generation.multi_turn import MultiTurnEngine
    from workers.tasks.envs import make_env
    from workers.tasks.envs.tools import run_tools
    from workers.tokenizer import Tokenizer

    tokenizer = tokenizer or Tokenizer.load(model_dir, tools=run_tools(section))
    return MultiTurnEngine(engine, tokenizer, make_env(section.env), section.env,
                           max_turns=section.max_turns, max_observation_tokens=section.max_observation_tokens,
                           truncate_side=section.observation_truncate_side,
                           workers=section.workers)


def _check_built(engine, name: str) -> None:
    """What your own engine built has the Protocol's methods and ``max_model_len``, and its
    ``stats()`` is an ``EngineStats`` (the runtime reads its fields): else a TypeError naming it."""
    missing = _missing(engine) + ([] if isinstance(getattr(engine, "max_model_len", None), int) else ["max_model_len"])
    if missing:
        raise TypeError(f"engine.backend: {name!r} built a {type(engine).__name__}, which has no "
                        f"{', '.join(missing)} (the Engine Protocol, workers/types.py)")
    stats = engine.stats()
    if not isinstance(stats, EngineStats):
        raise TypeError(f"engine.backend: {name!r}: stats() returned a {type(stats).__name__}, not a "
                        "workers.types.EngineStats (the runtime reads its running, waiting, KV block and "
                        "preemption counts)")
