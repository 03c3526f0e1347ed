"""The built-in verifiers (exact, numeric, gsm8k, math) and the user's reward function: which
answer a completion gives, how it is compared with the reference, and the options
(``task.kwargs.verifier_kwargs``) each takes."""
import asyncio
import json
import math

import pytest

from workers.tasks import make_task
from workers.tasks.latex import normalise
from workers.tasks.scoring import as_score, safe_score
from workers.tasks.verifiers import exact, make_verifier, numeric
from workers.types import TaskPrompt


def item(answer: str, raw=None) -> TaskPrompt:
    return TaskPrompt("q", answer, "t", raw_answer=raw)


@pytest.mark.parametrize("reference, completion", [
    ("\\frac{1}{2}", "\\boxed{\\frac{3}{2}}"),  # not the denominator
    ("3/4", "answer=1/4"),
    ("2:30", "answer=1:30"),  # a ratio or time: its text, not its last number
    ("(1, 2)", "answer=(5, 2)"),
    ("x = 5", "answer: y = 5"),
    ("\\frac{1}{2}", "answer: 1/3"),
    ("72", "answer: 7. Because 3+4 = 72"),  # the marked number is 7
])
def test_numeric_no_longer_matches_a_part_of_the_reference(reference, completion):
    assert numeric(item(reference), completion) == 0.0


@pytest.mark.parametrize("reference, completion", [
    ("72", "#### 72\nI hope this helps, 3 more"),  # gsm8k's mark, then chatter
    ("7", "answer: 7. Because 3+4 = 7 and 2 more steps"),
    ("\\frac{1}{2}", "so \\boxed{\\frac{1}{2}}"),
    ("\\frac{1}{2}", "answer: 0.5"),
    ("3/4", "answer=0.75"),
    ("\\dfrac34", "answer=3/4"),
    ("1,000", "answer: 1000"),
    ("1000", "#### 1,000"),
    ("2:30", "answer= 2:30"),
    ("(1, 2)", "answer=(1,2)"),
    ("x = 5", "answer: x=5"),
    ("42", "so \\boxed{42}. Check: 41"),
    ("5", "\\boxed{3} was wrong, so answer=5"),  # the last mark wins
    ("3", "x = 3.0000000001"),  # no mark: the last number
    ("1000", "<answer>1e3</answer>"),
    # a markdown heading is no gsm8k mark (it took "Step 2"'s 2, and overrode the box; review, s53)
    ("7", "#### Step 1: add\n3 + 4 = 7\n#### Step 2: conclude\nThe total is 7"),
    ("7", "so \\boxed{7}.\n\n#### Verification\nIndeed 3 + 4 = 7."),
    # a sign with a space after it is the number's own (it was dropped: 72 scored for - 72)
    ("-72", "answer: - 72"),
    ("-5", "\\boxed{- 5}"),
    ("-0.75", "The answer is $- 0.75$"),
    ("7", "10 - 3 = 7"),
    ("3", "the difference is 10 - 3"),  # a subtraction: no sign on the 3
    # a markdown bullet is no minus sign, nor is a label's brace a subtraction (review of the above)
    ("27", "Answer:\n- 27 apples"),
    ("27", "Answer:\n- 27"),
    ("27", "**Answer:**\n- 27"),
    ("27", "In total:\n\n- 27 apples"),
    ("-3", "\\textbf{Answer:} -3"),
    ("-3", "Answer: (B) -3"),
    ("-0.75", "so $x = - 0.75$"),
    ("-5", "Answer: - 5 degrees"),  # a spaced sign opening the marked answer (review of the above)
    ("42", "\\boxed{42}\n\n#### 2. Verification\nIt checks."),  # a numbered heading is no mark
])
def test_numeric_reads_the_marked_answer(reference, completion):
    assert numeric(item(reference), completion) == 1.0


def test_a_spaced_sign_is_not_lost_and_a_heading_is_not_an_answer():
    assert numeric(item("72"), "answer: - 72") == 0.0 and numeric(item("5"), "\\boxed{- 5}") == 0.0
    assert exact(item("7"), "\\boxed{7}.\n\n#### Verification\nIndeed 3 + 4 = 7.") == 1.0
    assert numeric(item("-5"), "#### - 5") == 1.0 and numeric(item("1000"), "#### $1,000") == 1.0


