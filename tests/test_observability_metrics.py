"""Metrics (TensorBoard scalars, iterations.jsonl, timeline files) driven with hand-made spans
and iteration results: async-mode busy times, idle windows, resumed runs, atomic files."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from controller.metrics import Metrics
from controller.program import IterationResult
from controller.timeline import Span


def _res(i: int, reward: float = 0.5) -> IterationResult:
    return IterationResult(iteration=i, version=i + 1, gen_version=i, metrics={"reward_mean": reward},
                           num_samples=8, num_tokens=48, gen_seconds=1.0, train_seconds=1.0,
                           iter_seconds=2.0, staleness_max=0, gen_lens=[6] * 8)


def _scalars(logdir, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logdir / "tb"))
    ea.Reload()
    return [(e.step, round(e.value, 6)) for e in ea.Scalars(tag)]


def _rows(logdir) -> list[dict]:
    return [json.loads(ln) for ln in (logdir / "iterations.jsonl").read_text().splitlines()]


def test_async_busy_times_count_spans_drained_one_iteration_early(tmp_path):
    # async_stream: G(1) runs during step(0), so its span (and the controller's dispatch of
    # iteration 1) is drained when iteration 0 is logged; iteration 1's busy times need it
    m = Metrics(tmp_path, timeline_every=0)
    drain0 = [Span("controller", "dispatch", 0.0, 0.1, 0), Span("gen1", "generate", 0.1, 2.0, 0),
              Span("train2", "train", 0.5, 2.5, 0), Span("controller", "wait_step", 2.0, 3.0, 0),
              Span("train2", "train", 2.5, 3.0, 0),
              Span("controller", "dispatch", 2.1, 2.2, 1), Span("gen1", "generate", 2.2, 2.9, 1)]
    d0 = m.log_iteration(_res(0), drain0)
    drain1 = [Span("train2", "train", 3.0, 4.5, 1), Span("controller", "wait_step", 3.5, 4.5, 1),
              Span("gen1", "weight_sync", 3.1, 3.2, 1)]
    d1 = m.log_iteration(_res(1), drain1)
    m.close()
    assert d0["time/generate_busy_s"] == pytest.approx(1.9) and d0["time/train_busy_s"] == pytest.approx(2.5)
    assert d1["time/generate_busy_s"] == pytest.approx(0.7)  # was 0.0: G(1)'s span came with drain 0
    assert d1["time/train_busy_s"] == pytest.approx(1.5)
    assert d1["balance/delta_s"] == pytest.approx(0.7 - 1.5)
    assert _scalars(tmp_path, "time/generate_busy_s") == [(0, 1.9), (1, 0.7)]
    # idle over iteration 1's window (its dispatch 2.1 .. the end of its step 4.5): gen1 busy
    # 2.2-2.9 (G(1), drained earlier) + 3.1-3.2 (push) = 0.8 of 2.4
    assert d1["idle/gen1"] == pytest.approx(1 - 0.8 / 2.4)
    assert d1["idle/train2"] == pytest.approx(1 - (0.9 + 1.5) / 2.4)  # train(0) 2.1-3.0, train(1) 3.0-4.5


def test_rates_are_over_the_interval_between_iterations(tmp_path):
    """async modes: each batch's own window (iter_seconds, 2 s here) overlaps the next one's,
    so the pipeline delivers an iteration every interval_s (1 s). Rates over iter_seconds were
    half the real ones, and the summary's tokens_per_s disagreed with its samples_per_s."""
    m = Metrics(tmp_path, timeline_every=0)
    ds = []
    for i in range(3):
        r = _res(i)
        r.interval_s = 1.0
        ds.append(m.log_iteration(r, [Span("gen1", "generate", float(i), i + 1.0, i)]))
    m.close()
    assert [d["perf/samples_per_s"] for d in ds] == [8.0] * 3
    assert [d["perf/tokens_per_s"] for d in ds] == [48.0] * 3
    assert [d["time/interval_s"] for d in ds] == [1.0] * 3 and ds[0]["time/iteration_s"] == 2.0
    s = m.summary()
    assert s["samples_per_s"] == 8.0 and s["tokens_per_s"] == 48.0 and m.seconds == 3.0
    assert [r["interval_s"] for r in _rows(tmp_path)] == [1.0] * 3


