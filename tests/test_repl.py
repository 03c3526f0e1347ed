"""The controller REPL under torchrun, driven through rank 0's stdin; the same run checks the
TensorBoard events, the Chrome trace and the checkpoint it writes."""
import json
from pathlib import Path

import pytest

from runtime_helpers import iterations, last_json, tiny_model, torchrun, write_config  # noqa: F401

COMMANDS = """status
run 2
sgs
trainer
timeline
mode stream
run 1
mode colocated
dispatch random
eval 4
bogus
echo "unmatched
run -1
save
status
quit
"""


def answers(out: str) -> list[dict]:
    return [json.loads(ln[4:]) for ln in out.splitlines() if ln.startswith(">>> ")]


def test_repl_drives_the_live_program(tmp_path, tiny_model):  # noqa: F811
    # a length ranker: none at ranker.path yet, so the controller bootstraps one from the
    # policy's own lengths (through the SGS) and saves it there; updated online every 2 iterations
    from test_ranker_synth import SMALL_LGBM

    # length-forced (train.length_trace): a one-row trace, 5 words -> round(5 x 1.3) = 6 tokens
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"question": "q", "resp_words": [5, 40, 40]}) + "\n")
    # small buckets and a binary tree: the weight_sync section reaches the runtime's pushes
    cfg = write_config(tmp_path, tiny_model, train__eval_every=0, train__length_trace=str(trace),
                       weight_sync__bucket_mb=0.01,
                       weight_sync__tree_shape="binary", ranker__kind="lgbm", ranker__path=str(tmp_path / "ranker"),
                       ranker__update_every=2, ranker__bootstrap_prompts=24, ranker__options=SMALL_LGBM)
    p = torchrun(cfg, extra=["--repl"], stdin=COMMANDS)
    assert p.returncode == 0, p.stderr[-4000:]
    # a successful run exits quietly: RRefs released, every agent shutting down before pipes close
    for noise in ("Leaking RRef", "RRef Leaks", "encountered error when reading incoming request"):
        assert noise not in p.stderr, p.stderr[-4000:]
    assert (f"[controller] ranker: no lgbm ranker at {tmp_path / 'ranker'}; bootstrapped one from the "
            "policy's lengths on 24 prompts x 2 samples") in p.stderr
    import ranker

    boot = ranker.load(tmp_path / "ranker")  # saved, loadable, and it ranks
    assert len(boot.predict(["1 + 2 =", "3 + 4 + 5 ="])) == 2
    said = [ln for ln in p.stderr.splitlines() if "[controller] weight sync:" in ln]
    assert len(said) == 1 and "tree plan (binary)" in said[0] and "buckets of <= 10000 B" in said[0], said
    a = answers(p.stdout)
    assert a[0]["ready"] is True
    status0, run2, sgs, trainer, timeline, mode, run1, bad_mode, disp, ev, bogus, bad_quote, run_neg, save, \
        status1 = a[1:]
    assert status0 == {"iteration": 0, "version": 0, "mode": "async_stream", "reward": None, "instances": 1,
                       "waiting": []}
    assert run2["ran"] == 2 and run2["version"] == 2
    inst = sgs["instances"][0]
    assert inst["rank"] == 1 and inst["running"] == 0 and "kv_blocks_free" in inst
    assert inst["weight_version"] == 0 and inst["staged_version"] == 2  # swapped at the next iteration
    assert trainer["ranks"][0]["version"] == 2 and trainer["ranks"][0]["queued_iterations"] == []
    assert set(timeline["bubble"]) == {"gen1", "train2"} and timeline["stage_s"]["generate"] > 0
    assert mode == {"mode": "stream"} and run1["ran"] == 1 and run1["iteration"] == 3
    assert "error" in bad_mode and "colocated" in bad_mode["error"]
    assert disp["dispatch"] == "random"
    assert "eval/mean" in ev and ev["prompts"] == 4 and ev["source"] == "repl"
    assert "unknown command" in bogus["error"]
    assert bad_quote == {"error": "ValueError: No closing quotation"}  # answered; the session goes on
    assert run_neg == {"error": "ValueError: run: expected a count >= 1, got '-1'"}
    assert Path(save["checkpoint"]).name == "iter_000003"
    assert status1["iteration"] == 3 and status1["version"] == 3 and status1["mode"] == "stream"

    rows = iterations(tmp_path / "run")
    assert [r["num_samples"] for r in rows] == [8, 8, 8]
    assert [r["num_tokens"] for r in rows] == [8 * 6] * 3  # every sample forced to the trace's 6 tokens
    assert [r["gen_version"] for r in rows] == [0, 0, 2]  # async lag 1, then a sync iteration
    assert [r["mode"] for r in rows] == ["async_stream", "async_stream", "stream"]  # the REPL's switch, recorded
    assert {r["dispatch"] for r in rows} == {"round_robin"}  # (dispatch random came after the last run)
    assert [r["staleness_max"] for r in rows] == [0, 1, 0]
    assert [r["ranker_rows"] for r in rows] == [0, 8, 0]  # iterations 0-1's prompts (their samples' mean), after 1
    assert [r["batch"]["response_len_max"] for r in rows] == [6] * 3 and rows[0]["batch"]["response_clip_ratio"] == 0
    summary = last_json(p.stdout)
    assert summary["iterations"] == 3 and summary["mode"] == "stream"
    assert summary["resumed_at"] == 0 and summary["attempt_iterations"] == 3
    # both rates over the same time: the iterations' intervals, without the REPL's pauses and evals
    assert summary["rl_seconds"] == pytest.approx(sum(r["interval_s"] for r in rows))
    assert summary["samples_per_s"] * summary["rl_seconds"] == pytest.approx(24)
    assert summary["tokens_per_s"] * summary["rl_seconds"] == pytest.approx(24 * 6)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tmp_path / "run" / "tb"))
    ea.Reload()
    tags = ea.Tags()
    assert "train/kl" not in tags["scalars"]  # kl_coef 0: no reference policy, no KL to it
    for t in ("train/reward_mean", "train/entropy", "perf/samples_per_s", "perf/tokens_per_s",
              "idle/gen1", "idle/train2", "staleness/max", "time/weight_sync_s", "balance/delta_s"):
        assert t in tags["scalars"], t
    assert [e.step for e in ea.Scalars("train/reward_mean")] == [0, 1, 2]
    assert "timeline/gantt" in tags["images"]
    # the REPL's eval, logged at its iteration, apart from the periodic evals' curve
    assert [e.step for e in ea.Scalars("eval_repl/p4/mean")] == [2] and "eval/mean" not in tags["scalars"]
    assert [e.step for e in ea.Scalars("batch/response_clip_ratio")] == [0, 1, 2]
    trace = json.loads((tmp_path / "run" / "timeline.json").read_text())
    stages = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"generate", "train", "weight_sync", "eval", "ranker"} <= stages
    # the ranker's bootstrap is its own stage (its generations were drawn as "eval"): before
    # the first dispatch, on the instance and on the controller; the one eval is the REPL's
    spans = [json.loads(ln) for ln in (tmp_path / "run" / "spans.jsonl").read_text().splitlines()]
    first = min(s["start"] for s in spans if s["stage"] == "dispatch")
    boot = {s["worker"] for s in spans if s["stage"] == "ranker"}
    assert boot == {"gen1", "controller"} and all(s["end"] <= first for s in spans if s["stage"] == "ranker")
    # at the iteration just trained, on the controller's row and the instance's (its span was
    # labelled with the weight version, and the last spans were never drained at the end)
    assert [s["iteration"] for s in spans if s["stage"] == "eval" and s["worker"] == "controller"] == [2]
    assert [s["iteration"] for s in spans if s["stage"] == "eval" and s["worker"] != "controller"] == [2]
    assert all(s["start"] > first for s in spans if s["stage"] == "eval")
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "iter_000003"

    # a new run into the same logdir (no --resume) is refused before any work: its rows,
    # TensorBoard steps and checkpoints would interleave with this run's
    again = torchrun(cfg)
    assert again.returncode != 0 and "exitcode: 2" in again.stderr, again.stderr[-4000:]
    for noise in ("Leaking RRef", "encountered error when reading incoming request"):
        assert noise not in again.stderr, again.stderr[-4000:]  # every rank left in lock-step
    assert (f"config error: logging.logdir: {tmp_path / 'run'} already holds a run (checkpoints up to "
            f"iter_000003); continue it with --resume {tmp_path / 'run'}") in again.stderr
    assert len(iterations(tmp_path / "run")) == 3  # untouched

    # resumed for one more iteration: the trace keeps the first attempt's spans, and the final
    # JSON says which fields are this attempt's
    spans_before = len((tmp_path / "run" / "spans.jsonl").read_text().splitlines())
    more = torchrun(cfg, extra=["--resume", str(tmp_path / "run"), "--set", "train.iterations=4"])
    assert more.returncode == 0, more.stderr[-4000:]
    s = last_json(more.stdout)
    assert (s["iterations"], s["resumed_at"], s["attempt_iterations"]) == (4, 3, 1)
    trace = json.loads((tmp_path / "run" / "timeline.json").read_text())["traceEvents"]
    procs = [e["args"]["name"] for e in trace if e["name"] == "process_name"]
    assert [p.split(" (")[0] for p in procs] == ["StreamRL attempt 0", "StreamRL attempt 1"], procs
    assert "iterations 0-2" in procs[0] and "iterations 3-3" in procs[1]
    assert sum(e["ph"] == "X" and e["pid"] == 0 for e in trace) == spans_before
