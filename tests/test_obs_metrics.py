"""Metrics' timeline files, timings, evaluations and summary, on real TensorBoard event files:
the timeline written off the pipeline's thread, the final figure at the last iteration, the
trace kept across a resume and after a crash, eval and checkpoint timings, REPL evals apart
from the periodic curve, idle per device, the final JSON's scopes, the batch's lengths."""
import json
import threading

import pytest

import controller.metrics as metrics_mod
from controller.metrics import Metrics
from controller.evaluation import EvalResult
from controller.program import IterationResult
from controller.timeline import Span


def _res(i: int, reward: float = 0.5) -> IterationResult:
    return IterationResult(iteration=i, version=i + 1, gen_version=i, metrics={"reward_mean": reward},
                           num_samples=8, num_tokens=48, gen_seconds=1.0, train_seconds=1.0,
                           iter_seconds=2.0, staleness_max=0, interval_s=1.0, gen_lens=[6] * 8)


def _spans(i: int, t0: float = 0.0) -> list[Span]:
    t = t0 + 10.0 * i
    return [Span("controller", "dispatch", t, t + 0.1, i), Span("gen1", "generate", t + 0.1, t + 1.0, i),
            Span("train2", "train", t + 1.0, t + 2.0, i), Span("controller", "wait_step", t + 1.0, t + 2.0, i)]


def _events(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logdir / "tb"), size_guidance={"images": 0, "scalars": 0})
    ea.Reload()
    return ea


