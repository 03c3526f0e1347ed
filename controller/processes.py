"""Joining and leaving the process and RPC groups: what every torchrun rank does around its
role (rank 0 runs the controller, the others serve RPC), and what a worker serves until told
to exit.

Start (``start_processes``): pick the device, agree on the attempt id in torchrun's store
(``controller/attempt.py``), init the data-plane process group (gloo on CPUs, NCCL where
each rank has a GPU) and the RPC group (dynamic membership unless ``placement.elastic`` is
false, so that processes can join later). Stop (``stop_processes``): close the roles, leave
RPC in lock-step on success, at once otherwise.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from controller import keepalive
from controller.attempt import ATTEMPT_KEY, store_key
from controller.keepalive import Watchdog
from controller.process_state import LOCAL
from controller.rpc import worker_name
from workers.model import rank_device

# The RPC group gets its own store (hosted by rank 0, one per torchrun restart attempt: a
# restarted job must not see the names of the previous attempt); its address and what joiners
# read are per-attempt keys of torchrun's store (controller.attempt.store_key).


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _local_address(peer_host: str, peer_port: int) -> str:
    """This host's address on the interface that reaches ``peer`` (multi-node safe)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer_host, peer_port))
        return s.getsockname()[0]


def _rpc_store_address(rank: int, store, timeout: datetime.timedelta, attempt: str) -> str:
    """Rank 0 picks the RPC store address and publishes it in torchrun's ``store``; every rank
    returns it (``host:port``)."""
    if rank == 0:
        global _RPC_STORE  # rank 0 hosts it for the whole run (torchrun's env makes init_rpc a client)
        addr = _local_address(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        _RPC_STORE = dist.TCPStore(addr, _free_port(), is_master=True, wait_for_workers=False, timeout=timeout)
        store.set(store_key("rpc_store", attempt), f"{addr}:{_RPC_STORE.port}")
    return store.get(store_key("rpc_store", attempt)).decode()


_RPC_STORE = None


def rpc_options(timeout: float, init_method: str) -> rpc.TensorPipeRpcBackendOptions:
    # TensorPipe's shared-memory transport busy-polls: three idle processes burned ~1.3 of this
    # machine's 2 cores. libuv (epoll) costs nothing while idle; tensors still travel as tensors.
    transports = os.environ.get("STREAMRL_RPC_TRANSPORTS", "uv").split(",")
    return rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=timeout, num_worker_threads=32,
                                           _transports=transports, _channels=["basic"])


def serve(gone: Callable[[], str | None] | None = None, every_s: float = 5.0,
          watchdog: Watchdog | None = None, who: str = "") -> int:
    """Worker ranks: host role objects until the controller says to exit. ``watchdog`` (checked
    every second) ends serving when the controller has gone silent; ``gone`` (a joiner's check
    that its job still runs: torchrun's ranks are ended by torchrun, a joiner is not) is called
    every ``every_s``. Either one's reason ends serving with exit code 1, said on stderr as
    ``{who} exits (code 1): {reason}`` and kept in ``LOCAL.left_because``."""
    waited = 0.0
    while not LOCAL.exit_event.wait(timeout=1.0):
        waited += 1.0
        why = watchdog.check() if watchdog is not None else None
        if why is None and gone is not None and waited >= every_s:
            waited = 0.0
            why = gone()
        if why is not None:
            LOCAL.left_because = why
            LOCAL.quiet_exit = False  # leaving alone: nobody else takes the lock-step exit
            print(f"{who or f'[rank {LOCAL.rank}]'} exits (code 1): {why}", file=sys.stderr, flush=True)
            return 1
    return LOCAL.exit_code


def pick_device(local_rank: int) -> torch.device:
    device = rank_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def data_plane_backend(device: torch.device, local_world_size: int, gpus: int) -> str:
    """NCCL when every rank of this node has a GPU of its own; gloo on CPUs and where ranks
    share a GPU (NCCL refuses two ranks on one device: "Duplicate GPU detected"), e.g. the
    quickstart's 3 ranks on a 1-GPU machine. Under gloo the weight-sync buffers live in host
    memory (``Local.comm_device``)."""
    if device.type != "cuda":
        return "gloo"
    if local_world_size > gpus:
        print(f"[streamrl] {local_world_size} ranks share {gpus} GPU(s) on this node: the data "
              "plane (weight sync, trainer all-reduce) uses gloo through host memory, not NCCL",
              file=sys.stderr, flush=True)
        return "gloo"
    return "nccl"


