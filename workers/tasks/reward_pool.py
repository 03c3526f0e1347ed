"""``RewardPool``: the task's score of many samples at once, each under an optional deadline
(the trainer's rewards; ``trainer.reward_workers``, ``reward_pool``, ``reward_timeout_s``).

* ``threads`` (the default): ``workers`` daemon threads in the trainer's process. For rewards that
  wait (a request to a judge or a sandbox, an ``async def`` reward: ``workers`` calls are in
  flight at once) and for cheap rules; the scoring of a batch overlaps the trainer's reference
  forward either way. A score past its deadline costs that sample (``Scored.why``); its thread
  cannot be stopped, so it is left to finish on its own and a fresh thread takes its place.
* ``processes``: ``workers`` spawned processes (pebble's ``ProcessPool``), each building the
  task once (``build_task``, e.g. ``make_task(name, **kwargs)``). For CPU-bound Python rewards
  (math-verify, sympy: the GIL serialises threads), and for rewards that time themselves out
  with ``signal.alarm`` (they run in a process's main thread there). A score past its deadline
  has its process killed and replaced.

A task with ``score_batch(prompts, completions)`` (a reward model, a judge that takes many
samples per request; verl's ``batch`` reward manager) is handed each ``submit_many`` call's
samples in one call, or in calls of at most ``batch_size``; a pool of ``workers`` has that many
such calls in flight, each under the deadline as a whole.

A pool never raises for a sample: every failure (the score raised, gave no finite number, ran
past the deadline, killed its process) is ``Scored(nan, why)``, and the trainer skips the sample
(``on_bad_sample``).
"""
from __future__ import annotations

import logging
import math
import multiprocessing
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Callable

from workers.tasks.scoring import deadline_passed, safe_score, safe_score_batch, score_batch_of, set_deadline
from workers.types import Task, TaskPrompt

REWARD_POOLS = ("threads", "processes")
CANCEL_AFTER_S = 0.5


@dataclass(frozen=True)
class Scored:
    """``score`` (NaN when ``why`` says why there is none), the seconds the call took where it
    ran (the reward's own time: verl's ``timing_s/reward`` sums it), and a dict reward's numbers
    and texts (``scoring.reward_info``: verl's ``reward_extra_info``, e.g. ``acc``, ``pred``)."""

    score: float
    why: str
    seconds: float
    info: dict = field(default_factory=dict)


def timed_score(task: Task, prompt: TaskPrompt, completion: str, what: str) -> Scored:
    t0 = time.perf_counter()
    score, why, info = safe_score(task, prompt, completion, what)
    return Scored(score, why, time.perf_counter() - t0, info)


def timed_batch(task: Task, items: list[tuple[TaskPrompt, str, str]]) -> list[Scored]:
    """One ``score_batch`` call for ``items`` ((prompt, completion, what) each); each sample is
    charged an equal share of the call's seconds."""
    t0 = time.perf_counter()
    what = items[0][2] + (f" and {len(items) - 1} more" if len(items) > 1 else "")
    out = safe_score_batch(task, [p for p, _, _ in items], [c for _, c, _ in items], what)
    share = (time.perf_counter() - t0) / len(items)
    return [Scored(score, why, share, info) for score, why, info in out]


def _late(timeout_s: float, how: str) -> Scored:
    return Scored(math.nan, f"the task's score ran past trainer.reward_timeout_s ({timeout_s:g} s); {how}",
                  timeout_s)


class _Job:
    __slots__ = ("future", "fn", "args", "started", "thread_done", "abandoned")

    def __init__(self, fn: Callable, args: tuple):
        self.future: Future = Future()
        self.fn, self.args = fn, args  # fn(task, *args): timed_score, or timed_batch
        self.started: float | None = None  # monotonic time a thread took it
        self.thread_done = False  # its thread finished it (a late result is dropped)
        self.abandoned = False  # past its deadline: its thread leaves once it returns


