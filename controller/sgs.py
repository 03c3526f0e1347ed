"""SGS client: the controller's view of the Stream Generation Service.

``SGS.generate(iteration, requests, version)`` splits the requests over the live instances
with F's dispatcher (``controller.scheduling.make_dispatcher``: skewness-aware split + LPT
order + batch caps) and starts every instance; samples flow from the instances straight to
the trainer ranks. ``Round.wait()`` collects the instances' metadata reports. When an
instance is lost mid-iteration (its process died), the requests whose samples never reached
a trainer are dispatched again to the others; the trainer drops duplicates by sample id, so
every request of the iteration is trained exactly once.

Every live instance fits every kept prompt: the starting ones by the start check
(controller/prompt_fit.py), a joiner by ``SGS.need`` (refused at ``add`` with less context).
So any instance can take any request, and re-dispatch after a loss or a scale-in never meets
one that cannot serve it.
"""
from __future__ import annotations

import math
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable

from controller import dead_members
from controller.config import PipelineSection
from controller.instance import GenerateReport
from controller.length_estimates import within_run_bounds
from controller.prompt_fit import ContextTooSmall
from controller.rpc import Call, Cancelled, Completions, WorkerFailed, WorkerHandle
from workers.types import Request


def default_profile(max_batch_size: int = 64, kv_tokens: int = 1 << 16, block_size: int = 16):
    """A flat-ish PTL profile for instances not profiled yet (dispatch still balances counts)."""
    from controller.scheduling import PTLProfile

    sizes = sorted({1, max_batch_size})  # engine.max_batch_size 1: one point (a profile's sizes increase)
    return PTLProfile(batch_sizes=sizes, ptl_s=[0.01 + 0.0002 * (b - 1) for b in sizes],
                      kv_tokens=kv_tokens, block_size=block_size, max_batch_size=max_batch_size)


@dataclass
class InstanceSlot:
    handle: WorkerHandle
    profile: object  # controller.scheduling.PTLProfile


class NoInstancesLeft(RuntimeError):
    """A round lost its last generation instance: the run cannot go on (the message says why)."""


