"""``train.eval_only`` (verl's ``val_only``): a real 3-process run evaluates the weights it starts
from and stops: nothing trained, no checkpoint written. Of a fresh run, the starting weights at
step -1 (the folder is no run afterwards: a run may start there); of ``--resume DIR``, the
checkpoint's weights at the step it was saved after, beside that run's own rows (its iterations,
evaluations, generations, TensorBoard steps, checkpoints and ``latest`` are kept as they were,
also for a checkpoint older than the last)."""
import json

from runtime_helpers import last_json, tiny_model, torchrun, write_config  # noqa: F401


def _rows(path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def _scalars(logdir, tag) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(logdir / "tb"))
    ev.Reload()
    return [(s.step, round(s.value, 6)) for s in ev.Scalars(tag)] if tag in ev.Tags()["scalars"] else []


def test_a_fresh_eval_only_run_scores_the_starting_weights_and_trains_nothing(tmp_path, tiny_model):  # noqa: F811
    cfg = write_config(tmp_path, tiny_model, train__eval_only=True, ranker__kind="lgbm",
                       ranker__path=str(tmp_path / "ranker"), logging__validation_data_dir=str(tmp_path / "gens"))
    p = torchrun(cfg, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    # no ranker at ranker.path: none bootstrapped (it generated on train prompts and saved one)
    assert "an eval-only run bootstraps none" in p.stderr and not (tmp_path / "ranker").exists()
    logdir = tmp_path / "run"
    [row] = _rows(logdir / "eval.jsonl")
    assert (row["iteration"], row["source"], row["prompts"], row["weight_version"]) == (-1, "eval_only", 4, 0)
    line = [ln for ln in p.stderr.splitlines() if "[controller] evaluation" in ln]
    assert len(line) == 1 and "before training (weight version 0, 4 prompts)" in line[0], p.stderr[-2000:]
    assert f"mean {row['eval/mean']:.3f}" in line[0]
    assert not (logdir / "iterations.jsonl").exists() and not (logdir / "checkpoints").exists()
    summary = last_json(p.stdout)
    assert summary["checkpoint"] is None and summary["mode"]
    gens = _rows(tmp_path / "gens" / "-1.eval_only_p4.jsonl")  # verl's validation_data_dir
    assert len(gens) == 4 and row["generations"].endswith("-1.eval_only_p4.jsonl")
    assert _scalars(logdir, "eval_only/p4/mean") == [(-1, round(row["eval/mean"], 6))]
    assert _scalars(logdir, "eval/mean") == []
    # it trained nothing: the folder holds no run, and one may start there (verl: val_only, then
    # train), also as torchrun --max-restarts jobs launch, with --resume of their own folder
    p = torchrun(write_config(tmp_path, tiny_model, train__iterations=1), extra=["--resume", str(logdir)], timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = _rows(logdir / "eval.jsonl")
    assert rows[0] == row and [(r["iteration"], r["source"]) for r in rows[1:]] == [(0, "periodic")]


def test_eval_only_of_a_checkpoint_keeps_the_run_it_resumes(tmp_path, tiny_model):  # noqa: F811
    gens = tmp_path / "gens"
    p = torchrun(write_config(tmp_path, tiny_model, train__iterations=4, train__ckpt_every=2,
                              logging__validation_data_dir=str(gens)), timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    logdir = tmp_path / "run"
    before = {f: (logdir / f).read_text() for f in ("iterations.jsonl", "eval.jsonl")}
    periodic = (gens / "1.jsonl").read_text()
    ckpts = sorted(x.name for x in (logdir / "checkpoints").iterdir())
    latest = (logdir / "checkpoints" / "latest").resolve()
    timeline = {f: (logdir / f).read_bytes() for f in ("timeline.png", "timeline.json")}
    trained = {tag: _scalars(logdir, tag) for tag in ("eval/mean", "train/reward_mean")}
    assert [s for s, _ in trained["train/reward_mean"]] == [0, 1, 2, 3]

    # the checkpoint after 2 of the 4 iterations, not the last
    p = torchrun(write_config(tmp_path, tiny_model, train__iterations=4, train__eval_only=True,
                              logging__validation_data_dir=str(gens)),
                 extra=["--resume", str(logdir / "checkpoints" / "iter_000002")], timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (logdir / "iterations.jsonl").read_text() == before["iterations.jsonl"]
    rows = _rows(logdir / "eval.jsonl")
    assert rows[:-1] == [json.loads(ln) for ln in before["eval.jsonl"].splitlines()]  # the periodic ones are kept
    new = rows[-1]
    # the checkpoint after 2 iterations: weights of version 2, logged at step 1
    assert (new["iteration"], new["source"], new["weight_version"]) == (1, "eval_only", 2)
    assert "after iteration 2 (step 1) (weight version 2, 4 prompts)" in p.stderr
    assert sorted(x.name for x in (logdir / "checkpoints").iterdir()) == ckpts  # none written
    assert (logdir / "checkpoints" / "latest").resolve() == latest  # a plain --resume continues from the last
    assert {f: (logdir / f).read_bytes() for f in timeline} == timeline  # (close() rewrote them with its spans)
    assert last_json(p.stdout)["checkpoint"] == str(logdir / "checkpoints" / "iter_000002")
    assert (gens / "1.jsonl").read_text() == periodic and len(_rows(gens / "1.eval_only_p4.jsonl")) == 4
    assert {tag: _scalars(logdir, tag) for tag in trained} == trained  # no step purged
    assert _scalars(logdir, "eval_only/p4/mean") == [(1, round(new["eval/mean"], 6))]


def test_eval_only_rows_are_no_run_and_no_run_drops_them(tmp_path):
    """A fork's eval-only row (at the step of the checkpoint it evaluated) was dropped by the
    first write of a training run started in that folder, and counted as a run's rows by the
    --resume of a torchrun --max-restarts job launched there."""
    from controller.jsonl_log import drop_rows_from
    from controller.preflight import _refuse_restart_over_rows, refuse_previous_run

    rows = [{"iteration": 1, "source": "eval_only", "eval/mean": 0.5}]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    refuse_previous_run(tmp_path)  # no run there: nothing raised
    _refuse_restart_over_rows(tmp_path, str(tmp_path))
    rows.append({"iteration": 2, "source": "periodic", "eval/mean": 0.25})
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert drop_rows_from(tmp_path / "eval.jsonl", 0)  # the periodic row is run again
    assert _rows(tmp_path / "eval.jsonl") == rows[:1]



def _tb(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logdir / "tb"))
    ea.Reload()
    return {t: [(e.step, e.value) for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}


def _eval(prompts=4):
    import time

    from controller.evaluation import EvalResult

    return EvalResult(scores={"eval/mean": 0.5}, prompts=prompts, requested=prompts, split=16, samples=1,
                      started=time.time(), seconds=0.1)


def test_an_evaluation_run_again_at_a_step_of_an_earlier_attempt_adds_no_point(tmp_path):
    """A REPL `eval 4` at step 1, save, resume, `eval 4` at step 1 again: TensorBoard had two
    points at step 1 (review, session 50); the second is in eval.jsonl only, as within one attempt."""
    from controller.metrics import Metrics

    (tmp_path / "config.yaml").write_text("x: 1\n")
    m = Metrics(tmp_path, timeline_every=0)
    m.log_eval(_eval(), 1, "repl")
    m.close()
    (tmp_path / "config.resume1.yaml").write_text("x: 1\n")
    m = Metrics(tmp_path, timeline_every=0)
    assert m.log_eval(_eval(), 1, "repl")["tensorboard"] == "not logged: eval_repl/p4/* has a point at step 1 already"
    m.close()
    assert _tb(tmp_path)["eval_repl/p4/mean"] == [(1, 0.5)]
    assert len((tmp_path / "eval.jsonl").read_text().splitlines()) == 2


def test_a_resume_from_an_older_checkpoint_keeps_the_eval_only_points(tmp_path):
    """The eval-only row of step 3 is kept when a run resumes from iteration 2 (no run writes it
    again), but the TensorBoard purge took its point: eval.jsonl and TensorBoard disagreed."""
    from controller.batch import IterationResult
    from controller.metrics import Metrics

    def it(i):
        return IterationResult(iteration=i, version=i + 1, gen_version=i, metrics={"reward_mean": 0.1 * i},
                               num_samples=8, num_tokens=64, gen_seconds=0.1, train_seconds=0.1, iter_seconds=0.2,
                               staleness_max=0, interval_s=0.2)

    (tmp_path / "config.yaml").write_text("x: 1\n")
    m = Metrics(tmp_path, timeline_every=0)
    for i in range(4):
        m.log_iteration(it(i), [])
    m.close()
    (tmp_path / "config.resume1.yaml").write_text("x: 1\n")  # --resume iter_000004 with train.eval_only
    m = Metrics(tmp_path, timeline_every=0, timeline_files=False)
    m.log_eval(_eval(), 3, "eval_only")
    m.close()
    (tmp_path / "config.resume2.yaml").write_text("x: 1\n")  # --resume iter_000002: 2 and 3 again
    m = Metrics(tmp_path, timeline_every=0)
    for i in (2, 3):
        m.log_iteration(it(i), [])
    m.close()
    tb = _tb(tmp_path)
    assert tb["eval_only/p4/mean"] == [(3, 0.5)]
    assert [(s, round(v, 6)) for s, v in tb["time/eval_only_p4_s"]] == [(3, 0.1)]
    assert [s for s, _ in tb["train/reward_mean"]] == [0, 1, 2, 3]
