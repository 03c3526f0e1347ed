"""The trainer's reward pool (workers/tasks/reward_pool.py): scores at once, deadlines, processes.

Real threads and real spawned processes (pebble); no clock is read by an assertion: concurrency
is shown by a barrier only concurrent calls can pass, deadlines by rewards that never return."""
import math
import os
import signal
import threading

import pytest

from runtime_helpers import tiny_model  # noqa: F401  (session-wide tiny model folder)
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


class Many(Rule):
    """A batch reward (a reward model, verl's batch manager): ``score_batch`` takes many samples;
    ``parties`` calls must be in flight at once to pass its barrier; "hang" in a batch hangs it."""

    def __init__(self, parties: int = 1):
        self.barrier = threading.Barrier(parties, timeout=30) if parties > 1 else None  # (locks do not pickle)
        self.sizes = []

    def score_batch(self, prompts, completions):
        self.sizes.append(len(completions))
        if "hang" in completions:
            FOREVER.wait()
        if self.barrier is not None:
            self.barrier.wait()
        return [float(c == p.answer) if c != "pid" else float(os.getpid()) for p, c in zip(prompts, completions)]


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
    ({"reward_timeout_s": 0}, r"trainer.reward_timeout_s must be in \(0, 9.22337e\+09\] seconds \(a thread's wait; "
                              r"or null: no deadline\), got 0"),
    # past threading.TIMEOUT_MAX: taken, then the pool's wait raised OverflowError
    ({"reward_timeout_s": 1e10}, r"trainer.reward_timeout_s must be in \(0, 9.22337e\+09\]"),
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


def _many(pool, completions):
    return pool.submit_many([(P, c, f"sample {i}") for i, c in enumerate(completions)])


def test_a_batch_reward_gets_each_submit_many_in_one_call_and_calls_run_at_once():
    task = Many(parties=2)
    pool = RewardPool(task, workers=2)
    first, second = _many(pool, ["5", "4", "5"]), _many(pool, ["5", "1"])  # two calls meet at the barrier
    assert [pool.result(p).score for p in first + second] == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert sorted(task.sizes) == [2, 3]
    assert [pool.result(p).why for p in _many(pool, [])] == []
    pool.close()
    capped = Many()
    pool = RewardPool(capped, workers=1, batch_size=2)  # trainer.reward_batch_size
    assert [pool.result(p).score for p in _many(pool, ["5", "4", "5", "5", "1"])] == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert capped.sizes == [2, 2, 1]
    pool.close()


def test_a_reward_that_calls_sys_exit_costs_its_sample_not_the_pool():
    # SystemExit ended the reward thread: the score never came and the trainer waited forever
    class Exits(Rule):
        def score(self, prompt, completion):
            if completion == "exit":
                raise SystemExit(2)
            return super().score(prompt, completion)

    pool = RewardPool(Exits(), workers=1)
    out = _all(pool, ["exit", "5", "exit", "5"])
    assert [s.score for s in out if not s.why] == [1.0, 1.0]
    assert [s.why for s in out if s.why] == ["the task's score raised SystemExit(2)"] * 2
    pool.close()


def test_a_reward_that_raises_cancelled_error_costs_its_sample_not_the_pool():
    # asyncio.CancelledError is a BaseException too (asyncio.run over a gather whose task was
    # cancelled): it ended the reward thread, and the sample waited forever (review, session 47)
    import asyncio

    class Cancels(Rule):
        def score(self, prompt, completion):
            if completion == "cancel":
                async def main():
                    t = asyncio.ensure_future(asyncio.sleep(10))
                    await asyncio.sleep(0)
                    t.cancel()
                    await asyncio.gather(t)
                return asyncio.run(main())
            return super().score(prompt, completion)

        def score_batch(self, prompts, completions):  # the batch path catches the same
            if "cancel" in completions:
                raise asyncio.CancelledError()
            return [self.score(p, c) for p, c in zip(prompts, completions)]

    pool = RewardPool(Cancels(), workers=1)
    out = [pool.result(p) for p in _many(pool, ["cancel", "5"])]  # one score_batch call
    assert [s.why for s in out] == ["the task's score_batch raised CancelledError()"] * 2
    pool.close()
    del Cancels.score_batch
    pool = RewardPool(Cancels(), workers=1)
    out = _all(pool, ["cancel", "5"])
    assert [(s.score, s.why) for s in out][1] == (1.0, "")
    assert out[0].why == "the task's score raised CancelledError()"
    pool.close()


