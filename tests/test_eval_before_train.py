"""``train.eval_before_train`` (verl's ``val_before_train``): a real 3-process run evaluates its
starting weights before the first iteration, logged at step -1 (the evaluation after iteration
i is at step i), in eval.jsonl and TensorBoard alike; a resumed run does not do it again."""
import json

from runtime_helpers import tiny_model, torchrun, write_config  # noqa: F401


def _eval_rows(logdir) -> list[dict]:
    return [json.loads(ln) for ln in (logdir / "eval.jsonl").read_text().splitlines()]


def test_the_starting_weights_are_evaluated_at_step_minus_one(tmp_path, tiny_model):  # noqa: F811
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = write_config(tmp_path, tiny_model, train__eval_before_train=True, train__iterations=2)
    p = torchrun(cfg, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    logdir = tmp_path / "run"
    rows = _eval_rows(logdir)
    # eval_every 2: after iteration 1 (weights of step 2); before training: the starting ones
    assert [(r["iteration"], r["weight_version"]) for r in rows] == [(-1, 0), (1, 2)]
    line = [ln for ln in p.stderr.splitlines() if "evaluation before training" in ln]
    assert len(line) == 1 and f"mean {rows[0]['eval/mean']:.3f}" in line[0] and "weight version 0, 4 prompts" in line[0]
    ev = EventAccumulator(str(logdir / "tb"))
    ev.Reload()
    assert [(s.step, round(s.value, 6)) for s in ev.Scalars("eval/mean")] == \
        [(r["iteration"], round(r["eval/mean"], 6)) for r in rows]
    # a resumed run has its evaluations: none before its first iteration; after its last one too,
    # which eval_every 2 does not divide (verl's is_last_step)
    p = torchrun(write_config(tmp_path, tiny_model, train__eval_before_train=True, train__iterations=5),
                 extra=["--resume", str(logdir)], timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [r["iteration"] for r in _eval_rows(logdir)] == [-1, 1, 3, 4]
    assert "evaluation before training" not in p.stderr
