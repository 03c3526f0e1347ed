"""The LightGBM ranker's feature set: text statistics, a TF-IDF ridge score, nearest-neighbour
length statistics (with the prompt's size relative to its neighbours: "bigger than its
siblings" is how within-task difficulty shows), SVD coordinates, and optionally an embedding
from the small LM.

Training rows get out-of-fold stacking features (ridge: K folds; neighbours: leave-one-out),
so LightGBM never sees a label through its own row. ``fingerprint()`` hashes the feature
names and the config: a model trained with another feature set is refused at load.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np
import scipy.sparse as sp
from sklearn.linear_model import Ridge
from sklearn.model_selection import KFold

from ranker.base import check_fields, config_kwargs, make_config
from ranker.textspace import SpaceConfig, TextSpace, one_blas_thread
from ranker.textstats import STAT_NAMES, text_stats
from workers.config_schema import Range, ranged

FEATURES_VERSION = 3  # 3: training rows' neighbour columns out-of-fold
_N_SIZE = 30  # the first columns of STAT_NAMES are sizes (compared with neighbours)
_KNN_NAMES = ("knn_mean", "knn_wmean", "knn_max", "knn_min", "knn_std", "knn_sim_mean",
              "knn_top1", "knn_sim_top1", "knn_frac_long", "knn_log_mean_words")
LONG_QUANTILE = 0.8  # "long" = above this quantile of the training lengths
_GRID = 2.0 ** 20  # neighbour similarities are computed on coordinates rounded to multiples of 1/_GRID
_CHUNK = 2048     # rows per neighbour-search block

# An embedding function: prompts -> float32 [N, D] (e.g. the small LM's pooled hidden state).
Embedder = Callable[[Sequence[str]], np.ndarray]


@dataclass(frozen=True)
class FeatureConfig:
    space: SpaceConfig = field(default_factory=SpaceConfig)
    knn_k: int = ranged(10, Range(1))
    # Training rows' neighbour columns come from the other folds only (0: leave-one-out).
    # Leave-one-out leaks: within a group of similar prompts the left-out mean falls as the
    # row's own label rises, which trees learn on training rows and which is absent at predict.
    knn_folds: int = ranged(5, Range(0))
    ridge_folds: int = ranged(5, Range(0))
    ridge_alpha: float = ranged(1.0, Range(0))
    max_memory: int = ranged(20000, Range(1))   # neighbour memory keeps the most recent rows
    lm_dims: int = ranged(0, Range(0))          # columns of LM embedding appended (0: none)

    def __post_init__(self):
        check_fields(self, "features")

    @classmethod
    def from_dict(cls, d: dict, name: str = "features") -> "FeatureConfig":
        d = config_kwargs(cls, d, name)
        space = SpaceConfig.from_dict(d.pop("space", {}), f"{name}.space")
        return make_config(cls, {"space": space, **d}, name, "features")


def _exact(z: np.ndarray) -> np.ndarray:
    """float64 integers round(z * _GRID). With |z| <= 1 (unit rows) every product and partial sum
    of their dot products is an integer below 2**53, so a matrix product of them is exact: the
    same whatever the BLAS, its thread count, the summation order or the batch (a float32
    product differed in the last bits with the thread count and changed neighbour sets)."""
    return np.round(np.asarray(z, dtype=np.float64) * _GRID)


class FeatureMismatchError(ValueError):
    """A saved model's feature set differs from the one this code computes."""


