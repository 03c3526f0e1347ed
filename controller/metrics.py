"""TensorBoard logging of the controller: per-iteration scalars, timeline figures, traces.

Scalars per iteration: the trainer's metrics (``train/*``: reward_mean, kl, losses, entropy,
...), throughput (samples/s, tokens/s), stage times, idle (bubble) fraction per worker,
staleness, weight-sync time, and delta = generation time - training time (stage balancing).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from controller.timeline import (BATCH_STAGES, Span, bubble_fractions, gantt_figure, iteration_windows,
                                 merge_intervals, pyplot, write_chrome_trace)
from workers.atomic import write_text


def stage_busy(spans: list[Span], stage: str) -> float:
    """Busy seconds of ``stage`` on its busiest worker (the stage's critical path)."""
    per: dict[str, list[Span]] = {}
    for s in spans:
        if s.stage == stage:
            per.setdefault(s.worker, []).append(s)
    return max((sum(b - a for a, b in merge_intervals(v)) for v in per.values()), default=0.0)


class Metrics:
    """One run's TensorBoard scalars (``<logdir>/tb``), ``iterations.jsonl`` rows and timeline.

    A resumed run (``--resume``, or a ``torchrun --max-restarts`` restart from the last
    checkpoint) continues in the same folder: when the earlier attempt had logged iterations
    from the first step this one logs, N, on (it crashed after its last checkpoint), those are
    replaced (TensorBoard ``purge_step``; their iterations.jsonl rows are dropped), so no step
    appears twice. The writer is opened at that first write, when N is known."""

    def __init__(self, logdir: str | Path, timeline_every: int = 5):
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._writer = None
        self.timeline_every = timeline_every
        self.spans: list[Span] = []
        self._batch_spans: dict[int, list[Span]] = {}  # iteration -> its batch's spans, until logged
        self._prev_drain: list[Span] = []
        self.rewards: list[float] = []
        self.samples = 0
        self.skipped = 0
        self.tokens = 0
        self.seconds = 0.0
        if timeline_every:
            pyplot()  # imported now (~1-2 s on a loaded machine), not in the middle of iteration
            # timeline_every - 1, where the controller's wait would stall the pipeline

    def _open(self, first_step: int):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # steps logged again (a restart from an older checkpoint than the last row) are
            # purged; a plain resume (rows end just before first_step) purges nothing, not even
            # the final Gantt figure logged at step first_step
            again = _drop_rows_from(self.logdir / "iterations.jsonl", first_step)
            again = _drop_rows_from(self.logdir / "eval.jsonl", first_step) or again
            self._writer = SummaryWriter(str(self.logdir / "tb"), purge_step=first_step if again else None)
        return self._writer

    def log_iteration(self, res, spans: list[Span]) -> dict[str, float]:
        """Write one iteration's scalars; returns the derived ones (delta, bubbles, rates).
        ``spans``: every span drained since the last call. In the async modes some of them
        belong to the next iteration (G(i+1) runs during step(i)); they are kept for it."""
        step = res.iteration
        w = self._open(step)
        self.spans += spans
        for s in spans:
            if s.stage in BATCH_STAGES:
                self._batch_spans.setdefault(s.iteration, []).append(s)
        recent, self._prev_drain = self._prev_drain + spans, spans
        it_spans = self._batch_spans.get(step, [])
        for i in [i for i in self._batch_spans if i <= step]:
            del self._batch_spans[i]
        for k, v in res.metrics.items():
            w.add_scalar(f"train/{k}", float(v), step)
        reward = float(res.metrics.get("reward_mean", 0.0))
        self.rewards.append(reward)
        self.samples += res.num_samples
        self.skipped += int(res.metrics.get("skipped_samples", 0))
        self.tokens += res.num_tokens
        self.seconds += res.interval_s
        gen_busy, train_busy = stage_busy(it_spans, "generate"), stage_busy(it_spans, "train")
        derived = {
            # rates over the interval since the previous iteration (what the pipeline delivers):
            # iter_seconds overlap in the async modes, so rates over them were too low
            "perf/samples_per_s": res.num_samples / max(res.interval_s, 1e-9),
            "perf/tokens_per_s": res.num_tokens / max(res.interval_s, 1e-9),
            "time/interval_s": res.interval_s,
            "time/iteration_s": res.iter_seconds,
            "time/generation_s": res.gen_seconds,
            "time/train_wait_s": res.train_seconds,
            "time/generate_busy_s": gen_busy,
            "time/train_busy_s": train_busy,
            "time/weight_sync_s": res.weight_sync_seconds,
            "balance/delta_s": gen_busy - train_busy,
            "staleness/max": float(res.staleness_max),
            "staleness/gen_version_lag": float(res.version - 1 - res.gen_version),
            "sgs/redispatched": float(res.redispatched),
            "sgs/instances": float(res.instances),
        }
        # the iteration's own window (its dispatch .. the end of its step), not the drain's:
        # a trainer's idle span can start long before (set-up, a pause at the REPL prompt)
        for k, v in res.ranker_quality.items():  # the estimates against the true lengths
            if v is not None:
                derived[f"ranker/{k}"] = float(v)
        window = iteration_windows(it_spans).get(step)
        if window is not None:
            for worker, frac in bubble_fractions(recent, window).items():
                derived[f"idle/{worker}"] = frac
        for k, v in derived.items():
            w.add_scalar(k, v, step)
        row = {k: v for k, v in vars(res).items() if k != "out_lens"}
        _append_line(self.logdir / "iterations.jsonl", json.dumps({**row, **derived}))
        if self.timeline_every and (step + 1) % self.timeline_every == 0 and self.spans:
            self.write_timeline(step)
        w.flush()
        return derived

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        w = self._open(step)
        for k, v in scalars.items():
            w.add_scalar(k, float(v), step)
        w.flush()

    def log_eval(self, scores: dict[str, float], step: int) -> None:
        """An evaluation after iteration ``step``: TensorBoard, and a row of ``eval.jsonl``."""
        self.log_scalars(scores, step)
        _append_line(self.logdir / "eval.jsonl", json.dumps({"iteration": step, **scores}))

    def write_timeline(self, step: int, last: int = 400) -> Path:
        """The Gantt figure of the last ``last`` spans (TensorBoard ``timeline/gantt`` and
        ``timeline.png``) and the Chrome trace of all spans (``timeline.json``); both files
        are replaced atomically."""
        spans = self.spans[-last:]
        fig = gantt_figure(spans, f"timeline up to iteration {step}")
        self._open(step).add_figure("timeline/gantt", fig, step, close=False)
        plt = pyplot()
        png = self.logdir / "timeline.png"
        tmp = png.with_name(f".{png.name}.tmp{os.getpid()}")
        try:
            fig.savefig(tmp, dpi=100, format="png")
            os.replace(tmp, png)
        finally:
            tmp.unlink(missing_ok=True)
            plt.close(fig)
        return write_chrome_trace(self.spans, self.logdir / "timeline.json")

    def summary(self) -> dict:
        n = len(self.rewards)
        k = max(1, n // 10)
        return {"reward_first": sum(self.rewards[:k]) / k if n else 0.0,
                "reward_last": sum(self.rewards[-k:]) / k if n else 0.0,
                "samples_per_s": self.samples / max(self.seconds, 1e-9),
                "tokens_per_s": self.tokens / max(self.seconds, 1e-9),
                "iterations": n, "skipped_samples": self.skipped}

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _append_line(path: Path, line: str) -> None:
    """Append one row with a single write() on an O_APPEND descriptor: a crash leaves the row
    whole or absent (a torn last line, after a power loss, is dropped at the next resume)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        data = (line + "\n").encode()
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


def _drop_rows_from(path: Path, first: int) -> bool:
    """Keep the rows of iterations before ``first`` (a resumed run writes the rest again) and
    drop a torn last line; replaced atomically, untouched when nothing changes. True when rows
    of ``first`` or later were there."""
    if not path.exists():
        return False
    text = path.read_text()
    kept, again = [], False
    for line in text.splitlines(keepends=True):
        try:
            if not line.endswith("\n"):
                continue  # torn
            if json.loads(line)["iteration"] < first:
                kept.append(line)
            else:
                again = True
        except (ValueError, KeyError, TypeError):
            pass
    if "".join(kept) != text:
        write_text(path, "".join(kept))
    return again
