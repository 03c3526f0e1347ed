"""The REPL's command loop on a stand-in session (no processes): answers, errors that keep the
session going, a worker failure that must stop it, help text, EOF, the timeline command."""
import io
import json
from types import SimpleNamespace

import pytest

from controller.repl import Repl
from controller.rpc import WorkerFailed
from controller.stops import RunStopped
from controller.sgs import NoInstancesLeft
from controller.timeline import Span


class _Program:
    """The program's state the REPL reads and switches; the dispatcher is set by the real
    ``switches.switch_dispatcher`` on a stand-in SGS of two live instances."""

    def __init__(self):
        from controller.ptl_profile import PTLProfile

        self.iteration, self.version, self.history = 0, 0, []
        self.mode = SimpleNamespace(name="async_stream")
        self.fail_run = None
        self.ranker = object()  # a run with a ranker (skew dispatchers need one)
        slots = [SimpleNamespace(profile=PTLProfile([1, 8], [0.01, 0.02], 4096)) for _ in range(2)]
        self.world = SimpleNamespace(sgs=SimpleNamespace(dispatcher=None, slots=slots, seed=0), colocated=False)
        self.per_prompt = 4
        self.cfg = SimpleNamespace(train=SimpleNamespace(batch_prompts=8, max_tokens=64, max_prompt_tokens=0),
                                   trainer=SimpleNamespace(max_staleness=1))

    @property
    def dispatcher(self):
        return self.world.sgs.dispatcher

    def run(self, k):
        if self.fail_run:
            raise self.fail_run
        self.iteration += k
        self.version += k
        return [SimpleNamespace(reward_mean=0.5)] * k  # IterationResult.reward_mean



def _refused_eval(program, n, step=None):
    raise WorkerFailed(1, "generation", "evaluate", "ValueError: engine refused eval request")


def _session(spans=()):
    logged = []
    metrics = SimpleNamespace(spans=list(spans), rewards=[], log_scalars=lambda acc, step: logged.append((acc, step)))
    world = SimpleNamespace(sgs=SimpleNamespace(slots=[1], handles=[], removed=[]), trainers=[])
    trainer = SimpleNamespace(total_steps=20, lr_schedule="constant", lr=1e-6, min_lr_ratio=0.0)
    return SimpleNamespace(program=_Program(), metrics=metrics, world=world, cfg=SimpleNamespace(trainer=trainer),
                           waiting=[], continue_lineage=lambda: None)


def _drive(session, text: str) -> list[dict]:
    out = io.StringIO()
    Repl(session).loop(io.StringIO(text), out)
    return [json.loads(ln[4:]) for ln in out.getvalue().splitlines() if ln.startswith(">>> ")]


def test_errors_are_answered_and_eof_ends_the_session(monkeypatch):
    from controller import repl

    monkeypatch.setattr(repl, "evaluate", _refused_eval)
    s = _session()
    a = _drive(s, "run\nrun abc\nrun 1 2\nleave x\ntimeline 0\ndispatch\ndispatch nosuch\n"
                  "dispatch random\neval 2\n\nstatus")  # no quit: EOF ends it
    ready, run1, *errs, disp, ev, status = a
    assert ready["ready"] and run1["ran"] == 1
    assert all("error" in e for e in errs), errs
    assert "run: expected a count >= 1, got 'abc'" in errs[0]["error"]
    assert disp == {"dispatch": "random", "options": {}} and s.program.dispatcher is not None
    assert "error" in ev and "engine refused" in ev["error"]  # a worker's error outside `run`: answered
    assert status["iteration"] == 1


def test_a_missing_or_extra_argument_is_answered_with_the_usage():
    # was Python's own words: "TypeError: Repl.mode() missing 1 required positional argument"
    a = _drive(_session(), "mode\nleave\nleave x\nsgs now\nrun 1 2\ntimeline 1 2\n")[1:]
    assert [x["error"] for x in a] == [
        "usage: mode NAME", "usage: leave RANK",
        "leave: expected a generation instance's rank (see sgs), got 'x'",
        "usage: sgs", "usage: run K", "usage: timeline [N]"]


