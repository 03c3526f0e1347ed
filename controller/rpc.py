"""Worker-group handles and the process-local runtime state behind torch RPC.

Every process runs ``controller/main.py``; rank 0 is the controller, the others wait for the
controller to create role objects on them with ``rpc.remote`` (``GenerationInstance``,
``TrainerRank``). The controller holds ``WorkerHandle``s (rank, role, RRef) and calls plain
methods: ``handle.call("generate", ...)`` -> ``rref.rpc_async().generate(...)``.

A method call on a role runs as long as its work takes (a generation round, a step over a slow
reward): no deadline on the call itself, as Ray's calls in verl (creating a role, and the model
bootstrap, keep ``placement.rpc_timeout_s``; 4x for the bootstrap). What ``placement.rpc_timeout_s`` bounds
is how long a busy worker may go without answering: while the controller waits on a call it
sends the worker a heartbeat every ``HEARTBEAT_S`` seconds (``ping``, served by another of
its RPC threads), and a worker that does not answer one within the timeout is lost. One that
answers but whose call never ends (a deadlock, an endless reward function) is waited for, said
on stderr every ``STILL_WAITING_S``. A call given an explicit ``timeout`` keeps that deadline.

A worker's exception comes back with torch's remote traceback; ``wait`` re-raises it as
``WorkerFailed`` naming the rank and role. A peer that vanished (process killed, connection
closed) is told apart from a Python exception raised in the worker (``is_peer_lost``).
"""
from __future__ import annotations

import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.rpc as rpc

from controller.process_state import RPC_TIMEOUT_S, ping


HEARTBEAT_S = 10.0  # how often a waiting controller checks that a busy worker still answers
SETUP_FACTOR = 4  # a worker's constructor (model load, the engine's first C++ kernel build, vLLM's start)
# and the model bootstrap may take this many times placement.rpc_timeout_s: it is one call, with
# no heartbeat to tell slow from hung
STILL_WAITING_S = 300.0  # how often a wait on a call that answers but does not end is said on stderr


def is_timeout(msg: str) -> bool:
    """Whether an RPC error message says its deadline passed (vs. a closed connection)."""
    low = msg.lower()
    return "timeout" in low or "timed out" in low


def worker_name(rank: int) -> str:
    return "controller" if rank == 0 else f"worker{rank}"


class WorkerFailed(RuntimeError):
    """A worker raised (or vanished); ``rank``/``role`` say which, the message holds its traceback."""

    def __init__(self, rank: int, role: str, method: str, detail: str, lost: bool = False):
        self.rank, self.role, self.method, self.lost = rank, role, method, lost
        timed_out = lost and is_timeout(detail.splitlines()[0] if detail else "")
        what = ("did not answer in time (hung, or busy past its deadline)" if timed_out
                else "was lost (process gone)" if lost else "raised")
        head = f"worker rank {rank} ({role}) {what} in {method}()"
        if lost and detail:  # the transport's reason on the first line: logs that keep one line keep it
            first, _, rest = detail.partition("\n")
            super().__init__(f"{head}: {first}" + (f"\n{rest}" if rest else ""))
        else:  # a Python exception: the worker's traceback below
            super().__init__(f"{head}:\n{detail}")


def is_peer_lost(err: BaseException) -> bool:
    """True when the error is a transport failure (peer process gone), not a Python exception
    raised inside the worker (torch prefixes those with ``On WorkerInfo(``)."""
    msg = str(err)
    if "On WorkerInfo(" in msg:
        return False
    low = msg.lower()
    lost_marks = ("eof", "end of file", "pipe closed", "connection reset", "econnreset", "connection refused",
                  "econnrefused", "broken pipe", "epipe", "closed", "shut down", "unknown destination worker",
                  "could not find destination")  # (a joiner that left the dynamic group: its id is gone)
    return any(m in low for m in lost_marks) or is_timeout(msg)