def _scalars(logdir, tag):
    """The points of ``tag`` as the TensorBoard UI shows them (the server's reader, which takes a
    run folder's first SessionLog.START as its session's start, purging nothing on it: a resume's
    purge was shown by the older reader only; flows review, s59), the same as the older reader's."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    ui = EventAccumulator(str(logdir / "tb"), size_guidance={"tensors": 0})
    ui.Reload()
    shown = [(e.step, round(float(make_ndarray(e.tensor_proto)), 6)) for e in ui.Tensors(tag)] \
        if tag in ui.Tags()["tensors"] else []
    assert shown == [(e.step, round(e.value, 6)) for e in _events(logdir).Scalars(tag)]
    return shown


def _trace(logdir):
    return json.loads((logdir / "timeline.json").read_text())["traceEvents"]


def test_gen_version_lag_counts_from_the_version_trained_at_also_after_a_skipped_step(tmp_path):
    m = Metrics(tmp_path, timeline_every=0)
    m.log_iteration(_res(0), _spans(0))  # lag 0: generated with 0, trained at 0 -> 1
    late = _res(1)
    late.gen_version = 0  # lag 1: generated with 0, trained at 1 -> 2
    m.log_iteration(late, _spans(1))
    skipped = _res(2)
    skipped.version, skipped.gen_version = 2, 1  # trained at 2, the step skipped: still 2
    skipped.metrics["step_skipped"] = 1.0
    m.log_iteration(skipped, _spans(2))
    m.close()
    assert _scalars(tmp_path, "staleness/gen_version_lag") == [(0, 0.0), (1, 1.0), (2, 1.0)]


def test_the_timeline_is_drawn_off_the_pipelines_thread(tmp_path, monkeypatch):
    # drawn inside log_iteration, the figure stalled the controller (0.9-1.3 s every
    # timeline_every iterations, a bubble on every worker)
    drawn_on = []
    real = metrics_mod.gantt_figure

    def gantt(*a, **k):
        drawn_on.append(threading.current_thread())
        return real(*a, **k)

    monkeypatch.setattr(metrics_mod, "gantt_figure", gantt)
    m = Metrics(tmp_path, timeline_every=2)
    for i in range(4):
        m.log_iteration(_res(i), _spans(i))
    m.close()  # waits for the timeline thread
    assert drawn_on and all(t is not threading.main_thread() for t in drawn_on)
    assert [e.step for e in _events(tmp_path).Images("timeline/gantt")][-1] == 3
    assert len([e for e in _trace(tmp_path) if e["ph"] == "X"]) == 16


def test_the_final_figure_is_at_the_last_iteration_once(tmp_path, monkeypatch):
    # the runner passes the next iteration (as range's end): the figure was logged one step
    # past the last scalar, titled with it, and twice when timeline_every divides the run
    titles = []
    real = metrics_mod.gantt_figure
    monkeypatch.setattr(metrics_mod, "gantt_figure", lambda spans, title: titles.append(title) or real(spans, title))
    m = Metrics(tmp_path, timeline_every=3)
    for i in range(3):
        m.log_iteration(_res(i), _spans(i))
    m.write_timeline(3)  # the run's end, after iteration 2
    m.close()
    assert [e.step for e in _events(tmp_path).Images("timeline/gantt")] == [2]
    assert set(titles) == {"timeline up to iteration 2"}


def test_a_resumed_run_keeps_the_earlier_attempts_spans(tmp_path):
    m = Metrics(tmp_path, timeline_every=0)
    for i in range(2):
        m.log_iteration(_res(i), _spans(i, 1000.0))
    m.write_timeline(2)
    m.close()
    m = Metrics(tmp_path, timeline_every=0)  # --resume from iteration 2
    m.rewards = [0.5, 0.5]  # the runner restores them from the checkpoint
    m.log_iteration(_res(2), _spans(2, 5000.0))
    m.close()
    xs = [e for e in _trace(tmp_path) if e["ph"] == "X"]
    assert [(e["pid"], e["args"]["iteration"]) for e in xs if e["name"] == "dispatch"] == [(0, 0), (0, 1), (1, 2)]
    assert xs[0]["ts"] == 1000.0 * 1e6  # epoch time: the attempts line up
    procs = [e["args"]["name"] for e in _trace(tmp_path) if e["name"] == "process_name"]
    assert [p.split(" (")[0] for p in procs] == ["StreamRL attempt 0", "StreamRL attempt 1"]
    s = m.summary()
    assert (s["iterations"], s["resumed_at"], s["attempt_iterations"]) == (3, 2, 1)


def test_a_crash_leaves_every_span_logged_so_far(tmp_path):
    m = Metrics(tmp_path, timeline_every=0)
    for i in range(3):
        m.log_iteration(_res(i), _spans(i))
    # killed here (os._exit, Ctrl-C): no timeline write, no close
    with open(tmp_path / "spans.jsonl", "a") as f:
        f.write('{"worker": "gen1", "stage"')  # torn by the crash
    rows = [json.loads(ln) for ln in (tmp_path / "spans.jsonl").read_text().splitlines()[:-1]]
    assert len(rows) == 12 and rows[0] == {"worker": "controller", "stage": "dispatch", "start": 0.0, "end": 0.1,
                                           "iteration": 0, "attempt": 0}
    m = Metrics(tmp_path, timeline_every=0)  # the resume reads them back; the torn line goes
    assert m.attempt == 1 and len((tmp_path / "spans.jsonl").read_text().splitlines()) == 12
    m.log_iteration(_res(3), _spans(3))
    m.close()
    assert len([e for e in _trace(tmp_path) if e["ph"] == "X"]) == 16
    assert len((tmp_path / "spans.jsonl").read_text().splitlines()) == 16


def test_an_attempt_that_logged_no_span_still_takes_its_number(tmp_path):
    """Attempts were counted from spans.jsonl only: a --resume that stopped before any span
    (set-up, a REPL quit without `run`) gave the next one the same number."""
    (tmp_path / "config.yaml").write_text("{}")  # run_record's, one per start of the folder
    m = Metrics(tmp_path, timeline_every=0)
    assert m.attempt == 0
    m.log_iteration(_res(0), _spans(0))
    m.close()
    (tmp_path / "config.resume1.yaml").write_text("{}")
    assert Metrics(tmp_path, timeline_every=0).attempt == 1  # stops before logging anything
    (tmp_path / "config.resume2.yaml").write_text("{}")
    assert Metrics(tmp_path, timeline_every=0).attempt == 2  # was 1 again


def test_close_writes_the_timeline_of_a_run_that_stopped(tmp_path):
    # the runner's way out of a failure or Ctrl-C: close() writes what the last periodic
    # write (timeline_every) had not yet
    m = Metrics(tmp_path, timeline_every=5)
    for i in range(3):
        m.log_iteration(_res(i), _spans(i))
    assert not (tmp_path / "timeline.json").exists()
    m.close()
    m.close()  # twice: harmless
    assert len([e for e in _trace(tmp_path) if e["ph"] == "X"]) == 12
    assert [e.step for e in _events(tmp_path).Images("timeline/gantt")] == [2]


def test_checkpoint_saves_and_evals_get_spans_and_timings(tmp_path):
    m = Metrics(tmp_path, timeline_every=0)
    m.log_iteration(_res(0), _spans(0))
    with m.timed("save", 0):
        pass
    with m.timed("save", -1):  # a REPL `save` before any iteration: the span only
        pass
    with m.timed("save", 0):  # a REPL `save` of the iteration ckpt_every saved: the span only
        pass
    m.log_eval(EvalResult({"eval/sum": 0.5, "eval/mean": 0.5}, 32, 32, 40, 1, 100.0, 0.75), 0)
    m.close()
    assert [(s.worker, s.stage, s.iteration) for s in m.spans if s.stage == "save"] == [
        ("controller", "save", 0), ("controller", "save", -1), ("controller", "save", 0)]
    assert [s for s, _ in _scalars(tmp_path, "time/save_s")] == [0]
    assert _scalars(tmp_path, "time/eval_s") == [(0, 0.75)] and _scalars(tmp_path, "eval/mean") == [(0, 0.5)]
    assert [(s.stage, s.start, s.end) for s in m.spans if s.stage == "eval"] == [("eval", 100.0, 100.75)]
    assert {"save", "eval"} <= {e["name"] for e in _trace(tmp_path) if e["ph"] == "X"}


def test_repl_evals_get_a_curve_per_prompt_count_and_one_point_per_step(tmp_path):
    # four REPL evals at iteration 8 (32 prompts, all 40, 4, 32 again) put 4 points at step 8
    # of eval/mean, the 4-prompt one on the 32-prompt curve
    m = Metrics(tmp_path, timeline_every=0)
    m.log_eval(EvalResult({"eval/mean": 0.42}, 32, 32, 40, 1, 100.0, 1.0), 7)  # the periodic one
    answers = [m.log_eval(EvalResult({"eval/mean": v}, n, n, 40, 1, 100.0, 1.0), 8, source="repl")
               for v, n in ((0.41, 32), (0.40, 40), (0.0, 4), (0.43, 32))]
    m.close()
    assert _scalars(tmp_path, "eval/mean") == [(7, 0.42)]
    assert _scalars(tmp_path, "eval_repl/p32/mean") == [(8, 0.41)]
    assert _scalars(tmp_path, "eval_repl/p40/mean") == [(8, 0.4)]
    assert _scalars(tmp_path, "eval_repl/p4/mean") == [(8, 0.0)]
    # the timing too: one curve per prompt count (was one time/eval_repl_s with 3 points at 8)
    assert [_scalars(tmp_path, f"time/eval_repl_p{n}_s") for n in (32, 40, 4)] == [[(8, 1.0)]] * 3
    assert answers[3]["tensorboard"].startswith("not logged") and answers[0]["tensorboard"] == "eval_repl/p32/* at step 8"
    rows = [json.loads(ln) for ln in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [(r["iteration"], r["source"], r["prompts"], r["eval/mean"]) for r in rows] == [
        (7, "periodic", 32, 0.42), (8, "repl", 32, 0.41), (8, "repl", 40, 0.4), (8, "repl", 4, 0.0),
        (8, "repl", 32, 0.43)]


def test_colocated_idle_is_per_device(tmp_path):
    # rank 1 generates, then trains: one busy device, not 50% idle generation + 50% idle trainer
    m = Metrics(tmp_path, timeline_every=0)
    spans = [Span("controller", "dispatch", 0.0, 0.1, 0), Span("gen1", "generate", 0.1, 4.0, 0),
             Span("train1", "idle", 0.1, 4.0, 0), Span("train1", "train", 4.0, 8.0, 0),
             Span("controller", "wait_step", 4.0, 8.0, 0)]
    d = m.log_iteration(_res(0), spans)
    m.close()
    idle = {k: round(v, 4) for k, v in d.items() if k.startswith("idle/")}
    assert idle == {"idle/rank1": round(0.1 / 8.0, 4)}
    assert [t for t in _events(tmp_path).Tags()["scalars"] if t.startswith("idle/")] == ["idle/rank1"]


def test_batch_lengths_are_tags_and_row_fields(tmp_path):
    m = Metrics(tmp_path, timeline_every=0)
    r = _res(0)
    r.batch = {"response_len_max": 48, "response_len_min": 3, "response_clip_ratio": 0.25,
               "prompt_len_mean": 12.5, "prompt_len_max": 20, "epoch": 0}
    m.log_iteration(r, _spans(0))
    m.close()
    assert _scalars(tmp_path, "batch/response_clip_ratio") == [(0, 0.25)]
    assert _scalars(tmp_path, "batch/prompt_len_max") == [(0, 20)]
    row = json.loads((tmp_path / "iterations.jsonl").read_text())
    assert row["batch"]["response_len_max"] == 48


@pytest.mark.parametrize("first", [0, 10])
def test_the_summary_names_its_scopes(tmp_path, first):
    # resumed at 10 (the checkpoint's 10 rewards restored): iterations and rewards cover the
    # whole run, the rates and counts this attempt; resumed_at says where it began
    m = Metrics(tmp_path, timeline_every=0)
    m.rewards = [0.1] * first
    for i in range(first, first + 2):
        m.log_iteration(_res(i, 0.9), _spans(i))
    m.close()
    s = m.summary()
    assert (s["iterations"], s["resumed_at"], s["attempt_iterations"]) == (first + 2, first, 2)
    assert s["reward_first"] == (0.1 if first else 0.9)
    assert s["samples_per_s"] == 8.0  # this attempt's 16 samples over its 2 s


def test_a_repl_eval_before_a_save_survives_the_resume(tmp_path):
    """A REPL eval is logged at the iteration just trained (4): a resume from the checkpoint saved
    after it (next iteration 5) replaces steps from 5 on, not that row (logged at 5, the next
    iteration to run, it was dropped and purged from TensorBoard)."""
    m = Metrics(tmp_path, timeline_every=0)
    for i in range(5):
        m.log_iteration(_res(i), _spans(i))
    m.log_eval(EvalResult({"eval/mean": 0.25}, 4, 4, 16, 1, 100.0, 1.0), 4, source="repl")
    m.log_iteration(_res(5), _spans(5))  # trained after the save, lost in a crash
    m.close()
    m = Metrics(tmp_path, timeline_every=0)  # --resume --repl from the checkpoint at 5: `eval 4` first
    said = m.log_eval(EvalResult({"eval/mean": 0.5}, 4, 4, 16, 1, 100.0, 1.0), 4, source="repl")["tensorboard"]
    assert said == "not logged: eval_repl/p4/* has a point at step 4 already"
    m.log_iteration(_res(5, reward=0.7), _spans(5, 1000.0))
    m.close()
    rows = [json.loads(ln) for ln in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [(r["iteration"], r["source"], r["eval/mean"]) for r in rows] == [(4, "repl", 0.25), (4, "repl", 0.5)]
    assert _scalars(tmp_path, "eval_repl/p4/mean") == [(4, 0.25)]  # one point per step, over attempts too
    assert [json.loads(ln)["iteration"] for ln in (tmp_path / "iterations.jsonl").read_text().splitlines()] == [
        0, 1, 2, 3, 4, 5]
    assert _scalars(tmp_path, "train/reward_mean") == [(i, 0.5) for i in range(5)] + [(5, 0.7)]


def test_a_repl_evaluating_an_older_checkpoint_drops_nothing_until_it_trains(tmp_path):
    """--resume RUN/checkpoints/iter_000003 --repl, `eval`, quit: the run's later rows and
    TensorBoard steps stay (the eval dropped rows 3-5 and purged them: review, s57); a console
    that then runs replaces them from its first iteration on, its evaluation kept."""
    m = Metrics(tmp_path, timeline_every=0)
    for i in range(6):
        m.log_iteration(_res(i), _spans(i))
    m.close()
    for trains in (False, True):
        m = Metrics(tmp_path, timeline_every=0)
        m.log_eval(EvalResult({"eval/mean": 0.25}, 4, 4, 16, 1, 100.0, 1.0), 2, source="repl")
        if trains:
            m.log_iteration(_res(3, reward=0.7), _spans(3, 1000.0))
        m.close()
        steps = [json.loads(ln)["iteration"] for ln in (tmp_path / "iterations.jsonl").read_text().splitlines()]
        assert steps == ([0, 1, 2, 3] if trains else [0, 1, 2, 3, 4, 5])
        assert _scalars(tmp_path, "train/reward_mean") == (
            [(0, 0.5), (1, 0.5), (2, 0.5), (3, 0.7)] if trains else [(i, 0.5) for i in range(6)])
        assert _scalars(tmp_path, "eval_repl/p4/mean") == [(2, 0.25)]


def test_a_failed_save_keeps_its_span_and_logs_no_timing(tmp_path):
    m = Metrics(tmp_path, timeline_every=0)
    m.log_iteration(_res(0), _spans(0))
    with pytest.raises(OSError, match="No space"):
        with m.timed("save", 0):
            raise OSError(28, "No space left on device")
    m.close()
    assert [(s.worker, s.stage, s.iteration) for s in m.spans if s.stage == "save"] == [("controller", "save", 0)]
    assert "time/save_s" not in _events(tmp_path).Tags()["scalars"]


def test_spans_drained_at_the_end_reach_the_trace(tmp_path):
    m = Metrics(tmp_path, timeline_every=0)
    m.log_iteration(_res(0), _spans(0))
    m.add_spans([Span("gen1", "eval", 3.0, 4.0, 0)])  # the evaluation after the last iteration
    m.write_timeline(1)
    m.close()
    lines = [json.loads(ln) for ln in (tmp_path / "spans.jsonl").read_text().splitlines()]
    assert ("gen1", "eval", 0) in [(s["worker"], s["stage"], s["iteration"]) for s in lines]
    assert "eval" in {e["name"] for e in _trace(tmp_path) if e["ph"] == "X"}


def test_a_long_run_holds_its_latest_spans_and_writes_the_whole_trace_at_the_end(tmp_path, monkeypatch):
    """Every span of the run was held and laid out again at each timeline write (2 s of the
    controller's CPU a write at 20k iterations; review, session 51): the latest KEEP_SPANS are
    held and written while it runs, every attempt's (spans.jsonl) at the end."""
    monkeypatch.setattr(metrics_mod, "KEEP_SPANS", 8)
    m = Metrics(tmp_path, timeline_every=1)
    for i in range(5):
        m.log_iteration(_res(i), _spans(i))
    m._pool.shutdown(wait=True)  # the timeline thread's last write
    assert len(m.spans) == 8 and len([e for e in _trace(tmp_path) if e["ph"] == "X"]) <= 8
    m.close()
    assert len([e for e in _trace(tmp_path) if e["ph"] == "X"]) == 20


@pytest.mark.parametrize("metrics, num_samples, stops", [
    ({"skipped_samples": 8}, 0, True),  # every sample skipped (a reward service down)
    ({"skipped_samples": 3}, 5, False),  # some trained
    ({"groups_without_baseline": 2, "num_seqs": 0}, 8, True),  # remax: no group had its greedy response
    ({"groups_without_baseline": 1, "num_seqs": 6}, 8, False),
    ({"num_seqs": 0}, 8, False),  # filter_groups dropped every group: a step like any other
])
def test_a_step_with_nothing_trainable_is_the_one_the_run_stops_and_retries_at(metrics, num_samples, stops):
    """IterationResult.nothing_trainable: Session stops there with a checkpoint that retries the
    step, and Program feeds the ranker nothing from it (it comes again: review, s57)."""
    res = _res(3)
    res.metrics.update(metrics)
    res.num_samples = num_samples
    assert res.nothing_trainable is stops