def test_a_dispatcher_a_run_cannot_use_is_refused_and_not_applied():
    s = _session()
    a = _drive(s, "dispatch skew draws=0\ndispatch oracle\n")[1:]
    assert a[0]["error"] == "ValueError: skew dispatcher: draws must be an int >= 1, got 0"
    assert "the oracle dispatcher plans on the true output lengths" in a[1]["error"]
    assert s.program.dispatcher is None  # neither replaced the one in use
    s.program.ranker = None  # ranker.kind: none: every estimate max_tokens
    assert "this run has no ranker" in _drive(s, "dispatch skew\n")[1]["error"] and s.program.dispatcher is None
    # (order=lpt is refused at load without a ranker; the REPL took it: session 51's second review)
    said = _drive(s, "dispatch random order=lpt\n")[1]["error"]
    assert "order=lpt orders by output-length estimate; this run has no ranker" in said
    assert s.program.dispatcher is None


@pytest.mark.parametrize("failure", [
    WorkerFailed(2, "trainer", "step", "RuntimeError: staleness"),
    NoInstancesLeft("step 1: every generation instance is gone"),  # were answered, and the
    RunStopped("step 1: all 8 samples were skipped"),  # session went on (audit, session 19)
])
def test_a_failure_during_run_stops_the_session(failure):
    # the iteration it interrupted is registered with the trainers, its samples in flight:
    # the run must stop (runner: exit 1), not answer and go on with a broken pipeline
    s = _session()
    s.program.fail_run = failure
    out = io.StringIO()
    with pytest.raises(type(failure)):
        Repl(s).loop(io.StringIO("status\nrun 2\nstatus\n"), out)
    answers = [json.loads(ln[4:]) for ln in out.getvalue().splitlines()]
    assert len(answers) == 3 and answers[-1]["fatal"] is True and str(failure).splitlines()[0] in answers[-1]["error"]


def test_help_prints_its_text_as_lines_and_answers_the_usages():
    # was one JSON string with escaped newlines: unreadable on a terminal
    s = _session()
    out = io.StringIO()
    Repl(s).loop(io.StringIO("help\n"), out)
    lines = out.getvalue().splitlines()
    answer = json.loads(lines[-1][4:])["help"]
    text = lines[1:-1]
    assert text[0].startswith("run K") and any(ln.startswith("timeline [N]") for ln in text)
    assert not any(ln.startswith(">>> ") or "\\n" in ln for ln in text)
    listed = {u.split(" ")[0] for u in answer} | {"quit"}
    assert listed == set(Repl(s).commands) | {"help", "quit"}
    assert "timeline [N]" in answer and "dispatch NAME [k=v ...]" in answer  # with their arguments


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_gets_a_prompt_and_a_pipe_does_not():
    out = io.StringIO()
    Repl(_session()).loop(_Tty("status\n"), out)
    assert out.getvalue().count("streamrl> ") == 2  # before `status`, and before the EOF
    assert out.getvalue().endswith("streamrl> \n")
    piped = io.StringIO()
    Repl(_session()).loop(io.StringIO("status\n"), piped)
    assert "streamrl>" not in piped.getvalue()
    assert all(ln.startswith(">>> ") for ln in piped.getvalue().splitlines())


def test_timeline_leaves_out_the_pauses_between_runs():
    # two `run 1` calls 60 s apart: the wait at the prompt is nobody's bubble
    spans = [Span("controller", "dispatch", 0.0, 0.1, 0), Span("gen1", "generate", 0.1, 1.0, 0),
             Span("train2", "train", 1.0, 2.0, 0), Span("controller", "wait_step", 1.0, 2.0, 0),
             Span("train2", "idle", 2.0, 62.5, 1),
             Span("controller", "dispatch", 62.0, 62.1, 1), Span("gen1", "generate", 62.1, 63.0, 1),
             Span("train2", "train", 62.5, 64.0, 1), Span("controller", "wait_step", 63.0, 64.0, 1)]
    t = _drive(_session(spans), "timeline\n")[1]
    assert t["spans"] == len(spans)
    assert t["bubble"]["gen1"] == pytest.approx(1 - 1.8 / 4.0)  # busy 1.8 s of the iterations' 4 s
    assert t["bubble"]["train2"] == pytest.approx(1 - 2.5 / 4.0)
    assert t["stage_s"]["generate"] == pytest.approx(1.8)
    assert t["stage_s"]["idle"] == pytest.approx(0.5)  # was 60.5: the pause at the prompt (62.0-62.5 is in)


