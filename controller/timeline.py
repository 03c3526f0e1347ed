"""Stage timeline: spans recorded by every worker, gathered by the controller.

Workers record ``Span(worker, stage, start, end, iteration)`` with ``time.time()`` around
their stages: "generate" (an instance's part of a batch), "train" (a trainer rank's
receive-time forwards and micro-batches, and its optimizer step), "weight_sync" (sending,
receiving or staging weights; its ``iteration`` is the weight version), "idle" (a trainer
waiting for samples). The controller's own row holds what it waits on ("dispatch",
"wait_generate", "wait_step", "wait_push"). The controller gathers them and writes a
Chrome-trace JSON (opens in Perfetto / chrome://tracing), a Gantt figure for TensorBoard, and
the bubble (idle) fraction per worker.
"""
from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from workers.atomic import write_text

CONTROLLER = "controller"
STAGES = ("generate", "train", "weight_sync", "idle")
# stages whose ``iteration`` is the batch they worked on (weight_sync carries a weight version,
# wait_push and idle the iteration that comes next): they delimit an iteration's window
BATCH_STAGES = ("generate", "train", "dispatch", "wait_generate", "wait_step")
_COLORS = {"idle": "lightgrey",  # drawn first: busy spans paint over it
           "generate": "tab:blue", "train": "tab:green",
           "weight_sync": "tab:purple",
           # the controller's own row: what it is waiting on
           "dispatch": "tab:red", "wait_generate": "lightsteelblue", "wait_step": "palegreen",
           "wait_push": "plum"}


@dataclass
class Span:
    worker: str
    stage: str
    start: float
    end: float
    iteration: int

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


def bubble_fractions(spans: list[Span], window=None) -> dict[str, float]:
    """Per worker: 1 - (time covered by a non-idle span) / window length. ``window``: one
    (start, end) pair or a list of them (their union: e.g. the windows of some iterations,
    leaving out the pauses between a REPL's ``run`` calls); default: the first start .. last
    end of the workers' non-idle spans. Idle spans never stretch the window: a trainer's first
    one starts when the rank is created, before any iteration. The controller's own row (what
    it waits on) is not a worker and is left out."""
    spans = [s for s in spans if s.worker != CONTROLLER]
    busy = [s for s in spans if s.stage != "idle"]
    if window is None:
        if not busy:
            return {w: 1.0 for w in sorted({s.worker for s in spans})}
        window = (min(s.start for s in busy), max(s.end for s in busy))
    windows = [window] if isinstance(window, tuple) else list(window)
    windows = merge_intervals([Span("", "", lo, hi, 0) for lo, hi in windows if hi > lo])
    length = max(sum(hi - lo for lo, hi in windows), 1e-9)
    out = {}
    for w in sorted({s.worker for s in spans}):
        covered = 0.0
        for lo, hi in windows:
            clipped = [Span(s.worker, s.stage, max(s.start, lo), min(s.end, hi), s.iteration)
                       for s in busy if s.worker == w and s.end > lo and s.start < hi]
            covered += busy_time(clipped)
        out[w] = 1.0 - covered / length
    return out


def stage_times(spans: list[Span]) -> dict[str, float]:
    """Total (merged) seconds per stage over all workers' spans."""
    out = {}
    for st in STAGES:
        ss = [s for s in spans if s.stage == st]
        if ss:
            out[st] = sum(b - a for a, b in merge_intervals(ss))
    return out


def _lanes(spans: list[Span]) -> list[tuple[Span, int]]:
    """Each span with a lane (0, 1, ...) such that the spans of one lane nest or follow each
    other, never overlap partially (Chrome's "X" events of one thread must nest): a weight
    push received while generating, or sent while the trainer trains the next batch, gets a
    second lane."""
    lanes: list[list[float]] = []  # per lane: the ends of its open (enclosing) spans
    out = []
    for s in sorted(spans, key=lambda s: (s.start, -s.end)):
        for k, open_ends in enumerate(lanes):
            while open_ends and open_ends[-1] <= s.start:
                open_ends.pop()
            if not open_ends or s.end <= open_ends[-1]:
                break
        else:
            k = len(lanes)
            lanes.append([])
        lanes[k].append(s.end)
        out.append((s, k))
    return out


def to_chrome_trace(spans: list[Span]) -> dict:
    """Chrome trace-event JSON ("X" complete events, microseconds; one thread per worker, plus
    a thread "<worker> #2", ... for spans that overlap partially on that worker)."""
    t0 = min((s.start for s in spans), default=0.0)
    placed = [(s, k) for w in sorted({s.worker for s in spans})
              for s, k in _lanes([s for s in spans if s.worker == w])]
    threads = sorted({(s.worker, k) for s, k in placed})
    tid = {t: i for i, t in enumerate(threads)}
    events = []
    for (w, k), i in tid.items():
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": i,
                       "args": {"name": w if k == 0 else f"{w} #{k + 1}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": i, "args": {"sort_index": i}})
    events += [{"name": s.stage, "cat": s.stage, "ph": "X", "pid": 0, "tid": tid[(s.worker, k)],
                "ts": (s.start - t0) * 1e6, "dur": max(s.duration, 0.0) * 1e6,
                "args": {"iteration": s.iteration}} for s, k in placed]
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
    """Matplotlib Gantt chart: one row per worker, one colour per stage."""
    plt = pyplot()

    workers = sorted({s.worker for s in spans})
    t0 = min((s.start for s in spans), default=0.0)
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(workers) + 1.2))
    for row, w in enumerate(workers):
        for st in _COLORS:
            bars = [(s.start - t0, s.duration) for s in spans if s.worker == w and s.stage == st]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), color=_COLORS[st], label=st)
    ax.set_yticks(range(len(workers)), workers)
    ax.set_xlabel("seconds")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), loc="upper right", fontsize=7, ncol=len(uniq))
    ax.set_title(title)
    fig.tight_layout()
    return fig


def spans_to_dicts(spans: list[Span]) -> list[dict]:
    return [asdict(s) for s in spans]
