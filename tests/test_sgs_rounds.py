"""The controller's waits on its workers, without processes (real ``controller.rpc.Call``s
over torch futures; handles stand in for the workers): a round's calls taken in the order
they end, re-dispatch after a lost instance (when, and to whom), an abandoned round, wait_all's
first failure, an evaluation that loses an instance. The real RPC path:
tests/test_rpc_heartbeat.py; with real engines and processes: tests/test_multinode.py."""
import pytest


def test_redispatch_goes_only_to_instances_holding_the_rounds_weights(capsys):
    """What a lost instance left goes to instances that can generate with the round's weights:
    those that took part in the round, or hold its version now. Not a joiner added after the
    round began (it pulled newer weights; RL correctness audit, session 18), nor an instance
    that sat the round out and holds older weights with the round's version only staged (async
    modes push the next version during the round, which replaces it: "asked to generate with
    weight version"; concurrency audit, session 19). With none left the round stops, saying why."""
    from types import SimpleNamespace

    import torch

    from controller.rpc import Call
    from controller.scheduling import make_dispatcher
    from controller.sgs import SGS, InstanceSlot, NoInstancesLeft, Round, default_profile
    from workers.types import Request

    class Handle:  # stands in for a WorkerHandle: records what it is asked to generate
        def __init__(self, rank, held):
            self.rank, self.held, self.staged, self.asked, self.alive = rank, held, None, [], True
            self.role, self.name = "generation", f"worker{rank}"

        def call(self, method, *args):
            if method == "stats":
                return SimpleNamespace(wait=lambda: SimpleNamespace(weight_version=self.held,
                                                                    staged_version=self.staged))
            iteration, chunk, version = args[:3]
            self.asked.append((iteration, [r.sample_id for r in chunk], version))
            return Call(self, method, torch.futures.Future())  # generating (never ends here)

    ran, idle_same, idle_older, joiner = Handle(1, 1), Handle(2, 1), Handle(3, 0), Handle(5, 2)
    idle_older.staged = 1
    sgs = SGS(make_dispatcher("random"), received=lambda it: {0})
    sgs.slots = [InstanceSlot(h, default_profile()) for h in (ran, idle_same, idle_older, joiner)]
    reqs = {i: Request(i, torch.tensor([1, 2, 3]), 4) for i in range(4)}
    rnd = Round(sgs, iteration=2, version=1, requests=reqs, took_part={1})
    ran.held = 0  # what it reports is not asked: it loaded v1 when its call began
    rnd._redispatch([0, 1, 2, 3])  # 0 already reached the trainers
    assert sorted(r for h in (ran, idle_same) for _, ids, v in h.asked if v == 1 for r in ids) == [1, 2, 3]
    assert idle_older.asked == [] and joiner.asked == []
    assert rnd.redispatched == [1, 2, 3]
    assert "re-dispatching 3 unfinished requests to [1, 2]" in capsys.readouterr().err
    sgs.slots = sgs.slots[2:]  # both holders are gone too
    with pytest.raises(NoInstancesLeft, match=r"ranks \[3, 5\] hold other weights than v1, 3 requests left"):
        rnd._redispatch([1, 2, 3])
    # a lag-0 round (no push runs during it: the round's version was pushed, and waited for,
    # before it began): an instance that sat it out with the version staged loads it and serves
    lag0 = Round(sgs, iteration=2, version=1, requests=reqs, took_part={1}, staged_ok=True)
    lag0._redispatch([1, 2, 3])
    assert [(v, ids) for _, ids, v in idle_older.asked] == [(1, [1, 2, 3])] and joiner.asked == []


