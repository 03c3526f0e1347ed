"""controller/attempt.py: every rank of a (re)start agrees on one fresh attempt id over a real
TCPStore, whatever stale keys of dead attempts the store still holds."""
from __future__ import annotations

import datetime
import multiprocessing as mp
import socket

import pytest
import torch.distributed as dist

from controller.attempt import AttemptError, agree_on_attempt

W = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(port: int, rank: int, world: int, timeout_s: float, out) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
        out.put((rank, "ok", agree_on_attempt(store, rank, world, timeout_s, poll_s=0.01)))
    except Exception as e:  # noqa: BLE001 - shipped to the test
        out.put((rank, "error", f"{type(e).__name__}: {e}"))


@pytest.fixture(scope="module")
def ctx():
    c = mp.get_context("forkserver")
    c.set_forkserver_preload(["torch", "torch.distributed", "controller.attempt"])
    return c


def _server():
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    return port, store


def _attempt(ctx, port: int, ranks, world: int = W, timeout_s: float = 60.0) -> dict:
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(port, r, world, timeout_s, out)) for r in ranks]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        r, status, value = out.get(timeout=120)
        got[r] = (status, value)
    for p in procs:
        p.join(30)
    return got


def _ids(got: dict) -> set[str]:
    assert all(status == "ok" for status, _ in got.values()), got
    return {value for _, value in got.values()}


def test_all_ranks_agree_on_one_id(ctx):
    port, _store = _server()
    ids = _ids(_attempt(ctx, port, range(W)))
    assert len(ids) == 1 and len(next(iter(ids))) == 32


def test_stale_keys_of_a_dead_attempt_do_not_fool_the_new_one(ctx):
    port, store = _server()
    stale = "deadbeef" * 4
    for r in range(1, W):  # a dead attempt's handshake, finished or half-way
        store.set(f"streamrl/hello/{r}", f"oldnonce{r}")
        store.set(f"streamrl/ack/{r}", f"oldnonce{r}:{stale}")
        store.set(f"streamrl/ready/{r}", stale)
    store.set("streamrl/attempt", stale)
    ids = _ids(_attempt(ctx, port, range(W)))
    assert len(ids) == 1 and stale not in ids


def test_consecutive_attempts_on_one_store_get_different_ids(ctx):
    port, _store = _server()
    first = _ids(_attempt(ctx, port, range(W)))
    second = _ids(_attempt(ctx, port, range(W)))
    assert len(first) == 1 and len(second) == 1 and first != second


def test_a_rank_that_never_comes_is_named_by_rank_0(ctx):
    port, store = _server()
    store.set("streamrl/hello/2", "oldnonce")  # a stale hello is no arrival
    store.set("streamrl/ready/2", "deadbeef")
    got = _attempt(ctx, port, [0, 1], timeout_s=2.0)  # bounded by _attempt's own waits, not timed here
    status, message = got[0]
    assert status == "error" and message.startswith("AttemptError: attempt handshake: rank(s) [2] of 3 never said hello")
    assert "\n" not in message
    assert got[1][0] == "ok"  # rank 1 was answered before rank 0 gave up


def test_a_rank_that_hears_no_answer_gives_up():
    port, store = _server()
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
    with pytest.raises(AttemptError, match="rank 1: rank 0 did not answer"):
        agree_on_attempt(client, 1, W, 0.3, poll_s=0.01)


def test_a_restart_is_counted_per_job_not_per_node(monkeypatch):
    """TORCHELASTIC_RESTART_COUNT rises only on the node whose worker failed: rank 0 on a
    healthy node restarted with 0 and took the job's own restart for a new launch (a
    ``--resume`` over its rows was refused and spent a restart). Rank 0 counts attempts in
    torchrun's store, which outlives them."""
    from controller import attempt

    port, store = _server()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # this node's count: another node failed
    monkeypatch.setattr(attempt, "_STARTS", None)
    assert attempt.is_restart() is False  # before the handshake: the node's count
    for start, restart in ((1, False), (2, True), (3, True)):
        monkeypatch.setattr(attempt, "_ATTEMPT", None)  # a new process of a new attempt
        attempt.current_attempt(30.0)
        assert attempt._STARTS == start
        assert attempt.is_restart() is restart
    monkeypatch.setattr(attempt, "_STARTS", None)  # no store (a process outside torchrun)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert attempt.is_restart() is True
