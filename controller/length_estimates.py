"""Length estimates for dispatch: map a ranker's scores to lengths, and model its error.

The ranker (ranker/) predicts an output length whose *order* is reliable, not its scale.
``calibrate_by_rank`` and ``calibrate_by_bins`` turn scores into lengths;
``BinnedPosterior`` is an empirical error model (held-out estimate/true pairs) the
skewness-aware dispatcher can plan against (controller/scheduling.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np


def _finite(where: str, **values: Sequence[float]) -> dict[str, np.ndarray]:
    """Each argument as a float array; ValueError naming the argument and the first index that
    is not a finite number (a NaN estimate gave numpy's 'Quantiles must be in the range [0,
    1]', a NaN reference silently NaN lengths)."""
    out = {}
    for name, v in values.items():
        a = np.asarray(v, dtype=float)
        bad = np.flatnonzero(~np.isfinite(a))
        if bad.size:
            raise ValueError(f"{where}: {name}[{bad[0]}] = {a[bad[0]]} is not a finite number")
        out[name] = a
    return out


def within_run_bounds(est: Sequence[float], min_tokens: int, max_tokens: float) -> list[float]:
    """A ranker's estimates as the run plans their lengths (dispatch, ``pipeline.balance_batch``):
    within the run's own bounds ``[max(1, train.min_tokens), train.max_tokens]`` (a ranker
    loaded from ``ranker.path`` may predict another scale); NaN as the floor. Never a request's
    own bounds: under ``train.length_trace`` both are the sample's forced, true length, and a
    clamp to them planned on the truth (skew dispatched as the oracle; review, s60). The requests
    keep the ranker's own estimates (``est_len``): the engines' ``admission: lpt`` orders by them,
    ties at a bound would lose their order, and ``ranker/*`` judge the ranker."""
    lo, hi = float(max(1, min_tokens)), float(max_tokens)
    return [lo if math.isnan(e) else min(max(float(e), lo), hi) for e in est]


def calibrate_by_rank(est_lens: Sequence[float], reference: Sequence[float]) -> list[float]:
    """Replace each estimate by the reference length distribution's quantile at its rank:
    keeps the ranker's order (what it predicts well) and restores the tail a regression
    flattens. Equal estimates share their average rank, so they get one length (the ranker
    told them apart in nothing). reference: recent true lengths (e.g. the trace's train split)."""
    if not len(reference):
        raise ValueError("calibrate_by_rank: empty reference distribution")
    a = _finite("calibrate_by_rank", est_lens=est_lens, reference=reference)
    m = len(a["est_lens"])
    if not m:
        return []
    from scipy.stats import rankdata  # here: importing scipy.stats takes ~1 s of every rank's start

    ranks = rankdata(a["est_lens"], method="average") - 1  # 0-based
    qs = (ranks + 0.5) / m
    return [float(x) for x in np.quantile(a["reference"], qs)]


def _quantile_bins(ref_est: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """The inner edges of ``bins`` quantile bins of ``ref_est`` and each estimate's bin. Tied
    estimates make equal edges: one bin for them, not empty bins in between."""
    edges = np.unique(np.quantile(ref_est, np.linspace(0, 1, bins + 1)[1:-1]))
    return edges, np.searchsorted(edges, ref_est, side="right")


def _nearest_filled(filled: np.ndarray) -> np.ndarray:
    """For each bin, the nearest non-empty bin below it (above, for the first ones): what an
    empty bin stands for. The whole pool (what empty bins took) is pulled up by the tail: an
    estimate under a floor of ties drew far longer lengths than one at it."""
    have = np.flatnonzero(filled)
    return have[np.maximum(np.searchsorted(have, np.arange(len(filled)), side="right") - 1, 0)]


def calibrate_by_bins(est_lens: Sequence[float], ref_est: Sequence[float], ref_true: Sequence[float],
                      bins: int = 20) -> list[float]:
    """Posterior-mean calibration: the mean true length of the held-out requests whose
    estimate falls in the same quantile bin (ref_est/ref_true: a held-out set's estimates and
    true lengths). Unlike ``calibrate_by_rank`` it shrinks toward the mean as much as the
    ranker errs, so work balancing on it is not fooled by confident wrong tails."""
    if len(ref_est) != len(ref_true) or len(ref_est) < bins:
        raise ValueError(f"calibrate_by_bins: need >= {bins} held-out pairs, got {len(ref_est)} / {len(ref_true)}")
    a = _finite("calibrate_by_bins", est_lens=est_lens, ref_est=ref_est, ref_true=ref_true)
    edges, ref_bin = _quantile_bins(a["ref_est"], bins)
    true, n = a["ref_true"], len(edges) + 1
    means = np.array([true[ref_bin == b].mean() if np.any(ref_bin == b) else np.nan for b in range(n)])
    means = means[_nearest_filled(~np.isnan(means))]
    means = np.maximum.accumulate(means)  # keep the ranker's order
    return [float(means[b]) for b in np.searchsorted(edges, a["est_lens"], side="right")]


@dataclass
class BinnedPosterior:
    """The true length given an estimate, empirically: held-out (estimate, true length) pairs
    grouped in ``bins`` estimate-quantile bins; ``draw`` samples a true length for each
    estimate from its bin (rank confusion, not just scale error)."""

    ref_est: Sequence[float]
    ref_true: Sequence[float]
    bins: int = 10

    def __post_init__(self):
        if isinstance(self.bins, bool) or not isinstance(self.bins, int) or self.bins < 1:
            raise ValueError(f"BinnedPosterior: bins must be an int >= 1, got {self.bins!r}")
        if len(self.ref_est) != len(self.ref_true) or len(self.ref_est) < self.bins:
            raise ValueError(f"BinnedPosterior: need >= {self.bins} held-out (estimate, true) pairs, "
                             f"got {len(self.ref_est)} / {len(self.ref_true)}")
        a = _finite("BinnedPosterior", ref_est=self.ref_est, ref_true=self.ref_true)  # (NaN draws; review, s54)
        self._edges, which = _quantile_bins(a["ref_est"], self.bins)
        true, n = a["ref_true"], len(self._edges) + 1
        near = _nearest_filled(np.array([np.any(which == b) for b in range(n)]))
        self._pools = [true[which == near[b]] for b in range(n)]

    def draw(self, est: Sequence[float], rng: np.random.Generator) -> np.ndarray:
        which = np.searchsorted(self._edges, np.asarray(est, dtype=float), side="right")
        return np.array([self._pools[b][rng.integers(len(self._pools[b]))] for b in which])
