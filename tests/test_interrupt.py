"""Ctrl-C on a running job (SIGINT to the whole process group, as a terminal sends it), or
SIGTERM to torchrun (how Slurm and Kubernetes stop a job; torchrun passes it to its ranks): one
line from the controller naming the last checkpoint, no traceback from the ranks, no process
left behind, and the checkpoint it names is whole and resumable."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from controller import checkpoint as ckpt
from tests.runtime_helpers import ROOT, free_port, tiny_model, write_config  # noqa: F401


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_ctrl_c_stops_every_rank_and_keeps_the_last_checkpoint(tmp_path, tiny_model, how):  # noqa: F811
    cfg = write_config(tmp_path, tiny_model, train__iterations=10_000, train__ckpt_every=2, train__eval_every=0)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port",
           str(free_port()), str(ROOT / "controller/main.py"), "--config", str(cfg)]
    p = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        # no deadline of its own (a loaded machine only makes the run slower): the suite's
        # pytest-timeout ends a run that never checkpoints
        while ckpt.find(tmp_path / "run") is None or ckpt.find(tmp_path / "run").name < "iter_000004":
            assert p.poll() is None, "the run ended before its fourth iteration's checkpoint"
            time.sleep(0.5)
        if how == "ctrl-c":
            os.killpg(p.pid, signal.SIGINT)
        else:
            p.send_signal(signal.SIGTERM)  # torchrun only: it forwards the signal to its ranks
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    # the controller's own signal, never "a worker was lost": the workers, signalled at the same
    # moment, are gone within a millisecond, so this only holds while no interrupt is lost on
    # the controller (test_an_interrupt_in_torchs_rpc_callback_reaches_the_caller)
    said = "[controller] interrupted" if how == "ctrl-c" else "[controller] stopped by SIGTERM"
    lines = [ln for ln in err.splitlines() if ln.startswith("[controller]")]
    assert [ln for ln in lines if ln.startswith(said)] == lines[-1:], err[-3000:]
    assert "the last checkpoint is" in lines[-1] and not any("run stopped" in ln for ln in lines), err[-3000:]
    assert "KeyboardInterrupt" not in err and "Terminated" not in err, err[-3000:]
    assert subprocess.run(["pgrep", "-f", str(cfg)], capture_output=True).returncode == 1  # nothing left
    found = ckpt.find(tmp_path / "run")
    assert str(found) in lines[-1]
    state = json.loads((found / "controller.json").read_text())
    assert state["iteration"] >= 4 and (found / "trainer" / "model" / "model.safetensors").exists()


# Every controller -> worker call is ``rref.rpc_async().method(...)``, which torch makes inside a
# Future callback that it runs inline, on the calling (main) thread, and whose exceptions it
# keeps: an interrupt raised there was lost (the controller then reported its workers, stopped
# by the same signal, as lost). Here the signal lands in that callback every time: the call's
# arguments are pickled there, and one of them signals this process when pickled.
_IN_CALLBACK = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {root!r})
    import torch.distributed.rpc as rpc
    from controller import lifecycle

    class Obj:
        def ping(self, x):
            return x

    class SignalsWhenPickled:
        def __reduce__(self):
            os.kill(os.getpid(), signal.{signame})
            return (int, (0,))

    rpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
        init_method="tcp://127.0.0.1:{port}", _transports=["uv"], _channels=["basic"]))
    # a shell's background job starts with SIGINT ignored (CI may run so): give this process the
    # handler Python installs when started from a terminal, which signals_interrupt takes over
    signal.signal(signal.SIGINT, signal.default_int_handler)
    lifecycle.signals_interrupt(signal.SIGTERM, signal.SIGHUP)
    rref = rpc.RRef(Obj())
    assert rref.rpc_async().ping(1).wait() == 1  # the RRef's type is known: callbacks run inline from here
    try:
        rref.rpc_async().ping(SignalsWhenPickled())
        for _ in range(300):  # a pending handler runs here (the kernel may have given the signal
            time.sleep(0.01)  # to another thread, which a loaded machine runs late)
        print("lost", flush=True)
    except KeyboardInterrupt as e:
        print("raised", type(e).__name__, str(e), lifecycle.stop_signal(), flush=True)
    os._exit(0)
""")


@pytest.mark.parametrize("signame, raised", [("SIGTERM", "Terminated SIGTERM"), ("SIGINT", "KeyboardInterrupt ")])
def test_an_interrupt_in_torchs_rpc_callback_reaches_the_caller(signame, raised):
    code = _IN_CALLBACK.format(root=str(ROOT), signame=signame, port=free_port())
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.stdout.strip() == f"raised {raised} {signame}", r.stdout + r.stderr[-2000:]


