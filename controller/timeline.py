"""Stage timeline: spans recorded by every worker, gathered by the controller.

Workers record ``Span(worker, stage, start, end, iteration)`` with ``time.time()`` (epoch
seconds) around their stages: "generate" (an instance's part of a batch), "train" (a trainer
rank's receive-time forwards and micro-batches, and its optimizer step), "weight_sync"
(sending or receiving weights; its ``iteration`` is the weight version), "weight_stage" (an
instance keeping received weights for the next iteration boundary; the weight version), "eval"
and "save" (evaluation, a checkpoint), "ranker" (an instance's generations for the ranker's
bootstrap), "idle" (a trainer waiting for samples). The controller's own row holds what it
waits on ("dispatch", "wait_generate", "wait_step", "wait_push", and "wait_filter": the trainers
counting the groups that pass ``trainer.filter_groups`` before a refill), its evaluations and
checkpoint saves ("eval", "save") and the ranker's bootstrap at start ("ranker":
generating, fitting, saving). A worker is named
``<role><rank>`` (``gen1``, ``train2``). The controller gathers the spans and writes a
Chrome-trace JSON (opens in Perfetto / chrome://tracing), a Gantt figure for TensorBoard, and
the bubble (idle) fraction per device.
"""
from __future__ import annotations

import json
import re
import threading
import time
from bisect import bisect_left
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from itertools import accumulate
from pathlib import Path
from workers.atomic import write_text

CONTROLLER = "controller"
STAGES = ("generate", "train", "weight_sync", "weight_stage", "eval", "ranker", "save", "idle")
MAIN_STAGES = ("generate", "train")  # a worker's own work: its trace row's first lane
# stages whose ``iteration`` is the batch they worked on (weight_sync and weight_stage carry
# a weight version; wait_push and idle the iteration that comes next, the one that waits for
# those weights or samples; eval and save the last iteration trained): they delimit an
# iteration's window
BATCH_STAGES = ("generate", "train", "dispatch", "wait_generate", "wait_step", "wait_filter")
_COLORS = {"idle": "lightgrey",  # drawn first: busy spans paint over it
           "generate": "tab:blue", "train": "tab:green",
           "weight_sync": "tab:purple", "weight_stage": "tab:pink", "eval": "tab:orange", "save": "tab:brown",
           "ranker": "tab:olive", "rollout_dump": "tab:gray",
           # the controller's own row: what it is waiting on
           "dispatch": "tab:red", "wait_generate": "lightsteelblue", "wait_step": "palegreen",
           "wait_push": "plum", "wait_filter": "khaki"}


@dataclass
class Span:
    worker: str
    stage: str
    start: float
    end: float
    iteration: int
    attempt: int = 0  # the run's attempt (0, then +1 per --resume or restart): set by the controller

    @property
    def duration(self) -> float:
        return self.end - self.start


class SpanRecorder:
    """Thread-safe span buffer of one worker; ``drain()`` hands them to the controller."""

    def __init__(self, worker: str):
        self.worker = worker
        self._spans: list[Span] = []
        self._lock = threading.Lock()

    def add(self, stage: str, start: float, end: float, iteration: int) -> None:
        with self._lock:
            self._spans.append(Span(self.worker, stage, start, end, iteration))

    @contextmanager
    def span(self, stage: str, iteration: int):
        t0 = time.time()
        try:
            yield
        finally:
            self.add(stage, t0, time.time(), iteration)

    def drain(self) -> list[Span]:
        with self._lock:
            out, self._spans = self._spans, []
        return out


def merge_intervals(spans: list[Span]) -> list[tuple[float, float]]:
    """Union of the spans' [start, end) intervals, sorted and non-overlapping."""
    out: list[list[float]] = []
    for s in sorted(spans, key=lambda s: s.start):
        if out and s.start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], s.end)
        else:
            out.append([s.start, s.end])
    return [(a, b) for a, b in out]


def busy_time(spans: list[Span]) -> float:
    return sum(b - a for a, b in merge_intervals([s for s in spans if s.stage != "idle"]))


def iteration_windows(spans: list[Span]) -> dict[int, tuple[float, float]]:
    """Per iteration: first start .. last end of the spans that worked on its batch (from the
    controller's dispatch to the end of its optimizer step)."""
    out: dict[int, tuple[float, float]] = {}
    for s in spans:
        if s.stage in BATCH_STAGES:
            lo, hi = out.get(s.iteration, (s.start, s.end))
            out[s.iteration] = (min(lo, s.start), max(hi, s.end))
    return out