def test_a_lost_instance_is_redispatched_while_an_earlier_instance_still_generates():
    """Round.wait takes the instances' calls in the order they end (concurrency audit, session
    19, finding 6): before, it waited them in dispatch order, so an instance lost while the one
    dispatched before it still generated was found only when that one finished, and its
    requests started late. Here rank 1 (first) ends only once the loss of rank 2 has been
    acted on; waited in order, the round would wait for rank 1 until the deadline and fail.
    The calls are real ``controller.rpc.Call``s over torch futures; the handles stand in for
    the instances (the real RPC path: tests/test_rpc_heartbeat.py)."""
    import threading

    import torch

    from controller.instance import GenerateReport
    from controller.rpc import Call
    from controller.scheduling import make_dispatcher
    from controller.sgs import SGS, InstanceSlot, Round, default_profile
    from workers.types import Request

    redispatched = threading.Event()

    class Handle:
        def __init__(self, rank):
            self.rank, self.role, self.name, self.alive, self.futures = rank, "generation", f"worker{rank}", True, []

        def call(self, method, *args):
            iteration, chunk, version = args[:3]
            fut = torch.futures.Future()
            self.futures.append((fut, [r.sample_id for r in chunk]))
            if self.rank == 2:  # its process dies: the transport fails the call
                fut.set_exception(RuntimeError("Connection reset by peer"))
            elif len(self.futures) == 2:  # the re-dispatched requests
                redispatched.set()
                self.end(1)
            return Call(self, method, fut)

        def end(self, k):
            fut, ids = self.futures[k]
            fut.set_result(GenerateReport(self.rank, 3, ids, 4 * len(ids), 0.1, 1, [4] * len(ids)))

    first, doomed = Handle(1), Handle(2)

    def finish_first_after_the_redispatch():
        # noted before rank 1 ends: its end lets wait() return, and the assertion below ran
        # before a note made after it (CI, sessions 20 and 21: 2 of ~70 runs)
        outcome.append(redispatched.wait(20))
        first.end(0)

    outcome = []
    sgs = SGS(make_dispatcher("random"), received=lambda it: set())
    sgs.slots = [InstanceSlot(first, default_profile()), InstanceSlot(doomed, default_profile())]
    reqs = [Request(i, torch.tensor([1, 2, 3]), 4) for i in range(8)]
    rnd = Round(sgs, iteration=3, version=1, requests={r.sample_id: r for r in reqs})
    rnd.launch(reqs)
    assert [len(h.futures) for h in (first, doomed)] == [1, 1]
    threading.Thread(target=finish_first_after_the_redispatch, daemon=True).start()
    reports = rnd.wait()
    assert outcome == [True], "rank 1's report was waited for before rank 2's loss was acted on"
    assert rnd.lost == [2] and sorted(rnd.redispatched) == sorted(doomed.futures[0][1])
    assert sorted(i for rep in reports for i in rep.sample_ids) == list(range(8))
    assert [s.handle.rank for s in sgs.slots] == [1]


def test_wait_all_fails_with_the_first_call_to_fail_at_once():
    """One trainer rank raising in ``step()`` leaves the others in a collective waiting for it
    until the process group's timeout. wait_all used to wait the calls in order and raise the
    first failure in that order once all had settled: minutes later, the others' timeout
    instead of the rank's own error. Now the first call to fail fails the wait at once; results
    come back in the calls' order. Real ``controller.rpc.Call``s over torch futures."""
    import threading

    import torch

    from controller.rpc import Call, WorkerFailed, wait_all

    class Handle:
        def __init__(self, rank):
            self.rank, self.role, self.name = rank, "trainer", f"worker{rank}"

    futs = [torch.futures.Future() for _ in range(3)]
    calls = [Call(Handle(r), "step", f) for r, f in zip((1, 2, 3), futs)]
    futs[2].set_result("done")
    futs[1].set_exception(RuntimeError("On WorkerInfo(id=2, name=worker2):\nValueError('the reward raised')"))
    returned = threading.Event()
    threading.Thread(target=lambda: (returned.wait(20), futs[0].set_result("late")), daemon=True).start()
    with pytest.raises(WorkerFailed, match="worker rank 2 \\(trainer\\) raised in step\\(\\)") as e:
        try:
            wait_all(calls)
        finally:
            ended_first = not futs[0].done()
            returned.set()
    assert ended_first, "wait_all waited for rank 1 before saying rank 2's error"
    assert "the reward raised" in str(e.value) and not e.value.lost
    ok = [torch.futures.Future() for _ in range(3)]
    for i in (2, 0, 1):
        ok[i].set_result(i)
    assert wait_all([Call(Handle(r), "stats", f) for r, f in zip((1, 2, 3), ok)]) == [0, 1, 2]


