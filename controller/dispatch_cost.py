"""What serving one instance's share of a batch costs, as the skewness-aware dispatcher plans
it (``controller/scheduling.py``, ``SkewDispatcher.cost``): the paper's formula
(``instance_latency``: PTL(BS) x L_avg x ceil(M / BS)) or an event-level simulation of the
instance's continuous batching (``simulated_cost``, ``controller/planner/engine_sim.py``), each
with the batch cap it picks."""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from controller.length_estimates import BinnedPosterior
from controller.planner.engine_sim import simulate_instance
from controller.ptl_profile import PTLProfile


def free_cap(profile: PTLProfile, m: int) -> int:
    """The batch cap ``engine.max_batch_size`` leaves for ``m`` requests (0: no limit)."""
    return max(1, min(m, profile.max_batch_size)) if profile.max_batch_size else max(1, m)


def instance_latency(profile: PTLProfile, m: int, l_avg: float, prompt_len: float = 0.0) -> tuple[float, int]:
    """Algorithm 2's cost of one instance: PTL(BS) * L_avg * ceil(M / BS), BS = the batch of
    (prompt_len + l_avg)-token sequences that fits the KV cache, at most M. Returns (s, BS)."""
    if m == 0:
        return 0.0, 1
    bs = min(m, profile.max_batch_for_len(prompt_len + l_avg))
    return profile.ptl(bs) * l_avg * math.ceil(m / bs), bs


def formula_cost(profile: PTLProfile, lens: Sequence[float], l_avg: float, prompt_len: float,
                 noise: float = 0.0, draws: int = 1) -> tuple[float, int]:
    """The paper's estimate for one instance: ``instance_latency`` at the class's L_avg."""
    return instance_latency(profile, len(lens), l_avg, prompt_len)


def no_preemption_cap(profile: PTLProfile, lens: Sequence[float], prompt_len: float) -> int:
    """The batch cap at which an instance's KV cache holds every running sequence whole
    (prompt + expected length, in blocks, plus one spare block each for the rounding and the
    engine's free-block watermark): the paper's "BS capped by memory". Under lazy allocation
    a larger batch admits on prompts alone and preempts as sequences grow."""
    if not len(lens):
        return 1
    per_seq = profile.seq_kv_tokens(prompt_len + float(np.mean(lens))) + profile.block_size
    bs = max(1, profile.kv_tokens // per_seq)
    return min(bs, profile.max_batch_size) if profile.max_batch_size else bs


def simulated_cost(profile: PTLProfile, lens: Sequence[float], l_avg: float, prompt_len: float,
                   noise: "float | BinnedPosterior" = 0.0, draws: int = 4) -> tuple[float, int]:
    """Event-level continuous-batching estimate of one instance; ``lens`` are the estimates
    in admission order. Returns (makespan, cap): the cap is the faster of "memory only"
    (lazy allocation, preempting as the cache fills) and ``no_preemption_cap``. With
    ``noise`` the true lengths are uncertain: the makespan is averaged over ``draws`` draws
    (fixed seed) of est * exp(N(0, noise)) (a float) or of a ``BinnedPosterior``, admitted
    in the given order."""
    est = [float(x) for x in lens]
    limit = max(1, profile.kv_tokens - int(prompt_len) - 2 * profile.block_size)
    prompts = [int(prompt_len)] * len(est)
    rng = np.random.default_rng(len(est))
    if isinstance(noise, BinnedPosterior) and est:
        draws_lens = [noise.draw(est, rng) for _ in range(draws)]
    elif noise and est:
        draws_lens = [np.asarray(est) * np.exp(rng.normal(0.0, noise, len(est))) for _ in range(draws)]
    else:
        draws_lens = [est]
    # a wide noise overflows exp() (and 0 * inf is NaN): a draw counts within [1, limit]
    outs = [np.clip(np.round(np.nan_to_num(np.asarray(d, dtype=float), nan=1.0, posinf=limit, neginf=1.0)),
                    1, limit).astype(int).tolist() for d in draws_lens]
    free = free_cap(profile, len(est))
    best = (math.inf, free)
    for cap in sorted({free, min(free, no_preemption_cap(profile, est, prompt_len))}, reverse=True):
        t = sum(simulate_instance(out, profile, cap, prompts).makespan_s for out in outs) / len(outs)
        best = min(best, (t, cap), key=lambda x: x[0])
    return best


COSTS: dict[str, Callable[..., tuple[float, int]]] = {
    "formula": formula_cost,
    "simulate": simulated_cost,
}
