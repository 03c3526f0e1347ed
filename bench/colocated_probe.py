"""Where generation time goes inside the runtime, per pipeline mode (a diagnostic for the planner).

    python bench/colocated_probe.py [--modes colocated,batch] [--repeat 2] [--iterations 8]

Runs bench/pipeline_modes.py's controller (same workload, same ranks) with the runtime's
``GenerationInstance.generate`` and ``TrainerRank.receive`` wrapped in every worker process:
per generate call, the generate thread's wall, CPU and run-queue seconds
(``/proc/self/task/<tid>/schedstat``; blocked = wall - CPU - run queue: GIL, I/O, locks), the
engine steps and their mean batch size, the CPU every other thread of the process used
meanwhile (RPC/TensorPipe, the Outbox, the trainer's consumer), and the trainer-side receive
calls that landed in that process meanwhile. Prints one JSON line per (mode, round, worker rank)
(``probe: true``, ``mode``, ``round`` from 0, ``rank``): means per measured iteration (the
warm-up iteration is left out).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import pipeline_modes as pm  # noqa: E402

from controller.planner.colocated import schedstat  # noqa: E402
from jsonline import json_line  # noqa: E402

RECORDS: list[dict] = []
RECV = {"calls": 0, "samples": 0, "cpu_s": 0.0}


def _threads() -> dict[int, tuple[str, float]]:
    """tid -> (thread name, CPU seconds) of every thread of this process."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                cpu = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError):
            continue
        out[int(tid)] = (names.get(int(tid), comm), cpu)
    return out


def _wrap() -> None:
    from controller import instance, trainer_rank

    gen0, recv0 = instance.GenerationInstance.generate, trainer_rank.TrainerRank.receive

    def generate(self, iteration, requests, weight_version, batch_cap=0, window_s=None):
        eng, step0 = self.engine, self.engine.step
        st = {"steps": 0, "batch": 0}

        def step():
            st["batch"] += eng.stats().running
            st["steps"] += 1
            return step0()

        eng.step = step
        tid, before, r0 = threading.get_native_id(), _threads(), dict(RECV)
        c0, q0 = schedstat()
        t0 = time.perf_counter()
        try:
            return gen0(self, iteration, requests, weight_version, batch_cap, window_s)
        finally:
            wall = time.perf_counter() - t0
            c1, q1 = schedstat()
            eng.step = step0
            others: dict[str, float] = {}
            for k, (name, cpu) in _threads().items():
                if k != tid:
                    name = "Dummy" if name.startswith("Dummy-") else name  # RPC-created Python threads
                    others[name] = others.get(name, 0.0) + cpu - before.get(k, (name, 0.0))[1]
            RECORDS.append({"rank": self.rank, "iteration": iteration, "wall_s": wall, "cpu_s": c1 - c0,
                            "runq_s": q1 - q0, "blocked_s": wall - (c1 - c0) - (q1 - q0), **st,
                            "others_cpu_s": others, "recv": {k: RECV[k] - r0[k] for k in RECV}})

    def receive(self, samples):
        c0 = time.thread_time()
        try:
            return recv0(self, samples)
        finally:
            RECV["calls"] += 1
            RECV["samples"] += len(samples)
            RECV["cpu_s"] += time.thread_time() - c0

    instance.GenerationInstance.generate = generate
    trainer_rank.TrainerRank.receive = receive


def drain() -> list[dict]:
    out = list(RECORDS)
    RECORDS.clear()
    return out


def summarize(mode: str, recs: list[dict]) -> list[dict]:
    """Means per measured iteration, per worker rank (the first iteration is the warm-up)."""
    first = min(r["iteration"] for r in recs)
    out = []
    for rank in sorted({r["rank"] for r in recs}):
        rs = [r for r in recs if r["rank"] == rank and r["iteration"] > first]
        n = len(rs)
        mean = lambda k: round(sum(r[k] for r in rs) / n, 4)  # noqa: E731
        steps = sum(r["steps"] for r in rs)
        others: dict[str, float] = {}
        for r in rs:
            for k, v in r["others_cpu_s"].items():
                others[k] = others.get(k, 0.0) + v / n
        out.append({"mode": mode, "rank": rank, "iterations": n, "wall_s": mean("wall_s"), "cpu_s": mean("cpu_s"),
                    "runq_s": mean("runq_s"), "blocked_s": mean("blocked_s"), "steps": round(steps / n, 1),
                    "mean_batch": round(sum(r["batch"] for r in rs) / max(steps, 1), 1),
                    "cpu_ms_per_step": round(1e3 * sum(r["cpu_s"] for r in rs) / max(steps, 1), 3),
                    "others_cpu_s": {k: round(v, 4) for k, v in sorted(others.items(), key=lambda kv: -kv[1])
                                     if v >= 5e-4},
                    "receive": {k: round(sum(r["recv"][k] for r in rs) / n, 4) for k in RECV}})
    return out


_wrap()
_run_mode = pm.run_mode
ROUNDS: dict[str, int] = {}  # mode -> rounds run: pipeline_modes runs each mode once a round


def run_mode(cfg, mode, a, *args):
    import torch.distributed.rpc as rpc

    for r in (1, 2):
        rpc.rpc_sync(f"worker{r}", drain)
    row = _run_mode(cfg, mode, a, *args)
    recs = [x for r in (1, 2) for x in rpc.rpc_sync(f"worker{r}", drain)]
    rnd = ROUNDS[mode] = ROUNDS.get(mode, -1) + 1  # 0-based, as pipeline_modes' own round lines
    for line in summarize(mode, recs):
        print(json_line({"probe": True, "round": rnd, **line}), flush=True)
    return row


pm.run_mode = run_mode  # pipeline_modes.controller looks it up at call time


def parse_args(argv=None):
    """pipeline_modes' flags (the same workload and ranks), with this probe's description."""
    return pm.parse_args(argv, description=__doc__.split("\n\n")[0])


def main() -> int:
    a = parse_args()
    if not a.worker:  # launcher: our own torchrun job, this file on every rank
        import socket
        import subprocess

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port", str(port),
               __file__, "--worker", *sys.argv[1:]]
        return subprocess.call(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    import torch

    from controller.processes import run_rank

    torch.set_num_threads(1)
    return run_rank(lambda: pm.controller(a), 600.0)


if __name__ == "__main__":
    sys.exit(main())
