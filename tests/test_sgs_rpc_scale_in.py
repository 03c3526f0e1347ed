"""Run-time scale-in over real torch RPC: an instance told to leave while it generates.

Four processes joined by torch RPC, wired as ``controller/world.py`` wires a run: rank 0 is
the controller with the real ``SGS`` (round-robin dispatcher) and ``WorkerHandle``s; ranks 1
and 2 each host a ``GenerationInstance`` created with ``rpc.remote`` and ``settle`` (as
``build_world``); rank 3 hosts a small recording trainer that stands in for ``TrainerRank``:
it is ``LOCAL.roles["trainer"]`` of its process, the instances are ``connect``ed to its RRef and
so stream their samples to it by plain RPC (``TrainerAddress`` -> ``receive_samples``), and
the SGS asks it which samples it holds (``World.received`` -> ``received_ids``).

Once samples of both instances have reached the sink, so instance 1 is mid-round, a second
controller thread issues the scale-in as the REPL's ``leave RANK`` does
(``controller.repl.Repl.leave``: ``stop`` over RPC, then ``SGS.remove``), while the main thread
waits on the round. Checked: the round completes; instance 1's report says stopped with
unfinished ids, and the SGS removed it; its unfinished ids are re-dispatched to instance 2;
every sample id reaches the sink exactly once with its full forced length; instance 1's
engine (its ``stats()`` over RPC) holds nothing; and the two instances' generate windows (the
``generate`` spans they report) overlap, i.e. they really ran at the same time.

It complements ``test_engine_abort.py::test_scale_in_aborts_what_the_instance_leaves_and_the_sgs_serves_it_elsewhere``,
whose ``LocalRRef`` runs every call synchronously in one process: the instances run one after
the other, the ``stop`` is patched into the engine's step, and errors come back unwrapped.
Here the ``stop`` arrives as an RPC on another thread of a process that is generating, the
samples cross process boundaries (Outbox -> trainer), the report and the re-dispatch go
through ``Call.wait``, and the leave races the round. (The REPL's own loop runs ``leave`` only
between ``run`` commands, which drain the pipeline; the mid-round path checked here is the one
``Round.wait`` keeps for a leave that finds the instance generating.)
"""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from runtime_helpers import free_port, tiny_model  # noqa: F401  (tiny_model: session-wide model folder)
from workers.weight_sync.localrun import run_local

WORLD = 4  # controller, two generation instances, one trainer (the sink)
LEAVING, STAYING, SINK = 1, 2, 3
N_REQUESTS = 48  # 24 per instance (round robin)
FORCED = 64  # output tokens per sample (min_tokens = max_tokens)
BATCH = 2  # engine.max_batch_size: each instance runs 12 waves, so a leave after the 1st finds work left
WATCHDOG_S = 150.0  # a rank still running after this exits (the test then fails, never hangs)
WAIT_S = 90.0  # the most the controller waits for the first samples of both instances


class RecordingTrainer:
    """The trainer rank's place (rank 3): records every sample it is sent, duplicates included."""

    def __init__(self):
        from controller.process_state import LOCAL

        self.records: list[tuple[int, int]] = []  # (sample_id, output tokens), in arrival order
        self._cond = threading.Condition()
        LOCAL.roles["trainer"] = self  # where receive_samples (an instance's plain RPC) finds it

    def receive(self, samples) -> int:
        with self._cond:
            self.records += [(s.sample_id, len(s.output_ids)) for s in samples]
            self._cond.notify_all()
        return len(samples)

    def received_ids(self, iteration: int) -> list[int]:
        with self._cond:
            return sorted({sid for sid, _ in self.records})

    def wait_for_both(self, first: list[int], second: list[int], timeout: float) -> bool:
        """Until at least one sample of ``first`` and one of ``second`` arrived (False: timed out)."""
        a, b = set(first), set(second)

        def both() -> bool:
            ids = {sid for sid, _ in self.records}
            return bool(ids & a) and bool(ids & b)

        with self._cond:
            return self._cond.wait_for(both, timeout=timeout)

    def samples(self) -> list[tuple[int, int]]:
        with self._cond:
            return list(self.records)

    def close(self) -> bool:
        return True


