"""verl's validation statistics (``controller/val_metrics.py``): per task and variable, over each
prompt's samples, averaged over prompts; bootstrap best / worst / majority with verl's draws."""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter

import numpy as np
import pytest

import controller.evaluation as evaluation_mod
import test_obs_program as harness
from controller.val_metrics import PromptSamples, majority, sizes, validation_metrics


def reference(prompts: list[PromptSamples]) -> dict[str, float]:
    """verl's procedure written out one draw at a time: numpy's global generator seeded 42
    before each statistic's 1,000 draws, the max / min / majority of each draw in a Python loop
    (the majority: the most common prediction, the first one drawn on a tie, its first value)."""
    per: dict[str, list[float]] = {}
    for p in prompts:
        for var in dict.fromkeys(k for r in p.rows for k in r):
            vals = [r[var] for r in p.rows]
            if not all(isinstance(v, float) for v in vals):  # a text (verl: its first is one), or None
                continue  # (verl's np.mean raises on a pred list that starts with None)
            n, out = len(vals), {}
            out[f"mean@{n}"] = sum(vals) / n
            if n > 1:
                out[f"std@{n}"] = math.sqrt(sum((v - out[f"mean@{n}"]) ** 2 for v in vals) / n)
                m, ms = 2, []
                while m < n:
                    ms.append(m)
                    m *= 2
                for m in ms + [n]:
                    for name, fn in (("best", max), ("worst", min), ("maj", None)):
                        if name == "maj" and "pred" not in p.rows[0]:
                            continue
                        np.random.seed(42)
                        idx = np.random.choice(n, size=(1000, m), replace=True)
                        got = []
                        for row in idx:
                            if fn is not None:
                                got.append(fn(vals[i] for i in row))
                                continue
                            count = Counter(p.rows[i]["pred"] for i in row)  # insertion order: first drawn
                            top = max(count, key=count.get)
                            got.append(next(vals[i] for i in row if p.rows[i]["pred"] == top))
                        out[f"{name}@{m}/mean"] = float(np.mean(got))
                        out[f"{name}@{m}/std"] = float(np.std(got))
            for stat, v in out.items():
                per.setdefault(f"eval/{p.task}/{var}/{stat}", []).append(v)
    return {k: sum(v) / len(v) for k, v in per.items()}


def _prompts(seed: int) -> list[PromptSamples]:
    rng = np.random.default_rng(seed)
    out = []
    for j, task in enumerate(["gsm8k", "gsm8k", "math", "math", "math"]):
        k = 6 if j == 4 else 5  # a prompt with one more sample has its own @6 statistics
        rows = []
        for _ in range(k):
            pred = str(rng.integers(0, 3))
            acc = float(pred == "1")
            rows.append({"reward": 2 * acc - 1 + float(rng.normal(0, 0.1)), "acc": acc, "pred": pred})
        out.append(PromptSamples(task, rows))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_statistics_are_verls_procedure_draw_for_draw(seed):
    prompts = _prompts(seed)
    got, want = validation_metrics(prompts), reference(prompts)
    assert set(got) == set(want)
    assert got == pytest.approx(want, abs=1e-12)
    assert {"eval/math/acc/maj@5/mean", "eval/math/acc/best@4/std", "eval/math/reward/worst@6/mean",
            "eval/gsm8k/acc/mean@5", "eval/gsm8k/reward/std@5"} <= set(got)
    assert "eval/gsm8k/pred/mean@5" not in got  # a text votes, has no statistics of its own


def test_best_at_m_is_the_expected_max_of_m_draws():
    """A bootstrap mean is near the exact expectation of the max of m draws with replacement
    (below the exact best of all n samples, the pooled eval/best@k)."""
    vals = [0.0, 0.0, 0.0, 1.0, 0.5]
    got = validation_metrics([PromptSamples("t", [{"reward": v} for v in vals])])
    for m in (2, 4, 5):
        exact = np.mean([max(c) for c in itertools.product(vals, repeat=m)])
        assert abs(got[f"eval/t/reward/best@{m}/mean"] - exact) < 0.03, m
        assert got[f"eval/t/reward/best@{m}/mean"] < 1.0
    assert sizes(1) == [] and sizes(2) == [2] and sizes(5) == [2, 4, 5] and sizes(8) == [2, 4, 8]
    one = validation_metrics([PromptSamples("t", [{"reward": 0.25}])])
    assert one == {"eval/t/reward/mean@1": 0.25}  # one sample: its mean only