def test_idle_fraction_is_over_the_iteration_not_the_set_up(tmp_path):
    # the trainer's first idle span starts when its rank is created (before the ranker
    # bootstrap, or a pause at the REPL prompt): 100 s before iteration 0 is dispatched
    m = Metrics(tmp_path, timeline_every=0)
    spans = [Span("train2", "idle", -100.0, 1.0, 0), Span("controller", "dispatch", 0.0, 0.2, 0),
             Span("gen1", "generate", 0.2, 1.0, 0), Span("train2", "train", 1.0, 3.8, 0),
             Span("controller", "wait_step", 1.0, 4.0, 0)]
    d = m.log_iteration(_res(0), spans)
    m.close()
    assert d["idle/gen1"] == pytest.approx(1 - 0.8 / 4.0)
    assert d["idle/train2"] == pytest.approx(1 - 2.8 / 4.0)  # was 0.97: window from -100
    assert "idle/controller" not in d


def test_resumed_run_replaces_the_steps_it_runs_again(tmp_path):
    # a run logs iterations 0-3, crashes, and restarts from its checkpoint of iteration 2
    # (torchrun --max-restarts ... --resume): steps 2-3 must not appear twice
    m = Metrics(tmp_path, timeline_every=0)
    for i in range(4):
        m.log_iteration(_res(i, 0.1 * i), [Span("gen1", "generate", 10.0 * i, 10.0 * i + 1, i)])
    m.close()
    with open(tmp_path / "iterations.jsonl", "a") as f:
        f.write('{"iteration": 4, "version"')  # torn by the crash
    m = Metrics(tmp_path, timeline_every=0)
    m.log_scalars({"sgs/instances": 2}, 2)  # the first write may come before the iteration's row
    for i in range(2, 5):
        m.log_iteration(_res(i, 0.5 + 0.1 * i), [Span("gen1", "generate", 10.0 * i, 10.0 * i + 1, i)])
    m.close()
    assert _scalars(tmp_path, "train/reward_mean") == [(0, 0.0), (1, 0.1), (2, 0.7), (3, 0.8), (4, 0.9)]
    rows = _rows(tmp_path)
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["metrics"]["reward_mean"] for r in rows] == pytest.approx([0.0, 0.1, 0.7, 0.8, 0.9])


def test_plain_resume_keeps_every_earlier_step(tmp_path):
    m = Metrics(tmp_path, timeline_every=0)
    for i in range(2):
        m.log_iteration(_res(i), [Span("gen1", "generate", i, i + 0.5, i)])
    m.close()
    m = Metrics(tmp_path, timeline_every=0)  # --resume from the final checkpoint (iteration 2)
    m.log_iteration(_res(2), [Span("gen1", "generate", 2.0, 2.5, 2)])
    m.close()
    assert [s for s, _ in _scalars(tmp_path, "train/reward_mean")] == [0, 1, 2]
    assert [r["iteration"] for r in _rows(tmp_path)] == [0, 1, 2]