def test_numeric_integers_are_equal_or_not_and_a_unicode_minus_is_a_sign():
    # the default relative tolerance (1e-6) made different large integers one answer (review, s47)
    assert numeric(item("1234567"), "#### 1234568") == 0.0 and numeric(item("1234567"), "#### 1234567.0") == 1.0
    assert numeric(item("2000000"), "answer: 2000001") == 0.0
    assert numeric(item("0.3333333"), "answer: 1/3") == 1.0  # not both integers: the tolerance
    assert make_verifier("numeric", {"rel_tol": 1e-6})(item("2000000"), "answer: 2000001") == 1.0  # asked for
    assert numeric(item("5"), "answer: \u22125") == 0.0 and numeric(item("-5"), "answer: \u22125") == 1.0
    assert numeric(item("-3/4"), "so \u22123/4") == 1.0


def test_numeric_tolerances_are_options():
    assert make_verifier("numeric", {"rel_tol": 0.1})(item("100"), "answer=95") == 1.0
    assert make_verifier("numeric")(item("100"), "answer=95") == 0.0
    with pytest.raises(ValueError, match=r"task.kwargs.verifier_kwargs.rel_tol: a number >= 0"):
        make_verifier("numeric", {"rel_tol": -1})
    with pytest.raises(ValueError, match=r"task.kwargs.verifier_kwargs: \['tolerance'\] are not options of the "
                                         r"verifier 'numeric' \(it takes \['rel_tol', 'abs_tol'\]\)"):
        make_verifier("numeric", {"tolerance": 0.1})


@pytest.mark.parametrize("completion, strict, flexible", [
    ("Natalia sold 48/2 = 24 clips in May. 48+24 = 72. #### 72", 1.0, 1.0),
    ("#### 71\nno, #### 72", 1.0, 1.0),  # the last mark
    ("48+24 = 72. #### 72\nI hope this helps, 3 more", 1.0, 0.0),  # flexible: the last number
    ("The answer is 72.", 0.0, 1.0),  # strict needs '#### '
    ("####72", 0.0, 1.0),
    ("#### 72.00", 1.0, 1.0),  # compared as numbers too
    ("#### 73", 0.0, 0.0),
    ("no number", 0.0, 0.0),
])
def test_gsm8k_strict_and_flexible(completion, strict, flexible):
    assert make_verifier("gsm8k")(item("72"), completion) == strict
    assert make_verifier("gsm8k", {"method": "flexible"})(item("72"), completion) == flexible


def test_gsm8k_commas_scores_and_options():
    assert make_verifier("gsm8k")(item("1000"), "so #### 1,000") == 1.0
    assert make_verifier("gsm8k")(item("1,000"), "so #### 1000") == 1.0
    g = make_verifier("gsm8k", {"format_score": 0.1, "score": 2.0})
    assert (g(item("72"), "#### 72"), g(item("72"), "#### 7"), g(item("72"), "7")) == (2.0, 0.1, 0.0)
    with pytest.raises(ValueError, match=r"verifier_kwargs.method: 'lenient' is not one of \('strict', 'flexible'\)"):
        make_verifier("gsm8k", {"method": "lenient"})


