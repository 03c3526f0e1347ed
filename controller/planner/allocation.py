"""Resource allocation between generation and training (paper Algorithm 1).

A ``StageModel`` gives each stage's time for one iteration's batch as a function of its
GPUs: generation by dispatching the workload over ``x // gen_unit`` instances and running
the event-level instance model (same dispatcher and LPT as the runtime), training from its
profile. With several batches (the planner's simulated iterations) each stage's time is its
mean over them (``mean_generation_time_model``; training is affine in tokens, so its mean is
its time on the mean tokens): Algorithm 1 balances the stages' expected times, the pipeline's
steady-state bottleneck. Single datacenter: x + y <= n, minimise max(gen, train) (then fewest GPUs).
Cross-datacenter: x <= m, y <= n independently; the paper shrinks the faster stage from
(m, n) while it stays no slower than the other; here each stage gets the fewest GPUs that
reach the best iteration time (when stage times fall monotonically: the paper's iteration
time, on no more GPUs); the rest is released.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Sequence

from controller.planner.engine_sim import simulate_plan
from controller.scheduling import PTLProfile, make_dispatcher


@dataclass
class StageModel:
    """gen_time(instances) and train_time(gpus) in seconds for one iteration's batch.
    gen_unit: generation GPU granularity (an instance, or a node of several);
    gpus_per_instance: GPUs of one instance (default gen_unit); train_unit: trainer GPU
    granularity; train_min: fewest trainer GPUs that hold the models."""

    gen_time: Callable[[int], float]
    train_time: Callable[[int], float]
    gen_unit: int = 1
    train_unit: int = 1
    train_min: int = 1
    gpus_per_instance: int = 0  # 0: gen_unit (one instance per unit); else a unit (node) holds several

    def instances(self, x: int) -> int:
        return x // (self.gpus_per_instance or self.gen_unit)

    def gen(self, x: int) -> float:
        k = self.instances(x)
        return math.inf if k < 1 else self.gen_time(k)

    def train(self, y: int) -> float:
        return math.inf if y < max(self.train_min, 1) else self.train_time(y)


@dataclass
class Allocation:
    gen_gpus: int
    train_gpus: int
    gen_instances: int
    gen_time_s: float
    train_time_s: float
    released_gen: int = 0
    released_train: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def iteration_s(self) -> float:
        return max(self.gen_time_s, self.train_time_s)


def _alloc(model: StageModel, x: int, y: int, **kw) -> Allocation:
    return Allocation(x, y, model.instances(x), model.gen(x), model.train(y), **kw)


def _xs(model: StageModel, hi: int) -> range:
    return range(model.gen_unit, hi + 1, model.gen_unit)


def _train_lo(model: StageModel) -> int:
    """The fewest trainer GPUs: its states (train_min), in whole trainer units."""
    return max(model.train_unit, math.ceil(model.train_min / model.train_unit) * model.train_unit)


def _ys(model: StageModel, hi: int) -> list[int]:
    return list(range(_train_lo(model), hi + 1, model.train_unit))


def _gen_unit_says(model: StageModel) -> str:
    """What one generation unit is: gen_unit GPUs, or whole instances of tp GPUs."""
    tp = model.gpus_per_instance or model.gen_unit
    if tp == model.gen_unit:
        return f"{model.gen_unit} GPUs: one instance of tp {tp}" + ("" if tp == 1 else ", or the cluster's gen_unit")
    return f"{model.gen_unit} GPUs: the cluster's gen_unit in whole instances of tp {tp}"


def _too_few(model: StageModel, n: int) -> str:
    """One datacenter of ``n`` GPUs too small for a generation unit and the trainer side by side."""
    train = _train_lo(model)
    return (f"allocation: {n} GPUs cannot hold one generation unit ({_gen_unit_says(model)}) and the trainer "
            f"(>= {train} GPUs: its states, in trainer_unit {model.train_unit}) side by side: the planner needs "
            f">= {model.gen_unit + train} GPUs (generation and training on separate GPUs; colocated is only "
            f"simulated beside such a split)")


def allocate_brute_force(model: StageModel, n: int) -> Allocation:
    """Every (x, y) with x + y <= n; the smallest (max(gen, train), x + y, x)."""
    best = None
    for x in _xs(model, n):
        for y in _ys(model, n - x):
            key = (max(model.gen(x), model.train(y)), x + y, x)
            if best is None or key < best[0]:
                best = (key, x, y)
    if best is None:
        raise ValueError(_too_few(model, n))
    return _alloc(model, best[1], best[2])


def allocate_single_dc(model: StageModel, n: int) -> Allocation:
    """Algorithm 1 for one datacenter. For each x the trainer gets the fewest GPUs that reach
    max(gen(x), train(all the rest)) (binary search; training time is non-increasing in
    GPUs); GPUs left over are released. Equals ``allocate_brute_force``."""
    best = None
    for x in _xs(model, n):
        ys = _ys(model, n - x)
        if not ys:
            continue
        g = model.gen(x)
        target = max(g, model.train(ys[-1]))  # the best max(gen, train) this x can reach
        lo, hi = 0, len(ys) - 1
        while lo < hi:  # the fewest GPUs reaching it
            mid = (lo + hi) // 2
            if model.train(ys[mid]) <= target:
                hi = mid
            else:
                lo = mid + 1
        y = ys[lo]
        key = (max(g, model.train(y)), x + y, x)
        if best is None or key < best[0]:
            best = (key, x, y)
    if best is None:
        raise ValueError(_too_few(model, n))
    return _alloc(model, best[1], best[2], released_gen=0, released_train=n - best[1] - best[2])


def allocate_cross_dc(model: StageModel, m: int, n: int) -> Allocation:
    """Algorithm 1 across datacenters: generation gets x <= m GPUs (its DC), training y <= n.
    The paper starts from (m, n) and shrinks the faster stage while it stays no slower than
    the other. With stage times that fall monotonically in GPUs that is: the iteration time
    T = max(fastest generation, fastest training) over the two DCs, each stage on the fewest
    GPUs that reach T. Computed that way here, so a generation time that is not monotone in
    instances (dispatch rounding: one more instance can be slower) never makes a larger
    datacenter give a slower plan, and a stage on a plateau (tail-bound generation) gives back
    the GPUs that do not speed it up even when it is the slower stage; the rest is released."""
    xs, ys = list(_xs(model, m)), _ys(model, n)
    if not xs:
        raise ValueError(f"allocation: the generation datacenter's {m} GPUs cannot hold one generation unit "
                         f"({_gen_unit_says(model)})")
    if not ys:
        raise ValueError(f"allocation: the trainer datacenter's {n} GPUs cannot hold the trainer "
                         f"(>= {_train_lo(model)} GPUs: its states, in trainer_unit {model.train_unit})")
    gens, trains = [model.gen(x) for x in xs], [model.train(y) for y in ys]
    target = max(min(gens), min(trains))
    x = next(x for x, g in zip(xs, gens) if g <= target)
    y = next(y for y, t in zip(ys, trains) if t <= target)
    return _alloc(model, x, y, released_gen=m - x, released_train=n - y)


def most_trainer_splits(model: StageModel, n: int, m: int | None = None) -> list[Allocation]:
    """The splits a mode whose iteration is gen + sync + train chooses from: every generation
    size x (multiples of gen_unit; x <= m on a generation datacenter of ``m`` GPUs, else
    x + y <= n) with the trainer on the most GPUs left (y <= n), as training time never rises
    with GPUs; the rest is released."""
    out = []
    for x in _xs(model, n if m is None else m):
        ys = _ys(model, n - x if m is None else n)
        if ys:
            out.append(_alloc(model, x, ys[-1], released_gen=0 if m is None else m - x,
                              released_train=n - ys[-1] - (x if m is None else 0)))
    return out


def even_split(model: StageModel, n: int) -> Allocation:
    """The baseline: half the GPUs to each stage (rounded to the stages' units); what the
    rounding leaves over is released (as Algorithm 1 reports it)."""
    x = max(model.gen_unit, (n // 2) // model.gen_unit * model.gen_unit)
    ys = _ys(model, n - x)
    if not ys:
        raise ValueError(f"even split: {n - x} GPUs cannot hold the trainer (>= {model.train_min})")
    return _alloc(model, x, ys[-1], released_train=n - x - ys[-1])


def generation_time_model(profile: PTLProfile, out_lens: Sequence[int], prompt_lens: Sequence[int] | None = None,
                          dispatcher: str = "oracle", seed: int = 0, **dispatch_kw) -> Callable[[int], float]:
    """gen_time(instances): the dispatcher's plan of this workload over identical instances,
    each run with the event-level model; the slowest instance's makespan. ``seed``: the plan's
    (the ``random`` dispatcher's split; the simulator gives batch i ``seed + i``). Cached."""
    lens = [max(1, int(x)) for x in out_lens]
    disp = make_dispatcher(dispatcher, **dispatch_kw)

    @lru_cache(maxsize=None)
    def gen_time(k: int) -> float:
        profs = [profile] * k
        plan = disp.plan([float(x) for x in lens], profs, true_lens=[float(x) for x in lens], prompt_lens=prompt_lens,
                         seed=seed)
        return max(r.makespan_s for r in simulate_plan(plan, lens, profs, prompt_lens))

    return gen_time


def mean_generation_time_model(profile: PTLProfile, batches: Sequence[tuple[Sequence[int], Sequence[int] | None]],
                               dispatcher: str = "oracle", seed: int = 0, **dispatch_kw) -> Callable[[int], float]:
    """gen_time(instances) averaged over several batches (``(out_lens, prompt_lens)`` each):
    each batch dispatched and run on its own (``generation_time_model``), the mean of their
    generation times. The planner plans on every simulated iteration's batch this way, not on
    one draw of the workload; batch i with the simulator's seed for it (``seed + i``). Cached."""
    models = [generation_time_model(profile, o, q, dispatcher, seed + i, **dispatch_kw)
              for i, (o, q) in enumerate(batches)]
    if not models:
        raise ValueError("mean_generation_time_model: no batch")

    @lru_cache(maxsize=None)
    def gen_time(k: int) -> float:
        return sum(m(k) for m in models) / len(models)

    return gen_time
