"""Ensemble: LightGBM (text features + optionally the small LM's label-free embedding) and
the fine-tuned small LM, blended as ``w * z(lgbm) + (1 - w) * z(lm)`` of their log-length
predictions (z: standardized with training-set statistics, mapped back to log-length with
LightGBM's scale so ``predict`` returns words).

With ``lm_embedding``: the LM is first pretrained on next-token loss only (no labels), a frozen
copy of it embeds prompts for LightGBM, then the LM is fine-tuned on lengths. The frozen copy
never saw a length, so LightGBM's training rows get no label leakage through it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from ranker import progress
from ranker.base import LogLengthRanker, check_fields, config_kwargs
from ranker.data import as_prompts, check_lengths
from ranker.lgbm import LgbmConfig, LgbmRanker
from ranker.lm import LmConfig, LmRanker
from workers.config_schema import Range, ranged


@dataclass(frozen=True)
class EnsembleConfig:
    lgbm: LgbmConfig = field(default_factory=LgbmConfig)
    lm: LmConfig = field(default_factory=LmConfig)
    lgbm_weight: float = ranged(0.7, Range(0, 1))
    lm_embedding: bool = True

    def __post_init__(self):
        check_fields(self, "ensemble")
        if self.lgbm.features.lm_dims:  # (fit failed on it after the LM's pretraining, or overwrote it)
            raise ValueError("ensemble config key 'lgbm.features.lm_dims': the ensemble sets it (the LM's embedding "
                             "columns, with lm_embedding: true); leave it out")

    @classmethod
    def from_dict(cls, d: dict) -> "EnsembleConfig":
        d = config_kwargs(cls, d, "ensemble")
        lg = LgbmConfig.from_dict(d.pop("lgbm", {}), "ensemble.lgbm")
        lm = LmConfig.from_dict(d.pop("lm", {}), "ensemble.lm")
        return cls(lgbm=lg, lm=lm, **d)  # (its own checks name "ensemble": its full path)


class EnsembleRanker(LogLengthRanker):
    kind = "ensemble"

    @property
    def fitted(self) -> bool:
        return self.lgbm is not None

    @property
    def min_rows(self) -> int:
        return max(self.cfg.lgbm.min_rows, self.lm.min_rows)

    def __init__(self, cfg: EnsembleConfig | None = None, **kw):
        self.cfg = cfg or EnsembleConfig.from_dict(kw)
        self.lm = LmRanker(self.cfg.lm)
        self.embedder: LmRanker | None = None
        self.lgbm: LgbmRanker | None = None
        self.stats = np.zeros(4)  # mean/std of lgbm and lm log predictions on training rows

    def _make_lgbm(self) -> LgbmRanker:
        lc = self.cfg.lgbm
        if self.cfg.lm_embedding:
            lc = replace(lc, features=replace(lc.features, lm_dims=self.embedder.embed_dims))
            return LgbmRanker(lc, embedder=self.embedder.embed)
        return LgbmRanker(lc)

    def fit(self, prompts: Sequence[str], lengths: Sequence[float]) -> "EnsembleRanker":
        prompts = as_prompts(prompts)
        check_lengths(prompts, lengths)
        self._need_rows(len(prompts), "the larger of its LightGBM's and its LM's minimum")
        self.lm.pretrain(prompts)
        if self.cfg.lm_embedding:
            self.embedder = self.lm.frozen_copy()
        self.lgbm = self._make_lgbm().fit(prompts, lengths)
        self.lm.finetune(prompts, lengths)
        progress.log("ensemble: blending statistics")
        a, b = self.lgbm.predict_log(prompts), self.lm.predict_log(prompts)
        self.stats = np.array([a.mean(), max(a.std(), 1e-6), b.mean(), max(b.std(), 1e-6)])
        return self

    def update(self, prompts: Sequence[str], lengths: Sequence[float]) -> "EnsembleRanker":
        self._need_fitted()
        self.lgbm.update(prompts, lengths)
        self.lm.update(prompts, lengths)
        return self

    def predict_log(self, prompts: Sequence[str]) -> np.ndarray:
        self._need_fitted()
        prompts = as_prompts(prompts)
        if not prompts:
            return np.zeros(0)
        w, (ma, sa, mb, sb) = self.cfg.lgbm_weight, self.stats
        za = (self.lgbm.predict_log(prompts) - ma) / sa
        zb = (self.lm.predict_log(prompts) - mb) / sb if w < 1.0 else 0.0
        return (w * za + (1 - w) * zb) * sa + ma

    # --- persistence -----------------------------------------------------------------------

    def meta(self) -> dict:
        return {"config": asdict(self.cfg), "stats": self.stats.tolist(),
                "lgbm": self.lgbm.meta(), "lm": self.lm.meta(),
                "embedder": self.embedder.meta() if self.embedder else None,
                "fingerprint": self.lgbm.features.fingerprint()}

    def save_files(self, folder: Path) -> None:
        self.lgbm.save_files(folder)
        self.lm.save_files(folder, "lm")
        if self.embedder is not None:
            self.embedder.save_files(folder, "lm_embed")

    @classmethod
    def load_files(cls, folder: Path, meta: dict) -> "EnsembleRanker":
        r = cls(EnsembleConfig.from_dict(meta["config"]))
        r.stats = np.asarray(meta["stats"], dtype=np.float64)
        r.lm = LmRanker.load_files(folder, meta["lm"], "lm")
        if meta.get("embedder"):
            r.embedder = LmRanker.load_files(folder, meta["embedder"], "lm_embed")
        r.lgbm = LgbmRanker.load_files(folder, meta["lgbm"], embedder=r.embedder.embed if r.embedder else None)
        return r
