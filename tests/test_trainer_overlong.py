"""DAPO's soft overlong punishment (``trainer.overlong_buffer`` / ``overlong_penalty``; verl's
``reward_model.overlong_buffer``): the penalty's values, what it does to the rewards the
advantages are taken from (not to the logged task scores), and its config."""
import pytest
import torch

from controller.config import ConfigError, from_dict
from workers.tasks import make_task
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer.bootstrap import build_model_dir
from workers.trainer.rollout import rollout
from workers.trainer.step_math import overlong_penalty
from tests.trainer_helpers import LengthRewardTask, tiny_config


def test_the_penalty_falls_linearly_over_the_buffer():
    cfg = TrainerConfig(overlong_buffer=4, max_response_tokens=16)
    assert [overlong_penalty(n, cfg) for n in (1, 12, 13, 14, 16)] == [0.0, 0.0, -0.25, -0.5, -1.0]
    two = TrainerConfig(overlong_buffer=4, max_response_tokens=16, overlong_penalty=2.0)
    assert overlong_penalty(16, two) == -2.0
    assert overlong_penalty(16, TrainerConfig()) == 0.0  # off


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_advantages_are_taken_from_the_shaped_reward(tmp_path, algorithm):
    torch.set_num_threads(1)
    task = LengthRewardTask(make_task("synthetic", max_terms=3, num_train=64, num_test=16))
    model_dir = str(build_model_dir(tmp_path / "m", task.base, tiny_config(), seed=0)[0])
    cfg = TrainerConfig(algorithm=algorithm, overlong_buffer=6, max_response_tokens=12, overlong_penalty=0.5,
                        max_tokens_per_microbatch=4096)
    w = TrainerWorker(cfg, model_dir, task, device="cpu")
    samples, prompts, groups = rollout(w.actor, w.tokenizer, task.prompts("train")[:6], 4, 12, seed=3)
    lens = [len(s.output_ids) for s in samples]
    assert min(lens) < 6 < 12 == max(lens)  # some inside the buffer, some not: the test sees both
    w.begin_iteration(0, prompts, groups)
    w.receive(samples)
    items = {p.sample_id: p for p in w.buffer.ready}
    assert len(items) == len(samples)
    for s in samples:
        p = items[s.sample_id]
        want = 0.5 * min(0.0, -(len(s.output_ids) - 6) / 6)
        assert p.overlong == pytest.approx(want)
        if algorithm == "grpo":
            assert p.reward == pytest.approx(p.score + want)
        else:  # PPO: the last token's reward
            assert float(p.token_rewards[-1]) == pytest.approx(p.score + want)
    res = w.step()
    assert res.metrics["overlong_penalty_mean"] == pytest.approx(sum(p.overlong for p in items.values()) / len(items))
    # reward_mean stays the task's score
    assert res.metrics["reward_mean"] == pytest.approx(sum(p.score for p in items.values()) / len(items))


def test_the_run_config_counts_from_train_max_tokens():
    cfg = from_dict({"trainer": {"overlong_buffer": 4}, "train": {"max_tokens": 16}})
    assert cfg.trainer.max_response_tokens == 16
    with pytest.raises(ConfigError, match=r"trainer.overlong_buffer must be in \[0, max_response_tokens 16\]"):
        from_dict({"trainer": {"overlong_buffer": 40}, "train": {"max_tokens": 16}})
    with pytest.raises(ConfigError, match="trainer.overlong_penalty .* is only used with trainer.overlong_buffer > 0"):
        from_dict({"trainer": {"overlong_penalty": 2.0}})
    with pytest.raises(ValueError, match="trainer.max_response_tokens: set it"):
        TrainerConfig(overlong_buffer=4)
