"""Cluster simulator: RL iterations event by event, for every pipeline mode.

Generation runs the runtime's dispatcher and LPT admission over the instances (the
event-level instance model of ``engine_sim``); each sample reaches the trainer when its
instance's Outbox sends it (``stream_window_s``: the samples that finish within the window of
the first unsent one travel together when the window closes, the rest at the instance's end;
0: each when it finishes). The trainer follows the mode's hand-over rule; the weight sync takes
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
               trainer takes iteration i's samples all at once, in step(i), which starts once
               sync(i-1) ended (the push reads the trainer's weights)
  async_stream lag 1 as async_batch, the trainer hand-over as stream: the micro-batches may
               train during sync(i-1), step(i) itself (``fixed_s``, and all of it with
               ``train_at_end``) not before it ends
Every iteration starts with ``iteration_overhead_s`` of controller work (batching, ranker).

Shared host (``gen_shared_slowdown`` / ``train_shared_slowdown`` > 1; default 1 = each stage
on its own hardware): generation and training share the same cores, and a stage's work takes
``slowdown`` times longer while another stage's process computes. The factors are measured
(``controller.planner.host.concurrent_slowdown``) and applied only where stages overlap in
time: a fixed point over whole runs, each pass stretching every iteration's generation by the
share of it the previous pass overlapped with training (or with the other instances), and
every training hand-over by the share of it overlapped with generation (or, colocated, with
the other DP rank, which always trains at the same time). ``gen_colocated_slowdown`` is the
separate factor of an instance while another instance generates on the same host (colocated:
two instance processes share the cores; measured through the runtime's generate + RPC path by
``controller.planner.colocated``); ``gen_shared_slowdown`` then covers only the share of it
that training overlaps.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

from controller.planner.engine_sim import simulate_plan
from controller.modes import MODES
from controller.planner.profile import TrainProfile
from controller.scheduling import PTLProfile, make_dispatcher
from controller.timeline import Span


# the shared-host time factors of SimConfig (all 1: each stage on its own hardware)
SLOWDOWNS = ("gen_shared_slowdown", "gen_colocated_slowdown", "train_shared_slowdown", "train_colocated_slowdown")

@dataclass
class Workload:
    """One iteration's requests: output tokens (true), prompt tokens, the ranker's estimates."""

    out_lens: list[int]
    prompt_lens: list[int]
    est_lens: list[float] | None = None
    groups: list[int] | None = None  # GRPO group id per request (None: each request its own group)
    # per request: whether it trains (None: all do); False: generation work only (remax's greedy
    # baseline response of each prompt)
    trained: list[bool] | None = None

    @property
    def trains(self) -> list[bool]:
        return self.trained if self.trained is not None else [True] * len(self.out_lens)


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
    stream_window_s: float = 0.0  # the instances' Outbox window (pipeline.stream_window_s)
    gen_shared_slowdown: float = 1.0  # shared host: generation's time factor while training computes
    gen_colocated_slowdown: float = 1.0  # shared host: an instance's time factor while another instance generates
    # shared host, DP ranks on one host (> 1: by overlap, like generation; 1: the old rule, every
    # rank's whole training at train_shared_slowdown): a rank's factor while another rank trains
    train_colocated_slowdown: float = 1.0
    train_shared_slowdown: float = 1.0  # shared host: training's time factor while another stage computes
    train_ranks: int = 1  # trainer DP ranks training at the same time (colocated: one per instance)
    # colocated as the runtime runs it (controller/outbox.route, controller/trainer_rank): DP
    # rank k trains the samples of groups g % train_ranks == k (route's split, up to which rank is
    # which: it rotates by the iteration), at ``trainer.s_per_token`` (one
    # rank's cost per token), once all of them are in; then every rank steps together
    # (all-reduce) for ``trainer.fixed_s``. False: one trainer takes the whole iteration.
    colocated_dp: bool = False
    # PPO with whitened advantages (trainer.whiten_advantages, verl's default): the runtime's
    # receive only prepares samples and every forward/backward of an iteration runs after its
    # last sample, so the trainer gets one hand-over whatever the mode (stream trains like batch,
    # async_stream like async_batch; generation still overlaps as the mode says)
    train_at_end: bool = False

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"simulator: mode {self.mode!r} is not one of {tuple(MODES)}")
        if self.gen_instances < 1:
            raise ValueError(f"simulator: gen_instances must be >= 1, got {self.gen_instances}")
        bad = {k: getattr(self, k) for k in SLOWDOWNS if not getattr(self, k) >= 1.0}
        if bad:
            raise ValueError(f"simulator: slowdown factors must be >= 1, got {bad}")


@dataclass
class SimResult:
    spans: list[Span]
    gen_start: list[float]
    gen_end: list[float]
    train_end: list[float]
    sync_end: list[float]
    lag: int = 0  # the mode's: 1 in the one-step off-policy modes

    @property
    def iteration_s(self) -> list[float]:
        """Time between consecutive trainer steps (the first from t = 0)."""
        ends = [0.0] + self.train_end
        return [b - a for a, b in zip(ends, ends[1:])]

    def steady_iteration_s(self) -> float:
        """Mean iteration time in the steady state: without the first iteration (it starts from
        an idle cluster) and over whole pipeline periods, the latest ones. With lag 1 generation
        i waits for the weight sync after training i - 2, and the iterations alternate: the
        second's generation waits for no sync (fast), the third's for the first sync (slow),
        and so on. Mean over an odd count of them, the async modes' time was understated
        (down to leaving the weight sync out at 2 iterations)."""
        period = 1 + self.lag
        it = self.iteration_s[1:]
        it = it[len(it) % period:] if len(it) >= period else self.iteration_s
        return sum(it) / len(it)


def _chunks(arrivals: list[tuple[float, int]], size: int) -> list[tuple[float, int]]:
    out = []
    for k in range(0, len(arrivals), size):
        chunk = arrivals[k:k + size]
        out.append((max(t for t, _ in chunk), sum(n for _, n in chunk)))
    return out


def _train_batches(release: str, arrivals: list[tuple[float, int]], cfg: SimConfig) -> list[tuple[float, int]]:
    """(ready time, tokens) of each hand-over the trainer gets, in order, under the mode's
    ``release`` rule. arrivals: (finish time, tokens) per request in request-index order."""
    if release == "all" or cfg.train_at_end:
        return [(max(t for t, _ in arrivals), sum(n for _, n in arrivals))]
    if release == "minibatch":
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


SHARED_HOST_PASSES = 6


def simulate(cfg: SimConfig, workloads: Sequence[Workload], seed: int = 0) -> SimResult:
    """Run len(workloads) iterations from t = 0; returns spans and per-iteration times."""
    n = len(workloads)
    if all(getattr(cfg, k) == 1.0 for k in SLOWDOWNS):
        return _simulate(cfg, workloads, seed, [1.0] * n, [1.0] * n)
    gen_scale, train_scale = [1.0] * n, [1.0] * n
    for _ in range(SHARED_HOST_PASSES):
        res = _simulate(cfg, workloads, seed, gen_scale, train_scale)
        gen_scale, train_scale = _shared_host_scales(cfg, res, n)
    return res


def _covered(interval: tuple[float, float], others: list[tuple[float, float]]) -> float:
    """Share of ``interval`` covered by the union of ``others``."""
    a, b = interval
    if b <= a:
        return 0.0
    cuts = sorted((max(a, x), min(b, y)) for x, y in others if min(b, y) > max(a, x))
    total, end = 0.0, a
    for x, y in cuts:
        if y > end:
            total += y - max(x, end)
            end = y
    return total / (b - a)


def _shared_host_scales(cfg: SimConfig, res: SimResult, n: int) -> tuple[list[float], list[float]]:
    """Per iteration, the time factor of its generation and of its training, from how much
    of each the other stages overlapped in ``res`` (see the module docstring)."""
    gen = [(sp.worker, sp.start, sp.end, sp.iteration) for sp in res.spans if sp.stage == "generate"]
    train_w = [(sp.worker, sp.start, sp.end, sp.iteration) for sp in res.spans if sp.stage == "train"]
    train = [(x, y, it) for _, x, y, it in train_w]
    gen_scale, train_scale = [], []
    for i in range(n):
        mine = [g for g in gen if g[3] == i]
        if mine:  # the instance that finishes last sets the iteration's generation time
            w, a, b, _ = max(mine, key=lambda g: g[2])
            instances = [(x, y) for v, x, y, _ in gen if v != w]
            by_gen = _covered((a, b), instances)  # another instance generates on the same host
            by_train = _covered((a, b), instances + [(x, y) for x, y, _ in train]) - by_gen  # only training
        else:
            by_gen = by_train = 0.0
        gen_scale.append(1.0 + (cfg.gen_colocated_slowdown - 1.0) * by_gen + (cfg.gen_shared_slowdown - 1.0) * by_train)
        spans = [(x, y) for x, y, it in train if it == i]
        busy = sum(y - x for x, y in spans)
        if cfg.train_ranks > 1 and cfg.train_colocated_slowdown > 1.0 and busy > 0:
            train_scale.append(_dp_train_scale(cfg, [t for t in train_w if t[3] == i], train_w, gen, busy))
            continue
        if cfg.train_ranks > 1:
            frac = 1.0  # the other DP ranks train at the same time
        elif busy > 0:
            frac = sum(_covered((x, y), [(g[1], g[2]) for g in gen]) * (y - x) for x, y in spans) / busy
        else:
            frac = 0.0
        train_scale.append(1.0 + (cfg.train_shared_slowdown - 1.0) * frac)
    return gen_scale, train_scale


def _dp_train_scale(cfg: SimConfig, mine: list, train_w: list, gen: list, busy: float) -> float:
    """Colocated DP ranks (``train_colocated_slowdown``): each training span is slowed by the
    share of it another rank trains (that factor) and the share only generation overlaps
    (``train_shared_slowdown``); the iteration's factor is their duration-weighted mean."""
    by_t = by_g = 0.0
    for w, x, y, _ in mine:
        ranks = [(a, b) for v, a, b, _ in train_w if v != w]
        t = _covered((x, y), ranks)
        by_t += t * (y - x)
        by_g += (_covered((x, y), ranks + [(g[1], g[2]) for g in gen]) - t) * (y - x)
    return 1.0 + ((cfg.train_colocated_slowdown - 1.0) * by_t + (cfg.train_shared_slowdown - 1.0) * by_g) / busy