@dataclass
class WorkerHandle:
    """One role object on one rank, as the controller sees it."""

    rank: int
    role: str  # "generation" | "trainer"
    rref: Any  # torch.distributed.rpc.RRef
    timeout: float = 300.0
    alive: bool = True

    @property
    def name(self) -> str:
        return worker_name(self.rank)

    def call(self, method: str, *args, timeout: float | None = None) -> "Call":
        """``method(*args)`` on the worker; without ``timeout`` it may run as long as the
        worker keeps answering heartbeats (module docstring), with one it must end in time."""
        try:
            fut = getattr(self.rref.rpc_async(timeout=0 if timeout is None else timeout), method)(*args)
        except Exception as e:  # noqa: BLE001 - e.g. the peer is already gone: fail via the future
            fut = torch.futures.Future()
            fut.set_exception(e)
        return Call(self, method, fut, heartbeat=timeout is None)


class Cancelled(BaseException):
    """A wait given up by its owner (``Completions.cancel``): it stops pinging and says nothing.
    A BaseException, so no ``except Exception`` on the way turns it into a worker failure."""


@dataclass
class Call:
    handle: WorkerHandle
    method: str
    future: Any
    heartbeat: bool = False

    def wait(self, cancelled: threading.Event | None = None) -> Any:
        """The call's result (``WorkerFailed`` if it failed). ``cancelled``: once set, the
        heartbeat loop stops and raises ``Cancelled``."""
        try:
            if self.heartbeat:
                self._wait_answering(cancelled or threading.Event())
            return self.future.wait()
        except WorkerFailed:
            raise
        except Exception as e:  # noqa: BLE001 - re-raised with rank/role
            raise WorkerFailed(self.handle.rank, self.handle.role, self.method, str(e),
                               lost=is_peer_lost(e)) from None

    def _wait_answering(self, cancelled: threading.Event) -> None:
        """Until the call ends, ping the worker every HEARTBEAT_S; one unanswered within the
        handle's timeout, or failing (the process is gone), makes it lost. A worker that answers
        but whose call never ends (a deadlock, a reward function in an endless loop) is waited
        for, as Ray's calls are, with a line on stderr every ``STILL_WAITING_S``."""
        done = threading.Event()
        self.future.add_done_callback(lambda _: done.set())
        start = time.monotonic()
        said = 0
        while not done.wait(HEARTBEAT_S):
            if cancelled.is_set():
                raise Cancelled
            try:
                beat = rpc.rpc_async(self.handle.name, ping, timeout=self.handle.timeout)
                if not _settles(beat, HEARTBEAT_S) and not done.is_set() and not cancelled.is_set():
                    # say a silent worker at once
                    print(f"[controller] worker rank {self.handle.rank} ({self.handle.role}) has not answered a "
                          f"heartbeat for {HEARTBEAT_S:g} s in {self.method}(); it is declared lost if none comes "
                          f"within placement.rpc_timeout_s = {self.handle.timeout:g} s", file=sys.stderr, flush=True)
                beat.wait()
            except Exception as e:  # noqa: BLE001
                if done.wait(1.0):
                    return  # it ended meanwhile: its own result or error tells
                if cancelled.is_set():
                    raise Cancelled from None
                waited = time.monotonic() - start
                why = (f"no answer to a heartbeat within placement.rpc_timeout_s = {self.handle.timeout:g} s"
                       if is_timeout(str(e)) else "its connection closed")
                raise WorkerFailed(self.handle.rank, self.handle.role, self.method,
                                   f"{why}, {waited:.0f} s into the call: {e}", lost=True) from None
            waited = time.monotonic() - start
            if waited >= (said + 1) * STILL_WAITING_S and not cancelled.is_set():
                said += 1
                print(f"[controller] still waiting for worker rank {self.handle.rank} ({self.handle.role}) in "
                      f"{self.method}(): {waited / 60:.0f} min; it answers its heartbeat, so it is alive but its "
                      "work has not ended (a long round, or stuck: see its own output)", file=sys.stderr, flush=True)


