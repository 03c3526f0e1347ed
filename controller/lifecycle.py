"""How torchrun's ranks start and end together, beyond what torchrun does itself.

* ``die_with_launcher``: a rank is killed when its torchrun agent dies (SIGKILLed, OOM-killed):
  torchrun ends its ranks only while it runs, and orphans would finish the run on their own, or
  hang forever once the controller is gone too (Ray ends a driver's workers the same way).
* ``signals_interrupt``: SIGTERM and SIGHUP (how Slurm, Kubernetes and ssh stop a job) take
  Ctrl-C's path: one line naming the last checkpoint, not a silent exit. The interrupt is not
  raised inside torch's future / RPC code, which would swallow it (``_TORCH_CALLBACK_CODE``).
* ``end_children``: a rank leaving by ``os._exit`` (Ctrl-C, SIGTERM, a failed run) first stops
  its own child processes (vLLM's engine core), which would otherwise outlive it.
* ``agree_on_config``: every rank publishes its config (or its config error) in torchrun's
  store and reads every other rank's before any process group exists, so an error on one
  node is printed on every node within seconds (it used to show on none but rank 0's node,
  while the others waited out the store timeout), and nodes that resolved different configs
  (a different file or ``--set`` on one node) are refused naming the keys that differ.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import signal
import sys
import time
import typing

PR_SET_PDEATHSIG = 1


def die_with_launcher() -> None:
    """Ask the kernel to SIGKILL this process when its parent (torchrun's agent) dies; if the
    parent is already gone (the kernel would not fire), exit now. Linux; elsewhere a no-op."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # reparented between the two calls
        os._exit(1)


def child_pids() -> list[int]:
    """This process's live child processes (every thread's, from /proc; Linux, else [])."""
    import glob

    pids: set[int] = set()
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        try:
            with open(path) as f:
                pids.update(int(p) for p in f.read().split())
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(pids)


def end_children(grace_s: float = 5.0) -> list[int]:
    """Stop this process's child processes before it leaves by ``os._exit``, which skips the
    atexit hooks and finalizers that would stop them: SIGTERM (vLLM's engine core shuts down in
    order on it), up to ``grace_s`` for them to end, then SIGKILL. Outside torchrun, vLLM's
    engine core (a spawned child) outlived a process that left by ``os._exit``: measured 10
    minutes later it still held 828 MB and the caller's output pipe. Under torchrun it would
    not outlive its rank (spawned, it runs controller/main.py's start, ``die_with_launcher``
    included, so the kernel SIGKILLs it when the rank dies, and torchrun kills each rank's
    process group), but SIGKILL gives it no shutdown; this does. Python's multiprocessing
    resource tracker is left alone: it ignores SIGTERM and ends by itself once its users have,
    cleaning up what they leaked. Returns the pids that had to be killed."""
    try:
        from multiprocessing import resource_tracker

        tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    except (ImportError, AttributeError):
        tracker = None
    left = [p for p in child_pids() if p != tracker]
    for p in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if not _ended(p)]
    for p in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    return left


