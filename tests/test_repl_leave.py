"""REPL ``leave RANK`` (scale-in): a process that joined with ``--join`` closes its instance and
exits (code 0, a line saying why) while the run goes on; a torchrun rank cannot leave
torchrun's group early, so it stays, idle, until the job ends (docs/controller.md)."""
import json
import subprocess
import sys
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from controller.repl import Repl
from controller.rpc import WorkerHandle
from controller.scheduling import make_dispatcher
from controller.sgs import SGS
from runtime_helpers import (ROOT, LocalRRef, free_port, iterations, last_json, tiny_model, torchrun,  # noqa: F401
                             write_config)


class FakeInstance:
    """A generation instance that records stop/close calls (and can be a lost peer): these
    tests pin the REPL's bookkeeping (which ranks are stopped, closed, told to exit), which a
    real process shows only indirectly. ``joiners.dismiss_joiner`` is monkeypatched for the
    same reason (it sends an RPC, which needs an RPC group and a joined process). The
    real-process path, a joined process exiting after ``leave`` while the run goes on, is
    ``test_a_joined_process_exits_after_leave_and_the_run_goes_on``."""

    def __init__(self, calls, rank, lost=False):
        self.calls, self.rank, self.lost = calls, rank, lost

    def stats(self):
        if self.lost:  # as the RPC layer reports a peer process that is gone
            raise RuntimeError("EPIPE: the peer closed the connection")
        return SimpleNamespace(flat=lambda: {"rank": self.rank})

    def stop(self):
        self.calls.append(("stop", self.rank))
        return True

    def close(self):
        self.calls.append(("close", self.rank))
        return True


def test_leave_closes_and_dismisses_a_joined_process_but_not_a_torchrun_rank(monkeypatch):
    from controller import joiners

    calls = []
    sgs = SGS(make_dispatcher("round_robin"), lambda it: set())
    for r in (1, 3, 4):  # ranks 1 and 3: torchrun generation ranks (2: the trainer); 4 joined
        sgs.add(WorkerHandle(r, "generation", LocalRRef(FakeInstance(calls, r))))
    session = SimpleNamespace(world=SimpleNamespace(sgs=sgs), static_ranks={1, 2, 3}, joined=[4], departed=[],
                              waiting=[])
    monkeypatch.setattr(joiners, "dismiss_joiner", lambda rank, code, reason: calls.append(("exit", rank, code)))
    repl = Repl(session)
    out = repl.leave("4")
    assert out["left"] == 4 and out["instances"] == [1, 3] and out["process"].startswith("exits")
    assert calls == [("stop", 4), ("close", 4), ("exit", 4, 0)] and session.departed == [4]
    calls.clear()
    out = repl.leave("3")
    assert out["instances"] == [1] and out["process"].startswith("stays")
    assert calls == [("stop", 3)] and session.departed == [4]  # neither closed nor told to exit
    assert repl.leave("1") == {"error": "the last generation instance cannot leave"}


def _session(calls, lost=(), waiting=()):
    sgs = SGS(make_dispatcher("round_robin"), lambda it: set())
    for r in (1, 3):
        sgs.add(WorkerHandle(r, "generation", LocalRRef(FakeInstance(calls, r, lost=r in lost))))
    return SimpleNamespace(world=SimpleNamespace(sgs=sgs), static_ranks={1, 2}, joined=[3], departed=[],
                           waiting=list(waiting))


def test_a_lost_instance_is_removed_not_counted_as_the_other(monkeypatch):
    """With joiner 3 dead, `leave 1` let the only live instance go (the next `run` ended the
    job), `leave 3` failed in stop() and left it in the SGS, and `sgs` answered an error only."""
    from controller import joiners

    calls = []
    monkeypatch.setattr(joiners, "dismiss_joiner", lambda rank, code, reason: calls.append(("exit", rank, code)))
    session = _session(calls, lost={3})
    repl = Repl(session)
    assert repl.leave("1") == {"error": "the last generation instance cannot leave"}
    assert [h.rank for h in session.world.sgs.handles] == [1] and session.world.sgs.removed[0][0] == 3
    session = _session(calls, lost={3})
    out = Repl(session).leave("3")
    assert out == {"left": 3, "lost": True, "instances": [1]} and ("stop", 3) not in calls
    session = _session(calls, lost={3})
    out = Repl(session).sgs()
    assert out["instances"] == [{"rank": 1}] and [r for r, _ in out["removed"]] == [3] and out["waiting"] == []


