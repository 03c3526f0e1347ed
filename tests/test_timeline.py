"""Timeline spans -> bubble fractions, Chrome trace, Gantt figure."""
import json

from controller.timeline import (Span, SpanRecorder, bubble_fractions, gantt_figure, merge_intervals,
                                 stage_times, write_chrome_trace)


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
    names = {e["args"]["name"] for e in ev if e["ph"] == "M"}
    assert names == {"gen1", "train2"}
    fig = gantt_figure(_spans(), "t")
    assert len(fig.axes[0].collections) >= 4


def test_recorder_drains():
    r = SpanRecorder("w")
    with r.span("train", 3):
        pass
    r.add("idle", 1.0, 2.0, 3)
    out = r.drain()
    assert [s.stage for s in out] == ["train", "idle"] and r.drain() == []