def test_an_instance_lost_during_an_evaluation_leaves_its_share_to_the_others(capsys):
    """An evaluation (or the ranker's length measurement) used to stop the run when an
    instance was lost during it (a joiner killed between rounds); now the instance leaves the
    SGS and its requests are generated by the others, as in a training round. With none left
    the run stops, saying why. Real ``controller.rpc.Call``s over torch futures; the handles
    stand in for the instances (the real RPC path: tests/test_rpc_heartbeat.py)."""
    from types import SimpleNamespace

    import torch

    from controller.evaluation import side_generate
    from controller.instance import EvalOutput
    from controller.rpc import Call
    from controller.scheduling import make_dispatcher
    from controller.sgs import SGS, InstanceSlot, NoInstancesLeft, default_profile
    from workers.types import Request

    class Handle:
        def __init__(self, rank, dies):
            self.rank, self.role, self.name, self.alive, self.dies, self.asked = rank, "generation", \
                f"worker{rank}", True, dies, []

        def call(self, method, chunk, newest, token, stage, step=None):
            self.asked.append(sorted(r.sample_id for r in chunk))
            fut = torch.futures.Future()
            if self.dies:
                fut.set_exception(RuntimeError("EOF: end of file (this error originated at tensorpipe)"))
            else:
                fut.set_result(EvalOutput(4, [(r.sample_id, [r.sample_id]) for r in chunk]))
            return Call(self, method, fut)

    live, doomed = Handle(1, False), Handle(2, True)
    sgs = SGS(make_dispatcher("random"), received=lambda it: set())
    sgs.slots = [InstanceSlot(h, default_profile()) for h in (live, doomed)]
    program = SimpleNamespace(world=SimpleNamespace(sgs=sgs), in_flight=None)
    reqs = [Request(-1 - i, torch.tensor([1, 2]), 4) for i in range(6)]
    outputs, versions = side_generate(program, reqs)
    assert outputs == {r.sample_id: [r.sample_id] for r in reqs} and versions == (4,)
    assert live.asked == [[-5, -3, -1], [-6, -4, -2]] and [s.handle.rank for s in sgs.slots] == [1]
    assert "[sgs] instance rank 2 removed: lost during an evaluation: worker rank 2 (generation) was lost" \
        in capsys.readouterr().err
    live.dies = True
    with pytest.raises(NoInstancesLeft, match=r"evaluation: every generation instance is gone \(rank 2: lost "
                                              r"during an evaluation: .*rank 1: lost during an evaluation"):
        side_generate(program, reqs)


def test_a_round_redispatches_a_lost_instances_requests_while_the_controller_is_busy_elsewhere():
    """In the async modes the controller trains the previous batch while a round generates;
    a loss in the round used to be acted on only when the controller came to wait for it
    (after the step). The round's own thread now re-dispatches at once: here before wait()
    is called at all. gen_seconds ends at the last report's arrival (``Round.ended_at``)."""
    import threading
    import time

    import torch

    from controller.instance import GenerateReport
    from controller.rpc import Call
    from controller.scheduling import make_dispatcher
    from controller.sgs import SGS, InstanceSlot, default_profile
    from workers.types import Request

    second_call = threading.Event()

    class Handle:
        def __init__(self, rank):
            self.rank, self.role, self.name, self.alive, self.futures = rank, "generation", f"worker{rank}", True, []

        def call(self, method, iteration, chunk, version, *rest):
            fut = torch.futures.Future()
            self.futures.append((fut, [r.sample_id for r in chunk]))
            if self.rank == 2:
                fut.set_exception(RuntimeError("Connection reset by peer"))
            elif len(self.futures) == 2:
                second_call.set()
            return Call(self, method, fut)

    live, doomed = Handle(1), Handle(2)
    sgs = SGS(make_dispatcher("random"), received=lambda it: set())
    sgs.slots = [InstanceSlot(live, default_profile()), InstanceSlot(doomed, default_profile())]
    reqs = [Request(i, torch.tensor([1, 2, 3]), 4) for i in range(8)]
    rnd = sgs.generate(5, reqs, 1)
    assert second_call.wait(20), "the lost instance's requests waited for the controller to wait"
    assert rnd.lost == [2] and [s.handle.rank for s in sgs.slots] == [1]
    before = time.time()
    for fut, ids in live.futures:
        fut.set_result(GenerateReport(1, 5, ids, 4 * len(ids), 0.1, 1, [4] * len(ids)))
    reports = rnd.wait()
    assert sorted(i for rep in reports for i in rep.sample_ids) == list(range(8))
    assert before <= rnd.ended_at <= time.time()