def run_rank(controller: Callable[[], int], rpc_timeout_s: float, elastic: bool = True) -> int:
    """Under torchrun: join the process and RPC groups, run ``controller`` on rank 0 (pinging
    every worker meanwhile: controller.keepalive) and serve RPC on every other rank (leaving when
    the controller is silent for ``rpc_timeout_s``), then leave. Returns the exit code."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    start_processes(rank, world, rpc_timeout_s, elastic)
    if rank != 0:
        return stop_processes(serve(watchdog=Watchdog(rpc_timeout_s)))
    keepalive.watch(*range(1, world))
    pinger = keepalive.Keepalive(keepalive.period(rpc_timeout_s)).start()
    try:
        code = controller()
    finally:
        pinger.stop()
    return stop_processes(code)


def start_processes(rank: int, world: int, rpc_timeout_s: float, elastic: bool = True) -> None:
    """Under torchrun: pick the device, init the data-plane process group and the RPC group."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    LOCAL.rank, LOCAL.local_rank, LOCAL.rpc_timeout_s = rank, local_rank, rpc_timeout_s
    LOCAL.device = pick_device(local_rank)
    timeout = datetime.timedelta(seconds=rpc_timeout_s)
    from controller.attempt import current_attempt, torchrun_store

    # torchrun's store outlives a restart: prefix by the agreed attempt id (the same on every
    # node, fresh each attempt) so stale keys of a dead attempt (gloo addresses) are never read
    attempt = current_attempt(rpc_timeout_s)
    tstore = torchrun_store(rpc_timeout_s)
    backend = data_plane_backend(LOCAL.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                                 torch.cuda.device_count() if torch.cuda.is_available() else 0)
    LOCAL.comm_device = LOCAL.device if backend == "nccl" else torch.device("cpu")
    dist.init_process_group(backend, timeout=timeout,
                            store=dist.PrefixStore(store_key("pg", attempt), tstore), rank=rank, world_size=world)
    LOCAL.has_process_group = True
    rpc_addr = _rpc_store_address(rank, tstore, timeout, attempt)
    rpc.init_rpc(worker_name(rank), rank=rank, world_size=None if elastic else world,
                 rpc_backend_options=rpc_options(rpc_timeout_s, f"tcp://{rpc_addr}"))
    dist.barrier()  # every static rank is in the RPC group
    if rank == 0:  # joiners wait for these keys (torchrun's store): the controller is up
        tstore.set(store_key("static_world", attempt), str(world))
        tstore.set(store_key("elastic", attempt), "1" if elastic else "0")
        tstore.set(store_key("rpc_timeout_s", attempt), repr(rpc_timeout_s))  # a joiner's watchdog uses it
        tstore.set(ATTEMPT_KEY, attempt)


def close_roles() -> None:
    """Close every role this process hosts: engines' own processes (vLLM) must not outlive it."""
    for role in list(LOCAL.roles.values()):
        try:
            role.close()
        except Exception as e:  # noqa: BLE001 - leaving anyway
            print(f"[rank {LOCAL.rank}] closing {type(role).__name__}: {e}", file=sys.stderr, flush=True)


def stop_processes(code: int) -> int:
    """Leave the RPC group and the process group; a failed run exits at once (``os._exit``).

    When the controller ended the job with every static rank alive and no other rank in it
    (``request_exit(code, quiet=True)``: success, a refusal before any work, or a run the
    controller stopped itself, e.g. every sample skipped), every RRef's owner is alive and
    inside the barriers: every static rank takes the same quiet path (``_quiet_rpc_exit``).
    Otherwise (a rank leaving on its own, a worker lost), or if a barrier fails: local
    (non-graceful) shutdown that waits for nobody."""
    close_roles()
    if LOCAL.quiet_exit:
        try:
            _quiet_rpc_exit()
        except Exception:  # noqa: BLE001 - a peer is gone; leave anyway (non-graceful below)
            pass
    rpc.shutdown(graceful=False)
    if code == 0:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    if code != 0:
        from controller.lifecycle import leave_now

        leave_now(code)  # children close_roles could not close (a role that raised) stopped first
    return code


def _quiet_rpc_exit(timeout_s: float = 20.0) -> None:
    """Graceful end of a successful run, in lock-step over the static ranks (gloo barriers):

    1. barrier: nobody issues new RPCs;
    2. every process deletes its user RRefs and waits until their owners confirmed (torch's
       graceful-shutdown step; without it the owners report "Leaking RRef ...");
    3. barrier, then each agent leaves the group (``join(shutdown=True)``: waits for its own
       calls to finish and marks the agent as shutting down);
    4. barrier: only now do pipes close (``rpc.shutdown(graceful=False)`` by the caller); every
       peer already expects it, so TensorPipe logs no EOF / "pipe closed" errors.

    torch's own ``rpc.shutdown(graceful=True)`` does not do step 4 for a dynamic-membership
    group (each process leaves on its own and closes its pipes while the others still read).
    Raises when a peer is gone (the caller then shuts down locally)."""
    from torch.distributed.rpc import api as rpc_api

    import gc

    dist.barrier()
    gc.collect()  # drop role objects / RRefs that only cycles still hold
    rpc_api._delete_all_user_and_unforked_owner_rrefs(datetime.timedelta(seconds=timeout_s))
    dist.barrier()
    rpc_api._get_current_rpc_agent().join(shutdown=True, timeout=timeout_s)
    dist.barrier()
