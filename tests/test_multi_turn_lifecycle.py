"""The environment's per-trajectory life cycle in MultiTurnEngine (workers/generation/multi_turn.py;
verl's tool create / release): ``start`` before a trajectory's first call, ``end`` once it is over
for any reason, never overlapping its call in flight, only after a ``start`` that returned, also
at ``close``; each call gets its trajectory's id."""
import threading

import pytest
import torch
from test_multi_turn_engine import (MODEL, OBS, TOK, _past_first_turn, first_stop, req, run, run_on, two_stops,
                                    wrap)

from workers.generation.multi_turn import MultiTurnEngine
from workers.types import EngineStats, Sample


class Sandbox:
    """A stateful environment (verl's BaseTool create / release): ``start`` before a trajectory's
    first call, ``end`` once it is over; each call gets its trajectory's id."""

    def __init__(self, answers=(OBS, None), gate=None, fail_start=False):
        self.answers, self.gate, self.fail_start = answers, gate, fail_start
        self.events, self.open, self.lock = [], {}, threading.Lock()
        self.ended = threading.Event()

    def start(self, trajectory, task):
        if self.fail_start:
            raise RuntimeError("no sandbox left")
        with self.lock:
            assert trajectory not in self.open
            self.open[trajectory] = 0
            self.events.append(("start", trajectory))

    def __call__(self, task, messages, trajectory):
        with self.lock:
            assert trajectory in self.open, trajectory  # started, not ended
            self.open[trajectory] += 1
            self.events.append(("call", trajectory))
            k = self.open[trajectory]
        if self.gate is not None:
            self.gate.wait(10)
        return self.answers[k - 1] if k <= len(self.answers) else None

    def end(self, trajectory):
        with self.lock:
            self.events.append(("end", trajectory))  # (recorded first: an assert below is only logged)
            assert self.open.pop(trajectory) >= 1  # only a started one ends, once
        self.ended.set()


def _wait_ends(env, n):
    for _ in range(200):
        if sum(e[0] == "end" for e in env.events) >= n:
            return
        threading.Event().wait(0.01)
    raise AssertionError(env.events)


def _calling(env, sid: int) -> MultiTurnEngine:
    """An engine stepped until request ``sid``'s first turn reached ``env``."""
    eos, _ = first_stop()
    eng = wrap(eos, env)
    eng.add([req(sid)])
    for _ in range(200):
        if env.events:
            return eng
        eng.step()
    raise AssertionError("the environment was never called")


def test_an_environment_with_start_and_end_sees_each_trajectory_open_and_close():
    eos, _ = two_stops()
    env = Sandbox()
    reqs = [req(sid, prompt=torch.tensor(TOK.encode(t)), group=sid) for sid, t in
            enumerate(["what is the answer", "the answer", "obs one"])]
    out = run(wrap(eos, env, workers=2), reqs)
    assert sorted(s.sample_id for s in out) == [0, 1, 2]
    started = sum(e[0] == "start" for e in env.events)
    assert started >= 2  # (a trajectory whose first turn ran out of budget never called it)
    _wait_ends(env, started)
    assert not env.open  # every trajectory the environment saw was ended
    for tid in {e[1] for e in env.events}:
        kinds = [k for k, t in env.events if t == tid]
        assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("start") == kinds.count("end") == 1
        assert int(tid.split("-")[0]) in (0, 1, 2)
    serials = [tid.split("-")[1] for tid in {e[1] for e in env.events}]
    assert len(set(serials)) == len(serials)  # each trajectory its own id


def test_abort_and_new_weights_end_what_the_environment_started():
    gate = threading.Event()
    env = Sandbox(gate=gate)
    eng = _calling(env, 1)
    assert env.events == [("start", "1-0"), ("call", "1-0")]  # its call is running (held at the gate)
    assert eng.abort([1]) == [1]
    threading.Event().wait(0.05)
    assert ("end", "1-0") not in env.events  # not while its call runs: the two never overlap
    gate.set()
    _wait_ends(env, 1)
    assert env.events[-1] == ("end", "1-0") and not env.open
    # new weights restart a trajectory past its first turn: the old attempt ends, the new one starts
    env = Sandbox()
    eng = wrap(first_stop()[0], env)
    eng.add([req(1)])
    _past_first_turn(eng, 1)
    eng.load_weights(MODEL.hf_state_dict().items(), version=1)
    run_on(eng)
    _wait_ends(env, 2)
    assert [e for e in env.events if e[0] != "call"] == [("start", "1-0"), ("end", "1-0"), ("start", "1-1"),
                                                         ("end", "1-1")]


def test_a_start_that_fails_is_the_samples_error_and_nothing_ends():
    eos, _ = first_stop()
    env = Sandbox(fail_start=True)
    [s] = run(wrap(eos, env), [req(5)])
    assert s.finish_reason == "error" and not env.events
    assert "multi_turn.env: 'script' start() failed on sample 5 after turn 1 (RuntimeError: no sandbox left)" in s.error


def test_close_ends_the_trajectories_in_flight():
    env = Sandbox(answers=(OBS, OBS, OBS))
    eng = _calling(env, 3)
    eng.close()
    _wait_ends(env, 1)
    assert ("end", "3-0") in env.events and not env.open


