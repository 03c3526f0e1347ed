"""MultiTurnEngine on its failure paths (review, session 53): an environment raising outside
``Exception`` (argparse's SystemExit), the inner engine's ``add`` raising while it takes the next
turns, and ``close()`` racing an ``end`` queued by a finishing call. A real native engine and
real pool threads; the model of ``tests/test_multi_turn_engine``."""
import argparse
import concurrent.futures as cf
import threading
import time

import pytest
import torch

from workers.generation.multi_turn import MultiTurnEngine
from workers.types import TaskPrompt
from tests.test_multi_turn_engine import HALF, OBS, TOK, first_stop, inner, req, run_on

torch.set_num_threads(1)


def test_an_environment_exiting_is_its_samples_error_and_the_others_go_on():
    """A tool parsing the model's arguments with argparse exits (SystemExit 2): the step raised
    it, the sample stayed queued for good and the step's other samples were lost."""

    def env(task, messages):
        if task.prompt == "bad":
            parser = argparse.ArgumentParser(prog="calc")
            parser.add_argument("--x", type=int, required=True)
            parser.parse_args(["--x", "not-an-int"])
        return None

    eng = MultiTurnEngine(inner(HALF), TOK, env, "tools.py:env")
    assert eng.add([req(1, task=TaskPrompt("bad", "", "t")), req(2, task=TaskPrompt("good", "", "t"), group=8)]) == []
    out = {s.sample_id: s for s in run_on(eng)}
    assert sorted(out) == [1, 2] and not eng._traj
    assert out[1].finish_reason == "error" and "SystemExit: 2" in out[1].error and "tools.py:env" in out[1].error
    assert out[2].finish_reason != "error"


def test_a_failing_add_of_the_next_turns_loses_no_trajectory():
    """The inner engine's ``add`` of the next turns raised (vLLM's queues them, then raises a
    server-side error): a trajectory the same step had ended was lost, and the continued ones
    never finished. Now the step's samples come out of the next step and the next turns are
    added again (dropped from the inner engine first: never twice)."""

    def env(task, messages):  # sample 1 ends after its first turn, sample 2 gets one observation
        return None if task.prompt == "one" else (OBS if sum(m["role"] == "assistant" for m in messages) == 1 else None)

    eng = MultiTurnEngine(inner(HALF), TOK, env, "s")
    assert eng.add([req(1, task=TaskPrompt("one", "", "t")), req(2, task=TaskPrompt("two", "", "t"), group=8)]) == []
    for _ in range(200):
        if len(eng._waiting) == 2:
            break
        eng.step()
    assert len(eng._waiting) == 2
    cf.wait([t.env_call for t in eng._waiting.values()])
    real = eng.inner.add

    def queues_then_raises(requests):
        real(requests)
        raise RuntimeError("server-side error")

    eng.inner.add = queues_then_raises
    with pytest.raises(RuntimeError, match="server-side error"):
        eng.step()
    eng.inner.add = real
    assert eng.has_work()
    out = run_on(eng)
    assert sorted(s.sample_id for s in out) == [1, 2] and all(s.finish_reason != "error" for s in out)
    two = next(s for s in out if s.sample_id == 2)
    assert two.turns == 2 and not eng._traj


def test_an_end_queued_as_close_runs_is_run():
    """A running call's done-callback queues the trajectory's ``end`` while ``close()`` shuts the
    pool down: close cancelled it and took its list before the callback added it, so ``end``
    never ran (a sandbox leaked). The callback's lock is delayed to force that order."""
    gate, closing, started, ended = threading.Event(), threading.Event(), [], []

    class Env:
        def start(self, trajectory, task):
            started.append(trajectory)

        def __call__(self, task, messages, trajectory=None):
            gate.wait(10)
            return OBS

        def end(self, trajectory):
            ended.append(trajectory)

    eos, _ = first_stop()
    eng = MultiTurnEngine(inner(eos), TOK, Env(), "s", workers=1)
    lock = eng._ends_lock

    class LateOnThePool:  # the callback's thread is preempted before it takes the lock
        def __enter__(self):
            if threading.current_thread().name.startswith("multi_turn_env"):
                closing.wait(5)
            return lock.__enter__()

        def __exit__(self, *exc):
            return lock.__exit__(*exc)

    eng._ends_lock = LateOnThePool()
    eng.add([req(1)])
    for _ in range(200):
        if eng._waiting:
            break
        eng.step()
    for _ in range(100):  # the call is running (start returned)
        if started:
            break
        time.sleep(0.05)
    assert started and eng.abort([1]) == [1]  # its end waits for the call's done-callback
    gate.set()
    time.sleep(0.3)  # the call returned; its callback queued the end (the one worker runs the callback)
    closer = threading.Thread(target=eng.close)
    closer.start()
    time.sleep(0.3)
    closing.set()
    closer.join(10)
    for _ in range(100):
        if ended:
            break
        time.sleep(0.05)
    assert ended == started


@pytest.mark.parametrize("where", ["add", "step"])
def test_a_next_turn_the_inner_engine_fails_keeps_its_trajectorys_group_and_prompt(where):
    """A continuation is a request of group -1 whose prompt is the context so far: refused by
    the inner engine (an observation id outside the model's vocabulary, vLLM failing it), its
    error sample went out as such, and the trainer (grouped: "group_id -1 has no size") stopped
    the run, or several ranks waited for it forever (review, s53)."""
    from dataclasses import replace

    from workers.generation.sequence import error_sample

    eng = MultiTurnEngine(inner(HALF), TOK, lambda task, messages: OBS, "s")
    real_add, real_step = eng.inner.add, eng.inner.step

    def add(requests):  # continuations (group -1) refused
        if where != "add":
            return real_add(requests)
        return real_add([r for r in requests if r.group_id != -1]) + [
            error_sample(r, "refused", 0) for r in requests if r.group_id == -1]

    def step():  # a continuation's turn fails
        return [replace(s, finish_reason="error", error="failed") if where == "step" and len(s.prompt_ids) > 8
                else s for s in real_step()]

    eng.inner.add, eng.inner.step = add, step
    assert eng.add([req(1, group=7), req(2, group=7)]) == []
    out = run_on(eng)
    assert sorted(s.sample_id for s in out) == [1, 2] and not eng._traj
    for s in out:
        assert s.finish_reason == "error" and s.group_id == 7 and s.prompt_ids.tolist() == req(1).prompt_ids.tolist()
