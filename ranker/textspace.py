"""A fitted bag-of-n-grams space for prompts: hashed character and word n-grams, the most
frequent ``max_columns`` of them kept, TF-IDF weighted, L2-normalised; plus a truncated SVD
of that space for dense similarity search.

All state is plain arrays (``state()`` / ``from_state``), so a saved model needs no pickles.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import scipy.sparse as sp
from sklearn.decomposition import TruncatedSVD
from sklearn.feature_extraction.text import HashingVectorizer
from sklearn.preprocessing import normalize
from threadpoolctl import threadpool_limits

from ranker.base import check_fields, check_range, config_kwargs, make_config
from workers.config_schema import Range, SEEDS, ranged


@dataclass(frozen=True)
class SpaceConfig:
    char_ngrams: tuple[int, int] = (2, 4)
    word_ngrams: tuple[int, int] = (1, 2)
    hash_bits: int = ranged(18, Range(1, 24))
    max_columns: int = ranged(20000, Range(2, note="the SVD needs 2 columns"))
    svd_dims: int = ranged(64, Range(1))
    seed: int = ranged(0, SEEDS)

    def __post_init__(self):
        check_fields(self, "space")
        for key in ("char_ngrams", "word_ngrams"):
            lo_hi = getattr(self, key)
            ok = (isinstance(lo_hi, tuple) and len(lo_hi) == 2 and all(type(v) is int for v in lo_hi)
                  and 1 <= lo_hi[0] <= lo_hi[1])
            check_range("space", key, ok, "[lo, hi] with 1 <= lo <= hi", lo_hi)

    @classmethod
    def from_dict(cls, d: dict, name: str = "space") -> "SpaceConfig":
        d = config_kwargs(cls, d, name)
        return make_config(cls, {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}, name, "space")


def one_blas_thread():
    """Context: BLAS / LAPACK on one thread. Their float results depend on the thread count (it
    changes the blocking and so the order of sums), so without it a model trained with
    OMP_NUM_THREADS=1 differed from one trained with 2 threads (SVD components ~2e-5 apart,
    other neighbours, other trees). Fits run their BLAS calls inside it."""
    return threadpool_limits(1, user_api="blas")


class TextSpace:
    """``sparse(prompts) -> csr float32 [N, M]`` (rows L2-normalised) and
    ``dense(X) -> float32 [N, svd_dims]`` (rows L2-normalised)."""

    def __init__(self, cfg: SpaceConfig):
        self.cfg = cfg
        n = 2 ** cfg.hash_bits
        self._char = HashingVectorizer(analyzer="char_wb", ngram_range=cfg.char_ngrams, n_features=n,
                                       alternate_sign=False, norm=None, dtype=np.float32)
        self._word = HashingVectorizer(ngram_range=cfg.word_ngrams, n_features=n, alternate_sign=False,
                                       norm=None, token_pattern=r"(?u)\b\w+\b", dtype=np.float32)
        self.columns: np.ndarray | None = None     # int64 [M] kept hashed columns
        self.idf: np.ndarray | None = None         # float32 [M]
        self.components: np.ndarray | None = None  # float32 [svd_dims, M]

    def _counts(self, prompts: Sequence[str]) -> sp.csr_matrix:
        return sp.hstack([self._char.transform(prompts), self._word.transform(prompts)]).tocsr()

    def fit(self, prompts: Sequence[str]) -> sp.csr_matrix:
        """Fit on ``prompts`` and return their ``sparse`` rows (computed once)."""
        counts = self._counts(prompts)
        df = np.asarray((counts > 0).sum(axis=0)).ravel()  # df: [2 * 2**bits]
        order = np.argsort(-df, kind="stable")
        keep = order[: self.cfg.max_columns]
        keep = np.sort(keep[df[keep] > 0])
        self.columns = keep.astype(np.int64)
        n = counts.shape[0]
        self.idf = (np.log((1 + n) / (1 + df[keep])) + 1).astype(np.float32)
        x = self._weight(counts[:, self.columns])
        k = max(1, min(self.cfg.svd_dims, x.shape[1] - 1, x.shape[0] - 1))
        with one_blas_thread():
            svd = TruncatedSVD(k, algorithm="randomized", n_iter=4, random_state=self.cfg.seed).fit(x)
        comps = np.zeros((self.cfg.svd_dims, x.shape[1]), dtype=np.float32)
        comps[:k] = svd.components_
        self.components = comps
        return x

    def _weight(self, counts: sp.csr_matrix) -> sp.csr_matrix:
        x = counts.astype(np.float32)
        x.data = np.log1p(x.data)  # sublinear tf
        x = x.multiply(self.idf[None, :]).tocsr()
        return normalize(x).astype(np.float32)

    def sparse(self, prompts: Sequence[str]) -> sp.csr_matrix:
        """csr float32 [N, M]."""
        return self._weight(self._counts(prompts)[:, self.columns])

    def dense(self, x: sp.csr_matrix) -> np.ndarray:
        """float32 [N, svd_dims], rows L2-normalised (zero rows stay zero)."""
        z = np.asarray(x @ self.components.T, dtype=np.float32)
        return normalize(z).astype(np.float32)

    def state(self) -> dict[str, np.ndarray]:
        return {"space_columns": self.columns, "space_idf": self.idf, "space_components": self.components}

    @classmethod
    def from_state(cls, cfg: SpaceConfig, state: dict[str, np.ndarray]) -> "TextSpace":
        s = cls(cfg)
        s.columns, s.idf, s.components = (state["space_columns"], state["space_idf"],
                                          state["space_components"])
        return s
