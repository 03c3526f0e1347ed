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
    longest ``frac`` (k = round(frac * N), at least 1). A pick as long as the k-th longest is
    right (any row tied at the true cut is among the longest, e.g. every response capped at
    max_tokens); predictions tied at the predicted cut count as random tie-breaking would on
    average (``_top_share``): a constant prediction scores the chance level, whatever the rows'
    order (ties were broken by row order: a constant prediction could score 1.0, a right one 0)."""
    pred, true = np.asarray(pred, dtype=np.float64), np.asarray(true, dtype=np.float64)
    if pred.shape != true.shape or pred.ndim != 1 or len(pred) == 0:
        raise ValueError(f"pred {pred.shape} and true {true.shape} must be equal non-empty 1-D")
    k = max(1, int(round(frac * len(true))))
    # a NaN (a diverged model's prediction) ranks lowest, as the sort put it before
    pred, true = (np.where(np.isnan(x), -np.inf, x) for x in (pred, true))
    longest = true >= np.sort(true)[::-1][k - 1]
    return float(np.dot(longest, _top_share(pred, k))) / k


def _top_share(x: np.ndarray, k: int) -> np.ndarray:
    """Each row's chance of being among the k largest of ``x`` when ties are broken at random:
    1 above the k-th largest value, the free places' share among the rows tied with it, else 0."""
    kth = np.sort(x)[::-1][k - 1]
    above, tied = x > kth, x == kth
    share = above.astype(np.float64)
    share[tied] = (k - int(above.sum())) / int(tied.sum())
    return share


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