def leave_now(code: int) -> typing.NoReturn:
    """Leave at once with ``code`` (``os._exit``: threads blocked in RPC or collective calls to
    peers that are gone must not keep the process alive): child processes stopped first
    (``end_children``), output flushed."""
    end_children()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _ended(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:  # reaped already (by multiprocessing's own wait)
        return True


class Terminated(KeyboardInterrupt):
    """SIGTERM / SIGHUP, taken as Ctrl-C (the message names the signal)."""


_STOP_SIGNAL: list[str] = []  # the name of the first stop signal the handler took

# Code the interrupt is not raised in: torch runs a Future's callback inline, in the thread that
# adds it, when the future is already complete (``then`` / ``add_done_callback``), and keeps an
# exception raised in a callback as that callback's future's error (rref_proxy's own
# ``except BaseException`` fails on a KeyboardInterrupt, which is no Exception, and torch keeps
# that error instead). Every ``rref.rpc_async().method()`` (each controller -> worker call) makes
# its call in such a callback (torch/distributed/rpc/rref_proxy.py): an interrupt raised there
# would never reach the caller (the handler has run, the signal is spent), the call's future
# would never complete, and the controller would go on until it found its workers gone, stopped
# by the same signal ("worker ... was lost" instead of "stopped by SIGTERM").
_TORCH_CALLBACK_CODE = ("futures", os.path.join("distributed", "rpc"))
DEFER_AT_MOST_S = 1.0  # past this the interrupt is raised wherever the main thread is


def interrupt_for(signame: str) -> KeyboardInterrupt:
    """The interrupt a stop signal raises: Ctrl-C's plain ``KeyboardInterrupt`` for SIGINT,
    ``Terminated`` naming the signal otherwise."""
    return KeyboardInterrupt() if signame == "SIGINT" else Terminated(signame)


def stop_signal() -> str | None:
    """The name of the first signal ``signals_interrupt``'s handler took ("SIGTERM", "SIGINT"),
    None before: recorded before anything is raised, so it stays known whatever catches the
    interrupt."""
    return _STOP_SIGNAL[0] if _STOP_SIGNAL else None


def _outermost_torch_callback_frame(frame):
    """The outermost frame of torch's future / RPC Python code among ``frame`` and its callers
    (None when there is none)."""
    torch = sys.modules.get("torch")
    if torch is None or getattr(torch, "__file__", None) is None:
        return None
    root = os.path.dirname(torch.__file__)
    dirs = tuple(os.path.join(root, d) + os.sep for d in _TORCH_CALLBACK_CODE)
    outer = None
    while frame is not None:
        if frame.f_code.co_filename.startswith(dirs):
            outer = frame
        frame = frame.f_back
    return outer


def signals_interrupt(*signums: int) -> None:
    """Raise ``Terminated`` in the main thread on each of ``signums`` (and ``KeyboardInterrupt``
    on SIGINT, unless it has a handler of its own or is ignored), once: from then on these and
    SIGINT are ignored (Slurm signals every process and torchrun forwards it too; a second one
    must not break the way out the first took).

    Python runs the handler in the main thread between two bytecodes, wherever it is. Inside
    torch's future / RPC code (``_TORCH_CALLBACK_CODE``) the interrupt is raised when the
    outermost such frame returns, into its caller (a profile function on the main thread until
    then; after ``DEFER_AT_MOST_S`` it is raised at once; where a profiler is already set, at once)."""
    deferred: list = []  # [signum, deadline, outermost torch frame] while an interrupt waits

    def interrupt(signum):
        for s in (*signums, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        raise interrupt_for(signal.Signals(signum).name)

    def on_event(frame, event, arg):  # sys.setprofile: every call / return on the main thread
        if (event == "return" and frame is deferred[2]) or time.monotonic() > deferred[1]:
            sys.setprofile(None)
            signum = deferred[0]
            deferred.clear()
            interrupt(signum)  # raised from the returning frame: its caller gets it

    def handler(signum, frame):
        if not _STOP_SIGNAL:
            _STOP_SIGNAL.append(signal.Signals(signum).name)
        if deferred:  # a second signal while the first waits: the first one's interrupt stands
            return
        outer = _outermost_torch_callback_frame(frame)
        if outer is not None and sys.getprofile() is None:
            deferred[:] = [signum, time.monotonic() + DEFER_AT_MOST_S, outer]
            sys.setprofile(on_event)
            return
        interrupt(signum)

    _STOP_SIGNAL.clear()
    for s in signums:
        if signal.getsignal(s) is not signal.SIG_IGN:  # `nohup torchrun ...`: a hangup stays ignored
            signal.signal(s, handler)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, handler)


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True)  # NaN as "NaN": equal to itself, unlike the float