def _settles(fut, seconds: float) -> bool:
    """Whether ``fut`` completes (with a result or an error) within ``seconds``."""
    ended = threading.Event()
    fut.add_done_callback(lambda _: ended.set())
    return ended.wait(seconds)


class Completions:
    """Calls waited for together, taken in the order they end: ``next()`` returns the first to
    end as ``(tag, call, result, error)``, its error a ``WorkerFailed`` (else None). Each call is
    waited on a thread of its own, with its heartbeat (``Call.wait``), so a worker lost while
    an earlier call still runs is known when it is lost, not once the earlier call ends.
    ``cancel()``: the owner gives up on what is still pending (it failed, or stops): those
    waits stop pinging and say nothing more, and ``next()`` raises ``Cancelled``.
    ``last_end()``: when the last call ended, noted as it ends (a done-callback), however late
    the owner takes it: a duration ends where the work ended."""

    def __init__(self) -> None:
        self._ended: queue.SimpleQueue = queue.SimpleQueue()
        self.pending = 0
        self.added = 0
        self.cancelled = threading.Event()
        self._end_times: list[float] = []

    def add(self, call: Call, tag: Any = None) -> None:
        def waiter() -> None:
            try:
                self._ended.put((tag, call, call.wait(self.cancelled), None))
            except Cancelled:
                pass
            except WorkerFailed as e:
                self._ended.put((tag, call, None, e))
            except BaseException as e:  # noqa: BLE001 - never leave next() waiting
                self._ended.put((tag, call, None, WorkerFailed(call.handle.rank, call.handle.role, call.method,
                                                               f"{type(e).__name__}: {e}")))

        self.pending += 1
        self.added += 1
        call.future.add_done_callback(lambda _f: self._end_times.append(time.time()))
        threading.Thread(target=waiter, daemon=True, name=f"wait-{call.handle.name}-{call.method}").start()

    def next(self) -> tuple[Any, Call, Any, WorkerFailed | None]:
        if self.pending == 0:
            raise RuntimeError("Completions.next: no call pending")
        while True:  # a timed get: a signal on the main thread is handled at once
            if self.cancelled.is_set():
                raise Cancelled
            try:
                out = self._ended.get(timeout=1.0)
            except queue.Empty:
                continue
            if self.cancelled.is_set():  # ended after the owner gave up: not its to act on
                raise Cancelled
            self.pending -= 1
            return out

    def cancel(self) -> None:
        self.cancelled.set()

    def last_end(self) -> float:
        """When the last call added so far ended; one still ending (its callback running, or
        not ended yet) counts as now."""
        now = time.time()
        return max(self._end_times + [now] * (self.added - len(self._end_times)), default=now)


def wait_all(calls: list[Call]) -> list[Any]:
    """Every call's result, in the calls' order. The first call to fail fails the wait at once
    (``Completions``), whatever the others do: when one trainer rank raises in ``step()`` the
    others wait for it in the gradient all-reduce until their group's timeout (torch's default
    then, 30 min; ``placement.rpc_timeout_s`` now, ``subgroup``), and waited in order, the run
    hung that long, then said that timeout instead of the worker's own error."""
    waiting = Completions()
    for i, c in enumerate(calls):
        waiting.add(c, i)
    out: list[Any] = [None] * len(calls)
    try:
        while waiting.pending:
            i, _call, result, err = waiting.next()
            if err is not None:
                raise err
            out[i] = result
    finally:
        waiting.cancel()  # the run stops on a failure: the calls left need no more heartbeats
    return out


def construct(rank: int, cls, args: tuple, timeout: float) -> tuple[int, Any]:
    """Start constructing ``cls(*args)`` on ``rank`` (``rpc.remote``, whose constructor may take
    ``SETUP_FACTOR`` x ``timeout``); ``settle`` waits for it. Several at once: one ``settle``."""
    return rank, rpc.remote(worker_name(rank), cls, args=args, timeout=timeout * SETUP_FACTOR)


