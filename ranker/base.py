"""What every length ranker shares: it implements ``predict_log`` (log(1 + words), float64 [N])
and ``fitted``; predictions in words, the fitted check and saving are the same for all."""
from __future__ import annotations

from dataclasses import fields
from typing import Sequence

import numpy as np

from ranker.data import MAX_WORDS
from workers.config_schema import RANGE



class TooFewRows(ValueError):
    """Fewer (prompt, length) pairs than a ranker of this kind and config fits on."""

class LogLengthRanker:
    @property
    def fitted(self) -> bool:
        raise NotImplementedError

    def predict_log(self, prompts: Sequence[str]) -> np.ndarray:
        raise NotImplementedError

    def predict(self, prompts: Sequence[str]) -> list[float]:
        """Estimated answer length in words per prompt (only the order is reliable)."""
        prompts = list(prompts)  # (an iterable: its length known after predict_log took it)
        logs = self.predict_log(prompts)
        if hasattr(logs, "detach"):  # a torch tensor of your own ranker's
            logs = logs.detach().cpu().numpy()
        try:
            got = np.asarray(logs, dtype=np.float64)
        except (TypeError, ValueError):
            got = None
        if got is None or got.shape != (len(prompts),) or not np.all(np.isfinite(got)):
            what = (type(logs).__name__ if got is None else f"shape {got.shape}" if got.shape != (len(prompts),)
                    else "values that are not finite")
            raise ValueError(f"ranker kind {getattr(self, 'kind', type(self).__name__)!r}: predict_log gave "
                             f"{what} for {len(prompts)} prompts; it must give one finite log(1 + words) each")
        return np.clip(np.expm1(got), 0.0, MAX_WORDS).tolist()

    def _refuse_diverged(self, prompts: Sequence[str], lr_key: str) -> None:
        """After a fit or an update: estimates of its own prompts that are not finite (or absurd)
        mean the training diverged. Said here, naming the option, not as a NaN length on every request
        of a run (the bootstrap saves the model at ``ranker.path``)."""
        logs = self.predict_log(list(prompts)[:256])
        if not np.all(np.abs(logs) <= 2 * np.log1p(MAX_WORDS)):  # NaN, inf, or e^41 words
            raise ValueError(f"{self.kind} ranker: training diverged (its estimates of its own training prompts "
                             f"are not finite, or past 1e18 words): lower its learning rate (the {self.kind} "
                             f"option {lr_key!r})")

    @property
    def min_rows(self) -> int:
        """The fewest (prompt, length) pairs ``fit`` accepts."""
        raise NotImplementedError

    def _need_rows(self, n: int, why: str) -> None:
        if n < self.min_rows:
            raise TooFewRows(f"{self.kind} ranker needs at least {self.min_rows} (prompt, length) pairs to fit "
                             f"({why}), got {n}")

    def _need_fitted(self) -> None:
        if not self.fitted:
            raise RuntimeError("ranker is not fitted: call fit() or ranker.load(dir)")

    def save(self, path) -> None:
        from ranker.store import save
        save(self, path)


# --- config checks (shared by LgbmConfig, FeatureConfig, SpaceConfig, LmConfig, EnsembleConfig);
# their ranges are declared on the fields, as the run config's (workers.config_schema) ---

_SCALAR_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}


def config_kwargs(cls, d, name: str) -> dict:
    """``d`` as keyword arguments for config dataclass ``cls``: refuses a non-object and unknown
    keys, naming ``name`` (e.g. "lgbm.features") and the key."""
    if not isinstance(d, dict):
        raise ValueError(f"{name} config must be a JSON object, got {type(d).__name__}")
    known = {f.name for f in fields(cls)}
    for k in d:
        if k not in known:
            raise ValueError(f"unknown {name} config key {k!r}: expected one of {sorted(known)}")
    return dict(d)


def make_config(cls, kwargs: dict, name: str, default: str):
    """``cls(**kwargs)``; a ValueError of its own checks, which name the config by its ``default``
    name ("features"), names the full key path ``name`` ("ensemble.lgbm.features") instead."""
    try:
        return cls(**kwargs)
    except ValueError as e:
        msg = str(e)
        if name != default and msg.startswith(f"{default} config"):
            raise ValueError(name + msg[len(default):]) from None
        raise


def check_fields(cfg, name: str) -> None:
    """Refuse scalar fields of the wrong type (a bool is not a number, 2.5 is not an int), then
    values outside the ``Range`` declared on the field (``workers.config_schema.ranged``)."""
    for f in fields(cfg):
        want = _SCALAR_TYPES.get(f.type)
        v = getattr(cfg, f.name)
        if want and (not isinstance(v, want) or (isinstance(v, bool) and f.type != "bool")):
            raise ValueError(f"{name} config key {f.name!r} must be {f.type}, got {v!r:.40}")
    for f in fields(cfg):
        rng = f.metadata.get(RANGE)
        if rng is not None:
            check_range(name, f.name, getattr(cfg, f.name) in rng, str(rng), getattr(cfg, f.name))


def check_range(name: str, key: str, ok: bool, want: str, value) -> None:
    if not ok:
        raise ValueError(f"{name} config key {key!r} must be {want}, got {value!r:.40}")
