"""Timeline spans -> bubble fractions, Chrome trace, Gantt figure."""
import json

from controller.timeline import (Span, SpanRecorder, bubble_fractions, devices, gantt_figure, iteration_windows,
                                 merge_intervals, stage_times, to_chrome_trace, write_chrome_trace)


def _spans():
    return [Span("gen1", "generate", 0.0, 4.0, 0), Span("gen1", "generate", 5.0, 9.0, 1),
            Span("train2", "train", 1.0, 3.0, 0), Span("train2", "train", 2.5, 5.0, 0),
            Span("train2", "idle", 5.0, 8.0, 1), Span("train2", "weight_sync", 9.0, 10.0, 1)]


def test_bubbles_from_spans():
    b = bubble_fractions(_spans())  # window 0..10
    assert abs(b["gen1"] - 0.2) < 1e-9  # busy 8 of 10
    assert abs(b["train2"] - 0.5) < 1e-9  # train 1..5 merged (4) + sync 1; idle does not count
    assert merge_intervals(_spans()[2:4]) == [(1.0, 5.0)]
    assert stage_times(_spans())["train"] == 4.0


def test_chrome_trace_and_gantt(tmp_path):
    path = write_chrome_trace(_spans(), tmp_path / "t.json")
    ev = json.loads(path.read_text())["traceEvents"]
    xs = [e for e in ev if e["ph"] == "X"]
    assert len(xs) == 6 and xs[0]["ts"] == 0 and xs[0]["dur"] == 4e6
    names = {e["args"]["name"] for e in ev if e["name"] == "thread_name"}
    assert names == {"gen1", "train2", "train2 #2"}  # train2's two train spans overlap partially
    fig = gantt_figure(_spans(), "t")
    assert len(fig.axes[0].collections) >= 4


def test_recorder_drains():
    r = SpanRecorder("w")
    with r.span("train", 3):
        pass
    r.add("idle", 1.0, 2.0, 3)
    out = r.drain()
    assert [s.stage for s in out] == ["train", "idle"] and r.drain() == []


def _nested(events) -> bool:
    """Chrome's rule for "X" events of one thread: any two nest or are disjoint."""
    for a in events:
        for b in events:
            a0, a1, b0, b1 = a["ts"], a["ts"] + a["dur"], b["ts"], b["ts"] + b["dur"]
            if a0 < b0 < a1 < b1:
                return False
    return True


def test_chrome_trace_threads_never_overlap_partially():
    # a weight push received while generating, a push sent across two train spans, an idle
    # wait, a zero-length staging span: all valid, but not nestable on one thread
    spans = [Span("gen1", "generate", 0.0, 4.0, 1), Span("gen1", "weight_sync", 3.0, 5.0, 2),
             Span("gen1", "weight_sync", 5.0, 5.0, 2), Span("gen1", "generate", 5.5, 8.0, 2),
             Span("train2", "idle", 0.0, 1.0, 1), Span("train2", "train", 1.0, 3.0, 1),
             Span("train2", "train", 3.0, 6.0, 2), Span("train2", "weight_sync", 2.5, 3.5, 2),
             Span("train2", "train", 3.1, 3.2, 2)]
    ev = to_chrome_trace(spans)["traceEvents"]
    name = {e["tid"]: e["args"]["name"] for e in ev if e["name"] == "thread_name"}
    xs = [e for e in ev if e["ph"] == "X"]
    assert len(xs) == len(spans) and all(e["dur"] >= 0 and e["pid"] == 0 for e in xs)
    for tid in name:
        assert _nested([e for e in xs if e["tid"] == tid]), name[tid]
    assert sorted(name.values()) == ["gen1", "gen1 #2", "train2", "train2 #2"]
    main = [e["name"] for e in xs if name[e["tid"]] == "gen1"]
    assert main == ["generate", "weight_sync", "generate"]  # only the overlapping push moved
    json.dumps(ev, allow_nan=False)  # strict JSON


def test_idle_spans_do_not_stretch_the_window():
    # a trainer's first idle span starts when the rank is created, long before iteration 0
    spans = [Span("train2", "idle", -100.0, 1.0, 0), Span("train2", "train", 1.0, 4.0, 0),
             Span("gen1", "generate", 0.0, 2.0, 0), Span("controller", "dispatch", 0.0, 0.5, 0),
             Span("controller", "wait_step", 3.0, 4.0, 0)]
    b = bubble_fractions(spans)  # window 0..4 (the workers' busy spans)
    assert abs(b["train2"] - 0.25) < 1e-9 and abs(b["gen1"] - 0.5) < 1e-9
    assert iteration_windows(spans) == {0: (0.0, 4.0)}
    # several windows: their union, the gap between them (a REPL pause) left out
    later = [Span("gen1", "generate", 100.0, 101.0, 1), Span("train2", "train", 101.0, 102.0, 1),
             Span("train2", "idle", 4.0, 101.0, 1)]
    wins = list(iteration_windows(spans + later).values())
    assert wins == [(0.0, 4.0), (100.0, 102.0)]
    b = bubble_fractions(spans + later, wins)
    assert abs(b["train2"] - (1 - 4.0 / 6.0)) < 1e-9 and abs(b["gen1"] - 0.5) < 1e-9