def test_eval_answers_its_prompt_count_and_says_when_n_exceeds_the_split(tmp_path, monkeypatch):
    from controller import repl
    from controller.evaluation import EvalResult
    from controller.metrics import Metrics

    s = _session()
    s.metrics = Metrics(tmp_path, timeline_every=0)
    s.program.iteration = 9  # the next to run: logged at 8, the iteration just trained
    monkeypatch.setattr(repl, "evaluate", lambda program, n, step=None: EvalResult({"eval/mean": 0.4}, min(n, 16) or 16, n, 16, 1,
                                                                        100.0, 0.5))
    a = _drive(s, "eval 4\neval 100\neval 4\neval 0\n")[1:]
    s.metrics.close()
    assert [(x["prompts"], x["requested"], x["eval/mean"]) for x in a] == [(4, 4, 0.4), (16, 100, 0.4), (4, 4, 0.4),
                                                                           (16, 0, 0.4)]
    assert "note" not in a[0] and a[1]["note"] == "asked for 100 prompts; the test split has 16: evaluated all of them"
    assert a[0]["tensorboard"] == "eval_repl/p4/* at step 8" and a[2]["tensorboard"].startswith("not logged")
    assert a[3]["tensorboard"].startswith("not logged")  # 0 (all) is the 16 prompts `eval 100` logged
    rows = [json.loads(ln) for ln in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [(r["source"], r["prompts"], r["iteration"]) for r in rows] == [("repl", 4, 8), ("repl", 16, 8),
                                                                          ("repl", 4, 8), ("repl", 16, 8)]


def test_a_line_that_is_not_utf8_is_answered_and_the_session_goes_on():
    # a stray byte (a Latin-1 paste) on a strictly decoded stdin (a UTF-8 locale) raised out of the
    # loop and stopped the run: "the run is never stopped by what is typed" (review, session 47)
    raw = io.BufferedReader(io.BytesIO(b"status\n\xe9t\xe9\nstatus\n"), buffer_size=1)
    stdin = io.TextIOWrapper(raw, encoding="utf-8", errors="strict")
    out = io.StringIO()
    Repl(_session()).loop(stdin, out)
    answers = [json.loads(ln[4:]) for ln in out.getvalue().splitlines()]
    assert "unknown command" in answers[2]["error"] and "\ufffd" in answers[2]["error"]
    assert answers[1].get("iteration") == answers[3].get("iteration") == 0


_BAD_DISPATCHERS = """
class Raises:
    def plan(self, est_lens, profiles, true_lens=None, seed=0, prompt_lens=None):
        raise KeyError("missing")


class Loses:
    def plan(self, est_lens, profiles, true_lens=None, seed=0, prompt_lens=None):
        from controller.scheduling import DispatchPlan
        return DispatchPlan([list(range(len(est_lens) - 1)), []], [8, 8])
"""


def test_a_dispatcher_whose_trial_plan_fails_is_refused_and_the_one_in_use_kept(tmp_path):
    """`dispatch FILE:Bad` was accepted and the next `run` stopped the run (the session and the
    job ended, exit 1; review, s53): a trial plan on the live instances refuses it at once."""
    f = tmp_path / "bad_dispatch.py"
    f.write_text(_BAD_DISPATCHERS)
    s = _session()
    a = _drive(s, f"dispatch random\ndispatch {f}:Raises\ndispatch {f}:Loses\nrun 1\n")[1:]
    kept = s.program.dispatcher
    assert a[0] == {"dispatch": "random", "options": {}}
    assert "a trial plan of 32 requests on the live instances (2) failed" in a[1]["error"]
    assert "plan() raised KeyError" in a[1]["error"] and "the dispatcher in use is kept" in a[1]["error"]
    assert "a trial plan" in a[2]["error"] and "Loses" in a[2]["error"]
    assert a[3]["ran"] == 1 and s.program.dispatcher is kept  # (random, still)
