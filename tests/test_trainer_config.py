"""TrainerConfig: validation at construction (unknown algorithm / estimator / key, switches that
take only bools, warmup past the schedule) and the learning-rate schedules."""
import math
import re

import pytest

from workers.config_schema import build_section
from workers.trainer import TrainerConfig


def test_config_validation():
    with pytest.raises(ValueError, match="algorithm"):
        TrainerConfig(algorithm="dpo")
    with pytest.raises(ValueError, match="kl_estimator"):
        TrainerConfig(kl_estimator="k4")
    with pytest.raises(ValueError, match="dual_clip"):
        TrainerConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="critic"):
        TrainerConfig(algorithm="ppo", critic=False)
    with pytest.raises(ValueError, match="trainer.lrr: unknown key; did you mean 'lr'"):
        build_section(TrainerConfig, "trainer", {"lr": 1e-3, "lrr": 1})
    assert build_section(TrainerConfig, "trainer", {"algorithm": "ppo", "betas": [0.9, 0.95]}).use_critic


@pytest.mark.parametrize("algorithm, key, value", [
    ("grpo", "gamma", 0.9), ("grpo", "gae_lambda", 0.5), ("grpo", "critic_lr", 1.0), ("grpo", "value_coef", 2.0),
    ("rloo", "value_clip", 0.5), ("rloo", "grpo_std_normalize", False), ("rloo", "adv_eps", 5.0),
    ("ppo", "grpo_std_normalize", False), ("ppo", "adv_eps", 1e-3), ("reinforce_plus_plus", "gae_lambda", 0.5),
    ("reinforce_plus_plus", "grpo_std_normalize", False), ("reinforce_plus_plus", "value_coef", 2.0),
    ("reinforce_plus_plus_baseline", "gamma", 0.9), ("reinforce_plus_plus_baseline", "adv_eps", 5.0)])
def test_a_knob_the_algorithm_does_not_read_is_refused(algorithm, key, value):
    """Used to be accepted and do nothing (as whiten_advantages under grpo is refused)."""
    with pytest.raises(ValueError, match=f"trainer.{key} .* only used by algorithm .*not '{algorithm}'"):
        TrainerConfig(algorithm=algorithm, **{key: value})
    TrainerConfig(algorithm=algorithm, **{key: getattr(TrainerConfig(), key)})  # the default is fine


def test_the_knobs_of_the_algorithm_are_taken():
    assert TrainerConfig(algorithm="ppo", gamma=0.9, gae_lambda=0.5, value_coef=1.0).gamma == 0.9
    assert not TrainerConfig(algorithm="grpo", grpo_std_normalize=False, adv_eps=0.0).grpo_std_normalize
    assert TrainerConfig(algorithm="reinforce_plus_plus", gamma=0.9).gamma == 0.9  # its returns' discount


def test_lr_schedule():
    from workers.trainer.schedule import lr_lambda

    f = lr_lambda(TrainerConfig(warmup_steps=2, lr_schedule="cosine", total_steps=6, min_lr_ratio=0.1))
    assert [round(f(s), 4) for s in range(7)] == [0.5, 1.0, 1.0, 0.8682, 0.55, 0.2318, 0.1]
    g = lr_lambda(TrainerConfig(lr_schedule="linear", total_steps=4))
    assert [g(s) for s in (0, 2, 4, 9)] == [1.0, 0.5, 0.0, 0.0]


def test_warmup_longer_than_the_schedule_is_refused():
    with pytest.raises(ValueError, match=r"trainer.warmup_steps \(5\) must be <= trainer.total_steps \(3\)"):
        TrainerConfig(warmup_steps=5, total_steps=3)
    TrainerConfig(warmup_steps=3, total_steps=3)


@pytest.mark.parametrize("key, value", [("recompute_old_logprobs", "false"), ("grpo_std_normalize", 0),
                                        ("critic", "yes"), ("whiten_advantages", 1), ("grpo_std_normalize", None)])
def test_switches_take_only_bools(key, value):
    """A library user's TrainerConfig(recompute_old_logprobs="false") turned the switch on (a
    non-empty string is truthy); run configs were type-checked already, direct use was not."""
    with pytest.raises(ValueError, match=rf"trainer.{key}: (expected bool|is empty)"):
        TrainerConfig(**{key: value})
    TrainerConfig(critic=None, whiten_advantages=None, recompute_old_logprobs=True)


@pytest.mark.parametrize("kw, said", [
    (dict(weight_decay=math.nan), "trainer.weight_decay: expected a finite number, got nan"),
    (dict(min_lr_ratio=math.nan), "trainer.min_lr_ratio: expected a finite number"),
    (dict(kl_coef=math.nan), "trainer.kl_coef: expected a finite number"),
    (dict(lr=math.inf), "trainer.lr: expected a finite number, got inf"),
    (dict(grad_clip=True), "trainer.grad_clip: expected float, got bool True"),
    (dict(warmup_steps=1.5, total_steps=10), "trainer.warmup_steps: expected int, got float 1.5"),
    (dict(mini_batches=2.5), "trainer.mini_batches: expected int"),
    (dict(ppo_epochs=True), "trainer.ppo_epochs: expected int, got bool True"),
    (dict(reward_timeout_s=math.nan), "trainer.reward_timeout_s: expected a finite number"),
    (dict(betas=(math.nan, 0.999)), "trainer.betas[0]: expected a finite number, got nan"),
    (dict(betas=(0.9, 1.5)), "trainer.betas[1] must be in [0, 1), got 1.5"),
    (dict(lr=10**400), "trainer.lr: expected a finite number, got an integer of 401 digits"),
    (dict(reward_workers=0), "trainer.reward_workers must be an int in [1, 256], got 0"),
])
def test_the_python_api_checks_types_as_the_run_config_does(kw, said):
    """TrainerConfig(...) took NaN, inf and 1.5 where a run config is refused: a NaN min_lr_ratio
    made every weight NaN with the step applied, 1.5 warmup steps an lr above the configured one
    (review, session 51). Both ways are one check now, with one message."""
    with pytest.raises(ValueError, match=re.escape(said)) as direct:
        TrainerConfig(**kw)
    with pytest.raises(ValueError) as from_file:
        build_section(TrainerConfig, "trainer", kw)
    assert str(direct.value) == str(from_file.value)
    TrainerConfig(lr=1, reward_timeout_s=None, weight_decay=0)  # an int where a float is declared; null
    assert TrainerConfig(betas=[0.9, 0.95]).betas == (0.9, 0.95)  # a list (JSON, OmegaConf) as AdamW takes it


def test_numpy_numbers_are_taken_as_the_python_numbers_they_are():
    """A sweep's np.int64 seed or np.float32 lr (the removed trainer check took numbers.Integral
    and numbers.Real; the file's check refused them: review, s57); an integral float for an int
    stays refused."""
    import numpy as np

    c = TrainerConfig(seed=np.int64(3), total_steps=np.int64(50), lr=np.float32(0.5), kl_coef=np.int64(0))
    assert (c.seed, c.total_steps, c.lr, c.kl_coef) == (3, 50, 0.5, 0.0)
    assert [type(v) for v in (c.seed, c.total_steps, c.lr, c.kl_coef)] == [int, int, float, float]
    with pytest.raises(ValueError, match="trainer.seed: expected int, got float64"):
        TrainerConfig(seed=np.float64(3.0))
