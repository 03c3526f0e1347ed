"""``controller/main.py --join``: the address checked as HOST:PORT, one line (not a traceback)
when no job answers or the job takes no joiners, and a joiner that ends when its job is gone
(torchrun ends its own ranks; nobody ended a joiner: it outlived a killed job)."""
import datetime
import socket

import pytest
import torch.distributed as dist

from controller import join_cli, processes
from controller.attempt import ATTEMPT_KEY, store_key
from controller import main as entry
from controller.process_state import LOCAL
from controller.rpc import worker_name


@pytest.mark.parametrize("addr", ["localhost", "localhost:abc", ":29500", "localhost:0", "localhost:70000"])
def test_a_bad_join_address_is_refused_naming_the_flag(addr, capsys):
    with pytest.raises(SystemExit) as e:
        entry.parse_args(["--join", addr])
    assert e.value.code == 2
    assert f"--join must be HOST:PORT (the controller's 'join address' line), got {addr!r}" in capsys.readouterr().err


@pytest.mark.parametrize("extra, named", [(["--config", "c.yaml"], "--config"), (["--set", "a=1"], "--set"),
                                          (["--repl", "--resume", "r"], "--repl, --resume")])
def test_flags_a_joiner_would_ignore_are_refused(extra, named, capsys):
    with pytest.raises(SystemExit) as e:
        entry.parse_args(["--join", "127.0.0.1:29500"] + extra)
    assert e.value.code == 2 and f"{named} cannot be given with it" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_job_at_the_address_is_one_line_after_the_timeout(capsys):
    args = entry.parse_args(["--join", f"127.0.0.1:{_free_port()}", "--rpc-timeout", "0.5"])
    assert join_cli.join_main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"[join] no StreamRL job answered at --join {args.join} within 0.5 s (ConnectionRefusedError)")
    assert "Traceback" not in err and "frame #" not in err


def test_a_port_that_accepts_and_never_answers_is_one_line_after_the_timeout(capsys):
    # a web server, TensorBoard, a mistyped port: TCPStore's handshake waited forever and
    # --rpc-timeout was never applied (the join hung until killed)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        args = entry.parse_args(["--join", f"127.0.0.1:{server.getsockname()[1]}", "--rpc-timeout", "1"])
        assert join_cli.join_main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"[join] no StreamRL job answered at --join {args.join} within 1 s (TimeoutError)")


def test_a_static_job_is_said_to_take_no_joiners(capsys):
    # a job with placement.elastic: false publishes it (controller.processes.start_processes);
    # joining it failed deep in torch ("RPC group mixes statically and dynamically initialized members")
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    store.set(store_key("static_world", "0"), "3")
    store.set(store_key("elastic", "0"), "0")
    store.set(ATTEMPT_KEY, "0")
    args = entry.parse_args(["--join", f"127.0.0.1:{port}", "--rpc-timeout", "5"])
    assert join_cli.join_main(args) == 1
    assert capsys.readouterr().err == (f"[join] the job at 127.0.0.1:{port} runs with placement.elastic: false "
                                       "(a static RPC group): it takes no joiners\n")


def test_serving_ends_when_the_job_is_gone(monkeypatch, capsys):
    monkeypatch.setattr(processes.LOCAL, "rank", 3)
    monkeypatch.setattr(processes.LOCAL, "exit_event", type(processes.LOCAL.exit_event)())
    monkeypatch.setattr(processes.LOCAL, "left_because", "")
    monkeypatch.setattr(processes.LOCAL, "quiet_exit", True)
    calls = []

    def gone():
        calls.append(1)
        return None if len(calls) < 2 else "the job at h:1 is gone (ConnectionRefusedError: its store does not answer)"

    assert processes.serve(gone, every_s=1.0, who="[join] rank 3") == 1
    assert len(calls) == 2
    assert processes.LOCAL.left_because.startswith("the job at h:1 is gone")
    assert not processes.LOCAL.quiet_exit  # leaving alone: no lock-step barrier that would wait for the gone job
    assert capsys.readouterr().err == ("[join] rank 3 exits (code 1): the job at h:1 is gone (ConnectionRefusedError: "
                                       "its store does not answer)\n")


def test_serving_ends_with_the_controllers_code(monkeypatch):
    ev = type(processes.LOCAL.exit_event)()
    ev.set()
    monkeypatch.setattr(processes.LOCAL, "exit_event", ev)
    monkeypatch.setattr(processes.LOCAL, "exit_code", 2)
    assert processes.serve(lambda: pytest.fail("not asked: the controller said exit")) == 2