def _union(windows) -> list[tuple[float, float]]:
    """One (start, end) pair or a list of them, as sorted disjoint intervals."""
    windows = [windows] if isinstance(windows, tuple) else list(windows)
    return merge_intervals([Span("", "", lo, hi, 0) for lo, hi in windows if hi > lo])


def clip(spans: list[Span], windows) -> list[Span]:
    """The parts of ``spans`` inside ``windows`` (one (start, end) pair or a list: their union)."""
    return [Span(s.worker, s.stage, max(s.start, lo), min(s.end, hi), s.iteration, s.attempt)
            for lo, hi in _union(windows) for s in spans if s.end > lo and s.start < hi]


def devices(workers) -> dict[str, str]:
    """Worker -> its device: the worker's own name, or ``rank<r>`` for the workers that share
    rank r (colocated: ``gen1`` and ``train1``, one device that generates, then trains)."""
    rank = {w: (m.group(1) if (m := re.fullmatch(r"[A-Za-z_]+(\d+)", w)) else w) for w in workers}
    shared = Counter(rank.values())
    return {w: f"rank{rank[w]}" if shared[rank[w]] > 1 else w for w in workers}


def bubble_fractions(spans: list[Span], window=None, per_device: bool = False) -> dict[str, float]:
    """Per worker (``per_device``: per device, the workers of one rank together, see
    ``devices``): 1 - (time covered by a non-idle span) / window length. ``window``: one
    (start, end) pair or a list of them (their union: e.g. the windows of some iterations,
    leaving out the pauses between a REPL's ``run`` calls); default: the first start .. last
    end of the workers' non-idle spans. Idle spans never stretch the window: a trainer's first
    one starts when the rank is created, before any iteration. The controller's own row (what
    it waits on) is not a worker and is left out."""
    spans = [s for s in spans if s.worker != CONTROLLER]
    busy = [s for s in spans if s.stage != "idle"]
    name = devices({s.worker for s in spans}) if per_device else {s.worker: s.worker for s in spans}
    if window is None:
        if not busy:
            return {d: 1.0 for d in sorted(set(name.values()))}
        window = (min(s.start for s in busy), max(s.end for s in busy))
    length = max(sum(hi - lo for lo, hi in _union(window)), 1e-9)
    inside = clip(busy, window)
    return {d: 1.0 - busy_time([s for s in inside if name[s.worker] == d]) / length for d in sorted(set(name.values()))}


def stage_times(spans: list[Span], windows=None) -> dict[str, float]:
    """Total (merged) seconds per stage over all workers' spans (``windows``: only their parts
    inside those windows, as ``clip``)."""
    if windows is not None:
        spans = clip(spans, windows)
    out = {}
    for st in STAGES:
        ss = [s for s in spans if s.stage == st]
        if ss:
            out[st] = sum(b - a for a, b in merge_intervals(ss))
    return out


def _lanes(spans: list[Span]) -> list[tuple[Span, int]]:
    """Each span of one worker with a lane (0, 1, ...) such that the spans of one lane nest or
    follow each other, never overlap partially (Chrome's "X" events of one thread must nest).
    The worker's own work (``MAIN_STAGES``) is placed first, so it keeps lane 0; a weight push
    received while generating, or sent while the trainer trains the next batch, goes to a
    second lane."""
    main = _greedy([s for s in spans if s.stage in MAIN_STAGES], {})
    fixed = {k: _Lane([s for s, j in main if j == k]) for k in {k for _, k in main}}
    return main + _greedy([s for s in spans if s.stage not in MAIN_STAGES], fixed)


class _Lane:
    """Spans already placed on a lane, sorted by start, for overlap look-ups."""

    def __init__(self, spans: list[Span]):
        self.spans = sorted(spans, key=lambda s: s.start)
        self.starts = [s.start for s in self.spans]
        self.reach = list(accumulate((s.end for s in self.spans), max))  # the latest end so far

    def partial(self, s: Span) -> bool:
        """Whether ``s`` overlaps one of them partially (neither holds the other)."""
        i = bisect_left(self.starts, s.end)
        while i > 0 and self.reach[i - 1] > s.start:
            i -= 1
            f = self.spans[i]
            if f.start < s.start < f.end < s.end or s.start < f.start < s.end < f.end:
                return True
        return False


