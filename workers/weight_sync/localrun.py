"""Run a function on N local processes joined in one gloo group over loopback (tests and
bench/weight_sync.py; the real system uses torchrun + the controller instead).

``run_local(world_size, fn, *args)`` starts ranks 0..N-1 (torch.multiprocessing, forkserver),
each calls ``init_process_group("gloo")`` on a free loopback port, runs
``fn(rank, world_size, *args)`` and returns its (picklable) result; the parent returns the
list of results by rank, or raises naming the rank that failed.
"""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, out_dir: str, threads: int,
           fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    result: Any
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=120))
        try:
            result = ("ok", fn(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - shipped to the parent with the traceback
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_local(world_size: int, fn: Callable[..., Any], *args: Any, threads: int = 1,
              start_method: str = "forkserver", missing_ok: bool = False) -> list[Any]:
    """Start ``world_size`` gloo ranks running ``fn(rank, world_size, *args)``; results by rank.
    ``fn`` must be importable (a module-level function). "forkserver" (default) starts one
    clean server process that imports torch once and forks the ranks from it (importing
    torch in every rank costs seconds of CPU each); "spawn" starts each rank from scratch.
    ``missing_ok``: a rank that exited without a result (a test killing one on purpose with
    ``os._exit(0)``) gives None instead of an error."""
    if start_method == "forkserver":
        mp.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed", __name__])
    with tempfile.TemporaryDirectory(prefix="weight_sync_") as out_dir:
        mp.start_processes(_entry, args=(world_size, free_port(), out_dir, threads, fn, args),
                           nprocs=world_size, join=True, start_method=start_method)
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                if missing_ok:
                    results.append(None)
                    continue
                raise RuntimeError(f"run_local: rank {rank} wrote no result")
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise RuntimeError(f"run_local: rank {rank} failed:\n{value}")
            results.append(value)
    return results