def test_the_train_span_keeps_the_main_lane_when_a_push_overlaps_it():
    # the trainer sends weights v2 (2.5-3.5) while its next micro-batch (3.0-6.0) starts: the
    # push started first, and used to take lane 0, moving the train span to "train2 #2"
    spans = [Span("train2", "train", 1.0, 2.5, 1), Span("train2", "weight_sync", 2.5, 3.5, 2),
             Span("train2", "train", 3.0, 6.0, 2), Span("train2", "train", 6.0, 7.0, 2)]
    ev = to_chrome_trace(spans)["traceEvents"]
    name = {e["tid"]: e["args"]["name"] for e in ev if e["name"] == "thread_name"}
    lanes = {e["name"] + str(e["args"]["iteration"]) + str(e["ts"]): name[e["tid"]] for e in ev if e["ph"] == "X"}
    assert [k for k, v in lanes.items() if v == "train2 #2"] == ["weight_sync22500000.0"]
    assert sum(v == "train2" for v in lanes.values()) == 3


def test_chrome_trace_has_epoch_times_attempts_as_processes_and_wall_times():
    t = 1_800_000_000.0  # 2027-01-15T08:00:00Z
    spans = [Span("controller", "dispatch", t, t + 0.1, 0), Span("gen1", "generate", t + 0.1, t + 1.0, 0),
             Span("controller", "dispatch", t + 60, t + 60.1, 1, attempt=1),
             Span("gen1", "generate", t + 60.1, t + 61.0, 1, attempt=1)]
    ev = to_chrome_trace(spans)["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in ev if e["name"] == "process_name"}
    assert procs == {0: "StreamRL attempt 0 (iterations 0-0, started 2027-01-15T08:00:00.000+00:00)",
                     1: "StreamRL attempt 1 (iterations 1-1, started 2027-01-15T08:01:00.000+00:00)"}
    xs = [e for e in ev if e["ph"] == "X"]
    assert xs[0]["ts"] == t * 1e6 and xs[-1]["pid"] == 1  # absolute: lines up across attempts and with logs
    assert xs[1]["args"] == {"iteration": 0, "wall_time": "2027-01-15T08:00:00.100+00:00"}
    threads = {(e["pid"], e["args"]["name"]) for e in ev if e["name"] == "thread_name"}
    assert threads == {(0, "controller"), (0, "gen1"), (1, "controller"), (1, "gen1")}


def test_stage_times_within_windows():
    # a trainer's idle span through a 60 s pause between two REPL `run`s: not a stage's time
    spans = [Span("gen1", "generate", 0.0, 1.0, 0), Span("train2", "idle", 1.0, 62.0, 1),
             Span("gen1", "generate", 61.0, 62.0, 1)]
    assert stage_times(spans)["idle"] == 61.0
    st = stage_times(spans, [(0.0, 2.0), (61.0, 63.0)])
    assert st == {"generate": 2.0, "idle": 2.0}


def test_colocated_ranks_are_one_device():
    # rank 1 generates (0-4), then trains (4-9), pushes (9-10): busy the whole window. Per
    # worker that read 60% / 50% idle; per device it is 0%
    spans = [Span("gen1", "generate", 0.0, 4.0, 0), Span("train1", "idle", 0.0, 4.0, 0),
             Span("train1", "train", 4.0, 9.0, 0), Span("train1", "weight_sync", 9.0, 10.0, 1),
             Span("gen2", "generate", 0.0, 2.0, 0), Span("train2", "train", 4.0, 6.0, 0)]
    assert devices({"gen1", "train1", "gen2", "train2", "trainer"}) == {
        "gen1": "rank1", "train1": "rank1", "gen2": "rank2", "train2": "rank2", "trainer": "trainer"}
    assert devices({"gen1", "train2"}) == {"gen1": "gen1", "train2": "train2"}  # disaggregated: the worker
    per_worker = bubble_fractions(spans, (0.0, 10.0))
    assert per_worker["gen1"] == 0.6 and per_worker["train1"] == 0.4
    assert bubble_fractions(spans, (0.0, 10.0), per_device=True) == {"rank1": 0.0, "rank2": 0.6}


def test_gantt_legend_sits_below_the_rows():
    spans = [Span(w, st, 0.0, 10.0, 0) for w in ("controller", "gen1", "train2")
             for st in ("generate", "train", "idle", "weight_sync", "wait_step")]
    fig = gantt_figure(spans, "t")
    fig.canvas.draw()
    ax, legend = fig.axes[0], fig.legends[0]
    assert legend.get_window_extent().y1 <= ax.get_window_extent().y0  # not over the top (trainer) row
