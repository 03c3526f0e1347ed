"""The trainer's reward pool (workers/tasks/reward_pool.py): scores at once, deadlines, processes.

Real threads and real spawned processes (pebble); no clock is read by an assertion: concurrency
is shown by a barrier only concurrent calls can pass, deadlines by rewards that never return."""
import math
import os
import signal
import threading

import pytest

from workers.tasks.reward_pool import RewardPool
from workers.trainer.config import TrainerConfig
from workers.types import TaskPrompt

P = TaskPrompt(prompt="q", answer="5", task="t")
FOREVER = threading.Event()  # never set: a reward waiting on it hangs (its thread is a daemon)


class Rule:
    """Module-level, so a spawned reward process can build it (by pickle)."""

    def prompts(self, split):
        return []

    def score(self, prompt, completion):
        if completion == "hang":
            FOREVER.wait()
        if completion == "sleep":
            import time

            time.sleep(3600)
        if completion == "die":
            os._exit(3)
        if completion == "pid":
            return float(os.getpid())
        if completion == "alarm":  # verl's timeout_limit / math-verify: SIGALRM, main thread only
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            return 1.0
        return float(completion == prompt.answer)


class Meet(Rule):
    """Four calls meet at a barrier: passing it needs four scores in flight at once."""

    def __init__(self, parties: int):
        self.barrier = threading.Barrier(parties, timeout=30)

    def score(self, prompt, completion):
        self.barrier.wait()  # BrokenBarrierError (a failed score) unless `parties` calls are in flight
        return 1.0


def _all(pool, completions):
    jobs = [pool.submit(P, c, f"sample {i}") for i, c in enumerate(completions)]
    return [pool.result(j) for j in jobs]


def test_threads_score_workers_at_once():
    pool = RewardPool(Meet(4), workers=4)
    assert [s.score for s in _all(pool, ["a"] * 8)] == [1.0] * 8  # two rounds of four
    pool.close()


def test_one_thread_scores_one_at_a_time():
    # reward_workers: 1 (the default) keeps the calls serial, as verl's naive reward manager:
    # the barrier of two is never met, so the first call fails after the barrier's own timeout
    task = Meet(2)
    task.barrier = threading.Barrier(2, timeout=0.2)
    out = _all(RewardPool(task, workers=1), ["a", "a"])
    assert all(math.isnan(s.score) and "BrokenBarrierError" in s.why for s in out)


def test_a_score_past_its_deadline_skips_that_sample_only_threads():
    pool = RewardPool(Rule(), workers=1, timeout_s=0.3)
    out = _all(pool, ["5", "hang", "4", "5"])
    assert [s.score for s in out if not s.why] == [1.0, 0.0, 1.0]  # a fresh thread took over
    assert math.isnan(out[1].score)
    assert "ran past trainer.reward_timeout_s (0.3 s)" in out[1].why and "thread cannot be stopped" in out[1].why
    # waited for out of order: a later job's wait still expires the hung one ahead of it
    jobs = [pool.submit(P, c, "x") for c in ("hang", "5")]
    assert pool.result(jobs[1]).score == 1.0 and math.isnan(pool.result(jobs[0]).score)
    pool.close()


def test_processes_run_elsewhere_and_take_signal_timeouts():
    # a reward that sets a SIGALRM handler (verl's timeout_limit) cannot run on a thread
    threads = _all(RewardPool(Rule(), workers=1), ["alarm"])[0]
    assert math.isnan(threads.score) and "main thread" in threads.why
    pool = RewardPool(Rule(), workers=2, pool="processes")
    alarm, pid, ok, bad = _all(pool, ["alarm", "pid", "5", "4"])
    assert (alarm.score, ok.score, bad.score) == (1.0, 1.0, 0.0)
    assert pid.score not in (float(os.getpid()), 0.0)
    pool.close()


def test_processes_kill_a_score_past_its_deadline_and_survive_a_death():
    pool = RewardPool(Rule(), workers=1, pool="processes", timeout_s=2.0)
    first = _all(pool, ["pid"])[0].score
    sleep, after, die, last = _all(pool, ["sleep", "pid", "die", "5"])
    assert math.isnan(sleep.score) and "its process was stopped" in sleep.why
    assert after.score not in (first, 0.0)  # a fresh process replaced the killed one
    assert math.isnan(die.score) and "died (exit code 3)" in die.why
    assert last.score == 1.0
    pool.close()


def _refuse():
    raise OSError("data/train.jsonl is gone")


def test_a_task_that_cannot_be_built_in_a_process_is_said_with_each_score():
    pool = RewardPool(Rule(), workers=1, pool="processes", build_task=_refuse)
    (s,) = _all(pool, ["5"])
    assert math.isnan(s.score)
    assert s.why == "building the task in a reward process raised OSError: data/train.jsonl is gone"
    pool.close()


@pytest.mark.parametrize("kw,said", [
    ({"reward_pool": "procs"}, r"trainer.reward_pool: 'procs' is not one of \('threads', 'processes'\)"),
    ({"reward_timeout_s": 0}, r"trainer.reward_timeout_s must be > 0 seconds \(or null: no deadline\), got 0"),
])
def test_config_refuses_bad_reward_settings(kw, said):
    with pytest.raises(ValueError, match=said):
        TrainerConfig(**kw)


def test_run_config_range_of_reward_workers(tmp_path):
    from controller.config import ConfigError, load_config

    p = tmp_path / "c.yaml"
    p.write_text("trainer:\n  reward_workers: 0\n")
    with pytest.raises(ConfigError, match=r"trainer.reward_workers"):
        load_config(p)
    p.write_text("trainer:\n  reward_workers: 8\n  reward_pool: processes\n  reward_timeout_s: 30\n")
    t = load_config(p).trainer
    assert (t.reward_workers, t.reward_pool, t.reward_timeout_s) == (8, "processes", 30)