def test_timeline_files_are_replaced_atomically(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    m = Metrics(tmp_path, timeline_every=1)
    m.log_iteration(_res(0), [Span("gen1", "generate", 0.0, 1.0, 0), Span("train2", "train", 1.0, 2.0, 0)])
    m._pool.shutdown(wait=True)  # the timeline thread's write of iteration 0
    png = (tmp_path / "timeline.png").read_bytes()
    trace = (tmp_path / "timeline.json").read_text()
    assert png.startswith(b"\x89PNG") and json.loads(trace)["traceEvents"]

    def crash_mid_write(self, fname, *a, **k):
        with open(fname, "wb") as f:
            f.write(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", crash_mid_write)
    m.add_spans([Span("gen1", "generate", 2.0, 3.0, 1)])  # (no span since the last write: the figure stands)
    with pytest.raises(OSError):
        m.write_timeline(2)
    assert (tmp_path / "timeline.png").read_bytes() == png  # the previous figure, whole
    assert (tmp_path / "timeline.json").read_text() == trace
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iterations.jsonl", "spans.jsonl", "tb", "timeline.json",
                                                         "timeline.png"]
    m.close()


def test_an_attempt_that_trained_nothing_leaves_the_runs_figure(tmp_path):
    """A --repl session that only inspected a checkpoint (its resume push, an eval) ends with
    the whole trace written: the run's Gantt figure stands (it was replaced by one of that
    attempt's few spans: review, s57); the trace gets them."""
    m = Metrics(tmp_path, timeline_every=1)
    m.log_iteration(_res(0), [Span("gen1", "generate", 0.0, 1.0, 0), Span("train2", "train", 1.0, 2.0, 0)])
    m.close()
    png = (tmp_path / "timeline.png").read_bytes()
    m = Metrics(tmp_path, timeline_every=1)
    m.add_spans([Span("controller", "push", 5.0, 5.5, 1)])
    m.write_timeline(1, whole=True)
    m.close()
    assert (tmp_path / "timeline.png").read_bytes() == png
    assert "push" in (tmp_path / "timeline.json").read_text()


def test_plain_resume_keeps_the_final_gantt(tmp_path):
    # the run's end logs the Gantt figure at its last iteration's step (the runner passes the
    # next iteration, as range's end); a resume from there must not purge it
    m = Metrics(tmp_path, timeline_every=5)
    m.log_iteration(_res(0), [Span("gen1", "generate", 0.0, 0.5, 0)])
    m.write_timeline(1)
    m.close()
    m = Metrics(tmp_path, timeline_every=5)
    m.log_iteration(_res(1), [Span("gen1", "generate", 1.0, 1.5, 1)])
    m.close()  # writes the timeline of iteration 1: spans came since the last write
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    # (sorted: two event files written in one second are read in the order of their names, whose
    # last field, a per-process count, sorts as text: "10" before "9" late in a test session)
    assert sorted(e.step for e in ea.Images("timeline/gantt")) == [0, 1]
    assert sorted(s for s, _ in _scalars(tmp_path, "train/reward_mean")) == [0, 1]


def test_timeline_every_0_draws_no_figure_but_keeps_the_trace(tmp_path):
    m = Metrics(tmp_path, timeline_every=0)  # "0: never" (docs/config.md)
    for i in range(3):
        m.log_iteration(_res(i), [Span("gen1", "generate", i, i + 0.5, i)])
    m.write_timeline(3)  # what the run's end does
    m.log_iteration(_res(3), [Span("gen1", "generate", 3.0, 3.5, 3)])
    m.close()  # and the way out, spans having come since
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    assert "timeline/gantt" not in ea.Tags()["images"] and not (tmp_path / "timeline.png").exists()
    trace = json.loads((tmp_path / "timeline.json").read_text())
    assert sorted(e["args"]["iteration"] for e in trace["traceEvents"] if e["ph"] == "X") == [0, 1, 2, 3]


def test_matplotlib_is_imported_at_set_up_not_mid_run(tmp_path):
    # the first Gantt figure used to import matplotlib inside iteration timeline_every - 1's
    # log call (1-2 s on a loaded machine), stalling the controller, hence the pipeline
    # (and TensorBoard's writer, 0.4-0.5 s, at the first iteration's log)
    code = ("import sys; from controller.metrics import Metrics; Metrics(sys.argv[1], 5); "
            "print('matplotlib.pyplot' in sys.modules, 'torch.utils.tensorboard' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], check=True)
    assert out.stdout.strip() == "True True"


def test_samples_per_s_counts_the_samples_trained_with_a_group_filter(tmp_path):
    """With trainer.filter_groups num_samples is every sample received (288 in the DAPO example
    for 64 trained): perf/samples_per_s and the summary's read 3-6x high (review, session 52)."""
    m = Metrics(tmp_path, timeline_every=0)
    r = _res(0)
    r.interval_s = 1.0
    r.metrics = {**r.metrics, "num_samples": 8.0, "num_seqs": 2.0}
    d = m.log_iteration(r, [Span("gen1", "generate", 0.0, 1.0, 0)])
    m.close()
    assert d["perf/samples_per_s"] == 2.0 and m.summary()["samples_per_s"] == 2.0


def test_a_queued_timeline_write_does_not_replace_the_whole_runs_trace(tmp_path):
    """The run's end writes every attempt's spans; a write of the last iteration still queued on
    the timeline thread ran after it and left this attempt's only, and close() took the whole
    trace as written (review, s53). The thread is held back to force that order."""
    import threading

    m = Metrics(tmp_path, timeline_every=0)  # attempt 0
    m.log_iteration(_res(0), [Span("gen1", "generate", 0.0, 1.0, 0)])
    m.close()
    (tmp_path / "config.yaml").write_text("x")
    (tmp_path / "config.resume1.yaml").write_text("x")
    m = Metrics(tmp_path, timeline_every=1)  # attempt 1 (--resume)
    go, real = threading.Event(), m._write_wanted

    def held():
        go.wait(10)
        real()

    m._write_wanted = held
    m.log_iteration(_res(1), [Span("gen1", "generate", 10.0, 11.0, 1)])  # its write queued, held
    m.write_timeline(2, whole=True)  # the run's end
    go.set()
    m.close()
    trace = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    assert sorted({e["pid"] for e in trace if e["ph"] == "X"}) == [0, 1]
