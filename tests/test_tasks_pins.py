"""Verifier and scoring behaviour the rest of the suite let through when changed by one line
(mutation review, session 56): huge exponents are text, the last <answer> tag counts, gsm8k's
flexible match skips a final period, zero tolerance accepts the exact value, math answers in
dollars or \\text, an infinite score is none, a batch score of the wrong length. ``_Task`` is a
user's task (the Task Protocol) returning the scores under test."""
import math

from workers.tasks.answers import answer_span, value
from workers.tasks.latex import equivalent
from workers.tasks.scoring import safe_score, safe_score_batch
from workers.tasks.verifiers import make_verifier
from workers.types import TaskPrompt


def item(answer):
    return TaskPrompt(prompt="q", answer=answer, task="t")


def test_a_huge_exponent_is_text_not_a_number():
    # past MAX_EXPONENT: no Fraction is built (1e999999999 would take minutes of the GIL and GBs)
    assert value("1e400") == 10 ** 400
    assert value("1e401") is None and value("1e-401") is None


def test_the_answer_is_in_the_last_answer_tag():
    completion = "<answer>3</answer> wait, that is wrong. <answer>5</answer>"
    assert answer_span(completion) == ("5", True)
    assert make_verifier("exact")(item("5"), completion) == 1.0


def test_gsm8k_flexible_ignores_a_final_period():
    assert make_verifier("gsm8k", {"method": "flexible"})(item("18"), "She makes 18 dollars.") == 1.0


def test_numeric_zero_tolerance_still_accepts_the_exact_value():
    v = make_verifier("numeric", {"rel_tol": 0, "abs_tol": 0})
    assert v(item("0.5"), "answer: 1/2") == 1.0


def test_math_answers_in_dollars_or_text_are_their_content():
    assert equivalent("$x^2$", "x^2")
    assert equivalent("\\text{(C)}", "(C)")


class _Task:
    def __init__(self, score=None, batch=None):
        self._score, self._batch = score, batch

    def prompts(self, split):
        return []

    def score(self, prompt, completion):
        return self._score

    def score_batch(self, prompts, completions):
        return self._batch


def test_an_infinite_score_is_no_score():
    score, why, _ = safe_score(_Task(score=float("inf")), item("1"), "x")
    assert math.isnan(score) and "inf" in why


def test_a_batch_of_the_wrong_length_costs_every_sample():
    out = safe_score_batch(_Task(batch=[1.0, 0.0, 1.0]), [item("1")] * 2, ["a", "b"])
    assert len(out) == 2 and all(math.isnan(s) and "one score per sample" in why for s, why, _ in out)
