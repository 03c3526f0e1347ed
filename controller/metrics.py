"""TensorBoard logging of the controller: per-iteration scalars, timeline figures, traces.

Scalars per iteration: the trainer's metrics (``train/*``: reward_mean, kl, losses, entropy,
...), throughput (samples/s, tokens/s), stage times, idle (bubble) fraction per worker,
staleness, weight-sync time, and delta = generation time - training time (stage balancing).
"""
from __future__ import annotations

import json
from pathlib import Path

from controller.timeline import Span, bubble_fractions, gantt_figure, merge_intervals, write_chrome_trace


def stage_busy(spans: list[Span], stage: str) -> float:
    """Busy seconds of ``stage`` on its busiest worker (the stage's critical path)."""
    per: dict[str, list[Span]] = {}
    for s in spans:
        if s.stage == stage:
            per.setdefault(s.worker, []).append(s)
    return max((sum(b - a for a, b in merge_intervals(v)) for v in per.values()), default=0.0)


class Metrics:
    def __init__(self, logdir: str | Path, timeline_every: int = 5):
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(self.logdir / "tb"))
        self.timeline_every = timeline_every
        self.spans: list[Span] = []
        self.rewards: list[float] = []
        self.samples = 0
        self.tokens = 0
        self.seconds = 0.0

    def log_iteration(self, res, spans: list[Span]) -> dict[str, float]:
        """Write one iteration's scalars; returns the derived ones (delta, bubbles, rates)."""
        w, step = self.writer, res.iteration
        self.spans += spans
        for k, v in res.metrics.items():
            w.add_scalar(f"train/{k}", float(v), step)
        reward = float(res.metrics.get("reward_mean", 0.0))
        self.rewards.append(reward)
        self.samples += res.num_samples
        self.tokens += res.num_tokens
        self.seconds += res.iter_seconds
        it_spans = [s for s in spans if s.iteration == res.iteration]
        gen_busy, train_busy = stage_busy(it_spans, "generate"), stage_busy(it_spans, "train")
        derived = {
            "perf/samples_per_s": res.num_samples / max(res.iter_seconds, 1e-9),
            "perf/tokens_per_s": res.num_tokens / max(res.iter_seconds, 1e-9),
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
        }
        if spans:
            window = (min(s.start for s in spans), max(s.end for s in spans))
            for worker, frac in bubble_fractions(spans, window).items():
                derived[f"idle/{worker}"] = frac
        for k, v in derived.items():
            w.add_scalar(k, v, step)
        row = {k: v for k, v in vars(res).items() if k != "out_lens"}
        with open(self.logdir / "iterations.jsonl", "a") as f:
            f.write(json.dumps({**row, **derived}) + "\n")
        if self.timeline_every and (step + 1) % self.timeline_every == 0 and self.spans:
            self.write_timeline(step)
        w.flush()
        return derived

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, float(v), step)
        self.writer.flush()

    def write_timeline(self, step: int, last: int = 400) -> Path:
        spans = self.spans[-last:]
        fig = gantt_figure(spans, f"timeline up to iteration {step}")
        self.writer.add_figure("timeline/gantt", fig, step)
        import matplotlib.pyplot as plt

        fig.savefig(self.logdir / "timeline.png", dpi=100)
        plt.close(fig)
        return write_chrome_trace(self.spans, self.logdir / "timeline.json")

    def summary(self) -> dict:
        n = len(self.rewards)
        k = max(1, n // 10)
        return {"reward_first": sum(self.rewards[:k]) / k if n else 0.0,
                "reward_last": sum(self.rewards[-k:]) / k if n else 0.0,
                "samples_per_s": self.samples / max(self.seconds, 1e-9),
                "tokens_per_s": self.tokens / max(self.seconds, 1e-9),
                "iterations": n}

    def close(self) -> None:
        self.writer.close()
