"""The run's output-length ranker (``ranker.*``): the one saved at ``ranker.path`` is checked
before any work, and at start the run takes the checkpoint's (updated online), the saved one,
or bootstraps one from the current policy's lengths (paper 5.2: no trace needed to start)."""
from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from pathlib import Path

from controller.config import ConfigError


def saved_ranker(cfg):
    """The ranker saved at ``ranker.path`` (loaded, so a damaged or incompatible folder is one
    config error before any work), or None when there is none yet and the path can take the
    one the run bootstraps (else the bootstrap's generations and fit would be lost at its save)."""
    r = cfg.ranker
    if r.kind == "none":
        return None
    import ranker
    from ranker.store import check_target

    path = Path(r.path)
    try:
        if not (path / "meta.json").exists():
            check_target(path)
            return None
        model = ranker.load(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"ranker.path: {e}") from None
    _check_options(r.options, model, f"the ranker saved at ranker.path ({path})")
    return model


def _check_options(options: dict, model, which: str) -> None:
    """``ranker.options`` configure a ranker the run bootstraps; a loaded one keeps the config it
    was saved with. Options that differ from it (``update_rounds: 50`` against its 5) were dropped
    without a word (review, s54): refused, naming each key and both values."""
    import ranker
    from dataclasses import asdict, is_dataclass

    if not options or not is_dataclass(getattr(model, "cfg", None)):
        return  # (your own class: its config is its own business)
    wanted, held = asdict(ranker.build(model.kind, **dict(options)).cfg), asdict(model.cfg)
    differ = {k: (wanted[k], held[k]) for k in options if k in wanted and k in held and wanted[k] != held[k]}
    if differ:
        said = ", ".join(f"{k}: {w!r} (it has {h!r})" for k, (w, h) in differ.items())
        raise ConfigError(f"ranker.options: {said}; {which} keeps the config it was saved with, and options only "
                          "configure a ranker the run bootstraps: drop them, or move the saved ranker away to "
                          "bootstrap a new one")


def run_ranker(cfg, saved, resumed_from: Path | None, measure_lengths, prompts: list[str], span=nullcontext):
    """The ranker the run uses: the one of the checkpoint resumed from (``resumed_from``),
    else ``saved`` (``saved_ranker``), else one bootstrapped on ``ranker.bootstrap_prompts`` of
    ``prompts`` with ``measure_lengths`` (the SGS generating with the current policy), fit and
    saved at ``ranker.path``, inside ``span()`` (the controller's "ranker" timeline span)."""
    r = cfg.ranker
    if r.kind == "none":
        return None
    import ranker
    from ranker.base import TooFewRows

    path = Path(r.path)
    resumed = resumed_from / "ranker" if resumed_from else None
    if resumed is not None and (resumed / "meta.json").exists():  # updated online (update_every)
        try:
            kept = ranker.load(resumed)
        except (OSError, ValueError) as e:  # a damaged folder, your own class no longer importable
            raise ConfigError(f"ranker: the checkpoint resumed from holds a ranker that does not load ({e})") from None
        if kept.kind != r.kind:
            raise ConfigError(f"ranker.kind: {r.kind!r}, but the checkpoint resumed from holds a {kept.kind!r} "
                              f"ranker ({resumed}); set ranker.kind: {kept.kind} to resume")
        _check_options(r.options, kept, f"the checkpoint's ranker ({resumed})")
        print(f"[controller] ranker: {kept.kind}, the one saved with the checkpoint, {resumed}",
              file=sys.stderr, flush=True)
        return kept
    if saved is not None:
        print(f"[controller] ranker: {r.kind} from {path} (its estimates are in the unit it was trained on)",
              file=sys.stderr, flush=True)
        return saved
    if cfg.train.eval_only:  # no generation of its own nor a file written for an evaluation
        print(f"[controller] ranker: none at {path}, and an eval-only run bootstraps none (its requests are "
              "dispatched without length estimates)", file=sys.stderr, flush=True)
        return None
    t0 = time.time()
    with span():
        try:
            model = ranker.bootstrap(measure_lengths, prompts, n=r.bootstrap_prompts, kind=r.kind,
                                     sample_seed=cfg.train.seed, options=dict(r.options))
        except TooFewRows as e:  # fewer train prompts than the kind fits on (before any generation)
            raise ConfigError(f"ranker.bootstrap_prompts: {e}") from None
        ranker.save(model, path)
    print(f"[controller] ranker: no {r.kind} ranker at {path}; bootstrapped one from the policy's lengths on "
          f"{min(r.bootstrap_prompts, len(prompts))} prompts x {cfg.train.group_size} samples in "
          f"{time.time() - t0:.1f} s, saved there", file=sys.stderr, flush=True)
    return model
