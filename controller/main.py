"""StreamRL entry point: one program for every rank.

Single machine (controller + 1 generation instance + 1 trainer rank)::

    torchrun --nproc-per-node 3 controller/main.py --config configs/quickstart.yaml

Options: ``--repl`` (interactive console on the controller), ``--resume DIR`` (run logdir or
checkpoint), ``--set key=value`` (config override, repeatable, e.g. ``--set train.iterations=5``).

Two nodes (rank 0 = controller on node 0; torchrun's c10d rendezvous, nothing home-made)::

    # on each node (NODE0 = address of node 0)
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint NODE0:29400 \
        controller/main.py --config configs/cluster_2node.yaml

Add a generation instance to a running job (elastic scale-out; ADDR = the job's store,
printed by the controller at start as ``join address``)::

    python controller/main.py --join ADDR --role generation

Rank 0 is the controller (``controller/runner.py``); every other rank serves RPC and hosts
the role objects the controller creates on it (``GenerationInstance``, ``TrainerRank``).
Data-plane collectives (trainer DP group, weight sync) use gloo on CPU, NCCL on GPU (each
worker takes LOCAL_RANK's GPU). RPC runs in dynamic-membership mode (``world_size=None``,
required of every rank so that processes can join later).
"""
from __future__ import annotations

import argparse
import math
import datetime
import os
import socket
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # torchrun runs this file as a script

if "TORCHELASTIC_RUN_ID" in os.environ and "--join" not in sys.argv:  # a torchrun rank: before torch's
    from controller.lifecycle import die_with_launcher  # seconds-long import, an orphan window

    die_with_launcher()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402

from controller.rpc import LOCAL, worker_name  # noqa: E402

# Keys in torchrun's store. The RPC group gets its own store (hosted by rank 0, one per
# torchrun restart attempt: a restarted job must not see the names of the previous attempt).
# Per-attempt keys are named by the id every rank agreed on (controller/attempt.py), not by
# TORCHELASTIC_RESTART_COUNT (per node: only the failed node's agent counts a restart).
# ATTEMPT_KEY holds the current id (joiners read it; a change means the job restarted).
ATTEMPT_KEY = "streamrl/attempt"


def _key(name: str, attempt: str) -> str:
    return f"streamrl/{attempt}/{name}"


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
        store.set(_key("rpc_store", attempt), f"{addr}:{_RPC_STORE.port}")
    return store.get(_key("rpc_store", attempt)).decode()


