"""Trainer behaviour the rest of the suite let through when changed by one line (mutation review,
session 56): remax's baseline carries its overlong penalty, the reported baseline too, and a
group completes when its greedy sample arrives last."""
import pytest

from tests.test_remax import _samples, _worker  # noqa: F401
from tests.test_trainer_stats import model_dir  # noqa: F401


def test_remax_baseline_carries_the_overlong_penalty(model_dir):  # noqa: F811
    """docs/trainer.md (ReMax): the greedy baseline is the task's score plus the overlong penalty,
    and baseline_reward_mean reports that. Members 3 and 2 tokens long, greedy 6 long, cap 6,
    buffer 4: penalties -0.25, 0, -1.0."""
    groups = [([(1.0, 3), (0.0, 2)], (0.5, 6))]
    samples, prompts, sizes = _samples(model_dir, groups)
    w = _worker(model_dir, max_response_tokens=6, overlong_buffer=4, overlong_penalty=1.0)
    w.begin_iteration(0, prompts, sizes)
    w.receive(samples)
    m = w.step().metrics
    baseline = 0.5 - 1.0
    assert m["baseline_reward_mean"] == pytest.approx(baseline)
    assert m["advantage_max"] == pytest.approx(1.0 - 0.25 - baseline, abs=1e-6)
    assert m["advantage_min"] == pytest.approx(0.0 - baseline, abs=1e-6)


def test_remax_group_completes_when_its_baseline_arrives_last(model_dir):  # noqa: F811
    """The greedy sample arriving after its group's members completes the group at receive
    time (its members become trainable while streaming), not at step() as an incomplete group."""
    samples, prompts, sizes = _samples(model_dir)
    w = _worker(model_dir)
    w.begin_iteration(0, prompts, sizes)
    w.receive(samples)  # members first, then each group's baseline
    assert not w.buffer.groups  # every group complete
    m = w.step().metrics
    assert m["incomplete_groups"] == 0 and m["groups_without_baseline"] == 0