def _differing_keys(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _differing_keys(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else k)
        return out
    return [] if _canonical(a) == _canonical(b) else [prefix or "(the whole config)"]


def _store(timeout_s: float):
    """torchrun's store (this attempt's config keys), or None when nothing answers there.
    The attempt id is agreed by every rank first (controller/attempt.py; raises
    ``AttemptError`` when a rank does not come), not taken from TORCHELASTIC_RESTART_COUNT."""
    import socket

    import torch.distributed as dist

    from controller.attempt import current_attempt, store_key, torchrun_store

    try:  # a plain connect first: torch's client retries a refused one until its timeout
        socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])),
                                 timeout=min(timeout_s, 10.0)).close()
    except OSError:
        return None
    attempt = current_attempt(timeout_s)
    return dist.PrefixStore(store_key("config", attempt), torchrun_store(timeout_s))


def agree_on_config(rank: int, world: int, config: dict | None, error: str, timeout_s: float,
                    say=None) -> str | None:
    """Publish this rank's resolved ``config`` (plain data; its digest, and the data itself for
    naming differences) or its config ``error`` in torchrun's store; rank 0 reads every rank's
    entry and publishes the verdict the others wait for (O(ranks) reads, not O(ranks^2)).
    Returns the error every rank reports (a rank's own error, or the keys where a rank's
    config differs from rank 0's), None when all agree.

    An error is handed to ``say`` (one line on this node's terminal) before this rank may
    leave: a rank with its own error says it before touching the store, the others once the
    verdict is read, and then every rank waits (bounded) until all have said theirs. The store
    lives in one node's torchrun agent, which ends when its ranks exit; the other node's agent
    then fails and kills its ranks, which must by then have printed (CI saw a node's error
    lost that way)."""
    say = say or print_once_per_node
    if config is None:
        from controller.attempt import AttemptError

        say(f"config error: {error}")  # first: whatever happens to the store, this node has said it
        try:
            store = _store(min(timeout_s, 30.0))
        except (AttemptError, RuntimeError, OSError):  # not every rank came: the error is said here all the same
            return error
        if store is not None:
            try:
                store.set(str(rank), json.dumps({"error": error}))
                if rank == 0:  # the others wait for rank 0's verdict: this is it
                    store.set("verdict", json.dumps({"error": error}))
            except (RuntimeError, OSError):  # the others will time out on their own; the error is said here
                return error
            _leave_together(store, rank, world, min(timeout_s, 30.0))
        return error
    store = _store(timeout_s)
    if store is None:
        return None  # no job's store to agree through (its own errors show at the process group)
    text = _canonical(config)
    store.set(f"{rank}/config", text)
    store.set(str(rank), json.dumps({"digest": hashlib.sha256(text.encode()).hexdigest()}))
    if rank == 0:
        store.wait([str(r) for r in range(world)])
        verdict = None
        for r in range(world):
            seen = json.loads(store.get(str(r)))
            if "error" in seen:
                verdict = f"(rank {r}) {seen['error']}"
                break
            if seen["digest"] != json.loads(store.get("0"))["digest"]:
                keys = _differing_keys(config, json.loads(store.get(f"{r}/config")))
                verdict = (f"rank {r} resolved another config than rank 0 (keys {keys[:8]}"
                           f"{' ...' if len(keys) > 8 else ''}): every node must run the same config file and --set "
                           "overrides")
                break
        store.set("verdict", json.dumps({"error": verdict}))
    store.wait(["verdict"])
    verdict = json.loads(store.get("verdict"))["error"]
    if verdict is not None:
        say(f"config error: {verdict}")
        _leave_together(store, rank, world, min(timeout_s, 30.0))
    return verdict


def _leave_together(store, rank: int, world: int, timeout_s: float, poll_s: float = 0.05) -> None:
    """Mark this rank as done with the config verdict and wait (at most ``timeout_s``) until
    every rank is; a store that is gone or a rank that never comes ends the wait. Polled from
    Python, not the store's blocking ``wait``, which holds off Ctrl-C / SIGTERM until it
    returns."""
    keys = [f"left/{r}" for r in range(world)]
    deadline = time.monotonic() + timeout_s
    try:
        store.set(f"left/{rank}", "1")
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(poll_s)
    except (RuntimeError, OSError):
        pass


def print_once_per_node(text: str) -> None:
    """On each node's first rank only (every node's terminal or log gets it once)."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(text, file=sys.stderr, flush=True)
