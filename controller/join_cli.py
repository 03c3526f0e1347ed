"""``controller/main.py --join ADDR``: a generation process joining a running job's RPC group
(elastic scale-out). ADDR is torchrun's store, printed by the controller as ``join address``;
the process registers with the controller and serves once the scale-out policy adds it."""
from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time

import torch.distributed as dist
import torch.distributed.rpc as rpc

from controller import dead_members
from controller.attempt import ATTEMPT_KEY, store_key
from controller.keepalive import Watchdog
from controller.processes import close_roles, pick_device, rpc_options, serve
from controller.process_state import LOCAL
from controller.rpc import worker_name


def _no_job(args, e: BaseException) -> int:
    print(f"[join] no StreamRL job answered at --join {args.join} within {args.rpc_timeout:g} s "
          f"({type(e).__name__}); pass the address from the controller's 'join address' line",
          file=sys.stderr, flush=True)
    return 1


def _open_store(host: str, port: int, timeout_s: float):
    """The job's store, its attempt id (set once the controller is up) and whether it is elastic."""
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    attempt = store.get(ATTEMPT_KEY).decode()
    return store, attempt, store.get(store_key("elastic", attempt)).decode() == "1"


def _within(timeout_s: float, fn, *args):
    """``fn(*args)``, given at most ``timeout_s``: a TimeoutError after that. TCPStore's own
    timeout does not bound its handshake: a port that accepts and never answers (a web server,
    TensorBoard, a mistyped port) held the join forever. The call runs on a daemon thread,
    left behind when it does not return."""
    done, out = threading.Event(), {}

    def call():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            out["error"] = e
        done.set()

    threading.Thread(target=call, name="join-store", daemon=True).start()
    if not done.wait(timeout_s):
        raise TimeoutError(f"no answer in {timeout_s:g} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


def _interrupted(rank: int, signame: str, timeout_s: float) -> None:
    """A joiner stopped on its own: one line, not a traceback. Still waiting to be added, it
    tells the controller, which stops listing it; an added instance ends its round (its
    unfinished requests go to the others) and waits until its report went out (the controller
    then removes it as stopped). Both leave the RPC group, so later joiners can join."""
    from controller.joiners import withdraw_joiner
    from controller.lifecycle import leave_now

    added = "generation" in LOCAL.roles
    if not added:
        try:
            rpc.rpc_sync("controller", withdraw_joiner, args=(rank, f"stopped by {signame}"), timeout=5)
        except Exception:  # noqa: BLE001 - the controller is gone or busy: it finds this rank lost
            pass
    print(f"[join] rank {rank} stopped by {signame}: it leaves the job" +
          ("; the controller re-dispatches its requests" if added else " (it was waiting to be added)"),
          file=sys.stderr, flush=True)
    if added:  # its round ends now, its unfinished requests reported back (as the REPL's leave)
        try:
            LOCAL.roles["generation"].stop()
        except Exception:  # noqa: BLE001 - leaving anyway: the controller finds it lost
            pass
        # the round's report must reach the controller first: torch's graceful leave waits for
        # this process's own calls only, not for its replies (with engine steps of 0.1 s or more
        # it left mid-round: its report lost, the instance "lost", every request generated again)
        served(timeout_s)
        close_roles()  # its engine (and vLLM's engine process) goes now
    # the job goes on: out of its RPC group, or every later joiner's start would call this one
    # (an added one stayed a dead member, and no process could join after it; review, s54)
    leave_group(LEAVE_GROUP_S)
    leave_now(130)


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
        store, attempt, elastic = _within(max(1.0, deadline - time.monotonic()), _open_store, host, int(port),
                                          args.rpc_timeout)
    except (RuntimeError, TimeoutError, OSError) as e:  # DistNetworkError / DistStoreError are RuntimeErrors
        return _no_job(args, e)
    if not elastic:
        print(f"[join] the job at {args.join} runs with placement.elastic: false (a static RPC group): "
              "it takes no joiners", file=sys.stderr, flush=True)
        return 1
    static = int(store.get(store_key("static_world", attempt)).decode())
    job_timeout_s = float(store.get(store_key("rpc_timeout_s", attempt)).decode())  # the controller's silence bound
    refused = dead_members.refusal(store, attempt, args.join)
    if refused:
        print(refused, file=sys.stderr, flush=True)
        return 1
    rank = static + int(store.add(store_key("joined", attempt), 1)) - 1
    rpc_addr = store.get(store_key("rpc_store", attempt)).decode()
    LOCAL.rank = rank
    LOCAL.device = pick_device(int(os.environ.get("LOCAL_RANK", "0")))
    failed = _join_group(args, store, attempt, rank, rpc_addr)
    if failed:
        _release_join_token(rpc_addr, worker_name(rank), args.rpc_timeout)
        print(failed, file=sys.stderr, flush=True)
        from controller.lifecycle import leave_now

        leave_now(1)
    from controller.joiners import register_joiner

    try:  # from here a stop (Ctrl-C, SIGTERM) withdraws it, even mid-registration
        rpc.rpc_sync("controller", register_joiner, args=(rank, args.role), timeout=args.rpc_timeout)
        print(f"[join] rank {rank} registered as {args.role}; it serves once the scale-out policy adds it "
              "(REPL: sgs)", file=sys.stderr, flush=True)
        return _serve(args, host, port, store, attempt, rank, job_timeout_s)
    except KeyboardInterrupt as e:  # Ctrl-C on its own terminal, SIGTERM, SIGHUP
        _interrupted(rank, str(e) or "SIGINT", job_timeout_s)


def _join_group(args, store, attempt: str, rank: int, rpc_addr: str, poll_s: float = 1.0) -> str | None:
    """Join the job's RPC group; None, or why it failed (one line). A member that died just
    before (noted by the controller within its keepalive period) makes torch's join hang for the
    whole ``--rpc-timeout`` holding the group's join token: the join runs on a thread of its own
    while this one watches the store, and such a death ends it at once with the refusal."""
    out: dict = {}

    def join():
        try:
            rpc.init_rpc(worker_name(rank), rank=rank, world_size=None,
                         rpc_backend_options=rpc_options(args.rpc_timeout, f"tcp://{rpc_addr}"))
        except Exception as e:  # noqa: BLE001 - said in one line by the caller
            out["error"] = e

    thread = threading.Thread(target=join, name="join-rpc", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(poll_s)
        refused = thread.is_alive() and dead_members.refusal(store, attempt, args.join)
        if refused:
            return refused
    e = out.get("error")
    if e is None:
        return None
    return (f"[join] rank {rank} could not join the job's RPC group at --join {args.join}: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


def _serve(args, host: str, port: str, store, attempt: str, rank: int, job_timeout_s: float) -> int:
    """Serve as a registered joiner until the controller, or the job's end, says to stop."""

    def gone() -> str | None:
        try:  # a plain connect first: a store op on a dead server logs a C++ stack trace
            socket.create_connection((host, int(port)), timeout=10).close()
            now = store.get(ATTEMPT_KEY).decode()
        except (RuntimeError, TimeoutError, OSError) as e:
            return f"the job at {args.join} is gone ({type(e).__name__}: its store does not answer)"
        if now == attempt:
            return None
        return (f"the job restarted (attempt {now[:8]}; this process joined attempt {attempt[:8]}): "
                "start it again to join the new one")

    code = serve(gone, watchdog=Watchdog(job_timeout_s), who=f"[join] rank {rank}")
    close_roles()
    if LOCAL.left_because:  # its job or controller is gone: nobody left to leave the RPC group with
        from controller.lifecycle import leave_now

        leave_now(1)
    if not LOCAL.exit_reason:  # the controller named no other reason: the job itself ended
        print(f"[join] rank {rank} exits (code {code}): the job ended "
              f"({'finished' if code == 0 else 'stopped: see the controller'})", file=sys.stderr, flush=True)
        rpc.shutdown(graceful=False)
        return code
    # told to leave while the job goes on (REPL leave, a refusal): out of the RPC group as
    # torch's graceful dynamic shutdown leaves it, or every later joiner's start would call it
    if not leave_group(LEAVE_GROUP_S):
        from controller.lifecycle import leave_now

        leave_now(code)
    return code


LEAVE_GROUP_S = 15.0


def leave_group(timeout_s: float) -> bool:
    """Leave the job's dynamic RPC group (every member told, this name off the store: torch's
    ``rpc.shutdown(graceful=True)`` for a dynamic group), within ``timeout_s``; False when it
    failed or took longer (the job is ending: the caller exits the local way)."""
    done: list = []

    def run():
        try:
            rpc.shutdown(graceful=True, timeout=timeout_s)
            done.append(True)
        except Exception as e:  # noqa: BLE001 - a member gone meanwhile: the local exit
            done.append(e)

    t = threading.Thread(target=run, name="leave-rpc-group", daemon=True)
    t.start()
    t.join(timeout_s)
    return done == [True]


def served(timeout_s: float, poll_s: float = 0.02) -> bool:
    """Wait (at most ``timeout_s``) until this process serves no call: each reply sent. False
    when one still runs then."""
    deadline = time.monotonic() + timeout_s
    try:
        agent = rpc.api._get_current_rpc_agent()  # (torch keeps it private; its metrics are public)
        while int(agent.get_metrics().get("agent.server_active_calls", "0")) > 0:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
    except RuntimeError:  # no RPC agent: nothing is served
        pass
    return True


def _release_join_token(rpc_addr: str, name: str, timeout_s: float) -> None:
    """A failed ``init_rpc`` of a dynamic group leaves its join token taken (torch's
    ``_group_membership_management`` releases it only when the join succeeds): every later join
    and graceful leave of the job would wait on it. Released here if this process holds it."""
    import datetime

    host, port = rpc_addr.rsplit(":", 1)
    try:  # init_rpc's first store is "rpc_prefix_0"; the token's key and value as torch names them
        store = dist.PrefixStore("rpc_prefix_0", dist.TCPStore(host, int(port), is_master=False,
                                                               timeout=datetime.timedelta(seconds=timeout_s)))
        token = f"Token_for_{name}_join"
        if store.compare_set("RpcGroupManagementToken", token, "").decode() == "":
            store.set(token, "Done")  # those waiting for it go on
    except Exception:  # noqa: BLE001 - best effort: the job may be gone
        pass
