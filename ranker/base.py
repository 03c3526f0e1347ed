"""What every length ranker shares: it implements ``predict_log`` (log(1 + words), float64 [N])
and ``fitted``; predictions in words, the fitted check and saving are the same for all."""
from __future__ import annotations

from typing import Sequence

import numpy as np


class LogLengthRanker:
    @property
    def fitted(self) -> bool:
        raise NotImplementedError

    def predict_log(self, prompts: Sequence[str]) -> np.ndarray:
        raise NotImplementedError

    def predict(self, prompts: Sequence[str]) -> list[float]:
        """Estimated answer length in words per prompt (only the order is reliable)."""
        return np.maximum(np.expm1(self.predict_log(prompts)), 0.0).tolist()

    def _need_fitted(self) -> None:
        if not self.fitted:
            raise RuntimeError("ranker is not fitted: call fit() or ranker.load(dir)")

    def save(self, path) -> None:
        from ranker.store import save
        save(self, path)
