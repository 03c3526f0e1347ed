"""Rewards that fail the hard ways (workers/tasks/reward_pool.py, scoring.py): a BaseException
outside Exception (func_timeout's FunctionTimedOut, raised by rewards with per-call deadlines),
an ``async def`` reward that never answers, or one that blocks the shared event loop; and the
trainer's log of failures, once per kind. Real threads and spawned processes; the deadlines are
rewards that never return, no assertion reads a clock."""
import asyncio
import math
import threading
import time

import pytest

from workers.tasks.reward_pool import RewardPool
from workers.trainer.step_math import failure_kind
from workers.types import TaskPrompt

P = TaskPrompt(prompt="q", answer="5", task="t")


class TimedOut(BaseException):
    """As func_timeout.FunctionTimedOut: a BaseException, not an Exception."""


class Raises:
    """Module-level: a spawned reward process builds it by pickle."""

    def prompts(self, split):
        return []

    def score(self, prompt, completion):
        raise TimedOut("reward call took too long")


class Interrupts:
    """A reward raising KeyboardInterrupt (a library's own, not the user's Ctrl-C)."""

    def prompts(self, split):
        return []

    def score(self, prompt, completion):
        raise KeyboardInterrupt("raised by the reward")


class InterruptsBatch(Interrupts):
    def score_batch(self, prompts, completions):
        raise KeyboardInterrupt("raised by the batch reward")


@pytest.mark.parametrize("batch", [False, True])
def test_a_keyboard_interrupt_in_a_reward_process_costs_its_samples_only(batch):
    """In a reward process it cannot be the user's Ctrl-C (that reaches the trainer): it was
    carried back and raised in the trainer, ending the run (review, s53)."""
    rewards = RewardPool(InterruptsBatch() if batch else Interrupts(), workers=1, pool="processes")
    try:
        out = [rewards.result(p) for p in rewards.submit_many([(P, "x", f"sample {i}") for i in range(2)])]
    finally:
        rewards.close()
    assert all(math.isnan(r.score) and "KeyboardInterrupt" in r.why for r in out), out


@pytest.mark.parametrize("pool", ["threads", "processes"])
def test_a_base_exception_costs_its_sample_only(pool):
    """threads: the reward thread died with the sample's future unset (no deadline: the trainer
    waited forever); processes: result() raised it into the trainer."""
    rewards = RewardPool(Raises(), workers=1, pool=pool)
    try:
        out = [rewards.result(rewards.submit(P, "x", f"sample {i}")) for i in range(3)]
    finally:
        rewards.close()
    assert all(math.isnan(r.score) for r in out)
    assert all("TimedOut" in r.why and "reward call took too long" in r.why for r in out), out


class Judge:
    """An async judge: "wait" never answers (a server down, no client timeout), "block" blocks the
    loop with a sync call (a mistake inside `async def`), anything else answers at once."""

    def __init__(self):
        self.release = threading.Event()

    def prompts(self, split):
        return []

    async def score(self, prompt, completion):
        if completion == "wait":
            await asyncio.Event().wait()
        if completion == "block":
            self.release.wait(30)
        await asyncio.sleep(0)
        return float(completion == prompt.answer)


def test_an_async_reward_past_its_deadline_is_cancelled():
    """It was left pending on the loop, its worker thread blocked on it for the rest of the run."""
    from workers.tasks import scoring

    def reward_threads() -> int:  # (other tests' pools may have left theirs: counted from here)
        return sum(t.name == "streamrl-reward" for t in threading.enumerate())

    before = reward_threads()
    rewards = RewardPool(Judge(), workers=2, timeout_s=0.2)
    out = [rewards.result(j) for j in [rewards.submit(P, "wait", f"sample {i}") for i in range(8)]]
    assert all(r.why.startswith("the task's score ran past trainer.reward_timeout_s") for r in out)
    for _ in range(100):  # (cancelled half a second after the pool gave up: CANCEL_AFTER_S)
        if reward_threads() <= before + 2 and not asyncio.all_tasks(scoring._LOOP.loop):
            break
        time.sleep(0.05)
    assert reward_threads() <= before + 2, (reward_threads() - before, "threads left by 8 timeouts")
    assert not asyncio.all_tasks(scoring._LOOP.loop)
    assert rewards.result(rewards.submit(P, "5", "after")).score == 1.0
    rewards.close()


def test_an_async_reward_blocking_the_loop_costs_its_sample_not_the_later_ones():
    """One event loop serves every async reward: one blocking it past its deadline made every
    later async score of the run time out too, each waiting behind it."""
    judge = Judge()
    rewards = RewardPool(judge, workers=4, timeout_s=1.0)
    try:
        first = rewards.result(rewards.submit(P, "block", "sample 0"))
        assert first.why.startswith("the task's score ran past trainer.reward_timeout_s")
        later = [rewards.result(j) for j in [rewards.submit(P, "5", f"sample {i}") for i in range(1, 5)]]
        assert [(r.score, r.why) for r in later] == [(1.0, "")] * 4
    finally:
        judge.release.set()
        rewards.close()