def test_a_waiting_joiner_is_listed_and_can_be_dismissed(monkeypatch):
    from controller import joiners

    calls = []
    monkeypatch.setattr(joiners, "dismiss_joiner", lambda rank, code, reason: calls.append(("exit", rank, code)))
    session = _session(calls, waiting=[5])
    repl = Repl(session)
    assert repl.sgs()["waiting"] == [5]
    out = repl.leave("5")
    assert out["left"] == 5 and out["process"].startswith("exits") and calls == [("exit", 5, 0)]
    assert session.waiting == [] and session.departed == [5] and repl.sgs()["waiting"] == []


@contextmanager
def _job_and_joiner(cfg):
    """A 3-rank job with the REPL on its stdin, and a process joining it (``--join``); both
    killed at the end if still there."""
    import os

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    main = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port",
                             str(port), "controller/main.py", "--config", str(cfg), "--repl"], cwd=ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = []

    def join():  # another process joining the job
        started.append(subprocess.Popen([sys.executable, "controller/main.py", "--join", f"127.0.0.1:{port}", "--role",
                                         "generation"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True))
        return started[-1]

    main.join = join
    joiner = join()
    try:
        yield main, joiner
    finally:
        for p in (main, *started):
            if p.poll() is None:
                p.kill()


def _registered(joiner, rank: int):
    """``joiner`` once it says it registered as ``rank``."""
    for line in joiner.stderr:
        if f"[join] rank {rank} registered" in line:
            break
    return joiner


def _last_commands(main, commands: str) -> tuple[str, str]:
    """Send the REPL its last commands (ending with quit) -> the job's stdout and stderr."""
    main.stdin.write(commands)
    main.stdin.close()
    out = main.stdout.read()
    main.wait(timeout=300)
    return out, main.stderr.read()


def test_a_joined_process_exits_after_leave_and_the_run_goes_on(tmp_path, tiny_model):  # noqa: F811
    cfg = write_config(tmp_path, tiny_model, train__iterations=8, train__eval_every=0,
                       placement__force_scale_out_at=1)
    with _job_and_joiner(cfg) as (main, joiner):
        main.stdin.write("run 2\nsgs\nleave 3\n")
        main.stdin.flush()
        _, joiner_err = joiner.communicate(timeout=300)  # it exits on its own, before the job ends
        assert main.poll() is None  # the run is still going
        # another process can join in its place: the one that left is out of the RPC group (it
        # stayed a member: the next joiner's start called it, met a closed port, and hung)
        again = _registered(main.join(), 4)
        out, err = _last_commands(main, "run 1\nstatus\nsgs\nquit\n")
        assert again.wait(timeout=120) == 0, again.stderr.read()[-3000:]
    assert joiner.returncode == 0 and "RRef Leaks" not in joiner_err, joiner_err[-3000:]  # its exit is one line
    said = [ln for ln in joiner_err.splitlines() if ln.startswith("[join] rank 3 exits")]
    assert said == ["[join] rank 3 exits (code 0): left the job (REPL leave): instance closed, nothing more to "
                    "serve"], joiner_err[-3000:]
    assert main.returncode == 0, err[-4000:]
    a = [json.loads(ln[4:]) for ln in out.splitlines() if ln.startswith(">>> ")]
    ready, run2, sgs, leave, run1, status, sgs_after = a
    assert [i["rank"] for i in sgs["instances"]] == [1, 3]
    assert leave["left"] == 3 and leave["instances"] == [1] and leave["process"].startswith("exits")
    assert run1["ran"] == 1 and status["instances"] == 2  # rank 4, added at that iteration (forced)
    assert [i["rank"] for i in sgs_after["instances"]] == [1, 4]
    rows = iterations(tmp_path / "run")
    assert [r["num_samples"] for r in rows] == [8, 8, 8] and rows[2]["per_instance"] == {"1": 4, "4": 4}
    assert last_json(out)["iterations"] == 3


@pytest.mark.slow  # ~40 s on 2 cores (a job, a joiner): the CI's slow tier runs it
def test_a_waiting_joiner_stopped_on_its_terminal_says_so_and_is_no_longer_listed(tmp_path, tiny_model):  # noqa: F811
    # it printed a bare KeyboardInterrupt traceback, and the controller kept listing it as
    # waiting (then, adding it, met its dead process: an EPIPE and a C++ stack in the REPL)
    import signal

    cfg = write_config(tmp_path, tiny_model, train__iterations=8, train__eval_every=0)
    with _job_and_joiner(cfg) as (main, joiner):
        seen = []
        for line in joiner.stderr:  # until it has registered with the controller
            seen.append(line)
            if line.startswith("[join] rank 3 registered"):
                break
        joiner.send_signal(signal.SIGINT)
        joiner_err = "".join(seen) + joiner.communicate(timeout=120)[1]
        out, err = _last_commands(main, "status\nrun 1\nstatus\nquit\n")
    assert joiner.returncode == 130 and "Traceback" not in joiner_err, joiner_err[-3000:]
    assert joiner_err.splitlines()[-1] == ("[join] rank 3 stopped by SIGINT: it leaves the job (it was waiting to "
                                           "be added)"), joiner_err[-3000:]
    assert main.returncode == 0, err[-4000:]
    assert "[controller] rank 3 left before it was added (stopped by SIGINT)" in err, err[-4000:]
    assert "EPIPE" not in err and "frame #" not in err, err[-4000:]
    ready, status0, run1, status1 = [json.loads(ln[4:]) for ln in out.splitlines() if ln.startswith(">>> ")]
    assert status0["waiting"] == [] and status1["waiting"] == [] and run1["ran"] == 1
    assert status1["instances"] == 1


@pytest.mark.slow  # ~60 s on 2 cores (a job, two joiners): the CI's slow tier runs it
def test_an_added_joiner_stopped_on_its_terminal_leaves_the_group_and_another_can_join(tmp_path, tiny_model):  # noqa: F811
    # an added joiner stopped with Ctrl-C exited without leaving the dynamic RPC group: the next
    # --join process called the dead member and never registered (review, s54); once it left, the
    # controller's next call met "could not find destination id 3", now a lost instance, not the
    # end of the run
    import signal

    cfg = write_config(tmp_path, tiny_model, train__iterations=8, train__eval_every=0,
                       placement__force_scale_out_at=1)
    with _job_and_joiner(cfg) as (main, joiner):
        main.stdin.write("run 2\nsgs\n")
        main.stdin.flush()
        answers = []
        for line in main.stdout:
            if line.startswith(">>> "):
                answers.append(json.loads(line[4:]))
                if len(answers) == 3:
                    break
        assert [i["rank"] for i in answers[2]["instances"]] == [1, 3]
        joiner.send_signal(signal.SIGINT)
        joiner_err = joiner.communicate(timeout=120)[1]
        main.stdin.write("run 1\n")
        main.stdin.flush()
        again = _registered(main.join(), 4)
        out, err = _last_commands(main, "run 1\nstatus\nquit\n")
        assert again.wait(timeout=120) == 0, (again.stderr.read()[-2000:], err[-5000:])
    assert joiner.returncode == 130 and "rank 3 stopped by SIGINT: it leaves the job" in joiner_err, joiner_err[-3000:]
    assert main.returncode == 0, err[-4000:]
    run1, run1b, status = [json.loads(ln[4:]) for ln in out.splitlines() if ln.startswith(">>> ")][-3:]
    assert run1["ran"] == 1 and run1b["ran"] == 1 and status["instances"] == 2  # rank 4 added (forced)
    rows = iterations(tmp_path / "run")
    assert [r["num_samples"] for r in rows] == [8] * 4


def test_run_says_when_it_goes_past_a_decaying_lr_schedule():
    # a cosine/linear schedule stays at its end past trainer.total_steps (lr 0 by default): the
    # REPL's `run K` went there silently
    class Program:
        iteration, version = 4, 4

        def run(self, n):
            self.iteration += n
            return []

    trainer = SimpleNamespace(total_steps=6, lr_schedule="cosine", lr=1e-3, min_lr_ratio=0.0)
    repl = Repl(SimpleNamespace(program=Program(), cfg=SimpleNamespace(trainer=trainer), continue_lineage=lambda: None,
                                world=_session([]).world, waiting=[]))
    assert "note" not in repl.run("2")  # iterations 4, 5
    assert repl.run("3")["note"] == ("3 of these iterations go past trainer.total_steps (6, the cosine "
                                     "schedule's length): they train at lr x min_lr_ratio = 0")
    trainer.lr_schedule = "constant"
    assert "note" not in repl.run("1")


def test_run_with_no_instance_left_is_refused_until_a_joiner_is_added(monkeypatch):
    """Every instance lost (found by `sgs`): `run` failed the whole job (NoInstancesLeft inside
    the run, fatal there) although nothing had started; a joiner waiting was never added (the
    scale-out policy adds at its own wish only), and one refused left the job failing as before
    (flows review, s57; diff review, s58)."""
    from controller import joiners
    from controller.prompt_fit import ContextTooSmall

    calls = []
    monkeypatch.setattr(joiners, "dismiss_joiner", lambda rank, code, reason: calls.append(("exit", rank, code)))
    session = _session(calls, lost={1, 3})
    ran = []
    session.program = SimpleNamespace(iteration=0, version=0, run=lambda n: ran.append(n) or [])
    session.cfg = SimpleNamespace(trainer=SimpleNamespace(total_steps=10, lr_schedule="constant"),
                                  placement=SimpleNamespace(force_scale_out_at=-1, rpc_timeout_s=1.0))
    session.continue_lineage = lambda: calls.append("lineage")
    session.want_add, session.policy, session.model_dir, session.eos_ids = False, None, "", [0]
    repl = Repl(session)
    out = repl.run("1")  # both found lost by run's own probe (no `sgs` typed first), removed
    assert out["error"].startswith("run: no generation instance is left (rank 1: lost during a REPL command: ")
    assert "start a process with --join" in out["error"] and "waiting" not in out["error"]
    assert ran == [] and not repl._in_run and "lineage" not in calls

    def refused(world, cfg, rank, model_dir, eos_ids, version):
        raise ContextTooSmall(f"joiner rank {rank}: max_model_len 64, the run's prompts need 96")

    monkeypatch.setattr(joiners, "add_instance", refused)
    session.waiting = [4]  # a joiner too small for the run's prompts: refused, and the run not started
    out = repl.run("1")
    assert "the process waiting was not added (the controller's log says why)" in out["error"]
    assert ran == [] and not repl._in_run and ("exit", 4, 2) in calls and "lineage" not in calls

    def add_instance(world, cfg, rank, model_dir, eos_ids, version):
        h = WorkerHandle(rank, "generation", LocalRRef(FakeInstance(calls, rank)))
        world.sgs.add(h)
        return h

    monkeypatch.setattr(joiners, "add_instance", add_instance)
    session.waiting = [5]  # the policy did not ask for one; none left: added all the same, then the run goes
    assert repl.run("1")["ran"] == 0 and ran == [1] and session.joined == [3, 4, 5] and session.waiting == []
    assert [h.rank for h in session.world.sgs.handles] == [5] and "lineage" in calls


def test_status_after_a_resume_gives_the_checkpoints_last_reward():
    # it answered "reward": null until the resumed run's first iteration
    program = SimpleNamespace(iteration=6, version=6, mode=SimpleNamespace(name="stream"), history=[])
    session = SimpleNamespace(program=program, metrics=SimpleNamespace(rewards=[0.25, 0.5]), waiting=[],
                              world=SimpleNamespace(sgs=SimpleNamespace(slots=[1])))
    assert Repl(session).status()["reward"] == 0.5
    session.metrics.rewards = []
    assert Repl(session).status()["reward"] is None


def test_a_dismissed_joiner_is_no_longer_pinged():
    from controller import joiners, keepalive

    keepalive.watch(7)
    joiners.dismiss_joiner(7, 0, "left the job")  # no RPC group here: the call fails, as to a gone process
    assert 7 not in keepalive.watched()


@pytest.mark.slow  # ~25 s on 2 cores (a job, a joiner): the CI's slow tier runs it
def test_a_waiting_joiner_killed_is_found_gone_and_never_added(tmp_path, tiny_model):  # noqa: F811
    # SIGKILL leaves no chance to withdraw: it stayed listed as waiting, the forced add met its
    # closed pipe (a C++ stack from the RRef's confirmation), the forced wait then waited 600 s,
    # and the job's exit printed RRef leaks (it counted as joined)
    import signal
    import time

    cfg = write_config(tmp_path, tiny_model, train__iterations=8, train__eval_every=0,
                       placement__force_scale_out_at=1)
    with _job_and_joiner(cfg) as (main, joiner):
        for line in joiner.stderr:  # until it has registered with the controller
            if line.startswith("[join] rank 3 registered"):
                break
        joiner.send_signal(signal.SIGKILL)
        joiner.wait(timeout=60)
        answers = []
        for line in main.stdout:  # `status` until the controller's keepalive has found it gone
            if line.startswith(">>> "):
                answers.append(json.loads(line[4:]))
                if answers[-1].get("waiting") == [] or len(answers) > 60:
                    break
            time.sleep(1)
            main.stdin.write("status\n")
            main.stdin.flush()
        out, err = _last_commands(main, "run 2\nstatus\nquit\n")
    assert answers[-1]["waiting"] == [], answers
    assert main.returncode == 0, err[-4000:]
    lost = [ln for ln in err.splitlines() if "rank 3 was lost before it was added" in ln]
    assert len(lost) == 1 and "its process is gone" in lost[0], err[-4000:]
    assert "frame #" not in err and "Leaking RRef" not in err and "added generation instance" not in err, err[-4000:]
    run2, status = [json.loads(ln[4:]) for ln in out.splitlines() if ln.startswith(">>> ")]
    assert run2["ran"] == 2 and status["instances"] == 1 and status["waiting"] == []
    assert [r["num_samples"] for r in iterations(tmp_path / "run")] == [8, 8]


def test_a_waiting_joiner_the_keepalive_found_gone_is_dropped_once(capsys):
    from controller import joiners, keepalive

    keepalive.watch(9, 10)
    keepalive.Keepalive._answered(SimpleNamespace(wait=lambda: (_ for _ in ()).throw(
        RuntimeError("EOF: end of file (this error originated at tensorpipe)"))), 9)
    keepalive.Keepalive._answered(SimpleNamespace(wait=lambda: (_ for _ in ()).throw(
        RuntimeError("RPC ran for more than set timeout (1000 ms) and will now be marked with an error"))), 10)
    assert keepalive.lost(9).startswith("EOF") and keepalive.lost(10) is None  # slow is not gone
    assert joiners.still_waiting([9, 10]) == [10] and joiners.still_waiting([9, 10]) == [10]
    assert capsys.readouterr().err.count("rank 9 was lost before it was added (its process is gone: EOF") == 1
    assert keepalive.watched().count(9) == 0 and 10 in keepalive.watched()
    keepalive.unwatch(10)


def test_a_run_after_a_torchrun_rank_left_still_exits_quietly(tmp_path, tiny_model):  # noqa: F811
    """A left static rank is a live process (it stays, idle): the run took it for a lost instance
    and skipped the lock-step exit, so every rank printed RRef-leak and "pipe closed" lines."""
    cfg = write_config(tmp_path, tiny_model, placement__generation=[1, 2], placement__trainer=[3],
                       train__eval_every=0)
    p = torchrun(cfg, nproc=4, extra=["--repl"], stdin="leave 2\nrun 1\nquit\n", timeout=240)
    assert p.returncode == 0, p.stderr[-4000:]
    [left] = [json.loads(ln[4:]) for ln in p.stdout.splitlines() if ln.startswith(">>> ") and '"left"' in ln]
    assert left["left"] == 2 and left["process"].startswith("stays")
    for noise in ("Leaking RRef", "RRef Leaks", "encountered error when reading incoming request"):
        assert noise not in p.stderr, p.stderr[-4000:]


def test_a_withdrawn_joiner_is_no_spare_instance(monkeypatch):
    """The scale-out policy's spare count read the announce queue, which held a joiner that had
    withdrawn (Ctrl-C) or died: its decision claimed an instance nobody could bring."""
    from controller import joiners, keepalive

    monkeypatch.setattr(keepalive, "watch", lambda *r: None)
    monkeypatch.setattr(keepalive, "unwatch", lambda r: None)
    joiners.register_joiner(11, "generation")
    joiners.withdraw_joiner(11, "stopped by SIGINT")
    assert joiners.waiting([]) == []
    joiners.register_joiner(12, "generation")
    assert joiners.waiting([]) == [12]


def test_status_gives_the_last_iterations_reward():
    from controller.repl import Repl

    history = [SimpleNamespace(reward_mean=0.1), SimpleNamespace(reward_mean=0.7)]
    program = SimpleNamespace(iteration=2, version=2, mode=SimpleNamespace(name="stream"), history=history)
    session = SimpleNamespace(program=program, metrics=SimpleNamespace(rewards=[0.1, 0.7]), waiting=[],
                              world=SimpleNamespace(sgs=SimpleNamespace(slots=[1])))
    assert Repl(session).status()["reward"] == 0.7