def test_a_majority_tie_goes_to_the_prediction_drawn_first():
    votes = ["a", "b", "b", "a", "c"]
    vals = np.array([1.0, 0.0, 0.5, 0.25, 0.75])
    picks = np.array([[0, 1, 2, 3], [1, 0, 3, 2], [4, 4, 0, 1], [2, 1, 1, 4]])
    # ties a/b: a drawn first -> its first drawn value; b first -> b's; c twice; b 3 times (2 drawn first)
    assert majority(vals, votes, picks).tolist() == [1.0, 0.0, 0.75, 0.5]


def test_an_evaluation_reports_accs_headline_and_verls_statistics(monkeypatch):
    """A dict reward (math_dapo's {"score": +-1, "acc": bool, "pred": ...}): eval/<task> and
    eval/best@k are over ``acc`` (verl's val-core variable; they were over the +-1 score), and
    verl's per-task statistics of every variable are there beside them; the dump rows carry the
    reward's extra numbers and texts (verl's validation_data_dir columns)."""
    p = harness._program(monkeypatch, "batch", harness.Clock())
    p.cfg.train.eval_samples = 4
    p.run(1)

    def outputs(self, requests, newest=False, token=None, stage="eval", step=None):
        return harness.EvalOutput(self.held, [(r.sample_id, [-r.sample_id % 3]) for r in requests])

    monkeypatch.setattr(harness.Instance, "evaluate", outputs)
    p.tok.decode = lambda ids, skip_special_tokens=False: str(int(ids[0])) if len(ids) else ""
    p.cfg.logging = dataclasses.replace(p.cfg.logging, log_val_generations=8)

    def score(prompt, completion):  # right when the output is 1
        return {"score": 1.0 if completion == "1" else -1.0, "acc": completion == "1", "pred": completion}

    monkeypatch.setattr(p.task, "score", score)
    ev = evaluation_mod.evaluate(p, 3)
    # sample ids -1..-12: outputs (s % 3) of 1..12 -> 1,2,0,1, 2,0,1,2, 0,1,2,0
    rows = [[{"reward": 1.0 if o == 1 else -1.0, "score": 1.0 if o == 1 else -1.0, "acc": float(o == 1),
              "pred": str(o)} for o in outs] for outs in ([1, 2, 0, 1], [2, 0, 1, 2], [0, 1, 2, 0])]
    want = reference([PromptSamples("sum", r) for r in rows])
    assert ev.scores["eval/sum"] == pytest.approx(4 / 12) and ev.scores["eval/mean"] == pytest.approx(4 / 12)
    assert ev.scores["eval/best@4"] == 1.0  # every prompt has a right sample (of acc: the score's best is 1 too)
    assert {k: v for k, v in ev.scores.items() if k.count("/") > 1} == pytest.approx(want, abs=1e-12)
    assert ev.scores["eval/sum/acc/mean@4"] == pytest.approx(4 / 12)
    assert ev.generations[0] == {"prompt": 0, "task": "sum", "input": ev.generations[0]["input"], "output": "1",
                                 "gts": "1", "score": 1.0, "acc": 1.0, "pred": "1"}


def test_an_evaluation_leaves_out_the_samples_whose_generation_failed(monkeypatch, caplog):
    """A multi-turn environment that raised on an eval sample failed the evaluation (and with
    a periodic one, the run; until session 53): the sample is unscored, said once per kind."""
    p = harness._program(monkeypatch, "batch", harness.Clock())
    p.cfg.train.eval_samples = 2
    p.run(1)

    def outputs(self, requests, newest=False, token=None, stage="eval", step=None):
        bad = [r.sample_id for r in requests if r.sample_id in (-2, -3)]  # prompt 0's second, prompt 1's first
        return harness.EvalOutput(self.held, [(r.sample_id, [1]) for r in requests if r.sample_id not in bad],
                                  errors=[(sid, f"gen1: eval sample {sid} failed: multi_turn.env: 'e' failed on "
                                                f"sample {sid} after turn 1 (ValueError: x)") for sid in bad])

    monkeypatch.setattr(harness.Instance, "evaluate", outputs)
    p.tok.decode = lambda ids, skip_special_tokens=False: str(int(ids[0])) if len(ids) else ""
    monkeypatch.setattr(p.task, "score", lambda prompt, completion: 1.0)
    with caplog.at_level("WARNING"):
        ev = evaluation_mod.evaluate(p, 2)
    assert ev.scores["eval/unscored"] == 2.0 and ev.scores["eval/mean"] == 1.0
    said = [r.getMessage() for r in caplog.records if "left out of eval/mean" in r.getMessage()]
    assert len(said) == 1 and "2 samples of 2 prompts" in said[0] and "multi_turn.env" in said[0], said

    def score_batch(prompts, completions):  # a batch reward indexing each completion: "" would fail it
        return [1.0 if c[-1] == "1" else 0.0 for c in completions]

    p.task.score_batch = score_batch  # the failed samples are not scored: the others' one call stands
    p.eval_pool = None  # (made at the first evaluation, from the task as it was)
    ev = evaluation_mod.evaluate(p, 2)
    assert ev.scores["eval/unscored"] == 2.0 and ev.scores["eval/mean"] == 1.0


