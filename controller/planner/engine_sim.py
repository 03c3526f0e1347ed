"""Event-level model of one generation instance running continuous batching.

Requests are admitted strictly in the plan's order (FCFS or LPT) while the batch is below
its cap and the KV cache can hold the request's whole sequence (prompt + output tokens,
in blocks: the native engine reserves a request's blocks as it grows and the planner
assumes no preemption). Between two events (an admission or a completion) the batch size
is constant, so time advances by ``PTL(BS) * steps``: the cost is O(M log M) per instance,
not O(tokens). Used by the dispatcher benchmarks, the allocation planner and the cluster
simulator.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

from controller.scheduling import PTLProfile


@dataclass
class InstanceRun:
    """finish_s[k]: completion time of the k-th request of ``order`` (same indexing as the
    input); makespan_s: when the last one finished; batch_trace: (time, batch size) changes."""

    finish_s: list[float]
    start_s: list[float]
    makespan_s: float
    max_batch: int


def simulate_instance(out_lens: Sequence[int], profile: PTLProfile, cap: int,
                      prompt_lens: Sequence[int] | None = None, t0: float = 0.0) -> InstanceRun:
    """Simulate one instance admitting requests in the given order.

    out_lens[k]: output tokens of request k (k = admission order); prompt_lens[k] its prompt.
    cap: max batch size. Each decode step gives every running request one token and costs
    profile.ptl(batch); an admission costs prefill_s_per_token * prompt tokens."""
    m = len(out_lens)
    prompts = list(prompt_lens) if prompt_lens is not None else [0] * m
    if len(prompts) != m:
        raise ValueError(f"simulate_instance: {len(prompts)} prompt_lens for {m} requests")
    cap = max(1, min(cap, profile.max_batch_size) if profile.max_batch_size else cap)
    need = [profile.seq_kv_tokens(prompts[k] + out_lens[k]) for k in range(m)]
    for k in range(m):
        if need[k] > profile.kv_tokens:
            raise ValueError(f"simulate_instance: request {k} needs {need[k]} KV tokens, "
                             f"the instance has {profile.kv_tokens}")
    finish, start = [0.0] * m, [0.0] * m
    running: list[tuple[int, int]] = []  # heap of (finish step, k)
    t, step, nxt, free, peak = t0, 0, 0, profile.kv_tokens, 0
    while nxt < m or running:
        while nxt < m and len(running) < cap and need[nxt] <= free:
            free -= need[nxt]
            t += profile.prefill_s_per_token * prompts[nxt]
            start[nxt] = t
            heapq.heappush(running, (step + max(1, int(out_lens[nxt])), nxt))
            nxt += 1
        peak = max(peak, len(running))
        done_step, _ = running[0]
        t += profile.ptl(len(running)) * (done_step - step)
        step = done_step
        while running and running[0][0] == step:
            _, k = heapq.heappop(running)
            finish[k] = t
            free += need[k]
    return InstanceRun(finish, start, max(finish, default=t0), peak)


def simulate_plan(plan, out_lens: Sequence[int], profiles: list[PTLProfile],
                  prompt_lens: Sequence[int] | None = None, t0: float = 0.0) -> list[InstanceRun]:
    """Run every instance of a DispatchPlan on its own (true lengths); list per instance."""
    runs = []
    for j, idx in enumerate(plan.per_instance):
        pl = [prompt_lens[i] for i in idx] if prompt_lens is not None else None
        runs.append(simulate_instance([out_lens[i] for i in idx], profiles[j], plan.batch_caps[j], pl, t0))
    return runs
