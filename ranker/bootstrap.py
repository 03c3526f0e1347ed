"""Bootstrapping a ranker when no trace exists: measure the current policy on a sample of
the dataset and fit on what it produced.

``generate`` is any callable ``prompts -> lengths`` (the controller wires it to the SGS:
generate each prompt's answers, return their mean length in words or tokens — the ranker
only needs a consistent unit).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ranker import progress
from ranker.data import as_prompts, check_lengths

GenerateFn = Callable[[list[str]], Sequence[float]]


def sample_prompts(prompts: Sequence[str], n: int, seed: int = 0) -> list[str]:
    """``n`` distinct prompts drawn without replacement (all when fewer)."""
    idx = np.random.RandomState(seed).permutation(len(prompts))[:n]
    return [prompts[i] for i in np.sort(idx)]


def measure(generate: GenerateFn, prompts: Sequence[str], chunk: int = 64) -> list[float]:
    """Lengths from ``generate`` in chunks of ``chunk`` prompts, checked for count and value."""
    out: list[float] = []
    with progress.bar("bootstrap: generating", len(prompts)) as b:
        for s in range(0, len(prompts), chunk):
            part = list(prompts[s:s + chunk])
            got = list(generate(part))
            if len(got) != len(part):
                raise ValueError(f"generate returned {len(got)} lengths for {len(part)} prompts "
                                 f"(chunk starting at prompt {s})")
            try:
                check_lengths(part, got)
            except ValueError as e:
                raise ValueError(f"generate, chunk starting at prompt {s}: {e}") from e
            out.extend(float(v) for v in got)
            b.advance(len(part))
    return out


def bootstrap(generate: GenerateFn, prompts: Sequence[str], n: int = 256, kind: str = "lgbm",
              sample_seed: int = 0, chunk: int = 64, options: dict | None = None, **kw):
    """Sample ``n`` prompts (drawn with ``sample_seed``), measure them with ``generate``, fit a
    ``kind`` ranker (config keywords ``options`` and ``kw``, its own ``seed`` among them; in
    ``options`` a keyword may share a name with this function's: ``n``, ``chunk``, ...) and
    return it (fitted)."""
    from ranker.store import build

    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"bootstrap n must be an int >= 2 (prompts to measure), got {n!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"bootstrap chunk must be an int >= 1, got {chunk!r}")
    prompts = as_prompts(prompts)
    model = build(kind, **{**(options or {}), **kw})  # a bad config fails here, before anything is generated
    picked = sample_prompts(prompts, n, sample_seed)
    model._need_rows(len(picked), f"{len(prompts)} prompts given, n = {n}")
    lengths = measure(generate, picked, chunk)
    fitted = model.fit(picked, lengths)
    if fitted is None:  # your own class's fit without its return: the measured lengths stay usable
        raise ValueError(f"ranker.kind {kind!r}: fit() returned None; it must return the ranker (return self)")
    return fitted
