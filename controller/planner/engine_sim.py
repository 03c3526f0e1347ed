"""Event-level model of one generation instance running continuous batching.

Requests are admitted strictly in the plan's order (FCFS or LPT) while the batch is below
its cap and the KV cache has room: "lazy" (the native engine, vLLM) admits when the prompt
fits, grows sequences block by block and preempts the most recently admitted one when the
cache is full (it is recomputed later); "reserve" admits only whole sequences. Between two events (an admission or a completion) the batch size
is constant, so time advances by ``PTL(BS) * steps``: the cost is O(M log M) per instance,
not O(tokens). Used by the dispatcher benchmarks, the allocation planner and the cluster
simulator.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

from controller.ptl_profile import PTLProfile


@dataclass
class InstanceRun:
    """finish_s[k]: completion time of the k-th request of ``order`` (same indexing as the
    input); makespan_s: when the last one finished; batch_trace: (time, batch size) changes."""

    finish_s: list[float]
    start_s: list[float]
    makespan_s: float
    max_batch: int
    decode_steps: int = 0  # engine steps that decode (every running sequence gains a token)
    prefill_steps: int = 0  # admission rounds (one prefill step each)
    prefill_tokens: int = 0  # tokens prefilled, recomputation after preemption included
    preemptions: int = 0


def simulate_instance(out_lens: Sequence[int], profile: PTLProfile, cap: int,
                      prompt_lens: Sequence[int] | None = None, t0: float = 0.0, alloc: str = "lazy") -> InstanceRun:
    """Simulate one instance admitting requests in the given order.

    out_lens[k]: output tokens of request k (k = admission order); prompt_lens[k] its prompt.
    cap: max batch size. alloc "lazy" models the native engine and vLLM (blocks allocated
    as sequences grow; when the cache is full the most recently admitted sequence is
    preempted and recomputed later); "reserve" admits a request only when its whole
    sequence fits (no preemption)."""
    if alloc not in ALLOCS:
        raise ValueError(f"simulate_instance: alloc {alloc!r} is not one of {sorted(ALLOCS)}")
    m = len(out_lens)
    prompts = list(prompt_lens) if prompt_lens is not None else [0] * m
    if len(prompts) != m:
        raise ValueError(f"simulate_instance: {len(prompts)} prompt_lens for {m} requests")
    cap = max(1, min(cap, profile.max_batch_size) if profile.max_batch_size else cap)
    for k in range(m):
        need = profile.seq_kv_tokens(prompts[k] + out_lens[k])
        if need > profile.kv_tokens:
            raise ValueError(f"simulate_instance: request {k} needs {need} KV tokens, "
                             f"the instance has {profile.kv_tokens}")
    return ALLOCS[alloc]([max(1, int(x)) for x in out_lens], prompts, profile, cap, t0)


def _reserve(out_lens, prompts, profile: PTLProfile, cap: int, t0: float) -> InstanceRun:
    m = len(out_lens)
    need = [profile.seq_kv_tokens(prompts[k] + out_lens[k]) for k in range(m)]
    finish, start = [0.0] * m, [0.0] * m
    running: list[tuple[int, int]] = []  # heap of (finish step, k)
    since = [0] * m
    t, step, nxt, free, peak, cached = t0, 0, 0, profile.kv_tokens, 0, 0.0
    prefills, prefilled = 0, 0
    g = 1 if profile.prefill_step_s > 0 else 0  # a measured prefill step yields a token (see _lazy)

    def complete() -> None:
        nonlocal free, cached
        while running and running[0][0] <= step:
            _, k = heapq.heappop(running)
            finish[k] = t
            free += need[k]
            cached -= prompts[k] + step - since[k]

    while nxt < m or running:
        admitted, nxt_before = 0, nxt
        while nxt < m and len(running) < cap and need[nxt] <= free:
            free -= need[nxt]
            admitted += prompts[nxt]
            cached += prompts[nxt] + g
            start[nxt], since[nxt] = t, step - g
            heapq.heappush(running, (since[nxt] + out_lens[nxt], nxt))
            nxt += 1
        if nxt_before != nxt:
            t += profile.prefill_step_s + profile.prefill_s_per_token * admitted
            prefills, prefilled = prefills + 1, prefilled + admitted
            in_batch = len(running)
            complete()
            # a 1-token request finishes in its prefill step; the engine refills its slot
            # (admits first whenever it can) before the next decode step
            if not running or (len(running) < in_batch and nxt < m):
                continue
        bs = len(running)
        peak = max(peak, bs)
        n = running[0][0] - step
        t += n * profile.step_time(bs, cached + bs * (n - 1) / 2.0)  # cache grows linearly
        step += n
        cached += bs * n
        complete()
    return InstanceRun(finish, start, max(finish, default=t0), peak, step, prefills, prefilled, 0)


def _lazy(out_lens, prompts, profile: PTLProfile, cap: int, t0: float) -> InstanceRun:
    """Tokens are tracked exactly, blocks as tokens + half a block of rounding per sequence.
    Between events (a completion, the cache filling up, an admission) the batch and the
    growth rate are constant, so time jumps by PTL(BS) * steps. A request is admitted when
    its cached tokens fit with one step of growth left for every running sequence. A measured
    prefill step (``prefill_step_s`` > 0) also produces each admitted sequence's next token,
    as the engine's does; an unmeasured (free) one produces none, so analytic profiles keep
    the paper's PTL(BS) * L."""
    m, half = len(out_lens), profile.block_size / 2.0
    g = 1 if profile.prefill_step_s > 0 else 0  # tokens a prefill step produces per sequence
    finish, start = [0.0] * m, [-1.0] * m
    cached = list(prompts)  # tokens a request brings into the cache when (re)admitted
    left = list(out_lens)  # output tokens still to produce
    epoch = [0] * m  # bumps on preemption: older heap entries are stale
    waiting = list(range(m - 1, -1, -1))  # stack: admission order; preempted go back on top
    running: list[int] = []  # admission order (last = first preempted)
    since = [0] * m  # step of the latest admission
    heap: list[tuple[int, int, int]] = []  # (finish step, k, epoch)
    t, step, used, peak = t0, 0, 0.0, 0
    prefills, prefilled, preempted = 0, 0, 0
    cap_tokens = float(profile.kv_tokens)
    while waiting or running:
        admitted, n_admitted = 0, 0
        while waiting and len(running) < cap:
            k = waiting[-1]
            need = cached[k] + half
            if running and used + need > cap_tokens - (len(running) + 1):
                break
            waiting.pop()
            if start[k] < 0:
                start[k] = t
            used += need + g
            admitted += cached[k]
            n_admitted += 1
            running.append(k)
            since[k] = step - g
            heapq.heappush(heap, (since[k] + left[k], k, epoch[k]))
        if n_admitted:
            t += profile.prefill_step_s + profile.prefill_s_per_token * admitted
            prefills, prefilled = prefills + 1, prefilled + admitted
            in_batch = len(running)
            used -= _complete(heap, epoch, step, t, finish, running, cached, since, half)
            # as in _reserve: a slot freed by a 1-token request is refilled before decoding
            if not running or (len(running) < in_batch and waiting):
                continue
        bs = len(running)
        peak = max(peak, bs)
        while heap[0][2] != epoch[heap[0][1]]:
            heapq.heappop(heap)
        room = int((cap_tokens - used) // bs)
        if room <= 0 and bs > 1:  # cache full: preempt the most recently admitted sequence
            k = running.pop()
            done = step - since[k]
            used -= cached[k] + half + done
            cached[k] += done
            left[k] -= done
            epoch[k] += 1
            preempted += 1
            waiting.append(k)
            continue
        n_steps = heap[0][0] - step if bs == 1 else max(1, min(heap[0][0] - step, room))
        t += n_steps * profile.step_time(bs, used - bs * half + bs * (n_steps - 1) / 2.0)
        step += n_steps
        used += bs * n_steps
        used -= _complete(heap, epoch, step, t, finish, running, cached, since, half)
    return InstanceRun(finish, [max(0.0, x) for x in start], max(finish, default=t0), peak,
                       step, prefills, prefilled, preempted)


def _complete(heap, epoch, step, t, finish, running, cached, since, half) -> float:
    """Finish every running sequence whose last token is due by ``step``; returns the KV
    tokens they free."""
    freed = 0.0
    while heap and heap[0][0] <= step:
        _, k, e = heapq.heappop(heap)
        if e != epoch[k]:
            continue
        finish[k] = t
        running.remove(k)
        freed += cached[k] + half + (step - since[k])
    return freed


ALLOCS = {"lazy": _lazy, "reserve": _reserve}


def simulate_plan(plan, out_lens: Sequence[int], profiles: list[PTLProfile],
                  prompt_lens: Sequence[int] | None = None, t0: float = 0.0, alloc: str = "lazy") -> list[InstanceRun]:
    """Run every instance of a DispatchPlan on its own (true lengths); list per instance."""
    runs = []
    for j, idx in enumerate(plan.per_instance):
        pl = [prompt_lens[i] for i in idx] if prompt_lens is not None else None
        runs.append(simulate_instance([out_lens[i] for i in idx], profiles[j], plan.batch_caps[j], pl, t0, alloc))
    return runs
