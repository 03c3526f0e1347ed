"""Verifier and scoring behaviour the rest of the suite let through when changed by one line
(mutation review, session 56): huge exponents are text, the last <answer> tag counts, gsm8k's
flexible match skips a final period, zero tolerance accepts the exact value, math answers in
dollars or \\text, an infinite score is none, a batch score of the wrong length. ``_Task`` is a
user's task (the Task Protocol) returning the scores under test."""
import json
import math

import pytest

from workers.tasks.answers import answer_span, value
from workers.tasks.envs.calculator import calculator_env
from workers.tasks.latex import equivalent
from workers.tasks.registry import make_task
from workers.tasks.scoring import safe_score, safe_score_batch
from workers.tasks.verifiers import make_verifier
from workers.types import TaskPrompt
from workers.tasks.rows import WHERE, row_item


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


# ---- the tasks' own verifiers and environments (mutation review, s58) ----
def test_the_calculator_answers_the_last_of_several_tool_calls():
    def call(e):
        return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": e}}) + "</tool_call>"

    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": call("1+1")},
            {"role": "tool", "content": "2"}, {"role": "assistant", "content": call("2*3")}]
    assert calculator_env(None, msgs) == "6"
    done = msgs + [{"role": "tool", "content": "6"}, {"role": "assistant", "content": "answer=6"}]
    assert calculator_env(None, done) is None


def test_reasoning_gym_test_split_is_not_the_train_split():
    t = make_task("reasoning_gym", dataset="basic_arithmetic", size=20, seed=1)
    train = {i.prompt for i in t.prompts("train")}
    test = [i.prompt for i in t.prompts("test")]
    assert [i.prompt for i in t.prompts("eval")] == test
    assert sum(p not in train for p in test) >= 15


def test_reasoning_gym_without_the_answer_hint():
    from workers.tasks.reasoning_gym_task import ANSWER_HINT

    t = make_task("reasoning_gym", dataset="basic_arithmetic", size=3, seed=1, answer_hint=False)
    assert not any(i.prompt.endswith(ANSWER_HINT) for i in t.prompts("train"))
    assert all(demo == item.answer for item, demo in t.demonstrations("train"))


def test_synthetic_verifiers_check_each_step_and_count_the_trace():
    c = make_task("synthetic", kind="countdown")
    item = TaskPrompt("count 23 by 3", "", "synthetic/countdown")  # 23 20 17 14 11 8 5 2: 8 numbers
    assert c.score(item, "23 20 17 14 11 8 5 2; answer=8") == 1.0
    assert c.score(item, "23 20; answer=2") == pytest.approx(0.5 * 2 / 8)  # the count is the trace's
    assert c.score(item, "23 20 17 14 11 8 5 2 -1 -4; answer=8") == pytest.approx(0.5 * 8 / 10 + 0.5)
    r = make_task("synthetic")
    item = TaskPrompt("sum 3 5 2 8", "", "synthetic/running_sum")
    assert r.score(item, "3+5=8; 1+7=10; 10+8=18; answer=18") == pytest.approx(0.5 * 2 / 3 + 0.5)


def test_a_noisy_running_sum_demonstration_answers_its_last_shown_step():
    for item, text in make_task("synthetic", num_train=60, demo_noise=1.0).demonstrations("train"):
        steps = text.split("; ")[:-1]
        want = int(steps[-1].split("=")[-1]) if steps else item.meta["terms"][0]
        assert text.endswith(f"answer={want}"), text


def test_a_verl_scorer_gets_the_rows_data_source_when_the_row_also_names_a_task(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "q", "answer": "1", "task": "group_a", "data_source": "openai/gsm8k"}) + "\n")
    f = tmp_path / "r.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return float(data_source == 'openai/gsm8k')\n")
    t = make_task("jsonl", files=str(data), verifier=f"{f}:compute_score")
    item = t.prompts("train")[0]
    assert item.task == "group_a" and t.score(item, "x") == 1.0


def test_a_calculator_expression_past_its_length_limit_is_refused():
    """(Without the limit a policy's 10^5-character expression was parsed whole, each turn.)"""
    from workers.tasks.envs.calculator import MAX_LENGTH, evaluate

    assert evaluate("+".join(["1"] * 500)) == 500  # 999 characters
    with pytest.raises(ValueError, match=f"expression longer than {MAX_LENGTH} characters"):
        evaluate("+".join(["1"] * 501))


def test_a_tool_schema_that_is_not_json_data_is_refused():
    """A chat template renders the tools with tojson: a set in a schema failed there, per prompt."""
    from workers.tasks.envs.tools import check_tools

    tool = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"enum": {1, 2}}}}
    with pytest.raises(ValueError, match=r"multi_turn\.tools: entry 0 \('f'\) is not JSON data"):
        check_tools([tool], "multi_turn.tools")


# ---- mutation review, session 59 ------------------------------------------------------------
def test_a_rows_prompt_and_answer_fields_stay_out_of_meta():
    """meta holds the row's OTHER fields: the reference answer must not ride along in it."""
    p = row_item({"prompt": "2 + 2 =", "answer": "4", "level": 3}, "d.jsonl:7", "prompt", "answer", "jsonl")
    assert (p.prompt, p.answer) == ("2 + 2 =", "4")
    assert p.meta == {"level": 3, WHERE: "d.jsonl:7"}


def test_a_boolean_task_field_names_no_eval_group():
    """A dataset's `task: true` flag is not a group name: the group falls to data_source, then the default."""
    row = {"prompt": "q", "answer": "1", "task": True}
    assert row_item(row, "d.jsonl:1", "prompt", "answer", "jsonl").task == "jsonl"
    assert row_item({**row, "data_source": "gsm8k"}, "d.jsonl:1", "prompt", "answer", "jsonl").task == "gsm8k"