@pytest.mark.parametrize("reference, boxed", [
    ("\\frac{1}{2}", "\\dfrac12"),
    ("\\frac{1}{2}", "\\tfrac{1}{2}"),
    ("\\frac{1}{2}", "0.5"),
    ("0.5", ".5"),
    ("5", "x = 5"),
    ("10", "10 \\text{ cm}"),
    ("12", "12 \\text{ cm}^2"),  # a unit's power and a final period go with it, as verl's cut
    ("20", "20\\text{ m}^3"),
    ("12", "12\\text{ cm}."),
    ("12\\text{ cm}^2", "12"),
    ("20", "20\\mbox{m}^{3}"),
    ("\\text{(B)}", "x = \\text{(B)}"),  # the answer's text, not a unit
    ("\\text{Monday}", "k=\\text{Monday}"),
    ("a", "a\\text{ units}"),
    ("\\left( 1, 2 \\right)", "(1,2)"),
    ("3", "3."),
    ("3", "$3$"),
    ("x+1", "$x+1$"),  # math-mode dollars in the box around a non-number (a number's value matched anyway)
    ("(B)", "\\text{(B)}"),  # text: its content
    ("\\sqrt{3}", "\\sqrt3"),
    ("\\frac{\\sqrt{3}}{2}", "\\dfrac{\\sqrt{3}}{2}"),
    ("90^\\circ", "90"),
    ("-\\frac{1}{2}", "-\\!\\frac{1}{2}"),
])
def test_math_equivalent_forms(reference, boxed):
    m = make_verifier("math")
    assert m(item(reference), f"so the answer is $\\boxed{{{boxed}}}$.") == 1.0
    assert m(item(reference), f"\\fbox{{{boxed}}}") == 1.0


@pytest.mark.parametrize("reference, completion", [
    ("\\frac{1}{2}", "\\boxed{\\frac{3}{2}}"),
    ("42", "answer: 42"),  # verl's math rule: no \boxed, no answer
    ("42", "\\boxed{42} then \\boxed{41}"),  # the last box
    ("2", "\\boxed{\\frac{4}{2}"),  # its braces do not close
    ("x+1", "\\boxed{x-1}"),
    ("5", "\\boxed{5 \\text{ and } 6}"),  # not a unit (verl's cut at "\\text{ " takes it for one)
    ("3125", "\\boxed{3, 125}"),  # a list of two, not 3,125 (review, s53)
    ("3, 125", "\\boxed{3125}"),
    ("-2, 500", "\\boxed{-2500}"),
])
def test_math_wrong_or_unboxed(reference, completion):
    assert make_verifier("math")(item(reference), completion) == 0.0


def test_math_boxed_braces_balance_and_normalise():
    assert make_verifier("math")(item("\\frac{1}{2}"), "\\boxed{\\frac{1}{2}} and more {text}") == 1.0
    assert normalise("\\left(\\dfrac12, 3\\right).") == "(\\frac{1}{2},3)"


def test_numbers_in_the_data_compare_by_value(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [{"prompt": "a", "answer": 2.0}, {"prompt": "b", "answer": 72},
                                                      {"prompt": "c", "answer": True}]) + "\n")
    t = make_task("jsonl", files=str(data))  # exact
    a, b, c = t.prompts("train")
    assert (a.answer, a.raw_answer, b.answer) == ("2.0", 2.0, "72")
    assert t.score(a, "answer=2") == 1.0 and t.score(b, "answer: 72.0") == 1.0 and t.score(b, "answer: 7") == 0.0
    assert t.score(c, "answer=True") == 1.0  # not a number: its text
    assert exact(item("2.0"), "answer=2") == 0.0  # a string reference stays text


def test_verl_reward_dict_gives_the_score_and_keeps_its_numbers_and_texts(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "q", "answer": "1"}) + "\n")
    f = tmp_path / "r.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return {'score': 0.5, 'acc': True, 'pred': solution_str, 'rows': [1, 2], 'none': None}\n")
    t = make_task("jsonl", files=str(data), verifier=f"{f}:compute_score")
    assert safe_score(t, t.prompts("train")[0], "x") == (0.5, "", {"score": 0.5, "acc": 1.0, "pred": "x"})


