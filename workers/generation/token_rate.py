"""``TokenRate``: an engine's tokens per second over its last few seconds (``stats().tokens_per_s``)."""
from __future__ import annotations

import threading
from collections import deque


class TokenRate:
    """Tokens per second over about the last ``horizon`` seconds (both engines'
    ``stats().tokens_per_s``). ``add(now, n, started)`` records a step that ran from
    ``started`` to ``now`` and made ``n`` tokens; the window keeps the last entry at least
    ``horizon`` old (it only marks where the span starts) and what follows, with a running
    sum of the tokens after it: O(1) a step (the sum used to be recomputed over the whole
    window at every step, ~500 entries at workload (a)'s step rate, ~0.15 ms of an 8 ms step).
    An engine that made no step for ``horizon`` seconds reports 0, not the rate of its last
    steps; its first step after such a pause starts a new span at that step's start (the
    pause is not counted as time spent generating, which made the rate read far too low for
    ``horizon`` seconds after every idle period)."""

    def __init__(self, horizon: float = 5.0):
        self.horizon = horizon
        self.window: deque[tuple[float, int]] = deque()
        self._after_first = 0  # tokens of every entry but the first
        # ``stats()`` reads the rate on an RPC thread while ``step()`` adds: both trim the window
        # (an IndexError in the step, or a running sum wrong from then on, without it)
        self._lock = threading.Lock()

    def add(self, now: float, n: int, started: float | None = None) -> None:
        with self._lock:
            self._add(now, n, started)

    def _add(self, now: float, n: int, started: float | None) -> None:
        w = self.window
        begin = now if started is None else started
        if w and begin - w[-1][0] >= self.horizon:  # idle since the last step: a new span
            w.clear()
            self._after_first = 0
        if not w and started is not None:
            w.append((started, 0))  # the span starts when this step did
        if w:
            self._after_first += n
        w.append((now, n))
        self._trim(now)

    def _trim(self, now: float) -> None:
        w = self.window
        while len(w) > 1 and now - w[1][0] >= self.horizon:
            w.popleft()
            self._after_first -= w[0][1]  # the new first entry only marks the start

    def rate(self, now: float) -> float:
        with self._lock:
            self._trim(now)
            span = now - self.window[0][0] if self.window else 0.0
            return self._after_first / span if span > 0 else 0.0