class FeatureBuilder:
    """``fit_transform(prompts, log_y) -> float32 [N, F]`` (out-of-fold stacking columns),
    ``transform(prompts) -> float32 [N, F]``, ``add_memory(prompts, log_y)`` for online updates."""

    def __init__(self, cfg: FeatureConfig, embedder: Embedder | None = None):
        self.cfg = cfg
        self.embedder = embedder
        self.space: TextSpace | None = None
        self.ridge_coef: np.ndarray | None = None     # float32 [M]
        self.ridge_bias = 0.0
        self.mem_z: np.ndarray | None = None          # float32 [K, svd_dims]
        self.mem_y: np.ndarray | None = None          # float32 [K] log(1 + length)
        self.mem_s: np.ndarray | None = None          # float32 [K, _N_SIZE] log1p sizes
        self.long_log_y = 0.0                         # LONG_QUANTILE of training log-lengths

    # --- identity ---------------------------------------------------------------------
    def names(self) -> list[str]:
        return (list(STAT_NAMES) + ["ridge"] + list(_KNN_NAMES)
                + [f"rel_{n}" for n in STAT_NAMES[:_N_SIZE]]
                + [f"svd_{i}" for i in range(self.cfg.space.svd_dims)]
                + [f"lm_{i}" for i in range(self.cfg.lm_dims)])

    def fingerprint(self) -> str:
        spec = {"version": FEATURES_VERSION, "names": self.names(), "config": asdict(self.cfg)}
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]

    # --- pieces -----------------------------------------------------------------------
    def _train_folds(self, n: int) -> np.ndarray | None:
        """int [n] fold id per training row for the neighbour columns (None: leave-one-out)."""
        if self.cfg.knn_folds < 2 or n < 2 * self.cfg.knn_folds:
            return None
        return np.random.RandomState(self.cfg.space.seed).permutation(n) % self.cfg.knn_folds

    def _knn(self, z: np.ndarray, sizes: np.ndarray, exclude_self: bool,
             folds: np.ndarray | None = None) -> np.ndarray:
        """float32 [N, len(_KNN_NAMES) + _N_SIZE]; z: [N, d] against memory [K, d].
        ``exclude_self``: z are the memory rows themselves; with ``folds`` [N] a row sees only
        memory rows of other folds, else all but itself."""
        n_out = len(self.mem_y) - (int(np.bincount(folds).max()) if folds is not None else int(exclude_self))
        k = min(self.cfg.knn_k, n_out)
        if k < 1:
            return np.zeros((len(z), len(_KNN_NAMES) + _N_SIZE), dtype=np.float32)
        idx, top = self._neighbours(z, k, exclude_self, folds)
        yy = self.mem_y[idx]  # yy: [N, k]
        w = np.exp(20.0 * (top - top[:, :1]))
        # frac_long and the mean in words (not logs) see runaway answers that log-means hide.
        summ = np.stack([yy.mean(1), (yy * w).sum(1) / w.sum(1), yy.max(1), yy.min(1), yy.std(1),
                         top.mean(1), yy[:, 0], top[:, 0], (yy > self.long_log_y).mean(1),
                         np.log1p(np.expm1(yy).mean(1))], axis=1)
        rel = sizes - self.mem_s[idx].mean(1)
        return np.concatenate([summ, rel], axis=1).astype(np.float32)

    def _neighbours(self, z: np.ndarray, k: int, exclude_self: bool, folds: np.ndarray | None):
        """(idx int [N, k], sim float64 [N, k]): each row's k most similar memory rows, most
        similar first; computed _CHUNK rows at a time (a [N, K] float64 matrix of 20k x 20k
        rows would take 3.2 GB)."""
        mem = _exact(self.mem_z).T
        idx, top = [], []
        for s in range(0, len(z), _CHUNK):
            sim = _exact(z[s:s + _CHUNK]) @ mem / _GRID ** 2  # sim: [c, K], exact
            if exclude_self and folds is not None:
                sim[folds[s:s + _CHUNK, None] == folds[None, :]] = -np.inf
            elif exclude_self:
                rows = np.arange(len(sim))
                sim[rows, s + rows] = -np.inf
            i = np.argpartition(-sim, k - 1, axis=1)[:, :k]
            t = np.take_along_axis(sim, i, 1)
            order = np.argsort(-t, axis=1, kind="stable")
            idx.append(np.take_along_axis(i, order, 1))
            top.append(np.take_along_axis(t, order, 1))
        return np.concatenate(idx), np.concatenate(top)

    def _ridge_oof(self, x: sp.csr_matrix, log_y: np.ndarray) -> np.ndarray:
        out = np.zeros(len(log_y), dtype=np.float32)
        folds = min(self.cfg.ridge_folds, len(log_y))
        if folds < 2:
            return out + float(log_y.mean())
        for a, b in KFold(folds, shuffle=True, random_state=self.cfg.space.seed).split(log_y):
            out[b] = Ridge(self.cfg.ridge_alpha).fit(x[a], log_y[a]).predict(x[b])
        return out

    def _assemble(self, prompts, stats, ridge, knn, z) -> np.ndarray:
        cols = [stats, ridge[:, None], knn, z]
        if self.cfg.lm_dims:
            if self.embedder is None:
                raise FeatureMismatchError("this feature set needs the LM embedding, but no LM is attached")
            emb = np.asarray(self.embedder(prompts), dtype=np.float32)
            if emb.shape != (len(prompts), self.cfg.lm_dims):
                raise FeatureMismatchError(f"LM embedding has shape {emb.shape}, feature set expects "
                                           f"[{len(prompts)}, {self.cfg.lm_dims}]")
            cols.append(emb)
        return np.concatenate(cols, axis=1).astype(np.float32)

    # --- public -----------------------------------------------------------------------
    def fit_transform(self, prompts: Sequence[str], log_y: np.ndarray) -> np.ndarray:
        log_y = np.asarray(log_y, dtype=np.float32)
        self.space = TextSpace(self.cfg.space)
        x = self.space.fit(prompts)
        z = self.space.dense(x)
        stats = text_stats(prompts)
        sizes = np.log1p(stats[:, :_N_SIZE])
        with one_blas_thread():  # the ridge solvers' sums too (see one_blas_thread)
            ridge_oof = self._ridge_oof(x, log_y)
            full = Ridge(self.cfg.ridge_alpha).fit(x, log_y)
        self.ridge_coef = np.asarray(full.coef_, dtype=np.float32)
        self.ridge_bias = float(full.intercept_)
        self.mem_z, self.mem_y, self.mem_s = z, log_y.copy(), sizes
        self.long_log_y = float(np.quantile(log_y, LONG_QUANTILE))
        knn = self._knn(z, sizes, exclude_self=True, folds=self._train_folds(len(log_y)))
        self._trim_memory()
        return self._assemble(prompts, stats, ridge_oof, knn, z)

    def transform(self, prompts: Sequence[str], exclude_self: bool = False) -> np.ndarray:
        if self.space is None:
            raise RuntimeError("feature builder is not fitted")
        x = self.space.sparse(prompts)
        z = self.space.dense(x)
        stats = text_stats(prompts)
        ridge = np.asarray(x @ self.ridge_coef, dtype=np.float32) + self.ridge_bias
        knn = self._knn(z, np.log1p(stats[:, :_N_SIZE]), exclude_self=exclude_self)
        return self._assemble(prompts, stats, ridge, knn, z)

    def add_memory(self, prompts: Sequence[str], log_y: np.ndarray) -> None:
        """Append rows to the neighbour memory (newest kept when over ``max_memory``)."""
        z = self.space.dense(self.space.sparse(prompts))
        sizes = np.log1p(text_stats(prompts)[:, :_N_SIZE])
        self.mem_z = np.concatenate([self.mem_z, z])
        self.mem_y = np.concatenate([self.mem_y, np.asarray(log_y, dtype=np.float32)])
        self.mem_s = np.concatenate([self.mem_s, sizes])
        self._trim_memory()

    def _trim_memory(self) -> None:
        m = self.cfg.max_memory
        self.mem_z, self.mem_y, self.mem_s = self.mem_z[-m:], self.mem_y[-m:], self.mem_s[-m:]

    def state(self) -> dict[str, np.ndarray]:
        return {**self.space.state(), "ridge_coef": self.ridge_coef,
                "ridge_bias": np.asarray([self.ridge_bias], dtype=np.float64),
                "long_log_y": np.asarray([self.long_log_y], dtype=np.float64),
                "mem_z": self.mem_z, "mem_y": self.mem_y, "mem_s": self.mem_s}

    @classmethod
    def from_state(cls, cfg: FeatureConfig, state: dict[str, np.ndarray],
                   embedder: Embedder | None = None) -> "FeatureBuilder":
        b = cls(cfg, embedder)
        b.space = TextSpace.from_state(cfg.space, state)
        b.ridge_coef, b.ridge_bias = state["ridge_coef"], float(state["ridge_bias"][0])
        b.long_log_y = float(state["long_log_y"][0])
        b.mem_z, b.mem_y, b.mem_s = state["mem_z"], state["mem_y"], state["mem_s"]
        return b