class _Threads:
    def __init__(self, task: Task, workers: int, timeout_s: float | None):
        self.task, self.timeout_s = task, timeout_s
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.running: set[_Job] = set()
        self.threads = 0
        for _ in range(workers):
            self._start_thread()

    def _start_thread(self) -> None:
        self.threads += 1
        threading.Thread(target=self._serve, name="streamrl-reward", daemon=True).start()

    def _serve(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            with self.lock:
                job.started = time.monotonic()
                self.running.add(job)
            # an async reward is cancelled a moment after the pool gives up on it (which says why)
            set_deadline(None if self.timeout_s is None else job.started + self.timeout_s + CANCEL_AFTER_S,
                         self.timeout_s)
            try:
                scored = job.fn(self.task, *job.args)
            except BaseException as e:  # noqa: BLE001 - never a thread that dies with its sample waiting
                why = f"the task's score raised {e!r}"
                scored = [Scored(math.nan, why, 0.0)] * len(job.args[0]) if job.fn is timed_batch else \
                    Scored(math.nan, why, 0.0)
            with self.lock:
                self.running.discard(job)
                job.thread_done = True
                if not job.future.done():
                    job.future.set_result(scored)
                if job.abandoned:  # a fresh thread took this one's place while it ran
                    self.threads -= 1
                    return

    def submit(self, args: tuple) -> _Job:
        job = _Job(timed_score, args)
        self.jobs.put(job)
        return job

    def submit_batch(self, items: list[tuple]) -> _Job:
        job = _Job(timed_batch, (items,))
        self.jobs.put(job)
        return job

    def result(self, job: _Job) -> Scored | list[Scored]:
        if self.timeout_s is None:
            return job.future.result()
        while True:
            with self.lock:
                started = job.started
            # a queued job waits for a thread; a running one for its deadline (or the next
            # running job's, which frees a thread: jobs need not be waited for in order)
            try:
                return job.future.result(timeout=self._next_deadline(started))
            except FutureTimeout:
                self._expire()

    def _next_deadline(self, started: float | None) -> float:
        now = time.monotonic()
        with self.lock:
            starts = [j.started for j in self.running if j.started is not None]
        if started is not None:
            starts.append(started)
        if not starts:
            return 0.5
        return max(min(starts) + self.timeout_s - now, 0.0) + 0.01

    def _expire(self) -> None:
        """Every running job past its deadline gets its timeout, and its thread a successor."""
        now = time.monotonic()
        with self.lock:
            late = [j for j in self.running if now - j.started >= self.timeout_s]
            if late:
                deadline_passed()
            for job in late:
                self.running.discard(job)
                job.abandoned = True
                job.future.set_result(_late(self.timeout_s, "its thread cannot be stopped and finishes on "
                                                            "its own"))
                self._start_thread()

    def close(self) -> None:
        for _ in range(self.threads):
            self.jobs.put(None)


_CHILD: dict = {}  # in a reward process: "task", or "error" when building it failed


def _child_start(build_task: Callable[[], Task]) -> None:
    try:
        import torch

        torch.set_num_threads(1)  # workers processes beside the trainer's own threads
    except ImportError:
        pass
    try:
        _CHILD["task"] = build_task()
    except Exception as e:  # noqa: BLE001 - said with every score instead of a pool restarting forever
        _CHILD["error"] = f"building the task in a reward process raised {type(e).__name__}: {e}"


# In a reward process a KeyboardInterrupt is the reward's own (a user's Ctrl-C reaches the
# trainer, which stops the pool): it costs the call's samples, as any exception, where scoring's
# rule (Ctrl-C stops the run) would carry it to the trainer and end the run

def _child_score(prompt: TaskPrompt, completion: str, what: str) -> Scored:
    if "error" in _CHILD:
        return Scored(math.nan, _CHILD["error"], 0.0)
    try:
        return timed_score(_CHILD["task"], prompt, completion, what)
    except KeyboardInterrupt as e:
        return Scored(math.nan, f"the task's score raised {e!r}", 0.0)


def _child_score_batch(items: list[tuple[TaskPrompt, str, str]]) -> list[Scored]:
    if "error" in _CHILD:
        return [Scored(math.nan, _CHILD["error"], 0.0)] * len(items)
    try:
        return timed_batch(_CHILD["task"], items)
    except KeyboardInterrupt as e:
        return [Scored(math.nan, f"the task's score_batch raised {e!r}", 0.0)] * len(items)


class _Processes:
    def __init__(self, build_task: Callable[[], Task], workers: int, timeout_s: float | None):
        from pebble import ProcessPool

        self.timeout_s = timeout_s
        # spawned: the trainer's process holds RPC and (on GPUs) CUDA state a fork must not copy
        self.pool = ProcessPool(max_workers=workers, context=multiprocessing.get_context("spawn"),
                                initializer=_child_start, initargs=(build_task,))

    def submit(self, args: tuple) -> Future:
        return self.pool.schedule(_child_score, args=args, timeout=self.timeout_s)

    def submit_batch(self, items: list[tuple]) -> Future:
        return self.pool.schedule(_child_score_batch, args=(items,), timeout=self.timeout_s)

    def result(self, future: Future) -> Scored | list[Scored]:
        from pebble import ProcessExpired

        try:
            return future.result()
        except FutureTimeout:
            return _late(self.timeout_s, "its process was stopped")
        except ProcessExpired as e:
            return Scored(math.nan, f"the reward process running the task's score died (exit code {e.exitcode})",
                          0.0)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - e.g. a result that does not pickle, FunctionTimedOut
            return Scored(math.nan, f"the reward process failed: {type(e).__name__}: {e}", 0.0)

    def close(self) -> None:
        self.pool.stop()
        self.pool.join(timeout=10)


class RewardPool:
    """``submit`` each sample's score (or ``submit_many`` several), then ``result`` each (in any
    order). ``build_task`` (``processes`` only) builds the task in each process; by default the
    task itself is pickled there (the built-in tasks pickle; a task loaded from a ``file.py``
    does not)."""

    def __init__(self, task: Task, workers: int = 1, pool: str = "threads", timeout_s: float | None = None,
                 build_task: Callable[[], Task] | None = None, batch_size: int | None = None):
        if pool not in REWARD_POOLS:
            raise ValueError(f"trainer.reward_pool: {pool!r} is not one of {REWARD_POOLS}")
        if pool == "processes":
            self._impl = _Processes(build_task or _Given(task), workers, timeout_s)
        else:
            self._impl = _Threads(task, workers, timeout_s)
        self.batched, self.batch_size = score_batch_of(task) is not None, batch_size
        if batch_size is not None and not self.batched:
            logging.getLogger("streamrl.trainer").warning(
                "trainer.reward_batch_size %d does nothing here: the task scores one sample a call (it has no "
                "score_batch; a verifier gets one with verl's batch names, compute_score(data_sources, "
                "solution_strs, ...))", batch_size)

    def submit(self, prompt: TaskPrompt, completion: str, what: str):
        return self._impl.submit((prompt, completion, what))

    def submit_many(self, items: list[tuple[TaskPrompt, str, str]]) -> list:
        """(prompt, completion, what) each -> what ``result`` takes, in order: when the task has
        ``score_batch``, one call for them all (or calls of ``batch_size``), else one call each."""
        if not self.batched:
            return [self._impl.submit(item) for item in items]
        size, out = self.batch_size or max(len(items), 1), []
        for k in range(0, len(items), size):
            chunk = list(items[k:k + size])
            pending = self._impl.submit_batch(chunk)
            out += [_Part(pending, i, len(chunk)) for i in range(len(chunk))]
        return out

    @staticmethod
    def plus(pending, extra: float):
        """``pending`` whose score, once in, has ``extra`` added (a multi-turn sample's environment
        rewards, ``Sample.env_rewards``); a failed score stays failed."""
        return _Plus(pending, float(extra)) if extra else pending

    def result(self, pending) -> Scored:
        if isinstance(pending, _Plus):
            r = self.result(pending.pending)
            return r if r.why else Scored(r.score + pending.extra, "", r.seconds, r.info)
        if not isinstance(pending, _Part):
            return self._impl.result(pending)
        out = self._impl.result(pending.pending)
        if isinstance(out, list):
            return out[pending.index]
        return Scored(out.score, out.why, out.seconds / pending.size)  # the call failed whole (late, died)

    def close(self) -> None:
        self._impl.close()


@dataclass(frozen=True)
class _Plus:
    """A score in flight and what is added to it (``RewardPool.plus``)."""

    pending: object
    extra: float


@dataclass(frozen=True)
class _Part:
    """Sample ``index`` of a ``score_batch`` call of ``size`` samples in flight as ``pending``."""

    pending: object
    index: int
    size: int


@dataclass(frozen=True)
class _Given:
    """A task handed to the reward processes as it is (pickled)."""

    task: Task

    def __call__(self) -> Task:
        return self.task
