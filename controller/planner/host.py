"""Host-level profile terms measured on this machine (the "shared host" case of the planner).

The stage profiles (``profile.py``) are timed with the stage alone. When generation and
training share a host's cores (this repo's single-machine runs), a stage runs slower while
the other computes; ``concurrent_slowdown`` measures that factor by timing a stage with and
without a background process doing the other stage's work. The simulator applies it only
where stages overlap in time (``SimConfig.gen_shared_slowdown`` / ``train_shared_slowdown``).
``measure_weight_sync`` times the runtime's weight-sync executor between two local
processes (gloo), instead of assuming a bandwidth.

Background workloads are module-level functions so a spawned process can import them.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from workers.env import env_var
from workers.types import Request, SamplingParams, Sample
from workers.weight_sync.localrun import free_port


# ---- background workloads (run in a spawned process until ``stop`` is set) ----------------
def _paused(gate) -> bool:
    """Background side of the A/B gate: while ``gate.go`` is clear, say so and wait."""
    if gate["go"].is_set():
        return False
    gate["idle"].set()
    gate["go"].wait(timeout=0.05)
    return True


def trainer_load(trainer_cfg, model_dir: str, task_name: str, task_kwargs: dict, out_lens: list[int],
                 prompt_lens: list[int], group_size: int, tokens: int, gate) -> None:
    """Train iterations of ``tokens`` tokens over and over (training's CPU demand)."""
    torch.set_num_threads(1)
    train = make_train_tokens(trainer_cfg, model_dir, task_name, task_kwargs, out_lens, prompt_lens, group_size)
    serve(gate, lambda: train(tokens))


def serve(gate, work: Callable[[], object]) -> None:
    """Background side of ``concurrent_slowdown``: ``work()`` once (warm-up), then ready, then
    ``work()`` over and over while the gate says go, until ``stop``."""
    work()
    gate["ready"].set()
    while not gate["stop"].is_set():
        if not _paused(gate):
            work()


def synthetic_requests(out_lens: list[int], prompt_lens: list[int], gen: torch.Generator, next_id: list[int],
                       vocab: int = 300, group_size: int = 0) -> list[Request]:
    """Length-forced requests of these shapes: random prompt ids in [3, vocab), ids counted up
    from ``next_id[0]`` (advanced in place), groups of ``group_size`` consecutive ids (0: none)."""
    out = []
    for n, p in zip(out_lens, prompt_lens):
        next_id[0] += 1
        out.append(Request(next_id[0], torch.randint(3, vocab, (int(p),), generator=gen), int(n), int(n),
                           group_id=next_id[0] // group_size if group_size else -1,
                           sampling=SamplingParams(temperature=1.0, seed=next_id[0])))
    return out


def make_train_tokens(trainer_cfg, model_dir: str, task_name: str, task_kwargs: dict, out_lens: list[int],
                      prompt_lens: list[int], group_size: int, rank: int = 0, world_size: int = 1,
                      max_batch: int = 0) -> Callable[[int], None]:
    """A callable ``train(T, handovers=1)``: one full TrainerWorker iteration (begin, receive,
    step) on length-forced samples shaped like the workload (its output and prompt lengths,
    cycled), about ``T`` tokens, whole GRPO groups, handed over in the order one generation
    instance (continuous batching, ``max_batch`` running, 0: all) finishes them, as the
    runtime's trainer rank receives them: micro-batches are cut in arrival order, so the order
    sets each micro-batch's longest sequence and the padded attention's cost (workload order
    was 13% slower than finish order on the bench's iteration). ``handovers > 1``: that order
    over that many ``receive`` calls, as a streaming trainer rank gets it. ``world_size > 1``:
    DP rank ``rank`` of the default process group (its step all-reduces with the other ranks,
    which must call too)."""
    from workers.tasks.registry import make_task
    from workers.trainer.worker import TrainerWorker

    if trainer_cfg.algorithm == "remax":  # the samples here have no greedy baseline; what trains costs as grpo's
        trainer_cfg = dataclasses.replace(trainer_cfg, algorithm="grpo")
    task = make_task(task_name, **task_kwargs)
    worker = TrainerWorker(trainer_cfg, model_dir, task, rank=rank, world_size=world_size,
                           build_task=functools.partial(make_task, task_name, **task_kwargs))
    items = list(task.prompts("train"))
    state = {"n": 100}
    vocab = min(300, worker.actor.config.vocab_size)  # random token ids the model can embed
    orders: dict[int, list[int]] = {}  # tokens -> finish order (the lengths depend on tokens only)

    def train(tokens: int, handovers: int = 1) -> None:
        state["n"] += 1
        base = state["n"] * 10_000
        prompts, groups, samples = {}, {}, []
        k, used = 0, 0
        while used < tokens or k % group_size:
            j = k % len(out_lens)
            sid, gid = base + k, base + k // group_size
            prompts[sid] = items[(k // group_size) % len(items)]
            groups[gid] = group_size
            samples.append(Sample(sid, torch.randint(3, vocab, (prompt_lens[j],)), torch.randint(3, vocab, (out_lens[j],)),
                                  torch.full((out_lens[j],), -1.0), worker.version, "length", gid))
            used += out_lens[j] + prompt_lens[j]
            k += 1
        if tokens not in orders:  # once per size: the runtime's trainer does not simulate an instance
            orders[tokens] = finish_order([len(s.output_ids) for s in samples],
                                          [len(s.prompt_ids) for s in samples], max_batch)
        samples = [samples[i] for i in orders[tokens]]
        worker.begin_iteration(state["n"], prompts, groups)
        for part in np.array_split(np.arange(len(samples)), max(1, handovers)):
            worker.receive([samples[i] for i in part])
        worker.step()

    return train


def finish_order(out_lens: list[int], prompt_lens: list[int], max_batch: int = 0) -> list[int]:
    """Indices of length-forced requests in the order one continuous-batching instance
    finishes them, admitted in the given order with at most ``max_batch`` running (0: all):
    step counts only (engine_sim on a flat PTL profile), ties kept in admission order."""
    from controller.planner.engine_sim import simulate_instance
    from controller.scheduling import PTLProfile

    n = len(out_lens)
    flat = PTLProfile([1], [1.0], kv_tokens=1 << 40)  # memory never binds: the order of steps only
    done = simulate_instance(out_lens, flat, max_batch or max(1, n), prompt_lens).finish_s
    return sorted(range(n), key=lambda i: (done[i], i))


def train_handover_s(train_tokens: Callable[..., None], total: int, microbatch_tokens: int, rounds: int = 5
                     ) -> float:
    """The trainer's fixed cost per hand-over (one ``TrainerWorker.receive`` call), for
    ``make_train_tokens``' callable: the same iteration's samples in one receive vs in
    micro-batch-sized receives (a streaming rank's hand-overs), both in the instance's finish
    order, interleaved; median of the per-round (chunked - one) / (extra receives)."""
    k = max(2, round(total / microbatch_tokens))
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        train_tokens(total)
        t1 = time.perf_counter()
        train_tokens(total, handovers=k)
        per.append(((time.perf_counter() - t1) - (t1 - t0)) / (k - 1))
    return max(0.0, float(np.median(per)))


def concurrent_slowdown(measure: Callable[[], float], background: Callable, args: tuple, rounds: int = 5
                        ) -> dict[str, float]:
    """Time ``measure()`` (returns seconds) alone and while ``background(*args, gate)`` runs in
    a spawned process, interleaved (alone, shared, alone, ...: the background is paused and
    resumed through ``gate``) so both see the same load from other tenants; the medians of
    ``rounds`` each. Returns {"alone_s", "shared_s", "slowdown"}: the median of the per-round
    shared / alone ratios (>= 1)."""
    ctx = mp.get_context("spawn")
    gate = {k: ctx.Event() for k in ("ready", "go", "idle", "stop")}
    gate["go"].set()
    with env_var("OMP_NUM_THREADS", "1"):  # the background process runs on one thread
        proc = ctx.Process(target=background, args=(*args, gate), daemon=True)
        proc.start()
        alone, shared = [], []
        try:
            if not gate["ready"].wait(timeout=300):
                raise RuntimeError("concurrent_slowdown: the background workload never started")
            for _ in range(rounds):
                gate["idle"].clear()
                gate["go"].clear()
                if not gate["idle"].wait(timeout=120):
                    raise RuntimeError("concurrent_slowdown: the background workload did not pause")
                alone.append(measure())
                gate["go"].set()
                time.sleep(0.2)  # let it get going
                shared.append(measure())
        finally:
            gate["stop"].set()
            gate["go"].set()
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    a, b = sorted(alone)[len(alone) // 2], sorted(shared)[len(shared) // 2]
    ratios = sorted(y / x for x, y in zip(alone, shared))  # each pair saw the same outside load
    return {"alone_s": a, "shared_s": b, "slowdown": max(1.0, ratios[len(ratios) // 2])}


# ---- weight sync between two local processes ------------------------------------------------
def _sync_rank(rank: int, port: int, named: dict, bucket_bytes: int, repeats: int, out) -> None:
    import torch.distributed as dist

    from workers.weight_sync import Topology, WeightSyncReceiver, WeightSyncSender, plan_sync, tensor_spec

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    plan = plan_sync(Topology(), [0], [1], tensor_spec(named.items()), bucket_bytes)
    times = []
    for v in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            WeightSyncSender(plan, 0).push(list(named.items()), v)
        else:
            staged = WeightSyncReceiver(plan, 1).receive()
            if not staged.ok:
                raise RuntimeError(f"measure_weight_sync: receive failed: {staged.error}")
        dist.barrier()
        times.append(time.perf_counter() - t0)
    rtt = _rpc_round_trips(rank, 30)
    if rank == 0:
        out.put((times[1:], rtt))  # the first sync includes connection set-up
    dist.destroy_process_group()


def _rpc_round_trips(rank: int, n: int) -> list[float]:
    """Rank 0 times ``n`` empty RPCs to rank 1 over the runtime's RPC options (libuv)."""
    import torch.distributed as dist
    import torch.distributed.rpc as rpc

    from controller.processes import rpc_options

    port = [free_port() if rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=rpc_options(60, f"tcp://127.0.0.1:{port[0]}"))
    times = []
    if rank == 0:
        rpc.rpc_sync("w1", os.getpid)
        for _ in range(n):
            t0 = time.perf_counter()
            rpc.rpc_sync("w1", os.getpid)
            times.append(time.perf_counter() - t0)
    rpc.shutdown()
    return times


def measure_weight_sync(named: dict[str, torch.Tensor], bucket_bytes: int = 1 << 22, repeats: int = 5
                        ) -> dict[str, float]:
    """Between two local processes: seconds for the weight-sync executor to move ``named``
    over gloo (plan_sync + WeightSyncSender/Receiver, the runtime's tree path; the fastest
    of ``repeats`` after one warm-up), and the median round trip of an empty RPC over the
    runtime's RPC options. Returns {"sync_s", "rpc_rtt_s", "sync_runs_s"} (each timed sync)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_sync_rank, args=(r, port, named, bucket_bytes, repeats, out), daemon=True)
             for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        times, rtt = out.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return {"sync_s": float(min(times)), "rpc_rtt_s": float(sorted(rtt)[len(rtt) // 2]),
            "sync_runs_s": [float(t) for t in times]}


# ---- the runtime's generate path vs the bare engine loop ----------------------------------
class _Done:
    def wait(self) -> None:
        return None


class PickleReceiver:
    """Stands in for a trainer RRef: ``rpc_async().receive(samples)`` serializes the samples
    (the RPC's pickling, on the sending thread) and returns a completed future. ``received``
    maps each streamed sample id to its output length (``expect`` checks a batch arrived)."""

    def __init__(self):
        self.received: dict[int, int] = {}

    def rpc_async(self, timeout: float = -1.0) -> "PickleReceiver":
        return self

    def receive(self, samples: list[Sample]) -> _Done:
        import pickle

        pickle.dumps(samples)
        self.received.update((s.sample_id, len(s.output_ids)) for s in samples)
        return _Done()

    def expect(self, reqs: list[Request]) -> None:
        """Raise unless every request was streamed exactly at its forced length."""
        bad = [r.sample_id for r in reqs if self.received.get(r.sample_id) != r.max_tokens]
        if bad:
            raise RuntimeError(f"generate path: {len(bad)} of {len(reqs)} samples were not streamed at their "
                               f"forced length (first: sample {bad[0]}, got {self.received.get(bad[0])})")


def model_vocab(model_dir: str) -> int:
    """The vocabulary size in ``model_dir``'s config.json (random prompt ids must stay below it:
    an in-process BPE may learn fewer tokens than it was asked for)."""
    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


def runtime_generate_factor(engine_cfg, model_dir: str, batches: list[tuple[list[int], list[int]]],
                            window_s: float = 0.02, seed: int = 0, vocab: int = 300) -> dict:
    """Time factor of ``controller.instance.GenerationInstance.generate`` (engine steps + the
    Outbox thread streaming every finished sample, pickled as the RPC would) over the bare
    engine loop (``add``; ``step`` until done) on the same requests, in one process.

    batches: (forced output lengths, prompt lengths) per synthetic iteration; each is run both
    ways, alternating, after one warm-up of each; prompt ids are random in [3, vocab). Returns ``factor`` (summed runtime seconds /
    summed bare seconds) and the per-batch seconds."""
    from controller.instance import GenerationInstance

    if not batches:
        raise ValueError("runtime_generate_factor: no batches")
    gen = torch.Generator().manual_seed(seed)
    vocab = min(vocab, model_vocab(model_dir))
    inst = GenerationInstance(0, engine_cfg, model_dir, stream_window_s=window_s)
    sink = PickleReceiver()
    inst.trainers = [sink]
    next_id = [50_000_000]

    def bare(b) -> float:
        inst.engine.add(synthetic_requests(*b, gen, next_id, vocab))
        t0 = time.perf_counter()
        while inst.engine.has_work():
            inst.engine.step()
        return time.perf_counter() - t0

    def runtime(b) -> float:
        reqs = synthetic_requests(*b, gen, next_id, vocab)
        t0 = time.perf_counter()
        inst.generate(0, reqs, inst.version)
        dt = time.perf_counter() - t0
        sink.expect(reqs)
        return dt

    bare(batches[0])
    runtime(batches[0])
    bare_s, runtime_s = [], []
    for k, b in enumerate(batches):
        pair = (bare, runtime) if k % 2 == 0 else (runtime, bare)
        got = {fn: fn(b) for fn in pair}
        bare_s.append(got[bare])
        runtime_s.append(got[runtime])
    inst.close()
    return {"factor": sum(runtime_s) / sum(bare_s), "bare_s": bare_s, "runtime_s": runtime_s,
            "streamed": len(sink.received)}
