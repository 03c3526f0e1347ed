"""Timeline spans -> bubble fractions, Chrome trace, Gantt figure."""
import json

from controller.timeline import (Span, SpanRecorder, bubble_fractions, gantt_figure, iteration_windows,
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
