"""What a StreamRL process knows about itself (``LOCAL``: its rank, device, roles, process
groups, how it should exit) and the small functions the controller calls on it over RPC
(``request_exit``, ``ping``, ``thread_cpu``), with the timeouts the config reads its defaults
from. The RPC call machinery that uses them is ``controller/rpc.py``."""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import torch

# placement.rpc_timeout_s's default, said here (the config reads it from this module: importing
# the config from here would load it, and what it imports, into every process that uses RPC)
RPC_TIMEOUT_S = 300.0
COLLECTIVE_TIMEOUT_S = 3600.0  # placement.collective_timeout_s (subgroup)
# gloo adds a collective's timeout to a clock in int64 nanoseconds: 1e10 s overflowed and the first
# all-reduce timed out at once (review, s53); ~31 years is "never" enough
MAX_COLLECTIVE_TIMEOUT_S = 1e9


@dataclass
class Local:
    """What a process knows about itself; role objects look things up here."""

    rank: int = 0
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # where tensors sent over the process group live: the GPU under NCCL, host memory under gloo
    comm_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    has_process_group: bool = False
    # placement.rpc_timeout_s: also how long one weight-sync bucket may take (a peer stuck longer is
    # not coming: the push fails then, not after the executor's own 600 s default)
    rpc_timeout_s: float = RPC_TIMEOUT_S  # start_processes sets the job's (placement.rpc_timeout_s)
    exit_event: threading.Event = field(default_factory=threading.Event)
    exit_code: int = 0
    exit_reason: str = ""  # said on a joiner's own terminal when it was told to leave (runner.leave_job)
    run_folder: str = ""  # the controller's run folder once resolved (a forked --resume writes elsewhere)
    quiet_exit: bool = True  # leave RPC in lock-step with the other static ranks (controller.processes)
    outcome: int | None = None  # the controller's exit code once the run's end was said (a later signal keeps it)
    last_heard: float = 0.0  # time.monotonic() of the controller's last ping (controller.keepalive)
    left_because: str = ""  # why this worker left on its own (its job or controller gone), said on stderr
    roles: dict = field(default_factory=dict)  # "trainer" / "generation" -> object
    groups: dict = field(default_factory=dict)  # tuple(ranks) -> ProcessGroup


LOCAL = Local()


def request_exit(code: int = 0, quiet: bool = True) -> bool:
    """Called by the controller through RPC: the worker's main loop exits with ``code``.
    ``quiet``: take the lock-step graceful RPC exit (only when every static rank does and no
    RRef owner is gone; the controller decides)."""
    LOCAL.exit_code = code
    LOCAL.quiet_exit = quiet
    LOCAL.exit_event.set()
    return True


def ping() -> int:
    """Runs on a worker's RPC thread (the heartbeat, the keepalive): it answers while its other
    threads work, and tells the worker's watchdog the controller is there."""
    LOCAL.last_heard = time.monotonic()
    return os.getpid()


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) this process has used, per thread name (Python threads by
    their ``threading`` name, native ones -- RPC, TensorPipe, OpenMP -- by their OS name), plus
    ``"total"`` (the whole process, exited threads included). Linux ``/proc``; {} elsewhere.
    A native thread that has run Python code shows up in ``threading`` as "Dummy-N"; it keeps
    its OS name here, so two snapshots name it alike (their difference is its CPU between)."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate() if not isinstance(t, threading._DummyThread)}
    out: dict[str, float] = {}
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/self/task/{tid}/comm") as f:
                    comm = f.read().strip()
            except OSError:  # the thread ended meanwhile
                continue
            name = names.get(int(tid), comm)
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out["total"] = (int(fields[11]) + int(fields[12])) / tick
    except OSError:
        return {}
    return out


def subgroup(ranks: list[int], timeout_s: float):
    """Process group over ``ranks`` (global ranks), created by its members only; ``None`` for
    a single rank or when this process is outside the static world (joined later). Its
    collectives give up after ``timeout_s`` (the trainer ranks': ``placement.
    collective_timeout_s``). Not ``rpc_timeout_s``: a rank waits in the gradient all-reduce
    for a peer that is alive and behind (its reward function slower, its share of tokens
    larger), and with ``rpc_timeout_s`` the run died after 300 s, the error naming the rank
    that waited. A peer that froze or died is the heartbeat's to find (``rpc_timeout_s``), and
    that stops the job."""
    import datetime

    import torch.distributed as dist

    ranks = sorted(ranks)
    if len(ranks) <= 1 or not LOCAL.has_process_group:
        return None
    key = tuple(ranks)
    if key not in LOCAL.groups:
        LOCAL.groups[key] = dist.new_group(ranks, use_local_synchronization=True,
                                           timeout=datetime.timedelta(seconds=timeout_s))
    return LOCAL.groups[key]