@dataclass
class Round:
    """One iteration's generation over the SGS (in flight). Its own thread collects the
    instances' reports as they end (``rpc.Completions``) from ``start()`` on, and re-dispatches
    a lost instance's requests at once, also while the controller waits on something else (the
    async modes train the previous batch meanwhile); ``wait()`` joins it."""

    sgs: "SGS"
    iteration: int
    version: int
    requests: dict[int, Request]
    calls: list[tuple[InstanceSlot, Call, list[int]]] = field(default_factory=list)  # every call made
    reports: list[GenerateReport] = field(default_factory=list)
    redispatched: list[int] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)  # ranks lost during this round
    instances: int = 0  # instances in the SGS when the round was dispatched
    took_part: set[int] = field(default_factory=set)  # ranks given requests of this round
    staged_ok: bool = False  # no push runs during the round (lag 0): a staged ``version`` is this round's
    _waiting: Completions = field(default_factory=Completions, repr=False)
    _collector: threading.Thread | None = field(default=None, repr=False)
    _error: BaseException | None = field(default=None, repr=False)

    def launch(self, requests: list[Request], slots: list[InstanceSlot] | None = None) -> None:
        calls = self.sgs.launch(self.iteration, requests, self.version, slots)
        self.took_part |= {slot.handle.rank for slot, _, _ in calls}
        self.calls += calls
        for slot, call, ids in calls:
            self._waiting.add(call, (slot, ids))

    @property
    def ended_at(self) -> float:
        """time.time() its last call ended (re-dispatched ones included), noted as each ended."""
        return self._waiting.last_end()

    def start(self) -> "Round":
        self._collector = threading.Thread(target=self._collect, daemon=True, name=f"round-{self.iteration}")
        self._collector.start()
        return self

    def wait(self) -> list[GenerateReport]:
        """Every instance's report (re-dispatches included); raises what stopped the round: a
        worker's error, or ``NoInstancesLeft``."""
        if self._collector is None:
            self.start()
        while self._collector.is_alive():
            self._collector.join(1.0)  # timed: a signal on the main thread is handled at once
        if self._error is not None:
            raise self._error
        return self.reports

    def abandon(self) -> None:
        """The run stopped while this round was in flight (a failed step, a stop signal): its
        calls failing as the workers exit are not losses to act on. The collector stops
        quietly: no removals, no re-dispatch, no heartbeat lines."""
        self._waiting.cancel()

    def raise_if_failed(self) -> None:
        """Raise what stopped this round, if it stopped already (before the controller waits
        for it: an evaluation in an async mode asks first, so the round's own message is said)."""
        if self._error is not None and not isinstance(self._error, Cancelled):
            raise self._error

    def _collect(self) -> None:
        try:
            while self._waiting.pending:
                (slot, ids), _call, rep, err = self._waiting.next()
                if err is not None:
                    self.sgs.remove_lost(err)
                    if slot.handle.rank not in self.lost:  # (it may hold two calls: its share and a re-dispatch)
                        self.lost.append(slot.handle.rank)
                    self._redispatch(ids)
                    continue
                self.reports.append(rep)
                if rep.stopped:  # the instance left (scale-in): hand its rest to the others
                    # (all its requests may be done: it still leaves; it stayed, and the next
                    # round's call met its closed process as a lost instance)
                    self.sgs.remove(slot.handle.rank, reason="stopped")
                    if rep.unfinished:
                        self._redispatch(rep.unfinished)
        except Cancelled:
            pass  # abandoned
        except BaseException as e:  # noqa: BLE001 - raised by wait(), on the controller's thread
            self._error = e

    def _redispatch(self, ids: list[int]) -> None:
        if self._waiting.cancelled.is_set():
            raise Cancelled
        received = self.sgs.received(self.iteration)
        missing = [i for i in ids if i not in received]
        if not missing:
            return
        slots = self._holders()
        if not slots:
            others = [s.handle.rank for s in self.sgs.slots]
            raise NoInstancesLeft(f"step {self.iteration}: every generation instance is gone "
                                  f"({', '.join(f'rank {r}: {why}' for r, why in self.sgs.removed)})"
                                  f"{f'; ranks {others} hold other weights than v{self.version}' if others else ''}"
                                  f", {len(missing)} requests left")
        print(f"[sgs] step {self.iteration}: re-dispatching {len(missing)} unfinished requests "
              f"to {[s.handle.rank for s in slots]}", file=sys.stderr, flush=True)
        self.redispatched += missing
        self.launch([self.requests[i] for i in missing], slots)

    def _holders(self) -> list[InstanceSlot]:
        """Live instances that can generate with this round's weights: those that took part in
        it (each loaded ``version`` when its call began) and any other that holds ``version``
        now, or has it staged where no push runs during the round (``staged_ok``: lag 0; the
        async modes push the next version during the round, which replaces the staged one
        before the call arrives: "asked to generate with weight version"). Not a joiner added
        after the round began (it pulled newer weights)."""
        out = []
        for s in list(self.sgs.slots):
            if s.handle.rank not in self.took_part:
                try:
                    st = s.handle.call("stats").wait()
                    if self.version not in (st.weight_version, st.staged_version if self.staged_ok else None):
                        continue
                except WorkerFailed:
                    continue  # gone too: its own call (if any) says so
            out.append(s)
        return out


def dispatch_estimates(requests: list[Request], bounds: tuple[int, float] = (0, math.inf)) -> list[float]:
    """The lengths the dispatcher plans with: the requests' ``est_len`` within ``bounds``, the
    run's ``(train.min_tokens, train.max_tokens)`` (``length_estimates.within_run_bounds``; not a
    request's own ``min_tokens`` / ``max_tokens``, which under ``train.length_trace`` are its true
    length), or, for a batch that carries no estimate (every ``est_len`` 0, the Request
    default), their ``max_tokens``. An estimate of 0 among others is the shortest, not a missing
    one (a ranker predicts >= 0)."""
    if any(r.est_len > 0 for r in requests):
        return within_run_bounds([r.est_len for r in requests], *bounds)
    return [float(r.max_tokens) for r in requests]