def _requests():
    from workers.types import Request, SamplingParams

    greedy = SamplingParams(temperature=0.0)
    # GRPO-like pairs sharing a prompt; every output forced to FORCED tokens
    return [Request(i, torch.arange(5 + i // 2) % 200 + 3, FORCED, FORCED, group_id=i // 2, sampling=greedy)
            for i in range(N_REQUESTS)]


def _controller(model_dir: str) -> dict:
    from types import SimpleNamespace

    import torch.distributed.rpc as rpc

    from controller.instance import GenerationInstance
    from controller.repl import Repl
    from controller.rpc import create, settle, wait_all, worker_name
    from controller.scheduling import make_dispatcher
    from controller.sgs import SGS
    from controller.world import World, _profile
    from workers.generation.config import EngineConfig

    engine = EngineConfig(device="cpu", kv_cache_tokens=1024, block_size=4, max_batch_size=BATCH)
    # as build_world: the trainer rank, then the instances (rpc.remote + settle), then connect + add
    sink = create(SINK, "trainer", RecordingTrainer, timeout=60)
    made = [(r, rpc.remote(worker_name(r), GenerationInstance, args=(r, engine, model_dir, [0]), timeout=60))
            for r in (LEAVING, STAYING)]
    instances = settle(made, "generation", 60)
    world = World([sink], None, False, {LEAVING, STAYING, SINK})  # type: ignore[arg-type]
    world.sgs = SGS(make_dispatcher("round_robin"), world.received, 0)
    wait_all([h.call("connect", [sink.rref]) for h in instances])
    cfg = SimpleNamespace(dispatch=SimpleNamespace(profile=""), engine=engine)
    for h in instances:
        world.sgs.add(h, _profile(cfg))
    sgs = world.sgs

    rnd = sgs.generate(0, _requests(), 0)
    dispatched = {slot.handle.rank: list(ids) for slot, _, ids in rnd.calls}

    # the scale-in, from another controller thread while the main one waits on the round
    session = SimpleNamespace(world=world, static_ranks={LEAVING, STAYING, SINK}, waiting=[], departed=[])
    leave: dict = {}

    def scale_in():
        try:
            leave["mid_round"] = sink.call("wait_for_both", dispatched[LEAVING], dispatched[STAYING],
                                           WAIT_S).wait()
            leave["received_at_leave"] = len(sink.call("received_ids", 0).wait())
            leave["answer"] = Repl(session).leave(str(LEAVING))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            leave["error"] = repr(e)

    t = threading.Thread(target=scale_in, name="repl-leave")
    t.start()
    reports = rnd.wait()
    t.join(WAIT_S + 30)

    stats = instances[0].call("stats").wait()  # the handle is marked gone; its process still answers
    spans = {h.rank: [(s.stage, s.start, s.end) for s in h.call("drain_spans").wait()] for h in instances}
    return {
        "dispatched": dispatched,
        "reports": [vars(r) for r in reports],
        "removed": list(sgs.removed),
        "slots": [s.handle.rank for s in sgs.slots],
        "redispatched": list(rnd.redispatched),
        "leave": leave,
        "leave_thread_alive": t.is_alive(),
        "leaving_stats": stats,
        "samples": sink.call("samples").wait(),
        "spans": spans,
    }


def _rank(rank: int, world_size: int, rpc_port: int, model_dir: str):
    import torch.distributed.rpc as rpc

    from controller.processes import rpc_options
    from controller.process_state import LOCAL
    from controller.rpc import worker_name

    torch.set_num_threads(1)
    LOCAL.rank = rank
    watchdog = threading.Timer(WATCHDOG_S, os._exit, args=(3,))
    watchdog.daemon = True
    watchdog.start()
    rpc.init_rpc(worker_name(rank), rank=rank, world_size=world_size,
                 rpc_backend_options=rpc_options(60, f"tcp://127.0.0.1:{rpc_port}"))
    out = None
    try:
        if rank == 0:
            t0 = time.monotonic()
            out = _controller(model_dir)
            out["controller_s"] = time.monotonic() - t0
    finally:
        rpc.shutdown()  # graceful: the workers serve until the controller gets here too
    watchdog.cancel()
    return out


@pytest.fixture(scope="module")
def result(tiny_model):  # noqa: F811
    return run_local(WORLD, _rank, free_port(), tiny_model)[0]


@pytest.mark.timeout(300)
def test_scale_in_over_rpc_mid_round_re_dispatches_what_the_leaving_instance_left(result):
    r = result
    assert "error" not in r["leave"], r["leave"]
    assert not r["leave_thread_alive"]
    assert r["leave"]["mid_round"], "the first samples of both instances never reached the sink"
    assert r["leave"]["answer"]["left"] == LEAVING and r["leave"]["answer"]["instances"] == [STAYING]
    assert r["leave"]["received_at_leave"] < N_REQUESTS

    # the round completed; the leaving instance reported stopped, with the ids it left
    ids1, ids2 = r["dispatched"][LEAVING], r["dispatched"][STAYING]
    assert sorted(ids1 + ids2) == list(range(N_REQUESTS))
    left = [rep for rep in r["reports"] if rep["rank"] == LEAVING]
    assert len(left) == 1, r["reports"]
    left = left[0]
    assert left["stopped"] and left["unfinished"], left
    assert sorted(left["sample_ids"] + left["unfinished"]) == sorted(ids1)
    # the SGS removed it (by the round's "stopped" or by leave's own remove, whichever came first)
    assert [rank for rank, _ in r["removed"]] == [LEAVING], r["removed"]
    assert r["removed"][0][1] in ("stopped", "left (REPL)")
    assert r["slots"] == [STAYING]
    # what it left went to the other instance, which finished everything else
    assert sorted(r["redispatched"]) == sorted(left["unfinished"])
    stayed = [rep for rep in r["reports"] if rep["rank"] == STAYING]
    assert len(stayed) == 2 and not any(rep["stopped"] or rep["unfinished"] for rep in stayed), stayed
    assert sorted(sum((rep["sample_ids"] for rep in stayed), [])) == sorted(ids2 + left["unfinished"])

    # every sample reached the trainer exactly once, at its full forced length
    got = sorted(sid for sid, _ in r["samples"])
    assert got == list(range(N_REQUESTS)), got
    assert all(n == FORCED for _, n in r["samples"])

    # the leaving engine holds nothing
    st = r["leaving_stats"].engine
    assert (st.running, st.waiting, st.kv_blocks_used) == (0, 0, 0), st

    # the two instances generated at the same time: their first generate windows overlap
    gen1 = [(a, b) for stage, a, b in r["spans"][LEAVING] if stage == "generate"]
    gen2 = sorted((a, b) for stage, a, b in r["spans"][STAYING] if stage == "generate")
    assert len(gen1) == 1 and len(gen2) == 2, r["spans"]
    (a1, b1), (a2, b2) = gen1[0], gen2[0]
    assert max(a1, a2) < min(b1, b2), (gen1, gen2)
    # and the re-dispatched call ran after the leaving instance had handed its rest back
    assert gen2[1][0] >= b1, (gen1, gen2)