def test_a_signal_after_the_run_ended_keeps_the_exit_code_said(tmp_path):
    """torchrun stops every rank once one has died: a SIGTERM reaching the controller after it
    said "run stopped: worker rank 2 (trainer) was lost" turned exit 1 into "stopped by SIGTERM",
    exit 130 (an SRE audit's run). One process imports the controller, a fork per case."""
    prog = f"""
import json, os, sys
from controller.process_state import LOCAL
from controller.main import _interrupted
out = {{}}
for outcome in (None, 1, 0):
    err = os.path.join({str(tmp_path)!r}, f"err{{outcome}}")
    pid = os.fork()
    if pid == 0:
        fd = os.open(err, os.O_WRONLY | os.O_CREAT)
        os.dup2(fd, 2)
        LOCAL.outcome = outcome
        _interrupted({str(tmp_path)!r}, "", "SIGTERM")
    out[str(outcome)] = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), open(err).read()]
print(json.dumps(out))
"""
    r = subprocess.run([sys.executable, "-c", prog], cwd=ROOT, env={**os.environ, "RANK": "0"}, capture_output=True,
                       text=True, timeout=120)
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["None"][0] == 130 and got["None"][1].startswith(
        "[controller] stopped by SIGTERM (yours, or torchrun's after a rank exited: its report names that rank); "), got
    assert got["1"] == [1, ""] and got["0"] == [0, ""], got  # the code said stands, no second line


def test_a_sigterm_after_a_worker_was_found_lost_names_that_worker(monkeypatch, capsys, tmp_path):
    """A worker killed while the controller waited on nothing (an idle REPL prompt): torchrun
    SIGTERMs the others and the controller said only "stopped by SIGTERM" (review, session 51).
    Where its keepalive ping had found the worker gone, it names it."""
    from controller import keepalive, lifecycle
    from controller import main as entry

    def leave(code):
        raise SystemExit(code)

    from controller.process_state import LOCAL

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setattr(LOCAL, "outcome", None)  # (an earlier test's run in this process may have set it)
    monkeypatch.setattr(LOCAL, "run_folder", "")
    monkeypatch.setattr(lifecycle, "leave_now", leave)
    monkeypatch.setattr(keepalive, "_LOST", {2: "Connection reset by peer"})
    with pytest.raises(SystemExit, match="130"):
        entry._interrupted(str(tmp_path / "run"), "", "SIGTERM")
    assert capsys.readouterr().err.startswith("[controller] stopped by SIGTERM (worker rank 2 was lost before: "
                                              "Connection reset by peer); ")
    monkeypatch.setattr(keepalive, "_LOST", {7: "Connection reset by peer"})  # a joiner the run went on without
    with pytest.raises(SystemExit, match="130"):
        entry._interrupted(str(tmp_path / "run"), "", "SIGTERM")
    assert capsys.readouterr().err.startswith("[controller] stopped by SIGTERM (yours, or torchrun's")


@pytest.mark.parametrize("ignored", [False, True])
def test_a_rank_leaves_quietly_on_a_signal_while_it_imports_torch(ignored):
    """Ctrl-C in the seconds a rank imports torch printed a KeyboardInterrupt traceback from every
    rank (review, session 51): from the module's start a torchrun rank leaves with 130 on SIGINT /
    SIGTERM / SIGHUP; a SIGINT its launcher ignores (`torchrun ... &` from a script) stays
    ignored."""
    code = textwrap.dedent("""
        import signal, sys
        sys.argv = ["controller/main.py"]
        import controller.main
        print(*(getattr(signal.getsignal(s), "__name__", str(signal.getsignal(s)))
                for s in (signal.SIGINT, signal.SIGTERM)))
    """)
    preexec = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignored else None
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "TORCHELASTIC_RUN_ID": "test"}, preexec_fn=preexec)
    assert p.returncode == 0, p.stderr
    want = f"{int(signal.SIG_IGN)} _leave_at_start" if ignored else "_leave_at_start _leave_at_start"
    assert p.stdout.split("\n")[-2] == want, p.stdout


def test_a_hangup_nohup_ignores_stays_ignored():
    """`nohup torchrun ...`: the ranks start with SIGHUP ignored; the controller's stop handler
    replaced it and a hangup stopped the run (session 51's second review)."""
    from controller import lifecycle

    before = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        lifecycle.signals_interrupt(signal.SIGTERM, signal.SIGHUP)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, signal.SIG_DFL)
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def test_a_signal_while_the_logs_close_keeps_the_exit_code_said(monkeypatch, capsys):
    """The run's end was taken as said only after the logs' close: torchrun's SIGTERM landing in
    ``metrics.close`` (after "run stopped: worker rank 2 (trainer) was lost") gave a second line
    and exit 130 (seen on 1 of 2 real trainer kills; review, s53). The code is kept as soon as
    the stop is said, and the resume hint comes before the close."""
    import types

    from controller import runner
    from controller.process_state import LOCAL
    from controller.rpc import WorkerFailed

    monkeypatch.setattr(LOCAL, "outcome", None)

    class Metrics:
        def close(self, exit_code=0):  # the signal lands while the logs close
            raise KeyboardInterrupt("SIGTERM")

    class Session:
        def __init__(self, *a):
            self.metrics, self.logdir = Metrics(), "/nonexistent/run"
            self.waiting, self.joined, self.departed = [], [], []
            self.world = types.SimpleNamespace(sgs=types.SimpleNamespace(lost=[2]))

        def run(self):
            raise WorkerFailed(2, "trainer", "step", "EOF: end of file", lost=True)

    monkeypatch.setattr(runner, "Session", Session)
    monkeypatch.setattr(runner, "config_notes", lambda cfg: [])
    with pytest.raises(KeyboardInterrupt):
        runner.run_controller(None, types.SimpleNamespace(resume="", set=[]), 3)
    assert LOCAL.outcome == 1  # what _interrupted leaves with, saying nothing more
    err = capsys.readouterr().err
    assert "run stopped: worker rank 2 (trainer) was lost" in err and "no checkpoint was written yet" in err