def test_a_loop_given_up_as_blocked_stops_once_its_call_returns():
    """Each replaced loop stayed in run_forever for the rest of the run: a thread and three file
    descriptors left per replacement (review, session 51)."""
    def loops() -> int:
        return sum(t.name == "streamrl-reward-loop" for t in threading.enumerate())

    judge = Judge()
    rewards = RewardPool(judge, workers=1, timeout_s=0.3)
    try:
        assert rewards.result(rewards.submit(P, "block", "sample 0")).why.startswith("the task's score ran past")
        assert rewards.result(rewards.submit(P, "5", "sample 1")).score == 1.0  # on a fresh loop
        judge.release.set()  # the blocking call returns: its loop stops and closes
        for _ in range(200):  # a hang guard, not a timing assertion
            if loops() == 1:
                break
            time.sleep(0.05)
        assert loops() == 1
    finally:
        judge.release.set()
        rewards.close()


def test_a_call_queued_on_a_loop_given_up_still_runs(monkeypatch):
    """A loop given up as blocked cancelled every call on it once the blocker returned, those
    still within their deadline or with none (a multi-turn environment's, an evaluation's): they
    raised CancelledError (session 51's first fix, found by its review). They run now."""
    from workers.tasks import scoring

    monkeypatch.setattr(scoring, "_LOOP", scoring._Loop())  # this test's own loop
    release, out = threading.Event(), {}

    async def blocker():
        release.wait(30)  # a sync call inside async def: blocks the loop
        return 0.0

    async def quick():
        await asyncio.sleep(0)
        return 1.0

    def timed_out():
        scoring.set_deadline(time.monotonic() + 0.3, 0.3)
        try:
            scoring.resolve(blocker())
        except TimeoutError:
            scoring.deadline_passed()  # the pool's word

    def no_deadline():  # e.g. an environment's call: no set_deadline on that thread
        out["x"] = scoring.resolve(quick())

    a = threading.Thread(target=timed_out)
    a.start()
    while not scoring._LOOP.loop or not asyncio.all_tasks(scoring._LOOP.loop):  # the blocker is on the loop
        time.sleep(0.01)
    x = threading.Thread(target=no_deadline)
    x.start()  # queued behind the blocker
    a.join()
    while time.monotonic() - scoring._LOOP.beat <= scoring._Loop.MIN_STALL_S + 0.1:  # blocked long enough
        time.sleep(0.05)
    scoring.set_deadline(time.monotonic() + 30, 0.3)
    try:
        assert scoring.resolve(quick()) == 1.0  # a later score gives the blocked loop up, runs on a new one
    finally:
        scoring.set_deadline(None)
    assert scoring._LOOP.replaced == 1
    release.set()  # the blocker returns: the old loop finishes what is on it, then closes
    x.join(timeout=30)
    assert out == {"x": 1.0}


def test_a_loop_given_up_closes_though_a_clients_task_runs_on_it():
    """A client's background task on the loop (a heartbeat, a token refresher) never ends: the
    drain waited for it and the given-up loop and its thread stayed (session 51's second review).
    The rewards' own calls are finished; the rest is cancelled."""
    from workers.tasks import scoring

    loops = scoring._Loop()
    old = loops.get(None)
    release = threading.Event()

    async def heartbeat():
        while True:
            await asyncio.sleep(0.05)

    async def blocking():
        release.wait(30)
        return 1.0

    asyncio.run_coroutine_threadsafe(heartbeat(), old)
    asyncio.run_coroutine_threadsafe(blocking(), old)
    while time.monotonic() - loops.beat <= scoring._Loop.MIN_STALL_S + 0.1:  # blocked long enough
        time.sleep(0.05)
    loops.suspect = True
    assert loops.get(0.5) is not old
    release.set()
    for _ in range(200):  # a hang guard, not a timing assertion
        if old.is_closed():
            break
        time.sleep(0.05)
    assert old.is_closed()
    loops.loop.call_soon_threadsafe(loops.loop.stop)


def test_a_score_under_a_deadline_is_left_to_the_pool_not_the_watchdog():
    """With reward_timeout_s the pool gives a late score up and says so; the watchdog still said
    "a reward that hangs holds the trainer" a minute later (review, session 51)."""
    from workers.tasks.scoring import WATCH, set_deadline

    set_deadline(time.monotonic() + 1.0, 1.0)
    try:
        key = WATCH.enter("sample 7")
    finally:
        set_deadline(None)
    try:
        assert WATCH.overdue(time.monotonic() + 3600) == []
    finally:
        WATCH.leave(key)
    key = WATCH.enter("sample 8")  # no deadline: said
    try:
        assert WATCH.overdue(time.monotonic() + 3600) == ["the task's score of sample 8 has run for 3600 s"]
    finally:
        WATCH.leave(key)


def test_failures_are_said_once_per_kind():
    """The trainer logs a failure once per kind: keyed by the whole message, a ValueError quoting
    each sample's answer was logged for every sample (and kept for the whole run)."""
    kinds = {failure_kind(f"the task's score raised ValueError(\"cannot parse '{x}'\")") for x in ("3x", "7 y", "'")}
    assert kinds == {"the task's score raised ValueError"}
    assert failure_kind("the task's score is nan") == "the task's score is nan"
    assert failure_kind("the reward process running the task's score died (exit code 9)") == \
        failure_kind("the reward process running the task's score died (exit code 15)")
