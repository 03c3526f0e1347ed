"""Reference predictors for ``eval``: the prompt's length, and a TF-IDF ridge regression
(word 1-2-grams, log(1 + words) target) trained on the same training rows."""
from __future__ import annotations

from typing import Sequence

import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import Ridge


def prompt_length(prompts: Sequence[str]) -> np.ndarray:
    """float64 [N]: characters in the prompt."""
    return np.asarray([len(p) for p in prompts], dtype=np.float64)


class TfidfRidge:
    def __init__(self, alpha: float = 1.0):
        self.vec = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True)
        self.model = Ridge(alpha)

    def fit(self, prompts: Sequence[str], lengths: Sequence[float]) -> "TfidfRidge":
        if len(prompts) < 2:  # its words must occur in 2 prompts (min_df)
            raise ValueError(f"needs at least 2 training prompts, got {len(prompts)}")
        self.model.fit(self.vec.fit_transform(prompts), np.log1p(np.asarray(lengths, dtype=np.float64)))
        return self

    def predict(self, prompts: Sequence[str]) -> np.ndarray:
        return np.expm1(self.model.predict(self.vec.transform(prompts)))
