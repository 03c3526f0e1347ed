"""Gradient-boosted ranker: LightGBM on ``FeatureBuilder`` columns, target log(1 + words).

Objectives (registry ``OBJECTIVES``): "l1" / "huber" / "l2" regress log-length; "lambdarank" learns
the order directly (relevance = length quantile bin, random query groups); "top" classifies
"longer than the training 80th percentile"; "rank" regresses max(percentile, 0.5). The last
three are mapped back to lengths by quantile matching so ``predict`` always returns words.
``update`` is the cheap online step: new rows join the neighbour memory and a few more trees
are boosted on them plus a replay sample of earlier rows.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import lightgbm as lgb
import numpy as np

from ranker import progress
from ranker.base import LogLengthRanker, check_fields, config_kwargs, make_config
from ranker.data import as_prompts, check_lengths
from ranker.features import FeatureBuilder, FeatureConfig, FeatureMismatchError
from workers.config_schema import Range, SEEDS, ranged


@dataclass(frozen=True)
class LgbmConfig:
    objective: str = "l1"  # all objectives tried land at 0.68-0.72 recall@20 (CV and val; docs/ranker.md)
    rounds: int = ranged(300, Range(1))
    learning_rate: float = ranged(0.05, Range(0, open_lo=True))
    num_leaves: int = ranged(31, Range(2, 131072))  # (LightGBM's own bound, checked when it trains)
    min_child_samples: int = ranged(10, Range(1))
    subsample: float = ranged(0.8, Range(0, 1, open_lo=True))
    colsample: float = ranged(0.5, Range(0, 1, open_lo=True))
    update_rounds: int = ranged(20, Range(0))
    replay: int = ranged(2000, Range(1))
    threads: int = ranged(1, Range(1))  # LightGBM's OpenMP spin-waits: 2 threads on a busy 2-core box ran 12x slower
    seed: int = ranged(0, SEEDS)
    features: FeatureConfig = field(default_factory=FeatureConfig)

    def __post_init__(self):
        check_fields(self, "lgbm")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"lgbm objective {self.objective!r}: expected one of {sorted(OBJECTIVES)}")

    @property
    def min_rows(self) -> int:
        """With fewer than 2 x min_child_samples rows no tree can split: every prediction is one constant."""
        return max(4, 2 * self.min_child_samples)

    @classmethod
    def from_dict(cls, d: dict, name: str = "lgbm") -> "LgbmConfig":
        d = config_kwargs(cls, d, name)
        feats = FeatureConfig.from_dict(d.pop("features", {}), f"{name}.features")
        return make_config(cls, {"features": feats, **d}, name, "lgbm")


def _regression(name: str) -> Callable[[np.ndarray], tuple[dict, np.ndarray, list[int] | None]]:
    def make(log_y: np.ndarray):
        return {"objective": name}, log_y, None
    return make


def _lambdarank(log_y: np.ndarray):
    """Relevance = quantile bin of the length (finer at the top, where recall is judged);
    random query groups of 200 so pairs span all tasks."""
    edges = np.quantile(log_y, [0.5, 0.7, 0.8, 0.9, 0.95, 0.98])
    rel = np.digitize(log_y, edges).astype(np.int32)
    n, g = len(log_y), 200
    groups = [g] * (n // g) + ([n % g] if n % g else [])
    params = {"objective": "lambdarank", "label_gain": [float(2 ** i - 1) for i in range(8)],
              "lambdarank_truncation_level": g}
    return params, rel, groups


def _top(log_y: np.ndarray):
    """P(length above the training rows' TOP_QUANTILE): the score that maximises the expected
    recall of the longest (1 - TOP_QUANTILE) -- not the median a log-space regression learns,
    which misses short-median tasks whose answers often run away."""
    return {"objective": "binary"}, (log_y > np.quantile(log_y, TOP_QUANTILE)).astype(np.float32), None


def _rank(log_y: np.ndarray):
    """E[max(percentile of the length, 0.5)]: a bounded mean, so runaway-prone prompts rank
    above steady ones of the same median, over the whole upper half."""
    _, tie, counts = np.unique(log_y, return_inverse=True, return_counts=True)
    first = np.cumsum(counts) - counts  # equal lengths share their mean rank (not their rows' order)
    pct = ((first + (counts - 1) / 2)[tie.reshape(-1)] + 0.5) / len(log_y)
    return {"objective": "regression"}, np.maximum(pct, 0.5).astype(np.float32), None


TOP_QUANTILE = 0.8
OBJECTIVES = {"l1": _regression("regression_l1"), "huber": _regression("huber"),
              "l2": _regression("regression"), "lambdarank": _lambdarank, "top": _top, "rank": _rank}
# Objectives whose raw score is not a log-length: mapped to one by quantile matching.
SCORE_OBJECTIVES = frozenset({"lambdarank", "top", "rank"})


class LgbmRanker(LogLengthRanker):
    kind = "lgbm"

    @property
    def fitted(self) -> bool:
        return self.booster is not None

    @property
    def min_rows(self) -> int:
        return self.cfg.min_rows

    def __init__(self, cfg: LgbmConfig | None = None, embedder=None, **kw):
        self.cfg = cfg or LgbmConfig.from_dict(kw)
        if self.cfg.features.lm_dims and embedder is None:
            raise ValueError("lgbm config key 'features.lm_dims' needs the small LM's embedding: only the "
                             "ensemble kind sets it (lm_embedding); leave it 0")
        self.features = FeatureBuilder(self.cfg.features, embedder)
        self.booster: lgb.Booster | None = None
        self.base: str | None = None  # the fitted model (LightGBM's text): each update boosts from it
        self.score_q: np.ndarray | None = None   # sorted raw scores (quantile map)
        self.logy_q: np.ndarray | None = None    # matching sorted log-lengths
        self.replay_x: np.ndarray | None = None  # float32 [R, F]
        self.replay_y: np.ndarray | None = None  # float32 [R]

    def _params(self, base: dict) -> dict:
        c = self.cfg
        return {**base, "learning_rate": c.learning_rate, "num_leaves": c.num_leaves,
                "min_child_samples": c.min_child_samples, "bagging_fraction": c.subsample,
                "bagging_freq": 1, "feature_fraction": c.colsample, "num_threads": c.threads,
                "seed": c.seed, "deterministic": True, "force_row_wise": True, "verbosity": -1}

    def _train(self, x: np.ndarray, log_y: np.ndarray, rounds: int, init: lgb.Booster | None, desc: str):
        base, label, groups = OBJECTIVES[self.cfg.objective](log_y)
        perm = np.random.RandomState(self.cfg.seed).permutation(len(log_y)) if groups else np.arange(len(log_y))
        ds = lgb.Dataset(x[perm], label[perm], group=groups, feature_name=self.features.names(),
                         free_raw_data=True)
        with progress.bar(desc, rounds) as b:
            booster = lgb.train(self._params(base), ds, num_boost_round=rounds, init_model=init,
                                keep_training_booster=True, callbacks=[lambda env: b.advance()])
        return booster

    def _calibrate(self, x: np.ndarray, log_y: np.ndarray) -> None:
        """Monotone map raw score -> log-length (quantile matching on training rows)."""
        q = np.linspace(0, 1, 101)
        self.score_q = np.quantile(self.booster.predict(x, num_threads=self.cfg.threads), q)
        self.logy_q = np.quantile(log_y, q)

    def fit(self, prompts: Sequence[str], lengths: Sequence[float]) -> "LgbmRanker":
        prompts = as_prompts(prompts)
        check_lengths(prompts, lengths)
        self._need_rows(len(prompts), "2 x min_child_samples: with fewer no tree can split and every "
                        "prediction is the same")
        log_y = np.log1p(np.asarray(lengths, dtype=np.float32))
        progress.log(f"lgbm: features for {len(prompts)} prompts")
        x = self.features.fit_transform(prompts, log_y)
        self.booster = self._train(x, log_y, self.cfg.rounds, None, f"lgbm ({self.cfg.objective})")
        self.base = self.booster.model_to_string()
        self._calibrate(x, log_y)
        keep = np.random.RandomState(self.cfg.seed).permutation(len(prompts))[: self.cfg.replay]
        self.replay_x, self.replay_y = x[np.sort(keep)], log_y[np.sort(keep)]
        self._refuse_diverged(prompts, "learning_rate")
        return self

    def update(self, prompts: Sequence[str], lengths: Sequence[float]) -> "LgbmRanker":
        """Online step: add rows to the neighbour memory, boost ``update_rounds`` trees from the
        fitted model on the new rows plus the replay sample (the newest ``replay`` rows), in place
        of the last update's: the model stays ``rounds + update_rounds`` trees. (Boosted on top of
        every earlier update, it grew 20 trees an update: 6,300 after 300, each update and
        prediction slower, the iterations 14x longer: review, session 51.)"""
        self._need_fitted()
        prompts = as_prompts(prompts)
        check_lengths(prompts, lengths)
        if not prompts:
            return self
        log_y = np.log1p(np.asarray(lengths, dtype=np.float32))
        # The new rows' features see only earlier neighbours (never their own labels).
        x_new = self.features.transform(prompts)
        self.features.add_memory(prompts, log_y)
        x = np.concatenate([self.replay_x, x_new])
        y = np.concatenate([self.replay_y, log_y])
        if self.cfg.update_rounds:
            self.booster = self._train(x, y, self.cfg.update_rounds, lgb.Booster(model_str=self.base), "lgbm update")
        self._calibrate(x, y)
        r = self.cfg.replay
        self.replay_x, self.replay_y = x[-r:], y[-r:]
        self._refuse_diverged(prompts, "learning_rate")
        return self

    def predict_log(self, prompts: Sequence[str]) -> np.ndarray:
        """float64 [N] estimated log(1 + words)."""
        self._need_fitted()
        prompts = as_prompts(prompts)
        if not prompts:
            return np.zeros(0)
        raw = self.booster.predict(self.features.transform(prompts), num_threads=self.cfg.threads)
        if self.cfg.objective not in SCORE_OBJECTIVES:
            return raw
        return np.interp(raw, self.score_q, self.logy_q)

    # --- persistence ------------------------------------------------------------------

    def meta(self) -> dict:
        return {"config": asdict(self.cfg), "fingerprint": self.features.fingerprint()}

    def save_files(self, folder: Path) -> None:
        # Written by Python, not by LightGBM's own file code: a full disk raises OSError here
        # instead of leaving a truncated model whose checksum would then be recorded.
        (folder / "lgbm.txt").write_text(self.booster.model_to_string())
        (folder / "lgbm_base.txt").write_text(self.base)
        np.savez(folder / "lgbm_state.npz", **self.features.state(), score_q=self.score_q,
                 logy_q=self.logy_q, replay_x=self.replay_x, replay_y=self.replay_y)

    @classmethod
    def load_files(cls, folder: Path, meta: dict, embedder=None) -> "LgbmRanker":
        cfg = LgbmConfig.from_dict(meta["config"])
        r = cls(cfg, embedder)
        want = r.features.fingerprint()
        if meta.get("fingerprint") != want:
            raise FeatureMismatchError(
                f"{folder}: model was trained with feature set {meta.get('fingerprint')!r}, but this "
                f"code computes feature set {want!r} (the feature code or config changed since training); "
                f"retrain it with `python -m ranker train`")
        st = dict(np.load(folder / "lgbm_state.npz"))
        r.features = FeatureBuilder.from_state(cfg.features, st, embedder)
        r.booster = lgb.Booster(model_file=str(folder / "lgbm.txt"))
        base = folder / "lgbm_base.txt"  # (a folder saved before session 51: the model is its own base)
        r.base = base.read_text() if base.is_file() else r.booster.model_to_string()
        if r.booster.num_feature() != len(r.features.names()):
            raise FeatureMismatchError(f"{folder}: LightGBM model has {r.booster.num_feature()} features, "
                                       f"this feature set has {len(r.features.names())}; retrain")
        r.score_q, r.logy_q = st["score_q"], st["logy_q"]
        r.replay_x, r.replay_y = st["replay_x"], st["replay_y"]
        return r