def test_verl_scorers_get_a_dict_extra_info_of_their_own(tmp_path):
    """verl's dataset gives a row without extra_info ``{}``: a scorer reading it (``len``, ``.get``)
    raised on every sample here (None), and a scorer that writes to it changed the next call's."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "q", "answer": "1"}) + "\n"
                    + json.dumps({"prompt": "r", "answer": "1", "extra_info": {"index": 4}}) + "\n")
    f = tmp_path / "r.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    seen = len(extra_info)\n"
                 "    extra_info['seen'] = True\n"
                 "    return float(seen)\n")
    t = make_task("jsonl", files=str(data), verifier=f"{f}:compute_score")
    bare, indexed = t.prompts("train")
    assert [t.score(bare, "x"), t.score(bare, "x"), t.score(indexed, "x"), t.score(indexed, "x")] == [0, 0, 1, 1]
    assert indexed.meta["extra_info"] == {"index": 4}


ASYNC_REWARDS = '''
import asyncio

async def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep(0)
    return {"score": float(solution_str == ground_truth)}

async def mine(prompt, completion, bonus=0.0):
    await asyncio.sleep(0)
    return float(completion == prompt.answer) + bonus
'''


def test_async_rewards_are_awaited(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "q", "answer": "7"}) + "\n")
    f = tmp_path / "r.py"
    f.write_text(ASYNC_REWARDS)
    for fn in ("compute_score", "mine"):
        t = make_task("jsonl", files=str(data), verifier=f"{f}:{fn}")
        q = t.prompts("train")[0]
        assert (as_score(t.score(q, "7")), as_score(t.score(q, "8"))) == (1.0, 0.0)
        assert safe_score(t, q, "7")[:2] == (1.0, "")

        async def inside_a_loop():  # a caller that runs an event loop itself
            return t.score(q, "7")
        assert as_score(asyncio.run(inside_a_loop())) == 1.0


def test_verifier_kwargs_reach_the_users_function(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "q", "answer": "7"}) + "\n")
    f = tmp_path / "r.py"
    f.write_text(ASYNC_REWARDS + "def verl(solution_str, ground_truth, scale, **kw):\n"
                 "    return scale * (solution_str == ground_truth) + kw.get('extra', 0)\n")
    t = make_task("jsonl", files=str(data), verifier=f"{f}:mine", verifier_kwargs={"bonus": 0.25})
    assert t.score(t.prompts("train")[0], "7") == 1.25
    t = make_task("jsonl", files=str(data), verifier=f"{f}:verl", verifier_kwargs={"scale": 3, "extra": 1})
    assert t.score(t.prompts("train")[0], "7") == 4.0
    with pytest.raises(ValueError, match=r"task.kwargs.verifier_kwargs: '.*r.py:mine' takes no keyword argument "
                                         r"\['scale'\] \(it takes prompt, completion, bonus\)"):
        make_task("jsonl", files=str(data), verifier=f"{f}:mine", verifier_kwargs={"scale": 2})
    with pytest.raises(ValueError, match=r"verifier_kwargs: \['ground_truth'\] are the arguments every call gets"):
        make_task("jsonl", files=str(data), verifier=f"{f}:verl", verifier_kwargs={"scale": 1, "ground_truth": "x"})
    with pytest.raises(ValueError, match=r"needs \['scale'\], which a verl-style scorer is not given"):
        make_task("jsonl", files=str(data), verifier=f"{f}:verl")
    with pytest.raises(ValueError, match=r"task.kwargs.verifier_kwargs: a mapping"):
        make_task("jsonl", files=str(data), verifier=f"{f}:mine", verifier_kwargs=[1])
    with pytest.raises(ValueError, match=r"are not options of the verifier 'reasoning_gym:basic_arithmetic'"):
        make_task("jsonl", files=str(data), verifier="reasoning_gym:basic_arithmetic", verifier_kwargs={"x": 1})


def test_a_verifier_per_data_source_as_the_docs_show(tmp_path):
    """verl's default reward picks its scorer from data_source; here, a few lines of the user's."""
    rows = [{"data_source": "openai/gsm8k", "prompt": "a", "reward_model": {"ground_truth": "72"}},
            {"data_source": "lighteval/MATH", "prompt": "b", "reward_model": {"ground_truth": "\\frac{1}{2}"}}]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    f = tmp_path / "by_source.py"
    f.write_text("from workers.tasks.verifiers import make_verifier\n\n"
                 "BY_SOURCE = {'openai/gsm8k': make_verifier('gsm8k'), 'lighteval/MATH': make_verifier('math')}\n\n"
                 "def score(prompt, completion):\n"
                 "    return BY_SOURCE[prompt.meta['data_source']](prompt, completion)\n")
    t = make_task("jsonl", files=str(data), answer_key="reward_model.ground_truth", verifier=f"{f}:score")
    gsm, mth = t.prompts("train")
    assert t.score(gsm, "#### 72") == 1.0 and t.score(gsm, "\\boxed{72}") == 0.0
    assert t.score(mth, "\\boxed{\\dfrac12}") == 1.0 and t.score(mth, "#### 0.5") == 0.0


def test_an_async_reward_keeps_its_client_between_calls():
    # each call ran on a new loop (asyncio.run): a client made on the first call failed every later one
    # ("attached to a different loop"), so all samples but one were skipped (a plugin-author review)
    import asyncio
    import threading

    from workers.types import TaskPrompt

    class Task:
        loop = None

        async def score(self, prompt, completion):
            if self.loop is None:  # a client made on the first call is bound to that call's loop
                self.loop = asyncio.get_running_loop()
            reply = self.loop.create_future()  # its requests' futures live on that loop
            self.loop.call_soon(reply.set_result, completion)
            return float(await reply == prompt.answer)

    task, p = Task(), TaskPrompt(prompt="1+1", answer="2", task="add")
    out = []
    threads = [threading.Thread(target=lambda c=c: out.append(safe_score(task, p, c))) for c in ("2", "3", "2")]
    for t in threads:
        t.start()
        t.join()
    assert sorted(out) == [(0.0, "", {}), (1.0, "", {}), (1.0, "", {})]


def test_a_task_score_follows_the_verifier_rule_for_what_it_returns():
    from workers.types import TaskPrompt

    class Task:
        def __init__(self, out):
            self.out = out

        def score(self, prompt, completion):
            return self.out

    p = TaskPrompt(prompt="1+1", answer="2", task="add")
    # verl's dict (was a TypeError); its numbers and texts are the sample's reward info
    assert safe_score(Task({"score": 0.5, "acc": True, "pred": "2", "raw": [1]}), p, "2") == \
        (0.5, "", {"score": 0.5, "acc": 1.0, "pred": "2"})
    score, why, _ = safe_score(Task("1.0"), p, "2")  # a string was read as a number, silently
    assert why == "the task's score: the reward returned str '1.0', not a number", why
    assert safe_score(Task(True), p, "2") == (1.0, "", {})
    # verl's default_compute_score takes res[0] of what is neither a dict nor a number:
    # prime_math's (is_correct, format_correct, extracted) was refused as a tuple
    assert safe_score(Task((True, True, "3")), p, "2") == (1.0, "", {})
    assert safe_score(Task([0.25, "why"]), p, "2") == (0.25, "", {})
    assert "the reward returned tuple ()" in safe_score(Task(()), p, "2")[1]


def test_a_score_running_long_is_said_once(monkeypatch):
    from workers.tasks import scoring

    w = scoring._Watch()
    key = w.enter("sample 7 (trainer rank 0, iteration 2)")
    now = w.running[key][0]
    assert w.overdue(now + 30) == []
    assert w.overdue(now + 61) == ["the task's score of sample 7 (trainer rank 0, iteration 2) has run for 61 s"]
    assert w.overdue(now + 120) == []  # said once
    w.leave(key)
    assert w.running == {}


BATCH_REWARDS = '''
CALLS = []

def compute_score(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0):
    CALLS.append(len(solution_strs))
    return [{"score": scale * (s == g), "source": d} if e.get("dict") else scale * (s == g)
            for d, s, g, e in zip(data_sources, solution_strs, ground_truths, extra_infos)]

def no_completion(data_sources, ground_truths):
    return [0.0] * len(ground_truths)

def wrong_length(solution_strs):
    return [1.0] * (len(solution_strs) + 1)

def takes_kwargs(solution_strs, **kwargs):  # verl passes all four names
    return [float(d == "src" and e is not None) for d, e in zip(kwargs["data_sources"], kwargs["extra_infos"])]

def masks(data_sources, solution_strs):  # verl's data_sources is a numpy object array: == is a mask
    return list((data_sources == "src").astype(float))

def mine(prompt, completion, ground_truths=None):  # StreamRL's signature, whatever its other names
    return 1.0

def one_bad(solution_strs):
    return [1.0 if s != "bad" else "n/a" for s in solution_strs]
'''


def test_verls_batch_compute_score_scores_many_samples_in_one_call(tmp_path):
    # verl's `reward_manager: batch`: compute_score(data_sources, solution_strs, ground_truths,
    # extra_infos) -> one score (or {"score": ...}) per sample; it was refused (a verifier is fn(prompt, completion))
    from workers.tasks.scoring import safe_score_batch

    rows = [{"prompt": f"q{i}", "answer": str(i), "data_source": "src", "extra_info": {"dict": i % 2 == 0}}
            for i in range(4)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    f = tmp_path / "batch.py"
    f.write_text(BATCH_REWARDS)
    t = make_task("jsonl", files=str(data), verifier=f"{f}:compute_score", verifier_kwargs={"scale": 2.0})
    qs = t.prompts("train")
    assert [s[:2] for s in safe_score_batch(t, qs, ["0", "x", "2", "3"])] == \
        [(2.0, ""), (0.0, ""), (2.0, ""), (2.0, "")]
    assert t.score(qs[1], "1") == 2.0  # one sample: a batch of one
    calls = __import__("sys").modules[t.verify.fn.__module__].CALLS
    assert calls == [4, 1]
    bad = make_task("jsonl", files=str(data), verifier=f"{f}:wrong_length")
    assert [w for _, w, _ in safe_score_batch(bad, qs[:2], ["0", "1"])] == \
        ["the task's score_batch did not return one score per sample"] * 2
    with pytest.raises(ValueError, match="the batch reward returned 2 scores for 1 sample"):
        bad.score(qs[0], "0")  # one sample scored alone: a batch of one (mutation review, s58)
    for fn in ("takes_kwargs", "masks"):
        t = make_task("jsonl", files=str(data), verifier=f"{f}:{fn}")
        assert [s[:2] for s in safe_score_batch(t, qs[:2], ["0", "1"])] == [(1.0, ""), (1.0, "")]
    assert make_task("jsonl", files=str(data), verifier=f"{f}:mine").score(qs[0], "x") == 1.0
    bad = make_task("jsonl", files=str(data), verifier=f"{f}:one_bad")
    out = safe_score_batch(bad, qs[:3], ["a", "bad", "c"])
    assert out[0][:2] == (1.0, "") and out[2][:2] == (1.0, "") and math.isnan(out[1][0])
    assert out[1][1] == "the task's score_batch: the reward returned str 'n/a', not a number"
    with pytest.raises(ValueError, match=r"the completion's, solution_strs, is not among them; name the completion "
                                         r"parameter solution_strs \(verl's compute_score\(data_sources, "):
        make_task("jsonl", files=str(data), verifier=f"{f}:no_completion")


def test_a_degenerate_output_is_scored_in_one_pass():
    """A run of whitespace (numeric, and exact with a JSON-number reference) or of periods in a
    box (math) was scanned again from each of its characters: 80k newlines took 10 s of regex
    holding the GIL for one sample (review, session 51). The scores are unchanged; at these
    sizes the old patterns would run for minutes."""
    blank = "Let me think." + "\n" * 300_000 + "So it is 5"
    assert make_verifier("numeric")(TaskPrompt("q", "5", "t"), blank) == 1.0
    assert make_verifier("exact")(TaskPrompt("q", "5", "t", raw_answer=5), blank) == 1.0  # a JSON number
    assert make_verifier("math")(TaskPrompt("q", "5", "t"), "\\boxed{0." + "." * 100_000 + "5}") == 0.0
    assert make_verifier("math")(TaskPrompt("q", "5", "t"), "\\boxed{5...}") == 1.0
    assert make_verifier("math")(TaskPrompt("q", "5", "t"), "\\boxed{5" + "$" * 100_000 + "x}") == 0.0
    assert make_verifier("math")(TaskPrompt("q", "5", "t"), "\\boxed{$$5$$}") == 1.0
    from workers.tasks.answers import numbers_in
    assert list(numbers_in("5 -\\frac{1}{2} - \\frac34 3/4")) == list(numbers_in("5 - \\frac{1}{2} -\\frac34 3/4"))