def test_a_batch_past_its_deadline_costs_its_samples_only():
    task = Many()
    pool = RewardPool(task, workers=1, timeout_s=0.3)
    hung, fine = _many(pool, ["5", "hang"]), _many(pool, ["5", "4"])
    out = [pool.result(p) for p in hung]
    assert all(math.isnan(s.score) and "ran past trainer.reward_timeout_s (0.3 s)" in s.why for s in out)
    assert [s.seconds for s in out] == [0.15, 0.15]  # the call's time, shared by its samples
    assert [pool.result(p).score for p in fine] == [1.0, 0.0]  # a fresh thread took over
    pool.close()


def test_a_batch_reward_in_processes_runs_there_in_one_call():
    pool = RewardPool(Many(), workers=1, pool="processes")
    try:
        out = [pool.result(p) for p in _many(pool, ["pid", "5", "4"])]
        assert out[0].score != float(os.getpid()) and [s.score for s in out[1:]] == [1.0, 0.0]
        assert len({s.seconds for s in out}) == 1  # one call, its time shared
    finally:
        pool.close()


GATE_TASK = '''
import threading

from workers.tasks.registry import make_task


class Gate:
    """Scores 1.0 once the test opens the gate; says which completions it was handed."""

    def __init__(self, **kwargs):
        self.base, self.entered, self.open = make_task("synthetic", **kwargs), [], threading.Event()

    def prompts(self, split):
        return self.base.prompts(split)

    def score(self, prompt, completion):
        self.entered.append(completion)
        assert self.open.wait(60)
        return 1.0
'''


def test_the_trainer_rank_scores_each_sample_as_it_arrives(tiny_model, tmp_path):  # noqa: F811
    # the rewards of a streamed iteration used to start only when the consumer reached the
    # samples, each small hand-over waiting out its own rewards; now each is in flight from the
    # receive RPC on. `batch` mode holds every sample until step(): the scores run before it
    import time

    from controller.trainer_rank import TrainerRank
    from runtime_helpers import TASK
    from workers.trainer.rollout import rollout

    (tmp_path / "gate.py").write_text(GATE_TASK)
    cfg = TrainerConfig(algorithm="grpo", reward_workers=4)
    rank = TrainerRank(0, [0], cfg, tiny_model, f"{tmp_path}/gate.py:Gate", TASK)
    try:
        task = rank.worker.task
        samples, prompts, groups = rollout(rank.worker.actor, rank.worker.tokenizer, task.prompts("train")[:4], 2, 6)
        rank.begin_iteration(0, prompts, groups, "batch", 0)
        assert rank.receive(samples) == 8
        for _ in range(600):  # four rewards in flight (the pool's four threads) before any train call
            if len(task.entered) == 4:
                break
            time.sleep(0.05)
        assert len(task.entered) == 4 and rank.worker.stats.sums["num_samples"] == 0.0
        task.open.set()
        report = rank.step(0)
        assert report.num_samples == 8 and report.metrics["reward_mean"] == 1.0
        assert len(task.entered) == 8  # each sample scored once: receive used the scores in flight
    finally:
        task.open.set()
        rank.close()


BATCH_TASK = GATE_TASK + '''

class Batched(Gate):
    def score_batch(self, prompts, completions):
        self.entered.append(len(completions))
        return [1.0] * len(completions)
'''


def test_a_batch_reward_is_handed_each_arrival_at_once(tiny_model, tmp_path):  # noqa: F811
    # a task with score_batch gets the samples of each receive RPC in one call (verl's batch manager
    # scored the whole batch; here each arrival is scored as it comes)
    from controller.trainer_rank import TrainerRank
    from runtime_helpers import TASK
    from workers.trainer.rollout import rollout

    (tmp_path / "batched.py").write_text(BATCH_TASK)
    rank = TrainerRank(0, [0], TrainerConfig(algorithm="grpo"), tiny_model, f"{tmp_path}/batched.py:Batched", TASK)
    try:
        task = rank.worker.task
        samples, prompts, groups = rollout(rank.worker.actor, rank.worker.tokenizer, task.prompts("train")[:4], 2, 6)
        rank.begin_iteration(0, prompts, groups, "stream", 0)
        assert rank.receive(samples[:6]) + rank.receive(samples[6:]) == 8
        report = rank.step(0)
        assert report.num_samples == 8 and report.metrics["reward_mean"] == 1.0
        assert task.entered == [6, 2]
    finally:
        rank.close()


def test_a_batch_size_for_a_reward_that_takes_one_sample_is_said(caplog):
    with caplog.at_level("WARNING", logger="streamrl.trainer"):
        RewardPool(Rule(), batch_size=4).close()
        RewardPool(Many(), batch_size=4).close()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("trainer.reward_batch_size 4 does nothing here: the task scores "
                                                 "one sample a call")