def create(rank: int, role: str, cls, *args, timeout: float = 300.0) -> WorkerHandle:
    """Construct ``cls(*args)`` on ``rank`` and return its handle (waits for the constructor,
    up to ``SETUP_FACTOR`` x ``timeout``; the handle's calls get ``timeout``)."""
    return settle([construct(rank, cls, args, timeout)], role, timeout)[0]


def owner_ready(rref) -> bool:
    """Runs on the owner: raises the constructor's exception if it failed."""
    rref.local_value()
    return True


def waited(fut, rank: int, role: str, method: str):
    """``fut`` (a call to ``rank``) waited for: what the call raised there (or its process lost)
    is a ``WorkerFailed`` naming the rank, its role and ``method``, as every other worker failure
    (a trainer failing in the model bootstrap was said as the controller's own error)."""
    try:
        return fut.wait()
    except Exception as e:  # noqa: BLE001
        raise WorkerFailed(rank, role, method, str(e), lost=is_peer_lost(e)) from None


def call_on(rank: int, role: str, fn, args: tuple = (), timeout: float | None = None):
    """``fn(*args)`` run on ``rank``, ``waited`` for (a call that cannot be sent fails as one)."""
    method = getattr(fn, "__name__", str(fn))
    try:
        fut = rpc.rpc_async(worker_name(rank), fn, args=args, timeout=RPC_TIMEOUT_S if timeout is None else timeout)
    except Exception as e:  # noqa: BLE001 - not in the group (gone before the call)
        raise WorkerFailed(rank, role, method, str(e), lost=True) from None
    return waited(fut, rank, role, method)


def settle(created: list[tuple[int, Any]], role: str, timeout: float) -> list[WorkerHandle]:
    """Wait until every ``rpc.remote``-created object exists (constructor errors surface here,
    with rank and role), up to ``SETUP_FACTOR`` x ``timeout`` (``construct`` made them with that
    deadline too); the object itself stays on its rank, its handle's calls get ``timeout``."""
    futs = [(r, rref, rpc.rpc_async(worker_name(r), owner_ready, args=(rref,), timeout=timeout * SETUP_FACTOR))
            for r, rref in created]
    out = []
    for r, rref, f in futs:
        try:
            f.wait()
        except Exception as e:  # noqa: BLE001
            raise WorkerFailed(r, role, "__init__", str(e), lost=is_peer_lost(e)) from None
        out.append(WorkerHandle(r, role, rref, timeout))
    return out


# torch RPC keeps a timeout as int32 milliseconds, and a constructor's call waits SETUP_FACTOR
# times the timeout: the largest that stays a timeout (~6.2 days; more wrapped to a negative one)
MAX_RPC_TIMEOUT_S = (2**31 - 1) // SETUP_FACTOR / 1000


def gone_peers(handles, besides: int, timeout_s: float = 3.0) -> list[str]:
    """``handles`` (not rank ``besides``) whose process does not answer a ping: a worker that
    raised a transport error (its call to another worker hit EOF) is not the cause; the one gone
    is, and the stop line names it (a dead trainer rank was reported as the generation rank's
    error; review, s54). A rank busy past ``timeout_s`` counts as answering."""
    def asked(h):  # a rank gone from the group fails at the call, not the answer
        try:
            return rpc.rpc_async(h.name, ping, timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - the answer, as a failed wait's
            return e

    out = []
    for h, fut in [(h, asked(h)) for h in handles if h.rank != besides]:
        try:
            if isinstance(fut, Exception):
                raise fut
            fut.wait()
        except Exception as e:  # noqa: BLE001 - what the ping met is the answer
            if is_peer_lost(e) and not is_timeout(str(e)):
                out.append(f"worker rank {h.rank} ({h.role}) is gone ({str(e).splitlines()[0][:120]})")
    return out
