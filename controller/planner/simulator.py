"""Cluster simulator: RL iterations event by event, for every pipeline mode.

Generation runs the runtime's dispatcher and LPT admission over the instances (the
event-level instance model of ``engine_sim``); each sample reaches the trainer when it
finishes. The trainer follows the mode's hand-over rule; the weight sync takes
``sync_s`` and blocks what the mode says it blocks. Output: the same ``Span`` records as
the runtime's timeline (controller/timeline.py), so a simulated run opens in the same
viewer, plus per-iteration times.

Mode semantics (controller/program.py and controller/trainer_rank.py; iteration i):
  colocated    gen(i) after sync(i-1); train(i) after gen(i) ends, on the same GPUs
  batch        same hand-over as colocated, on separate GPUs
  minibatch    the trainer takes fixed hand-overs of ``minibatch_size`` samples in arrival order
  stream       the trainer takes samples as they arrive and trains a micro-batch whenever
               ``microbatch_tokens`` tokens are in (0: per sample)
  async_batch  lag 1: gen(i) starts when gen(i-1) ended and the weights of train(i-2) are
               synced; sync(j) starts when train(j) ends (overlapping generation); the
               trainer takes iteration i's samples all at once, after step(i-1)
  async_stream lag 1 as async_batch, the trainer hand-over as stream
Every iteration starts with ``iteration_overhead_s`` of controller work (batching, ranker).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from controller.planner.engine_sim import simulate_plan
from controller.planner.profile import TrainProfile
from controller.scheduling import PTLProfile, make_dispatcher
from controller.timeline import Span

MODES = ("colocated", "batch", "minibatch", "stream", "async_batch", "async_stream")


@dataclass
class Workload:
    """One iteration's requests: output tokens (true), prompt tokens, the ranker's estimates."""

    out_lens: list[int]
    prompt_lens: list[int]
    est_lens: list[float] | None = None


@dataclass
class SimConfig:
    mode: str
    gen_instances: int
    gen_profile: PTLProfile
    trainer: TrainProfile
    sync_s: float = 0.0
    dispatcher: str = "skew"
    dispatch_kw: dict = field(default_factory=dict)
    minibatch_size: int = 8
    microbatch_tokens: int = 4096
    train_overhead_per_batch_s: float = 0.0  # per hand-over (micro/minibatch) fixed cost
    iteration_overhead_s: float = 0.0  # controller work before generation starts

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"simulator: mode {self.mode!r} is not one of {MODES}")
        if self.gen_instances < 1:
            raise ValueError(f"simulator: gen_instances must be >= 1, got {self.gen_instances}")


@dataclass
class SimResult:
    spans: list[Span]
    gen_start: list[float]
    gen_end: list[float]
    train_end: list[float]
    sync_end: list[float]

    @property
    def iteration_s(self) -> list[float]:
        """Time between consecutive trainer steps (the first from t = 0)."""
        ends = [0.0] + self.train_end
        return [b - a for a, b in zip(ends, ends[1:])]

    def steady_iteration_s(self, warmup: int = 1) -> float:
        it = self.iteration_s[warmup:] or self.iteration_s
        return sum(it) / len(it)


def _chunks(arrivals: list[tuple[float, int]], size: int) -> list[tuple[float, int]]:
    out = []
    for k in range(0, len(arrivals), size):
        chunk = arrivals[k:k + size]
        out.append((max(t for t, _ in chunk), sum(n for _, n in chunk)))
    return out


def _train_batches(mode: str, arrivals: list[tuple[float, int]], cfg: SimConfig) -> list[tuple[float, int]]:
    """(ready time, tokens) of each hand-over the trainer gets, in order.
    arrivals: (finish time, tokens) per request in request-index order."""
    if mode in ("colocated", "batch", "async_batch"):
        return [(max(t for t, _ in arrivals), sum(n for _, n in arrivals))]
    if mode == "minibatch":
        return _chunks(sorted(arrivals), cfg.minibatch_size)
    out, acc, last = [], 0, 0.0  # stream: by finish order, fill micro-batches
    for t, n in sorted(arrivals):
        acc, last = acc + n, t
        if acc >= cfg.microbatch_tokens:
            out.append((last, acc))
            acc = 0
    if acc:
        out.append((last, acc))
    return out


def simulate(cfg: SimConfig, workloads: Sequence[Workload], seed: int = 0) -> SimResult:
    """Run len(workloads) iterations from t = 0; returns spans and per-iteration times."""
    dispatcher = make_dispatcher(cfg.dispatcher, **cfg.dispatch_kw)
    profs = [cfg.gen_profile] * cfg.gen_instances
    mode = cfg.mode
    asynchronous = mode.startswith("async")
    spans: list[Span] = []
    gen_start, gen_end, train_end, sync_start, sync_end = [], [], [], [], []
    trainer_free = 0.0
    for i, w in enumerate(workloads):
        if len(w.prompt_lens) != len(w.out_lens):
            raise ValueError(f"simulator: workload {i} has {len(w.out_lens)} out_lens, {len(w.prompt_lens)} prompt_lens")
        # --- when generation of iteration i may start
        if asynchronous:
            t0 = max(gen_end[i - 1] if i >= 1 else 0.0, sync_end[i - 2] if i >= 2 else 0.0)
        else:
            t0 = sync_end[i - 1] if i >= 1 else 0.0
        t0 += cfg.iteration_overhead_s
        est = w.est_lens if w.est_lens is not None else [float(x) for x in w.out_lens]
        plan = dispatcher.plan(est, profs, true_lens=[float(x) for x in w.out_lens], seed=seed + i,
                               prompt_lens=w.prompt_lens)
        runs = simulate_plan(plan, w.out_lens, profs, w.prompt_lens, t0=t0)
        finish = [0.0] * len(w.out_lens)
        for j, (idx, run) in enumerate(zip(plan.per_instance, runs)):
            for k, r in enumerate(idx):
                finish[r] = run.finish_s[k]
            if idx:
                spans.append(Span(f"gen{j}", "generate", t0, run.makespan_s, i))
        gen_start.append(t0)
        gen_end.append(max(finish, default=t0))
        # --- training of iteration i
        arrivals = [(finish[r], w.out_lens[r] + w.prompt_lens[r]) for r in range(len(finish))]
        t = max(trainer_free, t0 if mode == "colocated" else 0.0)
        for ready, tokens in _train_batches(mode, arrivals, cfg):
            start = max(t, ready)
            t = start + cfg.trainer.s_per_token * tokens + cfg.train_overhead_per_batch_s
            spans.append(Span("trainer", "train", start, t, i))
        if cfg.trainer.fixed_s:
            spans.append(Span("trainer", "train", t, t + cfg.trainer.fixed_s, i))
            t += cfg.trainer.fixed_s
        train_end.append(t)
        trainer_free = t
        # --- weight sync of version i+1 (off the generation's critical path when lag 1)
        sync_start.append(t)
        sync_end.append(t + cfg.sync_s)
    for j, (a, b) in enumerate(zip(sync_start, sync_end)):
        if b > a:
            spans.append(Span("trainer", "weight_sync", a, b, j))
            for g in range(cfg.gen_instances):
                spans.append(Span(f"gen{g}", "weight_sync", a, b, j))
    return SimResult(spans, gen_start, gen_end, train_end, sync_end)


def sync_time_s(weight_bytes: float, gbps: float, hops: int = 1, latency_s: float = 0.0) -> float:
    """Bandwidth model of a pipelined broadcast tree: bytes cross the slowest link once,
    plus a per-hop latency (workers/weight_sync plans the tree; the bottleneck link sets
    the time)."""
    if gbps <= 0:
        raise ValueError(f"sync bandwidth must be > 0 Gbit/s, got {gbps}")
    return weight_bytes * 8 / (gbps * 1e9) + hops * latency_s


def run_modes(make_cfg: Callable[[str], SimConfig], workloads: Sequence[Workload], modes: Sequence[str] = MODES
              ) -> dict[str, SimResult]:
    """Simulate the same workloads under each pipeline mode."""
    return {m: simulate(make_cfg(m), workloads) for m in modes}
