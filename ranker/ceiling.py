"""How well could any prompt-only ranker do on a trace? An estimate of the ceiling that the
answers' own sampling noise puts on recall@k.

The eval ranks prompts by the mean of their n sampled answers (n = 3 in the traces). Even a
ranker that knew each prompt's expected mean exactly would miss prompts whose n answers
happened to run long or short. ``noise_ceiling`` simulates that:

1. Per task (the trace's ``task`` field; analysis only, never a ranker input), split each
   prompt's log-lengths into a location (the mean of its n log-lengths, shrunk towards the task
   mean by the reliability of an n-mean: the part of the spread that is not sampling noise)
   and residuals (scaled by sqrt(n / (n - 1)) so their variance is unbiased).
2. A simulated prompt draws each answer's residual from its own residuals with probability q,
   else from its task's pooled residuals (q = 1: a prompt that answered steadily stays steady;
   q = 0: every prompt of a task is as likely to run away as any other).
3. The oracle's score is the expected mean under that model; the target is a fresh n-answer
   mean. q is interpolated on a grid so the simulation reproduces an observable with the same noise: the
   split-half recall (rank by one answer, judge against the mean of the other n - 1).

Returns the observed split-half recall, the simulated oracle recall (mean and std over
repeats) at the matched q, and the whole q grid so the sensitivity is visible.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ranker.metrics import recall_at

Q_GRID = (0.0, 0.25, 0.5, 0.75, 1.0)


def split_half_recall(answers: np.ndarray, frac: float = 0.2) -> float:
    """Mean over i of recall@frac when answer i ranks prompts judged by the other answers' mean.
    answers: float [P, n], n >= 2."""
    n = answers.shape[1]
    return float(np.mean([recall_at(answers[:, i], np.delete(answers, i, axis=1).mean(1), frac)
                          for i in range(n)]))


def _decompose(answers: np.ndarray, tasks: np.ndarray):
    """Per-prompt location mu [P], residuals R [P, n] (log space) and per-task residual pools."""
    n = answers.shape[1]
    logs = np.log1p(answers)
    ybar = logs.mean(1)
    resid = (logs - ybar[:, None]) * np.sqrt(n / (n - 1))
    mu = np.empty_like(ybar)
    pools = {}
    for t in np.unique(tasks):
        s = tasks == t
        spread = ybar[s].var()
        noise = (resid[s] ** 2).mean() / n  # variance of an n-mean from sampling alone
        reliab = max(spread - noise, 1e-9) / max(spread, 1e-9)
        mu[s] = ybar[s].mean() + np.sqrt(reliab) * (ybar[s] - ybar[s].mean())
        pools[t] = resid[s].ravel()
    return mu, resid, pools


def noise_ceiling(answers: Sequence[Sequence[float]], tasks: Sequence[str], frac: float = 0.2,
                  repeats: int = 40, seed: int = 0, q_grid: Sequence[float] = Q_GRID) -> dict:
    """answers: [P][n] lengths (words) of each prompt's sampled answers; tasks: [P] labels."""
    a = np.asarray(answers, dtype=np.float64)
    t = np.asarray(tasks)
    if a.ndim != 2 or a.shape[1] < 2 or len(a) != len(t):
        raise ValueError(f"answers must be [P, n >= 2] with one task per prompt; got {a.shape}, {len(t)} tasks")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    rng = np.random.default_rng(seed)
    mu, resid, pools = _decompose(a, t)
    groups = {k: np.flatnonzero(t == k) for k in pools}
    e_own = np.expm1(mu[:, None] + resid).mean(1)                            # [P]
    e_pool = np.empty(len(a))
    for k, ix in groups.items():
        e_pool[ix] = np.expm1(mu[ix, None] + pools[k][None, :]).mean(1)
    grid = []
    for q in q_grid:
        oracle, half = [], []
        for _ in range(repeats):
            own = np.take_along_axis(resid, rng.integers(0, a.shape[1], size=a.shape), 1)
            pooled = np.empty_like(own)
            for k, ix in groups.items():
                pooled[ix] = rng.choice(pools[k], size=(len(ix), a.shape[1]))
            sim = np.expm1(mu[:, None] + np.where(rng.random(a.shape) < q, own, pooled))
            oracle.append(recall_at(q * e_own + (1 - q) * e_pool, sim.mean(1), frac))
            half.append(split_half_recall(sim, frac))
        grid.append({"q": float(q), "oracle": float(np.mean(oracle)), "oracle_std": float(np.std(oracle)),
                     "split_half": float(np.mean(half))})
    observed = split_half_recall(a, frac)
    q, ceiling, std = _match(grid, observed)
    return {"frac": frac, "observed_split_half": observed, "matched_q": q,
            "ceiling": ceiling, "ceiling_std": std, "grid": grid}


def _match(grid: list[dict], observed: float) -> tuple[float, float, float]:
    """Interpolate (q, oracle, std) at the observed split-half recall between the first pair of
    neighbouring grid points that brackets it; outside the grid, the nearest end."""
    for lo, hi in zip(grid, grid[1:]):
        a, b = lo["split_half"], hi["split_half"]
        if min(a, b) <= observed <= max(a, b) and a != b:
            w = (observed - a) / (b - a)
            return tuple(float(lo[k] + w * (hi[k] - lo[k])) for k in ("q", "oracle", "oracle_std"))
    end = min((grid[0], grid[-1]), key=lambda g: abs(g["split_half"] - observed))
    return end["q"], end["oracle"], end["oracle_std"]