_RPC_STORE = None


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="StreamRL controller / worker entry point",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--config", help="YAML run config (configs/*.yaml)")
    ap.add_argument("--repl", action="store_true", help="interactive console on the controller (stdin of rank 0)")
    ap.add_argument("--resume", default="", help="run logdir or checkpoint folder to resume from")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--join", default="", metavar="HOST:PORT", help="join a running job's RPC group")
    ap.add_argument("--role", default="generation", choices=["generation"], help="role of a joining process")
    ap.add_argument("--rpc-timeout", type=float, default=300.0, help="RPC timeout of a joining process (s)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = ap.parse_args(argv)
    if not args.join and not args.config:
        ap.error("--config is required (unless --join)")
    if args.join:
        host, sep, port = args.join.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            ap.error(f"--join must be HOST:PORT (the controller's 'join address' line), got {args.join!r}")
    if args.threads < 1:
        ap.error(f"--threads must be >= 1 (torch threads per process), got {args.threads}")
    if not (math.isfinite(args.rpc_timeout) and args.rpc_timeout > 0):
        ap.error(f"--rpc-timeout must be a number of seconds > 0, got {args.rpc_timeout}")
    return args


def _rpc_options(timeout: float, init_method: str) -> rpc.TensorPipeRpcBackendOptions:
    # TensorPipe's shared-memory transport busy-polls: three idle processes burned ~1.3 of this
    # machine's 2 cores. libuv (epoll) costs nothing while idle; tensors still travel as tensors.
    transports = os.environ.get("STREAMRL_RPC_TRANSPORTS", "uv").split(",")
    return rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=timeout, num_worker_threads=32,
                                           _transports=transports, _channels=["basic"])


def serve(gone: Callable[[], str | None] | None = None, every_s: float = 5.0) -> int:
    """Worker ranks: host role objects until the controller says to exit. ``gone`` (a joiner's
    check that its job still runs: torchrun's ranks are ended by torchrun, a joiner is not)
    is called every ``every_s``; a reason back ends serving with exit code 1."""
    waited = 0.0
    while not LOCAL.exit_event.wait(timeout=1.0):
        waited += 1.0
        if gone is not None and waited >= every_s:
            waited = 0.0
            why = gone()
            if why is not None:
                print(f"[join] rank {LOCAL.rank} exits (code 1): {why}", file=sys.stderr, flush=True)
                return 1
    return LOCAL.exit_code


def _pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


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


def _no_job(args, e: BaseException) -> int:
    print(f"[join] no StreamRL job answered at --join {args.join} within {args.rpc_timeout:g} s "
          f"({type(e).__name__}); pass the address from the controller's 'join address' line",
          file=sys.stderr, flush=True)
    return 1


def join_main(args) -> int:
    """A generation process joining a running job (elastic scale-out). ADDR: torchrun's store."""
    host, port = args.join.rsplit(":", 1)
    deadline = time.monotonic() + args.rpc_timeout
    while True:  # wait for the store quietly (torch's client logs a stack trace per retry)
        try:
            socket.create_connection((host, int(port)), timeout=max(0.1, min(5.0, deadline - time.monotonic()))).close()
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                return _no_job(args, e)
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    try:
        store = dist.TCPStore(host, int(port), is_master=False,
                              timeout=datetime.timedelta(seconds=args.rpc_timeout))
        attempt = store.get(ATTEMPT_KEY).decode()  # set once the controller is up
        elastic = store.get(_key("elastic", attempt)).decode() == "1"
    except (RuntimeError, TimeoutError, OSError) as e:  # DistNetworkError / DistStoreError are RuntimeErrors
        return _no_job(args, e)
    if not elastic:
        print(f"[join] the job at {args.join} runs with placement.elastic: false (a static RPC group): "
              "it takes no joiners", file=sys.stderr, flush=True)
        return 1
    static = int(store.get(_key("static_world", attempt)).decode())
    rank = static + int(store.add(_key("joined", attempt), 1)) - 1
    rpc_addr = store.get(_key("rpc_store", attempt)).decode()
    LOCAL.rank = rank
    LOCAL.device = _pick_device(int(os.environ.get("LOCAL_RANK", "0")))
    rpc.init_rpc(worker_name(rank), rank=rank, world_size=None,
                 rpc_backend_options=_rpc_options(args.rpc_timeout, f"tcp://{rpc_addr}"))
    from controller.joiners import register_joiner

    rpc.rpc_sync("controller", register_joiner, args=(rank, args.role), timeout=args.rpc_timeout)
    print(f"[join] rank {rank} registered as {args.role}; it serves once the scale-out policy adds it "
          "(REPL: sgs)", file=sys.stderr, flush=True)

    lost = []

    def gone() -> str | None:
        try:  # a plain connect first: a store op on a dead server logs a C++ stack trace
            socket.create_connection((host, int(port)), timeout=10).close()
            now = store.get(ATTEMPT_KEY).decode()
        except (RuntimeError, TimeoutError, OSError) as e:
            lost.append(f"the job at {args.join} is gone ({type(e).__name__}: its store does not answer)")
        else:
            if now == attempt:
                return None
            lost.append(f"the job restarted (attempt {now[:8]}; this process joined attempt {attempt[:8]}): "
                        "start it again to join the new one")
        return lost[-1]

    code = serve(gone)
    close_roles()
    if lost:  # nobody left to leave the RPC group with
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if not LOCAL.exit_reason:  # the controller named no other reason: the job itself ended
        print(f"[join] rank {rank} exits (code {code}): the job ended "
              f"({'finished' if code == 0 else 'stopped: see the controller'})", file=sys.stderr, flush=True)
    rpc.shutdown(graceful=False)
    return code


def _log_to_stderr() -> None:
    """StreamRL's own loggers (``streamrl.*``: SFT progress, trainer and engine warnings) print
    on stderr as ``[streamrl.sft] ...``; other libraries' loggers keep their own settings."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
    root = logging.getLogger("streamrl")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    _log_to_stderr()
    if args.join:
        return join_main(args)
    if "RANK" not in os.environ or "TORCHELASTIC_RUN_ID" not in os.environ:
        sys.exit("controller/main.py must be launched with torchrun "
                 "(torchrun --nproc-per-node 3 controller/main.py --config configs/quickstart.yaml)")
    import signal

    from controller import lifecycle
    from controller.attempt import AttemptError
    from controller.config import ConfigError, load_config
    from controller.run_record import plain

    lifecycle.die_with_launcher()  # (again: main() may be called without the module's start)
    lifecycle.signals_interrupt(signal.SIGTERM, signal.SIGHUP)
    world = int(os.environ["WORLD_SIZE"])
    cfg, error = None, ""
    try:
        try:  # every rank validates, so a bad config stops all of them before any work
            cfg = load_config(args.config, world, args.set)  # the --set texts: an error echoes them as typed
        except ConfigError as e:
            error = str(e)
        error = lifecycle.agree_on_config(int(os.environ["RANK"]), world, None if cfg is None else plain(cfg),
                                          error, cfg.placement.rpc_timeout_s if cfg is not None else 300.0)
    except KeyboardInterrupt:  # stopped before any work: nothing to say but the exit code
        os._exit(130)
    except AttemptError as e:  # the ranks of this attempt did not all meet in torchrun's store
        print(f"[rank {os.environ['RANK']}] {e}", file=sys.stderr, flush=True)
        return 1
    if error is not None:
        lifecycle.print_once_per_node(f"config error: {error}")  # one message per node, not per rank
        return 2

    def controller() -> int:
        from controller.runner import run_controller

        return run_controller(cfg, args, world)

    try:
        return run_rank(controller, cfg.placement.rpc_timeout_s, cfg.placement.elastic)
    except KeyboardInterrupt as e:
        _interrupted(cfg.logging.logdir, args.resume, str(e))


def _interrupted(logdir: str, resume: str, signame: str = "") -> None:
    """Ctrl-C (every rank of the terminal's job gets SIGINT), SIGTERM or SIGHUP: one line from
    rank 0 saying what is kept, no traceback from every rank, and out at once (RPC threads may
    still be blocked in calls to peers that are going away). Checkpoints are written
    atomically, so the last complete one is intact whatever was running. On the controller,
    after the run's end was said (``LOCAL.outcome``: a lost worker, a success), the signal is
    torchrun stopping the job's ranks: the exit code said stands, with no second line."""
    if LOCAL.outcome is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(LOCAL.outcome)
    if os.environ.get("RANK") == "0":
        from controller.checkpoint import resume_hint
        from controller.preflight import run_logdir

        folder = LOCAL.run_folder or run_logdir(Path(logdir), resume)  # resolved by the session once it began
        print(f"[controller] {'stopped by ' + signame if signame else 'interrupted'}; {resume_hint(folder, resume)}",
              file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


def run_rank(controller: Callable[[], int], rpc_timeout_s: float, elastic: bool = True) -> int:
    """Under torchrun: join the process and RPC groups, run ``controller`` on rank 0 and serve
    RPC on every other rank, then leave. Returns the exit code."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    start_processes(rank, world, rpc_timeout_s, elastic)
    return stop_processes(controller() if rank == 0 else serve())


def start_processes(rank: int, world: int, rpc_timeout_s: float, elastic: bool = True) -> None:
    """Under torchrun: pick the device, init the data-plane process group and the RPC group."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    LOCAL.rank, LOCAL.local_rank = rank, local_rank
    LOCAL.device = _pick_device(local_rank)
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
                            store=dist.PrefixStore(f"streamrl/pg/{attempt}", tstore), rank=rank, world_size=world)
    LOCAL.has_process_group = True
    rpc_addr = _rpc_store_address(rank, tstore, timeout, attempt)
    rpc.init_rpc(worker_name(rank), rank=rank, world_size=None if elastic else world,
                 rpc_backend_options=_rpc_options(rpc_timeout_s, f"tcp://{rpc_addr}"))
    dist.barrier()  # every static rank is in the RPC group
    if rank == 0:  # joiners wait for these keys (torchrun's store): the controller is up
        tstore.set(_key("static_world", attempt), str(world))
        tstore.set(_key("elastic", attempt), "1" if elastic else "0")
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

    Success or a refusal before any work (the controller's ``request_exit(code, quiet=True)``:
    no worker was lost and none joined, so every RRef's owner is alive and inside the
    barriers): every static rank takes the
    same quiet path (``_quiet_rpc_exit``). Otherwise, or if a barrier fails: local
    (non-graceful) shutdown that waits for nobody."""
    close_roles()
    if LOCAL.quiet_exit and code in (0, 2):  # success, or a refusal before any work (config error)
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
        os._exit(code)  # threads blocked in collectives with a dead peer must not keep us alive
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


if __name__ == "__main__":
    sys.exit(main())
