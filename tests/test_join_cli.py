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