def test_an_abandoned_round_acts_on_no_loss(capsys):
    """A run that stops while a round is in flight (a failed step, a stop signal; async modes)
    abandons it: its calls, failing as the workers exit, are not losses. Before, the round's
    thread removed the instances, said they were lost and re-dispatched their requests to
    exiting workers, after the controller had said why the run stopped (review of session 20)."""
    import torch

    from controller.program import Program
    from controller.rpc import Call
    from controller.scheduling import make_dispatcher
    from controller.sgs import SGS, InstanceSlot, default_profile
    from workers.types import Request

    class Handle:
        def __init__(self, rank):
            self.rank, self.role, self.name, self.alive, self.futures = rank, "generation", f"worker{rank}", True, []

        def call(self, method, *args):
            self.futures.append(torch.futures.Future())
            return Call(self, method, self.futures[-1])

    a, b = Handle(1), Handle(2)
    sgs = SGS(make_dispatcher("random"), received=lambda it: set())
    sgs.slots = [InstanceSlot(a, default_profile()), InstanceSlot(b, default_profile())]
    prog = Program.__new__(Program)
    prog.in_flight = sgs.generate(4, [Request(i, torch.tensor([1, 2]), 4) for i in range(4)], 1)

    def failing_run(k, keep):
        raise RuntimeError("worker rank 3 (trainer) raised in step()")

    prog._run = failing_run
    with pytest.raises(RuntimeError, match="raised in step"):
        prog.run(1)
    for h in (a, b):  # the workers exit: their calls fail as a lost peer's would
        h.futures[0].set_exception(RuntimeError("RPC agent is shut down"))
    prog.in_flight._collector.join(5)
    assert not prog.in_flight._collector.is_alive()
    assert [s.handle.rank for s in sgs.slots] == [1, 2] and prog.in_flight.redispatched == []
    assert [len(h.futures) for h in (a, b)] == [1, 1]
    assert "[sgs]" not in capsys.readouterr().err


