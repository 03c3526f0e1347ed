"""A task's reward where a bug in it must cost one sample, not the run (trainer and eval):
``safe_score`` one sample, ``safe_score_batch`` many in one call of the task's ``score_batch``."""
from __future__ import annotations

import asyncio
import inspect
import logging
import math
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Sequence

from workers.types import Task, TaskPrompt

log = logging.getLogger("streamrl.trainer")


class _Loop:
    """One event loop for the process's ``async def`` rewards, in a daemon thread: a client a
    reward makes once and keeps (``httpx.AsyncClient``, ``openai.AsyncOpenAI``, an aiohttp
    session) stays bound to the loop it was made on, so every call must run there (a loop per
    call, ``asyncio.run``, failed every call after the first: "attached to a different loop").

    The loop beats every ``BEAT_S`` (a callback it runs). Once a reward has run past its deadline
    (``suspect``, from the pool), a loop that has not beaten for a whole deadline (at least
    ``MIN_STALL_S``) is blocked (a blocking call inside an ``async def`` reward: ``time.sleep``,
    ``requests.get``, a long sympy call), and every reward queued behind it would run past its
    deadline too, for the rest of the run: ``get(budget_s)`` then starts a fresh loop (said once
    a loop; clients made on the old one cannot be used on it)."""

    BEAT_S, MIN_STALL_S = 0.1, 0.5

    def __init__(self):
        self.lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.beat = 0.0  # time.monotonic() of the loop's last beat
        self.suspect = False  # a reward ran past its deadline since the loop started
        self.replaced = 0  # loops given up as blocked (the first is said)

    def get(self, budget_s: float | None = None) -> asyncio.AbstractEventLoop:
        with self.lock:
            if (self.loop is not None and self.suspect and budget_s is not None
                    and time.monotonic() - self.beat > max(budget_s, self.MIN_STALL_S)):
                if not self.replaced:
                    log.warning("an async reward has blocked the reward event loop for over %g s (a blocking "
                                "call inside `async def`: await instead); later async rewards run on a new loop "
                                "(a client made on the old one cannot be used there)", budget_s)
                self.replaced += 1
                # it stops (and closes, in its thread) once the blocking call returns: a loop and
                # its thread and descriptors were left behind at each replacement (review, session 51)
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.loop = None
            if self.loop is None:
                self.loop, self.beat, self.suspect = asyncio.new_event_loop(), time.monotonic(), False
                self.loop.call_soon(self._beat, self.loop)
                threading.Thread(target=_run_then_close, args=(self.loop,), name="streamrl-reward-loop",
                                 daemon=True).start()
            return self.loop

    def _beat(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is self.loop:  # (a replaced loop stops beating)
            self.beat = time.monotonic()
            loop.call_later(self.BEAT_S, self._beat, loop)


_CALLS: dict[int, weakref.WeakSet] = {}  # id(loop) -> the rewards' calls ``resolve`` put on it


def _run_then_close(loop: asyncio.AbstractEventLoop) -> None:
    """Run ``loop`` until it is given up as blocked, then finish the calls ``resolve`` put on it
    (still within their deadline, or with none: an environment's, an evaluation's; those given up
    were cancelled by ``resolve``), cancel what else runs there (a client's own background task,
    which would keep it forever), and close it."""
    loop.run_forever()
    calls = _CALLS.setdefault(id(loop), weakref.WeakSet())
    while True:
        loop.run_until_complete(asyncio.sleep(0))  # callbacks scheduled meanwhile become tasks
        pending = [t for t in calls if not t.done()]
        if not pending:
            break
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    rest = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in rest:
        t.cancel()
    if rest:
        loop.run_until_complete(asyncio.gather(*rest, return_exceptions=True))
    _CALLS.pop(id(loop), None)
    loop.close()


_LOOP = _Loop()


def deadline_passed() -> None:
    """A reward ran past its deadline (the pool's word): the reward loop may be blocked."""
    _LOOP.suspect = True


_DEADLINE = threading.local()  # this thread's score's deadline and budget; the pool sets them


def set_deadline(at: float | None, budget_s: float | None = None) -> None:
    """The time (``time.monotonic()``) the score this thread runs next is given up at (None:
    never), and its whole budget (``reward_timeout_s``): an ``async def`` reward is cancelled
    then (``resolve``) instead of running on, and a loop blocked for a budget is replaced."""
    _DEADLINE.at, _DEADLINE.budget = at, budget_s


def resolve(out):
    """``out``, or what it gives when awaited (an ``async def`` reward), run on the process's
    reward loop (``_Loop``) from whatever thread scores. Awaited from inside that loop itself
    (a reward that scores through a sync helper), it runs on a fresh loop in a helper thread
    instead, which cannot deadlock."""
    if not inspect.isawaitable(out):
        return out

    async def wait(tracked: bool = True):
        if tracked:  # on the process's reward loop (a helper thread's own loop is closed by asyncio.run)
            _CALLS.setdefault(id(asyncio.get_running_loop()), weakref.WeakSet()).add(asyncio.current_task())
        return await out

    at, budget = getattr(_DEADLINE, "at", None), getattr(_DEADLINE, "budget", None)
    loop = _LOOP.get(budget)
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        with ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(asyncio.run, wait(False)).result()
    try:
        fut = asyncio.run_coroutine_threadsafe(wait(), loop)
    except RuntimeError:  # closed: given up as blocked by another thread's score meanwhile
        fut = asyncio.run_coroutine_threadsafe(wait(), _LOOP.get(budget))
    try:
        return fut.result(timeout=None if at is None else max(at - time.monotonic(), 0.0))
    except FutureTimeout:  # past its deadline: cancelled (its task ends, and this thread is free)
        fut.cancel()
        raise TimeoutError("the async reward was cancelled past trainer.reward_timeout_s") from None


def as_score(out) -> float:
    """A number, or verl's {"score": number, ...}, or a tuple / list whose first item is one (verl's
    ``default_compute_score`` takes ``res[0]``: prime_math returns (is_correct, format_ok,
    answer)); an awaitable is awaited first; anything else is a ValueError saying what it was (the
    trainer skips that sample and logs it). One rule for a task's ``score`` and a verifier alike."""
    out = resolve(out)
    if isinstance(out, dict):
        if "score" not in out:
            raise ValueError(f"the reward returned a dict without 'score' (keys {sorted(map(str, out))})")
        out = out["score"]
    elif isinstance(out, (tuple, list)) and out:
        out = out[0]
    if out is None or isinstance(out, (str, bytes)) or not hasattr(out, "__float__"):
        raise ValueError(f"the reward returned {type(out).__name__} {out!r:.60}, not a number")
    return float(out)


def reward_info(out) -> dict[str, float | str | None]:
    """verl's ``reward_extra_info`` of one sample: a dict reward's entries (``score`` among them)
    whose values are numbers (a bool as 0 / 1) or text (``math_dapo``'s ``pred``), the rest left
    out; ``{}`` for any other reward. ``pred`` (a majority vote's ballot) is kept whatever it is:
    None (no answer found: ``math_dapo``'s strict box) as None, any other value as its text.
    ``out`` is the reward's value, awaited already."""
    if not isinstance(out, dict):
        return {}
    info: dict[str, float | str | None] = {}
    for key, value in out.items():
        if key == "pred" and not isinstance(value, (str, int, float)):  # (bools are ints)
            info["pred"] = None if value is None else repr(value)
        elif isinstance(value, str):
            info[str(key)] = value
        elif not isinstance(value, bytes) and hasattr(value, "__float__") and getattr(value, "ndim", 0) == 0:
            try:
                number = float(value)
            except (TypeError, ValueError, OverflowError):
                continue
            if math.isfinite(number):
                info[str(key)] = number
    return info


class _Watch:
    """Scores running now (thread id -> (start, what)); a daemon thread says once per call when
    one has run past ``LONG_S``: a reward that hangs (a stuck request, an endless loop) held the
    trainer with no word, since its rank still answered the heartbeat. A score under a deadline
    (``set_deadline``) is the pool's to give up on: not said here."""

    LONG_S = 60.0

    def __init__(self):
        self.lock = threading.Lock()
        self.running: dict[int, tuple[float, str]] = {}
        self.thread: threading.Thread | None = None

    def enter(self, what: str) -> int:
        key = threading.get_ident()
        if getattr(_DEADLINE, "at", None) is not None:
            what = ""  # under trainer.reward_timeout_s: the pool gives up on it and says so
        with self.lock:
            self.running[key] = (time.monotonic(), what)
            if self.thread is None:
                self.thread = threading.Thread(target=self._watch, name="streamrl-score-watch", daemon=True)
                self.thread.start()
        return key

    def leave(self, key: int) -> None:
        with self.lock:
            self.running.pop(key, None)

    def overdue(self, now: float) -> list[str]:
        """The calls past LONG_S not said yet (each is said once)."""
        late = []
        with self.lock:
            for key, (start, what) in list(self.running.items()):
                if what and now - start > self.LONG_S:
                    late.append(f"the task's score of {what} has run for {now - start:.0f} s")
                    self.running[key] = (start, "")  # said
        return late

    def _watch(self) -> None:
        while True:
            time.sleep(min(10.0, self.LONG_S / 4))
            for line in self.overdue(time.monotonic()):
                log.warning("%s: a reward that hangs holds the trainer (set trainer.reward_timeout_s, or time "
                            "out inside the reward, e.g. a request's own timeout)", line)


WATCH = _Watch()



def safe_score(task: Task, prompt: TaskPrompt, completion: str,
               what: str = "a sample") -> tuple[float, str, dict]:
    """-> (the task's score, "", its ``reward_info``) or (NaN, why, {}): it raised, or gave no
    finite number (a number, verl's {"score": ...}, an awaitable of either: ``as_score``).
    ``what`` names the call in the line said when it runs past ``_Watch.LONG_S``."""
    key = WATCH.enter(what)
    try:
        out = resolve(task.score(prompt, completion))
    except KeyboardInterrupt:  # Ctrl-C stops the run, not a sample
        raise
    except BaseException as e:  # noqa: BLE001 - a user's verifier: anything (sys.exit, asyncio's
        # CancelledError, func_timeout's FunctionTimedOut: on a reward thread they ended the
        # thread, the score never came and the trainer waited forever)
        return float("nan"), f"the task's score raised {e!r}", {}
    finally:
        WATCH.leave(key)
    try:  # what it returned, checked: its own reason (not "raised ValueError": the failure summaries
        # group raised ones by type, and None, a str and a dict without 'score' were one line; s60)
        score = as_score(out)
    except ValueError as e:  # as_score's own word
        return float("nan"), f"the task's score: {e}", {}
    except Exception as e:  # noqa: BLE001 - float() of the user's value (an array of 2: TypeError)
        return float("nan"), f"the task's score raised {e!r}", {}
    return _finite(score, out)


_FP32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max (this module does not import torch)


def _finite(score: float, out) -> tuple[float, str, dict]:
    """``(score, "", reward_info(out))``, or ``(nan, why, {})`` for an inf or NaN score (it would
    poison the advantages), or one past float32's range: the trainer's rewards are fp32, where
    it is inf (1e39 made a group's advantages NaN and cost every sample of its micro-batches; s60)."""
    if not math.isfinite(score):
        return math.nan, f"the task's score is {score}", {}
    if abs(score) > _FP32_MAX:
        return math.nan, f"the task's score {score:g} is past float32's range (the trainer's rewards are fp32)", {}
    return score, "", reward_info(out)


def score_batch_of(task: Task):
    """The task's ``score_batch(prompts, completions) -> sequence of scores``, or None when it
    has none (it is scored one sample per call). A reward model or a judge that takes many
    samples per request defines it (verl's ``batch`` reward manager)."""
    fn = getattr(task, "score_batch", None)
    return fn if callable(fn) else None


def safe_score_batch(task: Task, prompts: Sequence[TaskPrompt], completions: Sequence[str],
                     what: str = "a batch") -> list[tuple[float, str, dict]]:
    """``safe_score`` of each sample, from one ``score_batch`` call: it raising, or not giving
    one result per sample, costs every sample of the call; a result that is no finite number
    (``as_score``'s rule), or an exception in a sample's place, costs its own sample."""
    n = len(prompts)
    key = WATCH.enter(what)
    try:
        out = resolve(score_batch_of(task)(list(prompts), list(completions)))
        if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__"):
            return [(math.nan, f"the task's score_batch returned {type(out).__name__} {out!r:.60}, not a "
                               "list of scores", {})] * n
        out = list(out)
        if len(out) != n:
            # no counts in it: the trainer says each different reason once, and batch sizes vary
            return [(math.nan, "the task's score_batch did not return one score per sample", {})] * n
        scored = []
        for x in out:
            if isinstance(x, BaseException):  # the batch scorer's word that this sample cannot be scored
                scored.append((math.nan, f"the task's score_batch: {x}", {}))
                continue
            try:
                x = resolve(x)
                score = as_score(x)
            except Exception as e:  # noqa: BLE001 - the user's value: this sample only
                scored.append((math.nan, f"the task's score_batch: {e}", {}))
                continue
            scored.append(_finite(score, x))
        return scored
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - a user's reward: anything can happen (as safe_score)
        return [(math.nan, f"the task's score_batch raised {e!r}", {})] * n
    finally:
        WATCH.leave(key)
