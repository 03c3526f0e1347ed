"""Trainer behaviour the rest of the suite let through when changed by one line (mutation review,
session 56): staleness_mean: 0 for samples of the trainer's version, 1 one version behind."""
import pytest

from tests.test_trainer_stats import KnownRewardTask, build, model_dir  # noqa: F401
from workers.trainer import TrainerConfig, TrainerWorker


def test_staleness_mean_is_the_trainers_version_less_the_samples(model_dir):  # noqa: F811
    """``staleness_mean``: mean of (trainer version - Sample.weight_version): 0 on-policy, 1 for
    samples of the weights one step back (the async modes' lag)."""
    samples, prompts, sizes = build(model_dir, [[(1.0, 3), (0.0, 4)], [(0.5, 2), (0.2, 5)]])
    w = TrainerWorker(TrainerConfig(algorithm="grpo", max_staleness=1), model_dir, KnownRewardTask(), device="cpu")
    w.begin_iteration(0, prompts, sizes)
    w.receive(samples)
    assert w.step().metrics["staleness_mean"] == 0.0
    assert w.version == 1
    w.begin_iteration(1, prompts, sizes)
    w.receive(samples)  # weight_version 0, trained at version 1
    assert w.step().metrics["staleness_mean"] == pytest.approx(1.0)
