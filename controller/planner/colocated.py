"""Colocated generation, measured the way the runtime runs it (a planner host profile).

In colocated mode two generation instances live in two worker processes on the same host and
generate at the same time, each streaming its finished samples over RPC to the trainer DP
rank that owns the sample's group (``outbox.route``, mod 2: half to its own process, half to the
other). ``measure_colocated_generation`` runs exactly that path -- three local processes (a
driver in the controller's place and two workers), torch RPC over the runtime's options, a
``controller.instance.GenerationInstance`` per worker whose Outbox sends to a sample sink
registered as the process's trainer role (``controller.trainer_address.receive_samples``) -- on
synthetic iterations of a workload's shapes (random prompt ids, forced lengths), each split
round-robin over the two instances as the bench's dispatcher does.

Per iteration it times, interleaved (A/B, so both see the same outside load):
  together  both instances generate their halves at once (the colocated case);
  alone     each instance generates its half while the other process idles.
Driver-side seconds (launch over RPC -> both reports back), plus each generate thread's
scheduler accounting (``/proc/self/task/<tid>/schedstat``: seconds on a CPU and seconds
runnable but waiting for one), which is what tells CPU contention (run-queue wait) from GIL
or I/O blocking (neither on a CPU nor runnable).

Returned terms: ``alone_s`` / ``together_s`` per iteration, ``slowdown`` (median per-iteration
together / alone: what an instance loses to the other instance generating on the same cores)
and the thread accounting of both cases.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from controller.planner.host import synthetic_requests
from controller.planner.profile import from_json, load_json, save_json
from workers.types import Request

WORKERS = ("worker1", "worker2")


@dataclass
class ColocatedGenProfile:
    """Measured colocated generation on one host (``measure_colocated_generation``): driver
    seconds per synthetic iteration with each instance's half alone and with both at once,
    ``slowdown`` = median per-iteration together / alone (the simulator's
    ``SimConfig.gen_colocated_slowdown``), and the generate threads' scheduler accounting
    (``thread_shares``) in both cases. Saved as JSON and reused like the stage profiles."""

    alone_s: list[float]
    together_s: list[float]
    slowdown: float
    alone_threads: dict[str, float] = field(default_factory=dict)
    together_threads: dict[str, float] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.alone_s or len(self.alone_s) != len(self.together_s):
            raise ValueError(f"ColocatedGenProfile: alone_s ({len(self.alone_s)}) and together_s "
                             f"({len(self.together_s)}) must be non-empty and of one length")
        if not self.slowdown > 0:
            raise ValueError(f"ColocatedGenProfile: slowdown must be > 0, got {self.slowdown}")

    def save(self, path: str | os.PathLike) -> None:
        save_json(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ColocatedGenProfile":
        return from_json(cls, load_json(path, "ColocatedGenProfile", ("alone_s", "together_s", "slowdown")), str(path))


def schedstat() -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting) of the calling thread; zeros off Linux."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            on_cpu, waiting, _ = f.read().split()
        return int(on_cpu) / 1e9, int(waiting) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


class _SampleSink:
    """Stands in for the TrainerRank of a colocated worker: takes the samples the instances
    stream (the RPC's receive path: unpickling on an RPC thread, the bookkeeping under a lock)."""

    def __init__(self):
        self.samples = 0
        self.lock = threading.Lock()

    def receive(self, samples) -> int:
        with self.lock:
            self.samples += len(samples)
        return len(samples)


def _generate(iteration: int, requests: list[Request]) -> dict[str, float]:
    """Worker side (RPC target): run this process's instance on ``requests``."""
    from controller.process_state import LOCAL

    inst = LOCAL.roles["generation"]
    c0, q0 = schedstat()
    t0 = time.perf_counter()
    inst.generate(iteration, requests, inst.version)
    wall = time.perf_counter() - t0
    c1, q1 = schedstat()
    return {"wall_s": wall, "cpu_s": c1 - c0, "runq_s": q1 - q0}


def _received() -> int:
    from controller.process_state import LOCAL

    return LOCAL.roles["trainer"].samples


def _rank(rank: int, world_size: int, engine_cfg, model_dir: str, batches, window_s: float, vocab: int,
          seed: int) -> dict | None:
    import torch.distributed as dist
    import torch.distributed.rpc as rpc

    from controller.instance import GenerationInstance
    from controller.processes import rpc_options
    from controller.process_state import LOCAL
    from controller.rpc import worker_name
    from controller.trainer_address import TrainerAddress
    from workers.weight_sync.localrun import free_port

    torch.set_num_threads(1)
    port = [free_port() if rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    if rank > 0:  # as controller/world.build_world places them: a trainer role and an instance per worker
        LOCAL.roles["trainer"] = _SampleSink()
        inst = GenerationInstance(rank, engine_cfg, model_dir, stream_window_s=window_s)
        inst.connect([TrainerAddress(w) for w in WORKERS])
    rpc.init_rpc(worker_name(rank), rank=rank, world_size=world_size,
                 rpc_backend_options=rpc_options(300, f"tcp://127.0.0.1:{port[0]}"))
    out = None
    if rank == 0:
        out = _drive(batches, vocab, seed)
    rpc.shutdown()
    return out


def _drive(batches, vocab: int, seed: int) -> dict:
    """The driver (controller's place): per iteration, both instances together and each alone."""
    import torch.distributed.rpc as rpc

    gen = torch.Generator().manual_seed(seed)
    next_id = [70_000_000]

    def halves(out_lens, prompt_lens) -> list[list[Request]]:
        reqs = synthetic_requests(out_lens, prompt_lens, gen, next_id, vocab, group_size=2)
        return [reqs[0::2], reqs[1::2]]  # round-robin over the two instances

    def together(it: int, b) -> tuple[float, list[dict]]:
        parts = halves(*b)
        t0 = time.perf_counter()
        futs = [rpc.rpc_async(w, _generate, args=(it, part)) for w, part in zip(WORKERS, parts)]
        reps = [f.wait() for f in futs]
        return time.perf_counter() - t0, reps

    def alone(it: int, b) -> tuple[float, list[dict]]:
        walls, reps = [], []
        for w, part in zip(WORKERS, halves(*b)):
            t0 = time.perf_counter()
            reps.append(rpc.rpc_sync(w, _generate, args=(it, part)))
            walls.append(time.perf_counter() - t0)
        return max(walls), reps

    together(0, batches[0])  # warm-up: connections, first-touch allocations
    alone(0, batches[0])
    res = {"alone_s": [], "together_s": [], "alone_threads": [], "together_threads": []}
    for k, b in enumerate(batches):
        order = (("alone", alone), ("together", together)) if k % 2 == 0 else (("together", together), ("alone", alone))
        for name, fn in order:
            wall, reps = fn(k + 1, b)
            res[f"{name}_s"].append(wall)
            res[f"{name}_threads"].append(reps)
    want = sum(len(b[0]) for b in batches) * 2 + 2 * len(batches[0][0])
    got = sum(rpc.rpc_sync(w, _received) for w in WORKERS)
    if got != want:
        raise RuntimeError(f"measure_colocated_generation: the trainers' sinks got {got} samples, expected {want}")
    return res


def thread_shares(reports: list[list[dict]]) -> dict[str, float]:
    """Summed generate-thread accounting over iterations: seconds on a CPU, waiting in the run
    queue, and blocked (neither: GIL, I/O), and the run-queue share of the wall."""
    wall = sum(r["wall_s"] for rs in reports for r in rs)
    cpu = sum(r["cpu_s"] for rs in reports for r in rs)
    runq = sum(r["runq_s"] for rs in reports for r in rs)
    return {"wall_s": wall, "cpu_s": cpu, "runq_s": runq, "blocked_s": max(0.0, wall - cpu - runq),
            "runq_share": runq / wall if wall > 0 else 0.0}


def measure_colocated_generation(engine_cfg, model_dir: str, batches: list[tuple[list[int], list[int]]],
                                 window_s: float = 0.02, vocab: int = 300, seed: int = 0) -> ColocatedGenProfile:
    """Two colocated instances on this host through the runtime's generate + RPC path (see the
    module docstring). ``batches``: (forced output lengths, prompt lengths) per synthetic
    iteration, split round-robin over the instances. Returns a ``ColocatedGenProfile``:
    ``alone_s``, ``together_s`` (driver seconds per iteration: the slower instance's half alone
    / both halves at once), ``slowdown`` (median of together / alone), ``alone_threads`` /
    ``together_threads`` (``thread_shares``)."""
    from workers.weight_sync.localrun import run_local

    if not batches:
        raise ValueError("measure_colocated_generation: no batches")
    if any(len(o) < 2 or len(o) != len(p) for o, p in batches):
        raise ValueError("measure_colocated_generation: every batch needs >= 2 requests and one prompt length each")
    from controller.planner.host import model_vocab

    res = run_local(3, _rank, engine_cfg, model_dir, batches, window_s, min(vocab, model_vocab(model_dir)), seed)[0]
    ratios = [t / a for a, t in zip(res["alone_s"], res["together_s"])]
    return ColocatedGenProfile(res["alone_s"], res["together_s"], float(np.median(ratios)),
                               thread_shares(res["alone_threads"]), thread_shares(res["together_threads"]),
                               {"batches": len(batches), "window_s": window_s, "source": "measured"})


# ---- colocated training: two DP ranks training at once, as the runtime's colocated ranks ----
def _train_rank(rank: int, world_size: int, trainer_args: tuple, tokens: int, iterations: int) -> dict:
    import torch.distributed as dist

    from controller.planner.host import make_train_tokens

    train = make_train_tokens(*trainer_args, rank=rank, world_size=world_size)
    train(tokens)  # warm-up
    out = []
    for _ in range(iterations):
        dist.barrier()  # both ranks start together, as both start once their samples are in
        c0, q0 = schedstat()
        t0 = time.perf_counter()
        train(tokens)  # begin, receive (reward, reference log-probs, micro-batches), step (all-reduce)
        wall = time.perf_counter() - t0
        c1, q1 = schedstat()
        out.append({"wall_s": wall, "cpu_s": c1 - c0, "runq_s": q1 - q0})
    return {"reports": out}


def measure_colocated_training(trainer_cfg, model_dir: str, task_name: str, task_kwargs: dict, out_lens: list[int],
                               prompt_lens: list[int], group_size: int, tokens: int, iterations: int = 5) -> dict:
    """Two trainer DP ranks in two local processes (gloo, the trainer's own all-reduce), each
    training ``tokens`` tokens of workload-shaped samples per iteration at the same time (the
    colocated ranks after generation). Returns ``together_s`` (per iteration, the slower rank's
    seconds for begin + receive + step) and ``threads`` (``thread_shares`` of the two ranks)."""
    from workers.weight_sync.localrun import run_local

    if iterations < 1 or tokens < 1:
        raise ValueError(f"measure_colocated_training: iterations and tokens must be >= 1, got {iterations}, {tokens}")
    args = (trainer_cfg, model_dir, task_name, task_kwargs, list(out_lens), list(prompt_lens), group_size)
    res = run_local(2, _train_rank, args, tokens, iterations)
    per_it = [[r["reports"][k] for r in res] for k in range(iterations)]
    return {"together_s": [max(x["wall_s"] for x in its) for its in per_it], "threads": thread_shares(per_it)}