class OneStepTurns:
    """A stand-in inner engine whose every turn ends in EOS at the next step: the lifecycle tests
    below are about the wrapper's thread pool, and this makes the order of its calls exact."""

    max_model_len = 4096

    def __init__(self):
        self.queue = []

    def add(self, reqs):
        self.queue += list(reqs)
        return []

    def has_work(self):
        return bool(self.queue)

    def step(self):
        out = [Sample(sample_id=r.sample_id, prompt_ids=r.prompt_ids, output_ids=torch.tensor([5, 6]),
                      logprobs=torch.zeros(2), weight_version=0, finish_reason="stop", group_id=r.group_id)
               for r in self.queue]
        self.queue = []
        return out

    def abort(self, ids):
        self.queue = [r for r in self.queue if r.sample_id not in ids]
        return list(ids)

    def stats(self):
        return EngineStats(0, 0, 0, 0, 0.0, 8, 0)

    def close(self):
        pass


class Gated(Sandbox):
    """A Sandbox whose calls for the ids in ``held`` wait at ``gate``; one call each, then done."""

    def __init__(self, held=()):
        super().__init__(answers=(None,), gate=threading.Event())
        self.held = set(held)

    def __call__(self, task, messages, trajectory):
        with self.lock:
            self.open[trajectory] += 1
            self.events.append(("call", trajectory))
        if trajectory in self.held:
            self.gate.wait(10)
        return None


def _until(cond):
    for _ in range(500):
        if cond():
            return
        threading.Event().wait(0.01)
    raise AssertionError("timed out")


def test_an_end_queued_behind_a_running_call_still_runs_at_close():
    env = Gated(held={"2-1"})  # (the engine's second trajectory)
    eng = MultiTurnEngine(OneStepTurns(), TOK, env, "gated", workers=1)
    eng.add([req(1), req(2, group=8)])
    out = eng.step()  # both first turns out: 1's call, then 2's (held) on the one worker
    _until(lambda: ("call", "2-1") in env.events)
    out += eng.step()  # 1 is done: its end is queued behind 2's running call
    assert [s.sample_id for s in out] == [1]
    eng.close()  # cancels what is queued; the end must still run
    env.gate.set()
    _wait_ends(env, 2)
    assert sorted(e for e in env.events if e[0] == "end") == [("end", "1-0"), ("end", "2-1")] and not env.open


def test_a_call_cancelled_before_it_ran_started_nothing_and_ends_nothing():
    env = Gated(held={"1-0"})
    eng = MultiTurnEngine(OneStepTurns(), TOK, env, "gated", workers=1)
    eng.add([req(1), req(2, group=8)])
    eng.step()
    _until(lambda: ("call", "1-0") in env.events)  # 2's first call waits in the queue
    assert eng.abort([2]) == [2]
    env.gate.set()
    run_on(eng)
    _wait_ends(env, 1)
    threading.Event().wait(0.05)
    assert [e for e in env.events if e[1] == "2-1"] == []  # neither start nor end


def test_a_start_that_raised_gets_no_end():
    env = Sandbox(fail_start=True)
    ends = []
    env.end = ends.append  # (any end would be recorded)
    eos, _ = first_stop()
    [s] = run(wrap(eos, env), [req(5)])
    threading.Event().wait(0.05)
    assert s.finish_reason == "error" and ends == []


def test_a_sample_id_added_again_after_an_abort_is_a_new_trajectory():
    """An evaluation cancelled and run again re-adds its sample ids (-1 - index each time) while
    the aborted call may still run: the new trajectory was "1-0" again, so the environment saw
    start("1-0") twice and the old trajectory's end closed the new one's state."""
    env = Gated(held={"1-0"})
    eng = MultiTurnEngine(OneStepTurns(), TOK, env, "gated", workers=2)
    eng.add([req(1)])
    eng.step()
    _until(lambda: ("call", "1-0") in env.events)
    assert eng.abort([1]) == [1]
    assert eng.add([req(1)]) == []
    eng.step()
    _until(lambda: ("call", "1-1") in env.events)  # (Sandbox.start asserts a new id is not open)
    env.gate.set()
    run_on(eng)
    _wait_ends(env, 2)
    assert [t for k, t in env.events if k == "start"] == ["1-0", "1-1"] and not env.open


class FailsOnce(OneStepTurns):
    """Its step raises once ``fail`` is set (a CUDA error mid-round), after other turns finished."""

    fail = False

    def step(self):
        if self.fail:
            self.fail = False
            raise RuntimeError("CUDA error (injected)")
        return super().step()


def test_an_abort_drops_the_samples_finished_before_a_failed_step():
    """A step that raises keeps the trajectories it had finished for the next step; the instance
    then aborts the round's requests, and those samples still came out of its next generate."""
    inner = FailsOnce()
    eng = MultiTurnEngine(inner, TOK, lambda task, messages: None, "done", workers=1)
    eng.add([req(1)])
    assert eng.step() == []  # its first turn ends in EOS: to the environment, which ends it
    _until(lambda: all(t.env_call.done() for t in eng._waiting.values()))
    eng.add([req(3, group=8)])
    inner.fail = True
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()  # 1 is collected, then the inner step fails
    assert eng.abort([1, 3]) == [1, 3]
    assert run_on(eng) == [] and not eng.has_work()
