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

import multiprocessing as mp
import os
import socket
import time
from typing import Callable

import torch

from workers.types import Request, SamplingParams, Sample


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- background workloads (run in a spawned process until ``stop`` is set) ----------------
def _paused(gate) -> bool:
    """Background side of the A/B gate: while ``gate.go`` is clear, say so and wait."""
    if gate["go"].is_set():
        return False
    gate["idle"].set()
    gate["go"].wait(timeout=0.05)
    return True


def engine_load(engine_cfg, model_dir: str, batch_size: int, gate) -> None:
    """Decode ``batch_size`` long sequences over and over (generation's CPU demand)."""
    from workers.generation.factory import make_engine

    torch.set_num_threads(1)
    engine = make_engine(engine_cfg, model_dir)
    next_id = 0
    gate["ready"].set()
    while not gate["stop"].is_set():
        if _paused(gate):
            continue
        if not engine.has_work():
            reqs = [Request(next_id + i, torch.randint(3, 100, (16,)), 96, 96,
                            sampling=SamplingParams(temperature=1.0, seed=i)) for i in range(batch_size)]
            next_id += batch_size
            engine.add(reqs)
        engine.step()


def trainer_load(trainer_cfg, model_dir: str, task_name: str, task_kwargs: dict, out_lens: list[int],
                 prompt_lens: list[int], group_size: int, tokens: int, gate) -> None:
    """Train iterations of ``tokens`` tokens over and over (training's CPU demand)."""
    torch.set_num_threads(1)
    train = make_train_tokens(trainer_cfg, model_dir, task_name, task_kwargs, out_lens, prompt_lens, group_size)
    train(tokens)
    gate["ready"].set()
    while not gate["stop"].is_set():
        if not _paused(gate):
            train(tokens)


def make_train_tokens(trainer_cfg, model_dir: str, task_name: str, task_kwargs: dict, out_lens: list[int],
                      prompt_lens: list[int], group_size: int) -> Callable[[int], None]:
    """A callable ``train(T)``: one full TrainerWorker iteration (begin, receive, step) on
    length-forced samples shaped like the workload (its output and prompt lengths, cycled),
    about ``T`` tokens, whole GRPO groups."""
    from workers.tasks.registry import make_task
    from workers.trainer.worker import TrainerWorker

    task = make_task(task_name, **task_kwargs)
    worker = TrainerWorker(trainer_cfg, model_dir, task)
    items = list(task.prompts("train"))
    state = {"n": 100}

    def train(tokens: int) -> None:
        state["n"] += 1
        base = state["n"] * 10_000
        prompts, groups, samples = {}, {}, []
        k, used = 0, 0
        while used < tokens or k % group_size:
            j = k % len(out_lens)
            sid, gid = base + k, base + k // group_size
            prompts[sid] = items[(k // group_size) % len(items)]
            groups[gid] = group_size
            samples.append(Sample(sid, torch.randint(3, 300, (prompt_lens[j],)), torch.randint(3, 300, (out_lens[j],)),
                                  torch.full((out_lens[j],), -1.0), worker.version, "length", gid))
            used += out_lens[j] + prompt_lens[j]
            k += 1
        worker.begin_iteration(state["n"], prompts, groups)
        worker.receive(samples)
        worker.step()

    return train


def concurrent_slowdown(measure: Callable[[], float], background: Callable, args: tuple, rounds: int = 5
                        ) -> dict[str, float]:
    """Time ``measure()`` (returns seconds) alone and while ``background(*args, gate)`` runs in
    a spawned process, interleaved (alone, shared, alone, ...: the background is paused and
    resumed through ``gate``) so both see the same load from other tenants; the medians of
    ``rounds`` each. Returns {"alone_s", "shared_s", "slowdown"} (slowdown >= 1)."""
    ctx = mp.get_context("spawn")
    gate = {k: ctx.Event() for k in ("ready", "go", "idle", "stop")}
    gate["go"].set()
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
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
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
    a, b = sorted(alone)[len(alone) // 2], sorted(shared)[len(shared) // 2]
    return {"alone_s": a, "shared_s": b, "slowdown": max(1.0, b / a)}


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

    from controller.main import _rpc_options

    port = [_free_port() if rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=_rpc_options(60, f"tcp://127.0.0.1:{port[0]}"))
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
    runtime's RPC options. Returns {"sync_s", "rpc_rtt_s"}."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
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
    return {"sync_s": float(min(times)), "rpc_rtt_s": float(sorted(rtt)[len(rtt) // 2])}
