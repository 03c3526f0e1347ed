"""Scale-in and joiner edges (flows review, s59): an instance stopped once its requests were all
done still leaves the SGS; a joiner that died inside the RPC group turns later joiners away in
one line (``controller.dead_members``); a joiner stopped on its terminal waits for the calls it
serves (``join_cli.served``). The real-process cases (a job, joiners SIGKILLed and SIGTERMed
mid-round) are in tests/test_joiner_deaths.py."""
import datetime
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from controller import dead_members, join_cli
from controller.attempt import store_key
from controller.rpc import WorkerFailed, WorkerHandle
from controller.scheduling import make_dispatcher
from controller.sgs import SGS
from runtime_helpers import LocalRRef, SinkTrainer, free_port, tiny_model  # noqa: F401  (tiny_model: fixture)
from test_engine_abort import _instance, _train_requests

torch.set_num_threads(1)


def test_an_instance_stopped_after_its_last_request_still_leaves(tiny_model):  # noqa: F811
    # stop() arriving once every request was done reported stopped with nothing unfinished: the
    # SGS kept the instance (it looked at the unfinished list), and the next round's call met the
    # process gone (a joiner leaving on SIGTERM) as a lost instance
    sink = SinkTrainer()
    leaving, staying = _instance(1, tiny_model, sink), _instance(2, tiny_model, sink)
    has_work, step, steps = leaving.engine.has_work, leaving.engine.step, []

    def stepping():
        steps.append(1)
        return step()

    def last_then_stop():  # the scale-in arrives between the last step and the loop's check
        more = has_work()
        if steps and not more:
            leaving.stop()
        return more

    leaving.engine.step, leaving.engine.has_work = stepping, last_then_stop
    sgs = SGS(make_dispatcher("round_robin"), lambda it: {s.sample_id for s in sink.samples})
    sgs.add(WorkerHandle(1, "generation", LocalRRef(leaving)))
    sgs.add(WorkerHandle(2, "generation", LocalRRef(staying)))
    reports = sgs.generate(0, _train_requests(8), 0).wait()
    left = next(r for r in reports if r.rank == 1)
    assert left.stopped and left.unfinished == [] and len(left.sample_ids) == 4
    assert sgs.removed == [(1, "stopped")] and [s.handle.rank for s in sgs.slots] == [2]
    assert sorted(s.sample_id for s in sink.samples) == list(range(8))  # each once, none generated again


@pytest.fixture
def store():
    port = free_port()
    return dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=10))


def test_a_joiner_is_turned_away_once_a_member_died_in_the_group(store):
    assert dead_members.refusal(store, "a1", "host:29500") is None
    store.set(store_key("dead_member", "a1"), "3: EOF: end of file (this error may indicate that the peer died)")
    said = dead_members.refusal(store, "a1", "host:29500")
    assert said.startswith("[join] the job at host:29500 takes no more joiners: rank 3, a process that joined it, "
                           "died without leaving its RPC group (EOF: end of file ")
    assert "restart it from its checkpoint (--resume)" in said
    assert dead_members.refusal(store, "a2", "host:29500") is None  # another attempt of the job: its own keys


def test_a_member_not_listed_is_not_noted_dead(monkeypatch):
    # a joiner that left the graceful way is off the group's list: its closed process (found by a
    # ping or a round's call) must not turn later joiners away; without an RPC agent, nothing is listed
    assert dead_members.note(7, "EOF") is False and 7 not in dead_members.known()
    monkeypatch.setattr(dead_members, "_listed", lambda rank: rank == 8)
    monkeypatch.setattr(dead_members, "_DEAD", {})
    stored = []
    monkeypatch.setattr(dead_members, "current_attempt", lambda timeout_s: "a1")
    monkeypatch.setattr(dead_members, "torchrun_store",
                        lambda timeout_s: type("S", (), {"set": lambda self, k, v: stored.append((k, v))})())
    assert dead_members.note(8, "EOF: end of file") is True
    assert dead_members.note(8, "again") is False  # said once
    assert stored == [(store_key("dead_member", "a1"), "8: EOF: end of file")]
    assert dead_members.known() == {8: "EOF: end of file"}


def test_run_with_no_instance_says_to_restart_once_a_member_died(monkeypatch):
    from controller import repl

    monkeypatch.setattr(dead_members, "_DEAD", {})
    assert repl._how_to_add() == "start a process with --join (docs/controller.md), then run again"
    monkeypatch.setattr(dead_members, "_DEAD", {3: "EOF"})
    assert repl._how_to_add() == ("no process can join any more (rank(s) [3] died without leaving the RPC group): "
                                  "quit and restart the job from its checkpoint (--resume)")


def test_served_waits_for_the_calls_in_progress(monkeypatch):
    import torch.distributed.rpc as rpc

    assert join_cli.served(0.1) is True  # no RPC agent: nothing served
    active = iter(["2", "1", "0"])
    agent = type("A", (), {"get_metrics": lambda self: {"agent.server_active_calls": next(active)}})()
    monkeypatch.setattr(rpc.api, "_get_current_rpc_agent", lambda: agent)
    assert join_cli.served(5.0, poll_s=0.0) is True
    stuck = type("A", (), {"get_metrics": lambda self: {"agent.server_active_calls": "1"}})()
    monkeypatch.setattr(rpc.api, "_get_current_rpc_agent", lambda: stuck)
    assert join_cli.served(0.05, poll_s=0.01) is False


