"""Stage timeline: spans recorded by every worker, gathered by the controller.

Workers record ``Span(worker, stage, start, end, iteration)`` with ``time.time()`` around
their stages ("generate", "ref_reward", "train", "weight_sync", "idle"). The controller
gathers them and writes a Chrome-trace JSON (opens in Perfetto / chrome://tracing), a Gantt
figure for TensorBoard, and the bubble (idle) fraction per worker.
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
STAGES = ("generate", "ref_reward", "train", "weight_sync", "idle")
_COLORS = {"idle": "lightgrey",  # drawn first: busy spans paint over it
           "generate": "tab:blue", "ref_reward": "tab:orange", "train": "tab:green",
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


def bubble_fractions(spans: list[Span], window: tuple[float, float] | None = None) -> dict[str, float]:
    """Per worker: 1 - (time covered by a non-idle span) / window length. ``window`` defaults
    to the first start .. last end over all spans (the same wall-clock window for everyone).
    The controller's own row (what it waits on) is not a worker and is left out."""
    spans = [s for s in spans if s.worker != CONTROLLER]
    if not spans:
        return {}
    lo, hi = window or (min(s.start for s in spans), max(s.end for s in spans))
    length = max(hi - lo, 1e-9)
    out = {}
    for w in sorted({s.worker for s in spans}):
        clipped = [Span(s.worker, s.stage, max(s.start, lo), min(s.end, hi), s.iteration)
                   for s in spans if s.worker == w and s.end > lo and s.start < hi]
        out[w] = 1.0 - busy_time(clipped) / length
    return out


def stage_times(spans: list[Span]) -> dict[str, float]:
    """Total (merged) seconds per stage over all workers' spans."""
    out = {}
    for st in STAGES:
        ss = [s for s in spans if s.stage == st]
        if ss:
            out[st] = sum(b - a for a, b in merge_intervals(ss))
    return out


def to_chrome_trace(spans: list[Span]) -> dict:
    """Chrome trace-event JSON ("X" complete events, microseconds; one thread per worker)."""
    workers = sorted({s.worker for s in spans})
    tid = {w: i for i, w in enumerate(workers)}
    t0 = min((s.start for s in spans), default=0.0)
    events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid[w], "args": {"name": w}}
              for w in workers]
    events += [{"name": s.stage, "cat": s.stage, "ph": "X", "pid": 0, "tid": tid[s.worker],
                "ts": (s.start - t0) * 1e6, "dur": max(s.duration, 0.0) * 1e6,
                "args": {"iteration": s.iteration}} for s in spans]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(spans: list[Span], path: str | Path) -> Path:
    return write_text(path, json.dumps(to_chrome_trace(spans)))


def gantt_figure(spans: list[Span], title: str = ""):
    """Matplotlib Gantt chart: one row per worker, one colour per stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