# ---- mutation review, session 59 ------------------------------------------------------------
def _job_store(attempt="a1", static=3):
    """A real TCPStore holding what an elastic job's controller publishes for joiners."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    for key, value in ((store_key("static_world", attempt), str(static)), (store_key("elastic", attempt), "1"),
                       (store_key("rpc_timeout_s", attempt), "5"),
                       (store_key("rpc_store", attempt), f"127.0.0.1:{store.port}"), (ATTEMPT_KEY, attempt)):
        store.set(key, value)
    return store


def test_a_joiner_after_a_dead_member_is_refused_before_it_takes_a_rank(capsys):
    """controller/dead_members.py's point: a member died in the group, so a --join says so in one
    line and exits 1, taking no rank (it would hang in init_rpc holding the join token)."""
    store = _job_store()
    store.set(store_key("dead_member", "a1"), "4: EOF")
    args = entry.parse_args(["--join", f"127.0.0.1:{store.port}", "--rpc-timeout", "5"])
    assert join_cli.join_main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"[join] the job at 127.0.0.1:{store.port} takes no more joiners: rank 4") and "(EOF)" in err
    assert store.add(store_key("joined", "a1"), 0) == 0  # no rank taken


def test_a_failed_join_releases_the_group_token_it_holds_and_only_its_own():
    """torch's _group_membership_management keeps RpcGroupManagementToken when init_rpc fails;
    every later join / graceful leave waits on Token_for_<name>_join being set. Real store."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))
    rpc_store = dist.PrefixStore("rpc_prefix_0", master)  # init_rpc's first store
    rpc_store.set("RpcGroupManagementToken", "Token_for_w5_join")
    join_cli._release_join_token(f"127.0.0.1:{master.port}", "w5", 5)
    assert rpc_store.get("RpcGroupManagementToken") == b""
    assert rpc_store.get("Token_for_w5_join") == b"Done"  # the waiters go on
    rpc_store.set("RpcGroupManagementToken", "Token_for_w6_join")  # another process's join in progress
    join_cli._release_join_token(f"127.0.0.1:{master.port}", "w7", 5)
    assert rpc_store.get("RpcGroupManagementToken") == b"Token_for_w6_join"
    assert not rpc_store.check(["Token_for_w6_join"]) and not rpc_store.check(["Token_for_w7_join"])


class _Left(Exception):
    pass


def _join_left(monkeypatch, store, init_rpc, rpc_timeout: float) -> None:
    """``join_main`` against ``store``'s job with ``init_rpc`` faked; it must end by leaving
    (``leave_now`` raises ``_Left`` here: it os._exit()s the process)."""
    def leave_now(code):
        raise _Left(code)

    monkeypatch.setattr(join_cli.rpc, "init_rpc", init_rpc)
    monkeypatch.setattr("controller.lifecycle.leave_now", leave_now)
    monkeypatch.setattr(LOCAL, "rank", LOCAL.rank)
    monkeypatch.setattr(LOCAL, "device", getattr(LOCAL, "device", None))
    args = entry.parse_args(["--join", f"127.0.0.1:{store.port}", "--rpc-timeout", str(rpc_timeout)])
    with pytest.raises(_Left):
        join_cli.join_main(args)

def test_the_first_joiner_takes_the_rank_after_the_static_ones_and_a_failed_join_frees_the_token(monkeypatch):
    """join_main numbers joiners after torchrun's ranks (static_world 3: the first is rank 3), and
    when init_rpc fails it releases the group token it took. Fakes: init_rpc (a real failure needs a
    dynamic RPC group with a dead member) and leave_now (it os._exit()s the test process)."""
    store = _job_store(static=3)
    rpc_store = dist.PrefixStore("rpc_prefix_0", store)
    seen = {}

    def failing_init_rpc(name, rank, **kw):
        seen.update(name=name, rank=rank)
        rpc_store.set("RpcGroupManagementToken", f"Token_for_{name}_join")  # as torch's join takes it
        raise RuntimeError("a member is gone")

    _join_left(monkeypatch, store, failing_init_rpc, rpc_timeout=5)
    assert seen == {"name": worker_name(3), "rank": 3}
    assert rpc_store.get("RpcGroupManagementToken") == b""
    assert rpc_store.get(f"Token_for_{worker_name(3)}_join") == b"Done"


def test_a_registered_joiner_sees_its_job_restarted(monkeypatch):
    """_serve's check: the store answers with another attempt id after a restart --resume, and the
    joiner leaves instead of serving a job that no longer counts it. Fake: processes.serve (the
    serving loop), replaced by one that calls the check and stops."""
    store = _job_store(attempt="a1")
    said = []

    class Stop(Exception):
        pass

    def serve(gone, **kw):
        said.append(gone())
        store.set(ATTEMPT_KEY, "b2-restarted")
        said.append(gone())
        raise Stop

    monkeypatch.setattr(join_cli, "serve", serve)
    args = entry.parse_args(["--join", f"127.0.0.1:{store.port}", "--rpc-timeout", "5"])
    with pytest.raises(Stop):
        join_cli._serve(args, "127.0.0.1", str(store.port), store, "a1", 3, 5.0)
    assert said[0] is None
    assert said[1].startswith("the job restarted (attempt b2-resta; this process joined attempt a1)")


def test_a_member_dying_while_a_join_hangs_ends_the_join_with_the_refusal(monkeypatch, capsys):
    """The death is noted while init_rpc hangs (torch's join calling the dead member holds the
    group token for the whole --rpc-timeout): the joiner leaves with the refusal while the join
    still hangs, and frees the token (mutation review, s60: nothing caught the watch skipped).
    Fakes: init_rpc (a real hang needs a dynamic RPC group with a dead member) and leave_now (it
    os._exit()s the test process)."""
    import threading

    store = _job_store(static=3)
    rpc_store = dist.PrefixStore("rpc_prefix_0", store)
    released, hung_up = threading.Event(), threading.Event()

    def hanging_init_rpc(name, rank, **kw):
        rpc_store.set("RpcGroupManagementToken", f"Token_for_{name}_join")
        store.set(store_key("dead_member", "a1"), "4: EOF")  # the controller notes the death meanwhile
        try:
            if not released.wait(60):
                raise RuntimeError("hung for the whole rpc timeout")
        finally:
            hung_up.set()

    try:
        _join_left(monkeypatch, store, hanging_init_rpc, rpc_timeout=120)
        assert not hung_up.is_set()  # it left while the join still hung, not at its end
    finally:
        released.set()
    assert "takes no more joiners: rank 4" in capsys.readouterr().err
    assert rpc_store.get("RpcGroupManagementToken") == b""