def test_rejoin_takes_a_torchrun_rank_that_left_back_with_the_current_weights(monkeypatch):
    # `leave` of a torchrun rank left it idle for good: nothing could bring it back, and its
    # instance kept its stop flag (every later generate returned its requests unfinished)
    from types import SimpleNamespace

    from controller.repl import Repl
    from test_repl_leave import FakeInstance

    class Instance(FakeInstance):
        def resume(self):
            self.calls.append(("resume", self.rank))
            return True

        def hold_weights(self, version):
            self.calls.append(("hold", self.rank, version))
            return version

    calls = []
    sgs = SGS(make_dispatcher("round_robin"), lambda it: set())
    for r in (1, 3):  # torchrun generation ranks (2: the trainer)
        sgs.add(WorkerHandle(r, "generation", LocalRRef(Instance(calls, r))), profile=f"profile{r}")

    def push_weights(version, only=None):
        calls.append(("push", [h.rank for h in only], version))
        return []

    session = SimpleNamespace(world=SimpleNamespace(sgs=sgs, push_weights=push_weights), static_ranks={1, 2, 3},
                              joined=[], departed=[], waiting=[], program=SimpleNamespace(version=5))
    repl = Repl(session)
    assert repl.rejoin("1")["error"].startswith("rejoin: rank 1 is no torchrun rank that left with `leave`")
    assert repl.leave("1")["process"].startswith("stays (a torchrun rank)")
    calls.clear()
    out = repl.rejoin("1")
    assert out == {"rejoined": 1, "version": 5, "instances": [3, 1]}
    assert calls == [("resume", 1), ("push", [1], 5), ("hold", 1, 5)]
    assert [(s.handle.rank, s.profile) for s in sgs.slots] == [(3, "profile3"), (1, "profile1")]
    assert sgs.removed == []  # `sgs` listed it live and, once per leave, gone (review, s59)
    assert "error" in repl.rejoin("1") and "error" in repl.rejoin("x")  # taken back once


@pytest.mark.slow  # ~40 s on 2 cores (a 4-rank job): the CI's slow tier runs it
def test_a_torchrun_rank_rejoined_generates_with_the_current_weights(tmp_path, tiny_model):  # noqa: F811
    import json

    from runtime_helpers import iterations, torchrun, write_config

    cfg = write_config(tmp_path, tiny_model, train__iterations=8, train__eval_every=0, pipeline__mode="stream",
                       placement__generation=[1, 2], placement__trainer=[3])
    p = torchrun(cfg, nproc=4, extra=["--repl"], timeout=300,
                 stdin="run 1\nleave 1\nrun 2\nrejoin 1\nrun 1\nsgs\nquit\n")
    assert p.returncode == 0, p.stderr[-4000:]
    a = [json.loads(ln[4:]) for ln in p.stdout.splitlines() if ln.startswith(">>> ")]
    _ready, _run1, leave, run2, rejoin, run1, sgs = a
    assert leave["left"] == 1 and run2["ran"] == 2
    assert rejoin == {"rejoined": 1, "version": 3, "instances": [2, 1]}, rejoin
    assert run1["ran"] == 1 and sorted(i["rank"] for i in sgs["instances"]) == [1, 2]
    rows = iterations(tmp_path / "run")
    assert [r["num_samples"] for r in rows] == [8] * 4
    assert rows[1]["per_instance"] == {"2": 8} and rows[3]["per_instance"] == {"1": 4, "2": 4}
    # stream mode trains on-policy only: rank 1's samples of the last step had the current weights
    assert all(r["staleness/max"] == 0 for r in rows), [r.get("staleness/max") for r in rows]


# ---- mutation review, session 59 ------------------------------------------------------------
torch.set_num_threads(1)


@pytest.mark.parametrize("failure, lost", [(RuntimeError("EPIPE: the peer closed the connection"), True),
                                           (ValueError("a bug in resume"), False)])
def test_rejoin_says_a_lost_rank_is_lost_and_raises_any_other_failure(failure, lost):
    """controller/repl.py rejoin: a rank lost meanwhile is one REPL error line; an error the
    instance raised (a bug, not a gone process) is the run's failure and propagates, never
    reported as "lost". Fakes as tests/test_scale_in_edges.py's rejoin test (FakeInstance /
    LocalRRef: a rank that left needs a torchrun job)."""
    from controller.repl import Repl
    from test_repl_leave import FakeInstance

    class Instance(FakeInstance):
        def resume(self):
            if self.rank == 1:
                raise failure
            return True

    calls = []
    sgs = SGS(make_dispatcher("round_robin"), lambda it: set())
    for r in (1, 3):
        sgs.add(WorkerHandle(r, "generation", LocalRRef(Instance(calls, r))), profile=f"profile{r}")
    session = SimpleNamespace(world=SimpleNamespace(sgs=sgs, push_weights=lambda version, only=None: []),
                              static_ranks={1, 2, 3}, joined=[], departed=[], waiting=[],
                              program=SimpleNamespace(version=5))
    repl = Repl(session)
    assert repl.leave("1")["process"].startswith("stays (a torchrun rank)")
    if lost:
        assert repl.rejoin("1")["error"].startswith("rejoin: rank 1 was lost: worker rank 1 (generation) was lost")
    else:
        with pytest.raises(WorkerFailed, match=r"worker rank 1 \(generation\) raised in resume\(\)"):
            repl.rejoin("1")
    assert [h.rank for h in sgs.handles] == [3]
