"""Ranking quality: recall of the longest fraction, Kendall tau, Spearman rho.

Only the order of predictions matters (the dispatcher sorts by them), so every metric here
is invariant to monotone transforms of ``pred``.
"""
from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np
from scipy.stats import kendalltau, spearmanr

RECALL_FRACTIONS = (0.1, 0.2, 0.3)


def recall_at(pred: Sequence[float], true: Sequence[float], frac: float) -> float:
    """Fraction of the truly longest ``frac`` of prompts that are also among the predicted
    longest ``frac`` (k = round(frac * N), at least 1). Ties broken by index (stable)."""
    pred, true = np.asarray(pred, dtype=np.float64), np.asarray(true, dtype=np.float64)
    if pred.shape != true.shape or pred.ndim != 1 or len(pred) == 0:
        raise ValueError(f"pred {pred.shape} and true {true.shape} must be equal non-empty 1-D")
    k = max(1, int(round(frac * len(true))))
    top_true = np.argsort(-true, kind="stable")[:k]
    top_pred = np.argsort(-pred, kind="stable")[:k]
    return len(np.intersect1d(top_true, top_pred)) / k


def ranking_report(pred: Sequence[float], true: Sequence[float]) -> dict[str, float]:
    """{"recall@10", "recall@20", "recall@30", "kendall_tau", "spearman"}."""
    out = {f"recall@{int(round(f * 100))}": recall_at(pred, true, f) for f in RECALL_FRACTIONS}
    # Undefined correlations (constant input, fewer than 2 rows) are NaN, printed as null by the
    # CLI: scipy's warnings about them (ConstantInputWarning, SmallSampleWarning) add nothing.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out["kendall_tau"] = float(kendalltau(pred, true).statistic)
        out["spearman"] = float(spearmanr(pred, true).statistic)
    return out