def outbox_send_times(finish: Sequence[float], window_s: float, end: float) -> list[float]:
    """When ``controller.outbox.Outbox`` sends each sample (same indexing as ``finish``): the
    first unsent sample opens a window of ``window_s``; every sample finished by its close
    travels then; the instance's end (``close()``) sends what is left at once."""
    if window_s <= 0.0:
        return list(finish)
    out = [0.0] * len(finish)
    order = sorted(range(len(finish)), key=lambda k: finish[k])
    i = 0
    while i < len(order):
        send = min(finish[order[i]] + window_s, max(end, finish[order[i]]))
        while i < len(order) and finish[order[i]] <= send:
            out[order[i]] = send
            i += 1
    return out


def scaled_profile(profile: PTLProfile, factor: float) -> PTLProfile:
    """``profile`` with every time ``factor`` times longer (a slowed-down instance)."""
    if factor == 1.0:
        return profile
    return replace(profile, ptl_s=[x * factor for x in profile.ptl_s],
                   prefill_s_per_token=profile.prefill_s_per_token * factor,
                   prefill_step_s=profile.prefill_step_s * factor, kv_s_per_token=profile.kv_s_per_token * factor)


def _simulate(cfg: SimConfig, workloads: Sequence[Workload], seed: int, gen_scale: list[float],
              train_scale: list[float]) -> SimResult:
    dispatcher = make_dispatcher(cfg.dispatcher, **cfg.dispatch_kw)
    base = [cfg.gen_profile] * cfg.gen_instances
    mode = MODES[cfg.mode]
    spans: list[Span] = []
    gen_start, gen_end, train_end, sync_start, sync_end = [], [], [], [], []
    trainer_free = 0.0
    for i, w in enumerate(workloads):
        if len(w.prompt_lens) != len(w.out_lens) or len(w.trains) != len(w.out_lens):
            raise ValueError(f"simulator: workload {i} has {len(w.out_lens)} out_lens, {len(w.prompt_lens)} "
                             f"prompt_lens, {len(w.trains)} trained flags")
        # --- when generation of iteration i may start
        if mode.lag:
            t0 = max(gen_end[i - 1] if i >= 1 else 0.0, sync_end[i - 2] if i >= 2 else 0.0)
        else:
            t0 = sync_end[i - 1] if i >= 1 else 0.0
        t0 += cfg.iteration_overhead_s
        est = w.est_lens if w.est_lens is not None else [float(x) for x in w.out_lens]
        plan = dispatcher.plan(est, base, true_lens=[float(x) for x in w.out_lens], seed=seed + i,
                               prompt_lens=w.prompt_lens)
        profs = [scaled_profile(p, gen_scale[i]) for p in base]
        runs = simulate_plan(plan, w.out_lens, profs, w.prompt_lens, t0=t0)
        finish = [0.0] * len(w.out_lens)
        arrive = [0.0] * len(w.out_lens)  # when the trainer gets each sample (the Outbox)
        for j, (idx, run) in enumerate(zip(plan.per_instance, runs)):
            sent = outbox_send_times(run.finish_s, cfg.stream_window_s, run.makespan_s)
            for k, r in enumerate(idx):
                finish[r], arrive[r] = run.finish_s[k], sent[k]
            if idx:
                spans.append(Span(f"gen{j}", "generate", t0, run.makespan_s, i))
        gen_start.append(t0)
        gen_end.append(max(finish, default=t0))
        # --- training of iteration i
        trains, ready = w.trains, _ready_times(w, arrive)  # (a generation-only request is no training work)
        arrivals = [(ready[r], w.out_lens[r] + w.prompt_lens[r]) for r in range(len(finish)) if trains[r]]
        t = max(trainer_free, t0 if mode.colocated else 0.0)
        if mode.colocated and cfg.colocated_dp and cfg.train_ranks > 1:
            t = _colocated_dp_train(cfg, w, arrivals, t, train_scale[i], i, spans)
            train_end.append(t)
            trainer_free = t
            sync_start.append(t)
            sync_end.append(t + cfg.sync_s)
            continue
        # lag 1: step(i) is called once the push of step(i-1)'s weights ended (the trainer's
        # weights are the push's source); what it holds back (all, or train_at_end) trains in it
        gate = sync_end[i - 1] if mode.lag and i >= 1 else 0.0
        if mode.release == "all" or cfg.train_at_end:
            t = max(t, gate)
        for ready, tokens in _train_batches(mode.release, arrivals, cfg):
            start = max(t, ready)
            t = start + (cfg.trainer.s_per_token * tokens + cfg.train_overhead_per_batch_s) * train_scale[i]
            spans.append(Span("trainer", "train", start, t, i))
        t = max(t, gate)
        if cfg.trainer.fixed_s:
            fixed = cfg.trainer.fixed_s * train_scale[i]
            spans.append(Span("trainer", "train", t, t + fixed, i))
            t += fixed
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
    return SimResult(spans, gen_start, gen_end, train_end, sync_end, lag=mode.lag)