def test_a_failed_evaluation_tells_the_instances_still_on_it_to_stop():
    """One instance's share of an evaluation fails (an error, not a loss): the evaluation fails
    at once, and each instance still generating its share is sent ``cancel`` with the token its
    call carries. Before, those calls ran on, and the REPL's next ``run`` waited behind them.
    Real ``controller.rpc.Call``s over torch futures; the handles stand in for the instances
    (the instance's side: test_controller_units.py::test_an_evaluate_call_stops_when_cancelled)."""
    from types import SimpleNamespace

    import torch

    from controller.evaluation import side_generate
    from controller.rpc import Call, WorkerFailed
    from controller.scheduling import make_dispatcher
    from controller.sgs import SGS, InstanceSlot, default_profile
    from workers.types import Request

    class Handle:
        def __init__(self, rank, fails):
            self.rank, self.role, self.name, self.alive, self.fails = rank, "generation", f"worker{rank}", True, fails
            self.calls = []

        def call(self, method, *args):
            self.calls.append((method, args))
            fut = torch.futures.Future()
            if method == "evaluate" and self.fails:
                fut.set_exception(RuntimeError("On WorkerInfo(id=2, name=worker2):\nValueError('engine refused')"))
            return Call(self, method, fut)  # the other's evaluate never ends here

    busy, failing = Handle(1, False), Handle(2, True)
    sgs = SGS(make_dispatcher("random"), received=lambda it: set())
    sgs.slots = [InstanceSlot(h, default_profile()) for h in (busy, failing)]
    program = SimpleNamespace(world=SimpleNamespace(sgs=sgs), in_flight=None)
    reqs = [Request(-1 - i, torch.tensor([1, 2]), 4) for i in range(4)]
    with pytest.raises(WorkerFailed, match="engine refused"):
        side_generate(program, reqs)
    (m1, (chunk, newest, token, stage, step)), (m2, cancel_args) = busy.calls
    assert stage == "eval" and step is None
    assert (m1, m2) == ("evaluate", "cancel") and cancel_args == (token,)
    assert [m for m, _ in failing.calls] == ["evaluate"]  # the failed call is not cancelled
    assert [s.handle.rank for s in sgs.slots] == [1, 2]  # an error is not a loss: both stay


def test_dispatch_plans_with_the_estimates_and_a_zero_estimate_is_the_shortest():
    # an estimate of 0 (a ranker's shortest prediction, clamped at 0) was taken for "no
    # estimate" and replaced by max_tokens: the shortest prompt was dispatched as the longest
    import torch

    from controller.sgs import dispatch_estimates
    from workers.types import Request

    def req(i, est=0.0):
        return Request(i, torch.tensor([1, 2]), max_tokens=64, est_len=est)

    assert dispatch_estimates([req(0, 12.0), req(1, 0.0), req(2, 3.5)]) == [12.0, 1.0, 3.5]  # (no output is shorter)
    assert dispatch_estimates([req(0), req(1)]) == [64.0, 64.0]  # no estimates: the caps


def test_an_instance_lost_holding_two_calls_of_a_round_is_listed_once():
    """Its own share and a re-dispatched one fail together when its process dies: the round's
    ``lost`` (iterations.jsonl) listed it twice (review, session 47)."""
    import torch

    from controller.instance import GenerateReport
    from controller.rpc import Call
    from controller.scheduling import make_dispatcher
    from controller.sgs import SGS, InstanceSlot, Round, default_profile
    from workers.types import Request

    class Handle:
        def __init__(self, rank):
            self.rank, self.role, self.name, self.alive, self.futures = rank, "generation", f"worker{rank}", True, []

        def call(self, method, *args):
            ids = [r.sample_id for r in args[1]]
            fut = torch.futures.Future()
            self.futures.append(fut)
            if self.rank == 1:  # gone at once: its share goes to ranks 2 and 3
                fut.set_exception(RuntimeError("Connection reset by peer"))
            elif self.rank == 2 and len(self.futures) == 2:  # dies holding its share and the re-dispatch
                for f in self.futures:
                    f.set_exception(RuntimeError("Connection reset by peer"))
            elif self.rank == 3:
                fut.set_result(GenerateReport(3, 0, ids, 4 * len(ids), 0.1, 0, [4] * len(ids)))
            return Call(self, method, fut)

    handles = [Handle(r) for r in (1, 2, 3)]
    sgs = SGS(make_dispatcher("round_robin"), received=lambda it: set())
    sgs.slots = [InstanceSlot(h, default_profile()) for h in handles]
    reqs = [Request(i, torch.tensor([1, 2]), 4) for i in range(6)]
    rnd = Round(sgs, iteration=0, version=0, requests={r.sample_id: r for r in reqs})
    rnd.launch(reqs)
    reports = rnd.wait()
    assert len(handles[1].futures) == 2  # (the case: rank 2 held two calls)
    assert sorted(i for rep in reports for i in rep.sample_ids) == list(range(6))
    assert rnd.lost == [1, 2]