def _greedy(spans: list[Span], fixed: dict[int, _Lane]) -> list[tuple[Span, int]]:
    """Lanes for ``spans`` in start order: the first lane whose open spans enclose the span (or
    none is open) and whose ``fixed`` spans it does not overlap partially."""
    lanes: list[list[float]] = []  # per lane: the ends of its open (enclosing) spans
    out = []
    for s in sorted(spans, key=lambda s: (s.start, -s.end)):
        k = 0
        while True:
            if k == len(lanes):
                lanes.append([])
            open_ends = lanes[k]
            while open_ends and open_ends[-1] <= s.start:
                open_ends.pop()
            if (not open_ends or s.end <= open_ends[-1]) and not (k in fixed and fixed[k].partial(s)):
                break
            k += 1
        lanes[k].append(s.end)
        out.append((s, k))
    return out


def iso(t: float) -> str:
    """Epoch seconds as UTC ISO 8601 with milliseconds."""
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds")


def to_chrome_trace(spans: list[Span]) -> dict:
    """Chrome trace-event JSON ("X" complete events). ``ts``: epoch microseconds, so the trace
    lines up with logs and TensorBoard's wall time; each event's ``args`` holds its iteration
    and its start as UTC (``wall_time``). One process per attempt of the run (a resumed run
    adds one), named with its iterations and its start; in it one thread per worker, plus a
    thread "<worker> #2", ... for spans that overlap partially on that worker."""
    events = []
    for a in sorted({s.attempt for s in spans}):
        mine = [s for s in spans if s.attempt == a]
        its = [s.iteration for s in mine if s.stage in BATCH_STAGES]
        what = f"iterations {min(its)}-{max(its)}, " if its else ""
        events += [{"name": "process_name", "ph": "M", "pid": a,
                    "args": {"name": f"StreamRL attempt {a} ({what}started {iso(min(s.start for s in mine))})"}},
                   {"name": "process_sort_index", "ph": "M", "pid": a, "args": {"sort_index": a}}]
        placed = [(s, k) for w in sorted({s.worker for s in mine}) for s, k in _lanes([s for s in mine if s.worker == w])]
        tid = {t: i for i, t in enumerate(sorted({(s.worker, k) for s, k in placed}))}
        for (w, k), i in tid.items():
            events.append({"name": "thread_name", "ph": "M", "pid": a, "tid": i,
                           "args": {"name": w if k == 0 else f"{w} #{k + 1}"}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": a, "tid": i, "args": {"sort_index": i}})
        events += [{"name": s.stage, "cat": s.stage, "ph": "X", "pid": a, "tid": tid[(s.worker, k)],
                    "ts": s.start * 1e6, "dur": max(s.duration, 0.0) * 1e6,
                    "args": {"iteration": s.iteration, "wall_time": iso(s.start)}}
                   for s, k in sorted(placed, key=lambda p: p[0].start)]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(spans: list[Span], path: str | Path) -> Path:
    return write_text(path, json.dumps(to_chrome_trace(spans)))


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def gantt_figure(spans: list[Span], title: str = ""):
    """Matplotlib Gantt chart: one row per worker, one colour per stage, the legend below the
    axes. A ``matplotlib.figure.Figure`` outside pyplot's state, so it can be drawn on a
    background thread."""
    from matplotlib.figure import Figure

    workers = sorted({s.worker for s in spans})
    t0 = min((s.start for s in spans), default=0.0)
    fig = Figure(figsize=(10, 0.6 * len(workers) + 1.6), layout="constrained")
    ax = fig.subplots()
    for row, w in enumerate(workers):
        for st in _COLORS:
            bars = [(s.start - t0, s.duration) for s in spans if s.worker == w and s.stage == st]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), color=_COLORS[st], label=st)
    ax.set_yticks(range(len(workers)), workers)
    ax.set_xlabel(f"seconds from {iso(t0)}")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    fig.legend(uniq.values(), uniq.keys(), loc="outside lower center", fontsize=7, ncol=len(uniq) or 1)
    ax.set_title(title)
    return fig