class SGS:
    """Live generation instances + the dispatcher. ``received(iteration)``: sample ids the
    trainers hold for an iteration (used to find what a lost instance left undone)."""

    def __init__(self, dispatcher, received: Callable[[int], set[int]], seed: int = 0):
        self.dispatcher = dispatcher
        self.received = received
        self.seed = seed
        self.slots: list[InstanceSlot] = []
        self.removed: list[tuple[int, str]] = []
        self.lost: list[int] = []  # of those, the ranks found lost (remove_lost), not asked to leave
        self.stream_window_s = PipelineSection.stream_window_s  # instances' Outbox window (Program sets the run's)
        self.need = None  # controller.prompt_fit.ContextNeed, set by the start check
        self.est_bounds: tuple[int, float] = (0, math.inf)  # (train.min_tokens, max_tokens): Program sets the run's
        self._lock = threading.Lock()

    @property
    def handles(self) -> list[WorkerHandle]:
        with self._lock:  # a round's collector may remove a lost instance meanwhile
            return [s.handle for s in self.slots]

    def add(self, handle: WorkerHandle, profile=None) -> None:
        """Take ``handle``'s instance. Once ``need`` is set (the prompts are checked), one with
        less context (max_model_len) is closed and refused: ``ContextTooSmall``."""
        if self.need is not None:
            try:
                self.need.check(handle.rank, handle.call("stats").wait().max_model_len)
            except ContextTooSmall:
                handle.alive = False
                try:
                    handle.call("close").wait()  # its engine's own processes (vLLM) stop now
                except WorkerFailed:
                    pass  # gone already
                raise
        with self._lock:
            self.slots.append(InstanceSlot(handle, profile or default_profile()))

    def remove(self, rank: int, reason: str = "") -> None:
        with self._lock:
            for s in list(self.slots):
                if s.handle.rank == rank:
                    s.handle.alive = False
                    self.slots.remove(s)
                    self.removed.append((rank, reason))
                    print(f"[sgs] instance rank {rank} removed: {reason}", file=sys.stderr, flush=True)

    def remove_lost(self, err: WorkerFailed, during: str = "") -> None:
        """A generation instance found lost (its process gone or silent) leaves, with the
        transport's reason; any other failure is raised: it stops the run."""
        if not (err.lost and err.role == "generation"):
            raise err
        why = str(err).splitlines()[0]
        self.remove(err.rank, reason=f"{f'lost during {during}: ' if during else ''}{why}")
        self.lost.append(err.rank)
        dead_members.note(err.rank, why)  # a joiner killed stays in the RPC group: later joins are refused

    def launch(self, iteration: int, requests: list[Request], version: int,
               slots: list[InstanceSlot] | None = None) -> list[tuple[InstanceSlot, Call, list[int]]]:
        """Dispatch ``requests`` over ``slots`` (default: every live instance)."""
        slots = list(self.slots) if slots is None else slots
        if not slots:  # the last one was lost between rounds (during a weight push)
            raise NoInstancesLeft(f"step {iteration}: every generation instance is gone ("
                                  + ", ".join(f"rank {r}: {why}" for r, why in self.removed) + ")")
        est = dispatch_estimates(requests, self.est_bounds)
        plan = self.dispatcher.plan(est, [s.profile for s in slots], seed=self.seed + iteration,
                                    prompt_lens=[len(r.prompt_ids) for r in requests])
        calls = []
        for slot, idx, cap in zip(slots, plan.per_instance, plan.batch_caps):
            if not idx:
                continue
            chunk = [requests[i] for i in idx]
            calls.append((slot, slot.handle.call("generate", iteration, chunk, version, int(cap),
                                                         self.stream_window_s),
                          [r.sample_id for r in chunk]))
        return calls

    def generate(self, iteration: int, requests: list[Request], version: int, staged_ok: bool = False) -> Round:
        """``staged_ok``: no weight push runs during the round (``Round.staged_ok``)."""
        rnd = Round(self, iteration, version, {r.sample_id: r for r in requests}, instances=len(self.slots),
                    staged_ok=staged_ok)
        rnd.launch(requests)
        return rnd.start()