def _ready_times(w: Workload, arrive: list[float]) -> list[float]:
    """When each request of ``w`` can train: when it reaches the trainer, and (remax) not before
    its group's generation-only greedy response does (the group's advantages need it); without
    groups, not before the iteration's last greedy response."""
    trains = w.trains
    if all(trains):
        return arrive
    if w.groups is None:
        gate = max(a for a, t in zip(arrive, trains) if not t)
        return [max(a, gate) for a in arrive]
    greedy: dict[int, float] = {}
    for a, g, t in zip(arrive, w.groups, trains):
        if not t:
            greedy[g] = max(greedy.get(g, 0.0), a)
    return [max(a, greedy.get(g, 0.0)) for a, g in zip(arrive, w.groups)]


def _colocated_dp_train(cfg: SimConfig, w: Workload, arrivals: list[tuple[float, int]], t: float, scale: float,
                        i: int, spans: list[Span]) -> float:
    """Colocated DP training of one iteration (``SimConfig.colocated_dp``); returns its end."""
    groups = w.groups if w.groups is not None else list(range(len(w.out_lens)))
    groups = [g for g, t in zip(groups, w.trains) if t]  # those of ``arrivals``
    ends = []
    for k in range(cfg.train_ranks):
        mine = [a for a, g in zip(arrivals, groups) if g % cfg.train_ranks == k]
        if not mine:
            ends.append(t)
            continue
        start = max(t, max(f for f, _ in mine))
        end = start + (cfg.trainer.s_per_token * sum(n for _, n in mine) + cfg.train_overhead_per_batch_s) * scale
        spans.append(Span(f"train{k}", "train", start, end, i))
        ends.append(end)
    step = max(ends)  # the all-reduce waits for the slowest rank
    end = step + cfg.trainer.fixed_s * scale
    for k in range(cfg.train_ranks):
        spans.append(Span(f"train{k}", "train", ends[k], end, i))  # its wait + the step
    return end


def sync_time_s(weight_bytes: float, gbps: float, hops: int = 1, latency_s: float = 0.0) -> float:
    """Bandwidth model of a pipelined broadcast tree: bytes cross the slowest link once,
    plus a per-hop latency (workers/weight_sync plans the tree; the bottleneck link sets
    the time)."""
    if gbps <= 0:
        raise ValueError(f"sync bandwidth must be > 0 Gbit/s, got {gbps}")
    return weight_bytes * 8 / (gbps * 1e9) + hops * latency_s
