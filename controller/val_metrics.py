"""verl's validation statistics (``process_validation_metrics``) of one evaluation, per task
(verl's ``data_source``) and per variable: the score (``reward``) and each number a dict reward
gives (``scoring.reward_info``: ``acc``, ``score``, ...). Each is computed over one prompt's
scored samples, then averaged over the prompts:

* ``mean@n``, and with n > 1 ``std@n`` (the population std) of the prompt's n samples;
* with n > 1, for m = 2, 4, 8, ... below n, and n itself: ``best@m/mean``, ``best@m/std``,
  ``worst@m/mean``, ``worst@m/std``: the max / min of m samples drawn with replacement, over
  ``DRAWS`` draws, their mean and std (numpy's legacy generator seeded 42 for each statistic, so
  the draws are verl's and the figures equal its own);
* ``maj@m/mean``, ``maj@m/std`` where the reward gives every sample of the prompt a ``pred``
  (None too: a ballot of its own, as verl counts it): the value of the most common prediction
  among the m drawn (a tie: the prediction drawn first), as ``best@m``.

Keys ``eval/<task>/<variable>/<statistic>``: verl's ``val-core`` / ``val-aux`` /
``<source>/<variable>/<statistic>``, under this project's ``eval/`` (``eval_repl/p<N>/`` for a REPL
evaluation). A text variable has no statistics (``pred`` votes only), as in verl.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

DRAWS = 1000  # verl's n_bootstrap
_NONE = object()  # a sample without a pred
SEED = 42  # verl's seed, for every statistic


@dataclass
class PromptSamples:
    """One prompt's scored samples: each one's variables (``reward``: its score; a dict reward's
    numbers and texts beside it)."""

    task: str
    rows: list[dict[str, float | str]] = field(default_factory=list)


def sizes(n: int) -> list[int]:
    """The draw sizes of a prompt with n samples: 2, 4, 8, ... below n, and n (none for n <= 1)."""
    if n <= 1:
        return []
    out, m = [], 2
    while m < n:
        out.append(m)
        m *= 2
    return out + [n]


def draws(n: int, m: int) -> np.ndarray:
    """``DRAWS`` draws of m sample indices out of n, with replacement: verl's (``np.random.seed(42)``
    then ``np.random.choice``), from a generator of its own instead of numpy's global one."""
    return np.random.RandomState(SEED).choice(n, size=(DRAWS, m), replace=True)


def majority(values: np.ndarray, votes: list, picks: np.ndarray) -> np.ndarray:
    """For each draw (a row of ``picks``), the value of the first drawn sample whose vote is the
    draw's most common one (a tie: the vote drawn first)."""
    codes: dict = {}
    code = np.array([codes.setdefault(v, len(codes)) for v in votes])[picks]  # (draws, m)
    onehot = code[:, :, None] == np.arange(len(codes))[None, None, :]  # (draws, m, kinds)
    counts = onehot.sum(axis=1)
    m = picks.shape[1]
    first = np.where(onehot.any(axis=1), onehot.argmax(axis=1), m)  # each kind's first position
    winner = np.argmax(counts * (m + 1) - first, axis=1)  # most votes, then drawn first
    at = first[np.arange(len(picks)), winner]
    return values[picks[np.arange(len(picks)), at]]


def prompt_stats(rows: list[dict[str, float | str]]) -> dict[str, dict[str, float]]:
    """One prompt's statistics: variable -> statistic -> value."""
    out: dict[str, dict[str, float]] = {}
    names = list(dict.fromkeys(k for r in rows for k in r))
    for var in names:
        have = [r for r in rows if isinstance(r.get(var), float)]
        if not have:  # a text (pred): votes only
            continue
        vals = np.array([r[var] for r in have], dtype=np.float64)
        n = len(vals)
        stats = {f"mean@{n}": float(vals.mean())}
        if n > 1:
            stats[f"std@{n}"] = float(vals.std())
            preds = [r.get("pred", _NONE) for r in have]  # (None is a ballot: no answer found, as verl counts it)
            votes = None if any(p is _NONE for p in preds) else preds
            for m in sizes(n):
                picks = draws(n, m)
                drawn = vals[picks]
                for name, got in (("best", drawn.max(axis=1)), ("worst", drawn.min(axis=1))):
                    stats[f"{name}@{m}/mean"], stats[f"{name}@{m}/std"] = float(got.mean()), float(got.std())
                if votes is not None:
                    maj = majority(vals, votes, picks)
                    stats[f"maj@{m}/mean"], stats[f"maj@{m}/std"] = float(maj.mean()), float(maj.std())
        out[var] = stats
    return out


_STATISTIC = re.compile(r"/[^/]+/(?:(?:mean|std)@\d+|(?:best|worst|maj)@\d+/(?:mean|std))$")


def is_statistic(key: str) -> bool:
    """Whether an ``eval/`` key is one of these statistics (not a headline: ``eval/<task>``,
    whose task may have a ``/`` in its name, ``eval/mean``, ``eval/best@k``)."""
    return bool(_STATISTIC.search(key))


def is_headline(key: str) -> bool:
    """An ``eval/`` key that is a score the console says: a task's, ``eval/mean``, ``eval/best@k``
    (not a statistic, ``eval/unscored``, nor a multi-turn run's ``eval/num_turns/*``)."""
    return (key.startswith("eval/") and not is_statistic(key) and key != "eval/unscored"
            and not key.startswith("eval/num_turns/"))


def validation_metrics(prompts: list[PromptSamples], key=lambda task: task) -> dict[str, float]:
    """``eval/<key(task)>/<variable>/<statistic>``: each prompt's statistics averaged over the
    prompts of its task that have them (a prompt with fewer scored samples counts toward its own
    ``@n``). ``key`` names a task as its ``eval/`` key."""
    sums: dict[str, list[float]] = {}
    for p in prompts:
        if not p.rows:
            continue
        for var, stats in prompt_stats(p.rows).items():
            for stat, value in stats.items():
                sums.setdefault(f"eval/{key(p.task)}/{var}/{stat}", []).append(value)
    return {k: math.fsum(v) / len(v) for k, v in sums.items()}