def test_a_multi_turn_evaluation_reports_its_turns(monkeypatch):
    """verl's val-aux/num_turns/{min,max,mean} (here the assistant turns, ``Sample.turns``); the
    console's line leaves them out with the statistics (``is_headline``)."""
    from controller.val_metrics import is_headline

    p = harness._program(monkeypatch, "batch", harness.Clock())
    p.cfg.train.eval_samples = 2
    p.cfg.multi_turn = dataclasses.replace(p.cfg.multi_turn, env="envs.py:env")
    p.run(1)

    def outputs(self, requests, newest=False, token=None, stage="eval", step=None):
        return harness.EvalOutput(self.held, [(r.sample_id, [1]) for r in requests],
                                  turns=[(r.sample_id, 1 + (-r.sample_id) % 3) for r in requests])

    monkeypatch.setattr(harness.Instance, "evaluate", outputs)
    p.tok.decode = lambda ids, skip_special_tokens=False: str(int(ids[0])) if len(ids) else ""
    ev = evaluation_mod.evaluate(p, 2)  # sample ids -1..-4: turns 2, 3, 1, 2
    assert ev.scores["eval/num_turns/mean"] == 2.0
    assert (ev.scores["eval/num_turns/min"], ev.scores["eval/num_turns/max"]) == (1.0, 3.0)
    assert not is_headline("eval/num_turns/mean") and is_headline("eval/sum") and not is_headline("eval/unscored")


def test_a_pred_of_none_is_a_ballot_and_the_prompt_keeps_its_majority():
    """math_dapo's strict box gives pred None when no answer was found: that dropped the prompt
    from maj@m (reward_info left the None out), so maj@m was over the easier prompts only
    (review, session 52); verl counts None as one more vote."""
    from workers.tasks.scoring import reward_info

    assert reward_info({"score": -1.0, "acc": False, "pred": None}) == {"score": -1.0, "acc": 0.0, "pred": None}
    assert reward_info({"score": 1.0, "pred": [1, 2]})["pred"] == "[1, 2]"
    rows = [[{"reward": a, "acc": a, "pred": p} for a, p in zip(accs, preds)]
            for accs, preds in (([1.0, 1.0, 0.0, 0.0], ["4", "4", None, None]),
                                ([0.0, 0.0, 0.0, 1.0], [None, None, "3", "7"]))]
    prompts = [PromptSamples("t", r) for r in rows]
    got = validation_metrics(prompts)
    assert got == pytest.approx(reference(prompts), abs=1e-12)
    assert "eval/t/acc/maj@4/mean" in got and got["eval/t/acc/maj@4/mean"] < 0.75  # both prompts, the second's None wins


def test_the_console_tells_a_statistic_from_a_task_with_a_slash_in_its_name():
    """The eval line dropped eval/openai/gsm8k and eval/synthetic/running_sum with the statistics
    (it counted slashes; review of session 52's change)."""
    from controller.val_metrics import is_statistic

    for key in ("eval/openai/gsm8k", "eval/synthetic/running_sum", "eval/mean", "eval/best@4", "eval/task:mean"):
        assert not is_statistic(key), key
    for key in ("eval/openai/gsm8k/acc/mean@4", "eval/t/reward/std@2", "eval/a/b/score/best@2/mean",
                "eval/t/acc/maj@8/std", "eval/t/reward/worst@4/mean"):
        assert is_statistic(key), key
