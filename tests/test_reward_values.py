"""What a reward function returns, checked (``workers/tasks/scoring.py``): each kind of bad value
has its own reason, so the failure summaries (``failure_kind``: one line per kind) keep them
apart, and a score past float32's range is left out like an inf (flows review, s60)."""
import math

from workers.types import TaskPrompt
from workers.tasks.scoring import safe_score, safe_score_batch
from workers.trainer.step_math import failure_kind

P = TaskPrompt(prompt="1+1", answer="2", task="add")


class Returns:
    def __init__(self, out):
        self.out = out

    def score(self, prompt, completion):
        return self.out


def test_each_kind_of_bad_value_is_its_own_failure_kind():
    # None, a str and a dict without 'score' were all "the task's score raised ValueError": the
    # eval's summary printed the first one's reason for every prompt of the three
    whys = [safe_score(Returns(out), P, "2")[1] for out in (None, "n/a", {"acc": 1.0}, None)]
    assert whys[0] == "the task's score: the reward returned NoneType None, not a number"
    assert whys[2] == "the task's score: the reward returned a dict without 'score' (keys ['acc'])"
    kinds = [failure_kind(w) for w in whys]
    assert len(set(kinds[:3])) == 3 and kinds[3] == kinds[0]

    class Raises:
        def score(self, prompt, completion):
            raise ValueError(f"cannot parse {completion!r}")

    # a reward's own exceptions still group by type, whatever their text
    assert failure_kind(safe_score(Raises(), P, "3x")[1]) == failure_kind(safe_score(Raises(), P, "7y")[1]) == \
        "the task's score raised ValueError"


def test_a_score_past_float32s_range_is_left_out_like_inf():
    # 1e39 passed as finite, was inf in the trainer's fp32 rewards, and its group's NaN advantages
    # cost every sample of its micro-batches (a step skipped, skipped_samples 0)
    for big in (1e39, -1e39):
        score, why, info = safe_score(Returns(big), P, "2")
        assert math.isnan(score) and info == {}
        assert why == f"the task's score {big:g} is past float32's range (the trainer's rewards are fp32)"
    assert safe_score(Returns(3.0e38), P, "2")[:2] == (3.0e38, "")
    assert safe_score(Returns({"score": -3.0e38}), P, "2")[:2] == (-3.0e38, "")
    assert safe_score(Returns(math.inf), P, "2")[1] == "the task's score is inf"


def test_the_value_a_reward_returned_is_not_a_kind_of_its_own():
    # 40 different strings were 40 kinds: MAX_FAILURE_KINDS (32) used up, and later kinds (a real
    # exception) never said (diff review, s60); an apostrophe in a word is no quote
    kinds = {failure_kind(safe_score(Returns(f"x{c}"), P, "2")[1]) for c in "abcdefghij"}
    assert kinds == {"the task's score: the reward returned str _, not a number"}
    assert failure_kind(safe_score(Returns({"acc": 1.0}), P, "2")[1]) == \
        failure_kind(safe_score(Returns({"pred": "7"}), P, "2")[1])


class BatchScored:
    """A task scored many samples per call (a reward model, a judge: verl's batch manager)."""

    def __init__(self, out):
        self.out = out

    def score(self, prompt, completion):
        raise AssertionError("scored per batch")

    def score_batch(self, prompts, completions):
        return self.out


def test_score_batch_leaves_out_a_score_past_float32s_range_or_not_finite():
    # the same rule per sample of a score_batch call (a reward model, a judge; mutation review, s60)
    got = safe_score_batch(BatchScored([1.0, 1e39, {"score": -1e39}, math.inf, math.nan]), [P] * 5, ["2"] * 5)
    assert got[0] == (1.0, "", {})
    assert [math.isnan(s) for s, _, _ in got] == [False, True, True, True, True]
    assert got[1][1] == "the task's score 1e+39 is past float32's range (the trainer's rewards are fp32)"
    assert got[2][1:] == ("the task's score -1e+39 is past float32's range (the trainer's rewards are fp32)", {})
    assert got[3][1] == "the task's score is inf"
