"""Keys a run would accept and never read: set (to other than their default) where the switch
they act under is off, each is one config error naming the key and that switch, as
``train.sft_steps`` without ``model.init`` (``config_checks.validate``). A review found them
accepted and ignored (session 51)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from workers.config_schema import ConfigError

if TYPE_CHECKING:
    from controller.config import Config


def _default(section, name: str):
    f = next(f for f in dataclasses.fields(section) if f.name == name)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _set(section, name: str) -> bool:
    return getattr(section, name) != _default(section, name)


def _yaml(value) -> str:
    from controller.config_yaml import dump

    return dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def check_unused(cfg: "Config") -> None:
    t, e, r, mt = cfg.train, cfg.engine, cfg.ranker, cfg.multi_turn
    only = "acts only with"
    rules = [  # (section name, section, keys, the switch is off, why they act on nothing)
        ("train", t, ("length_scale",), not t.length_trace, f"{only} train.length_trace (the trace it scales)"),
        ("train", t, ("sft_lr",), cfg.model.init is None,
         f"{only} model.init (the SFT warm-start runs only when a model is built)"),
        ("multi_turn", mt, ("max_turns", "max_observation_tokens", "observation_truncate_side", "workers"),
         not mt.env, f"{only} multi_turn.env (single-turn without it)"),
        ("ranker", r, ("path", "options", "bootstrap_prompts"), r.kind == "none",
         f"{only} ranker.kind (none: no ranker; a trained folder loads with kind: lgbm / lm / ...)"),
        ("engine", e, ("seed",), e.backend in ("native", "vllm"),  # (your own engine may read it)
         "is read by nothing in a run: every request carries its own seed (train.seed * 7919 + its sample "
         "id), so the engine's generator draws none; set train.seed"),
        ("engine", e, ("attention_backend", "cpu_prepack", "cpu_half_compute"), e.backend == "vllm",
         f"{only} engine.backend: native (vLLM picks its own kernels; docs/vllm.md)"),
    ]
    for name, section, keys, off, why in rules:
        for key in keys:
            if off and _set(section, key):
                raise ConfigError(f"{name}.{key}: {getattr(section, key)!r} {why}; drop {name}.{key} (from the "
                                  f"command line: --set {name}.{key}={_yaml(_default(section, key))})")
    if cfg.ranker.kind == "none" and e.admission == "lpt":  # (as dispatch.name: skew, config_checks)
        raise ConfigError("engine.admission: lpt admits the longest estimate first, and ranker.kind: none gives "
                          "every request the same one (max_tokens): it is fcfs; set ranker.kind, or drop it")
    from controller.scheduling import needs_ranker

    if cfg.ranker.kind == "none" and needs_ranker("", cfg.dispatch.options):
        raise ConfigError("dispatch.options.order: lpt orders by estimate, and ranker.kind: none gives every "
                          "request the same one (max_tokens); set ranker.kind, or drop it")
    if cfg.pipeline.mode == "colocated":
        from workers.weight_sync import WeightSyncConfig

        if cfg.weight_sync != WeightSyncConfig.from_dict(None, cfg.weight_sync.topology):
            raise ConfigError("weight_sync: colocated, the trainer's weights are copied within each process, no "
                              "broadcast runs; drop the weight_sync section (or use a disaggregated mode)")
        from workers.weight_sync import Topology

        if cfg.topology != Topology():  # the broadcast trees are its only reader (review, s54)
            raise ConfigError("topology: colocated, the trainer's weights are copied within each process, no "
                              "broadcast runs over its links; drop the topology section (or use a disaggregated "
                              "mode)")


def minibatch_unused(cfg: "Config") -> None:
    """``pipeline.minibatch_size`` in a run whose mode hands no mini-batches over (not checked
    with ``--repl``, where ``mode minibatch`` may read it later)."""
    p = cfg.pipeline
    if p.mode != "minibatch" and _set(p, "minibatch_size"):
        raise ConfigError(f"pipeline.minibatch_size: {p.minibatch_size!r} acts only with pipeline.mode: minibatch "
                          f"(this run's is {p.mode}); drop pipeline.minibatch_size (from the command line: --set "
                          f"pipeline.minibatch_size={_yaml(_default(p, 'minibatch_size'))}), or run with --repl to "
                          "switch to it later")
