"""Keepalive: workers end when the controller has gone silent.

torchrun ends a job when one of its processes exits, not when one stops answering: a frozen
controller (SIGSTOPped, stuck in a system call, a C extension holding the GIL) would hold
every worker, and its GPUs, forever. So the controller pings each worker every
``KEEPALIVE_S`` seconds from a thread of its own, whatever its main thread is doing (a
generation round, the REPL waiting on stdin, a checkpoint), and a worker that hears nothing
for ``placement.rpc_timeout_s`` (a joiner too: it reads the job's) leaves with exit code 1 saying
why; torchrun then stops the job (``processes.serve``). The same timeout bounds the other
direction (controller.rpc: a worker that answers no heartbeat is lost).

A worker that was itself stopped (Ctrl-Z stops every rank of a terminal's job) does not count
the time it was stopped against the controller: ``Watchdog`` restarts its count when its own
1-second checks come late.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import torch.distributed.rpc as rpc

from controller.process_state import LOCAL, ping
from controller.rpc import is_peer_lost, is_timeout, worker_name

KEEPALIVE_S = 10.0  # how often the controller pings each worker (at most a quarter of rpc_timeout_s)
OWN_GAP_S = 5.0  # a check this late means this process was stopped or starved: count afresh


def period(timeout_s: float) -> float:
    """The controller's ping period for workers that leave after ``timeout_s`` of silence."""
    return min(KEEPALIVE_S, timeout_s / 4)


_WATCHED: set[int] = set()  # worker ranks the controller pings (static ranks, then joiners)
_LOST: dict[int, str] = {}  # rank -> the transport error of the ping that found its process gone
_LOCK = threading.Lock()


def watch(*ranks: int) -> None:
    """Ping these workers from now on (static ranks at start, a joiner once it registers)."""
    with _LOCK:
        _WATCHED.update(ranks)
        for r in ranks:
            _LOST.pop(r, None)


def unwatch(rank: int) -> None:
    with _LOCK:
        _WATCHED.discard(rank)


def watched() -> list[int]:
    with _LOCK:
        return sorted(_WATCHED)


def lost(rank: int) -> str | None:
    """Why a ping found ``rank``'s process gone (its transport error's first line), or None."""
    with _LOCK:
        return _LOST.get(rank)


def lost_ranks() -> dict[int, str]:
    """Every rank a ping found gone, with why."""
    with _LOCK:
        return dict(_LOST)


def _mark_lost(rank: int, err: BaseException) -> None:
    with _LOCK:
        _WATCHED.discard(rank)
        _LOST[rank] = str(err).splitlines()[0] if str(err) else type(err).__name__


class Keepalive:
    """The controller's pinging thread: ``start()`` after joining RPC, ``stop()`` before
    leaving it. A worker whose peer is gone is dropped from the list (the run's own calls say
    it is lost; ``lost(rank)`` says why: a joiner still waiting is not added then); any other
    failure (a slow answer) is retried at the next round."""

    def __init__(self, every_s: float = KEEPALIVE_S):
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="streamrl-keepalive", daemon=True)

    def start(self) -> "Keepalive":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.every_s)

    def _run(self) -> None:
        from controller import dead_members

        while not self._stop.is_set():
            for r, why in lost_ranks().items():  # (here, not in the ping's callback: it may wait on the store)
                dead_members.note(r, why)
            for r in watched():
                try:
                    fut = rpc.rpc_async(worker_name(r), ping, timeout=max(self.every_s, 1.0))
                except RuntimeError:  # not (or no longer) in the RPC group
                    unwatch(r)
                    continue
                fut.add_done_callback(lambda f, r=r: self._answered(f, r))
            self._stop.wait(self.every_s)

    @staticmethod
    def _answered(fut, rank: int) -> None:
        try:
            fut.wait()
        except Exception as e:  # noqa: BLE001 - a failed ping is only ever a reason to stop pinging
            if is_peer_lost(e) and not is_timeout(str(e)):  # gone, not slow (a stopped worker resumes)
                _mark_lost(rank, e)


class Watchdog:
    """A worker's count of the time since the controller was last heard from (``ping`` sets
    ``LOCAL.last_heard``). ``check()`` once a second from the serving loop: None, or why the
    worker should leave."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.timeout_s, self.clock = timeout_s, clock
        self._last_check = clock()
        LOCAL.last_heard = self._last_check

    def check(self) -> str | None:
        now = self.clock()
        if now - self._last_check > OWN_GAP_S:  # this process was stopped: not the controller's silence
            LOCAL.last_heard = now
        self._last_check = now
        silent = now - LOCAL.last_heard
        if silent <= self.timeout_s:
            return None
        return (f"the controller (rank 0) has not been heard from for {silent:.0f} s "
                f"(placement.rpc_timeout_s = {self.timeout_s:g} s): it is frozen or unreachable; "
                "this worker leaves so that the launcher ends the job")
