"""A worker leaves when the controller goes silent (controller.keepalive), so a frozen controller
cannot hold a job forever; a worker that was itself stopped (Ctrl-Z) does not blame the
controller for the time it was stopped. Real torch RPC across three processes: rank 0 plays
the controller and pings ranks 1 and 2 from its keepalive thread."""
from __future__ import annotations

import io
import os
import signal
import sys
import time

import pytest

from workers.weight_sync.localrun import free_port, run_local

TIMEOUT_S = 2.0  # the workers' rpc_timeout_s
EVERY_S = 0.2  # the keepalive's period here (10 s in a run)


def serving() -> bool:
    """RPC probe on a worker: still in its serving loop (it has not left on its own)."""
    from controller.process_state import LOCAL

    return not LOCAL.left_because


def _scenario(rank: int, world: int, rpc_port: int):
    import torch.distributed.rpc as rpc

    from controller import keepalive
    from controller import rpc as crpc
    from controller.process_state import LOCAL as local
    from controller.process_state import request_exit
    from controller.processes import rpc_options, serve

    opts = rpc_options(30, f"tcp://127.0.0.1:{rpc_port}")  # the run's transport (libuv)
    rpc.init_rpc(crpc.worker_name(rank), rank=rank, world_size=world, rpc_backend_options=opts)
    local.rank = rank
    out = {}
    if rank == 0:
        keepalive.watch(1, 2)
        pinger = keepalive.Keepalive(every_s=EVERY_S).start()
        pid2 = rpc.rpc_sync("worker2", os.getpid)
        time.sleep(0.5)
        os.kill(pid2, signal.SIGSTOP)  # rank 2 stopped for longer than its timeout (Ctrl-Z, then fg)
        time.sleep(2 * TIMEOUT_S)
        out["1_serving_while_pinged"] = rpc.rpc_sync("worker1", serving)  # 2 timeouts of pings
        time.sleep(keepalive.OWN_GAP_S + 1.5 - 2 * TIMEOUT_S)
        os.kill(pid2, signal.SIGCONT)
        keepalive.unwatch(1)  # rank 1 hears nothing from now on: the controller is silent to it
        time.sleep(TIMEOUT_S + 2.5)
        out["2_serving_after_its_stop"] = rpc.rpc_sync("worker2", serving)
        out["watched_after"] = keepalive.watched()
        try:
            rpc.rpc_sync("worker2", request_exit, args=(0,))
        except RuntimeError:  # delivered: the rank may leave before its answer is sent (EOF here);
            pass  # had it not been, it would leave on its own with code 1, which the test refuses
        pinger.stop()
    else:
        said, sys.stderr = sys.stderr, io.StringIO()
        try:
            out["code"] = serve(watchdog=keepalive.Watchdog(TIMEOUT_S))
        finally:
            said, sys.stderr = sys.stderr, said
        out["said"] = said.getvalue()
    rpc.shutdown(graceful=False)
    return out


@pytest.fixture(scope="module")
def results():
    return run_local(3, _scenario, free_port())


def test_a_pinged_worker_keeps_serving(results):
    assert results[0]["1_serving_while_pinged"] is True


def test_a_worker_the_controller_stopped_pinging_leaves_naming_why(results):
    assert results[1]["code"] == 1
    said = results[1]["said"]
    assert said.startswith("[rank 1] exits (code 1): the controller (rank 0) has not been heard from for ")
    assert f"(placement.rpc_timeout_s = {TIMEOUT_S:g} s): it is frozen or unreachable" in said


def test_a_worker_stopped_itself_does_not_blame_the_controller(results):
    assert results[0]["2_serving_after_its_stop"] is True
    assert results[2] == {"code": 0, "said": ""}  # it left when told to, not on its own
    assert results[0]["watched_after"] == [2]


def test_watchdog_counts_silence_but_not_its_own_stops(monkeypatch):
    from controller import keepalive
    from controller.process_state import LOCAL

    now = [100.0]
    dog = keepalive.Watchdog(10.0, clock=lambda: now[0])
    for _ in range(10):  # checks every second, the controller silent
        now[0] += 1.0
        assert dog.check() is None
    now[0] += 1.0
    assert dog.check().startswith("the controller (rank 0) has not been heard from for 11 s")
    LOCAL.last_heard = now[0]  # a ping
    now[0] += 1.0
    assert dog.check() is None
    now[0] += 60.0  # this process was stopped for a minute: its own check came late
    assert dog.check() is None
    now[0] += 1.0
    assert dog.check() is None
