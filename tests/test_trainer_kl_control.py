"""The adaptive KL coefficient of ``trainer.kl_mode: reward`` (``trainer.kl_target`` /
``kl_horizon``; verl's ``algorithm.kl_ctrl.type: adaptive``): the update rule, what a trainer
step does with it (the rewards use this iteration's beta; the next iteration gets the updated
one), its metrics, and that a checkpoint carries it."""
import pytest
import torch

from controller.config import ConfigError, from_dict
from workers.tasks import make_task
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer.bootstrap import build_model_dir
from workers.trainer.kl import KL_ESTIMATORS
from workers.trainer.kl_control import KLCoefficient
from workers.trainer.rollout import rollout
from tests.trainer_helpers import LengthRewardTask, tiny_config


def test_the_update_rule():
    beta = KLCoefficient(0.1, target=0.05, horizon=100)
    assert beta.update(0.06, 50) == pytest.approx(0.1 * (1 + 0.2 * 0.5))  # kl / target - 1 = 0.2
    beta = KLCoefficient(0.1, target=0.05, horizon=100)
    assert beta.update(1.0, 50) == pytest.approx(0.1 * (1 + 0.2 * 0.5))  # error clipped to +0.2
    beta = KLCoefficient(0.1, target=0.05, horizon=100)
    assert beta.update(0.0, 50) == pytest.approx(0.1 * (1 - 0.2 * 0.5))  # and to -0.2
    beta = KLCoefficient(0.1, target=0.05, horizon=100)
    assert beta.update(0.045, 10) == pytest.approx(0.1 * (1 - 0.1 * 0.1))
    assert KLCoefficient(0.1).update(5.0, 50) == 0.1  # no target: fixed
    assert KLCoefficient(0.1, target=0.05).update(5.0, 0) == 0.1  # no samples: unchanged
    # a non-finite KL (one sample's) is not folded in: a NaN beta would make every later reward NaN
    assert KLCoefficient(0.1, target=0.05).update(float("nan"), 50) == 0.1
    assert KLCoefficient(0.1, target=0.05).update(float("inf"), 50) == 0.1


def _worker(tmp_path, **kw):
    torch.set_num_threads(1)
    task = LengthRewardTask(make_task("synthetic", max_terms=3, num_train=64, num_test=16))
    model_dir = str(build_model_dir(tmp_path / "m", task.base, tiny_config(), seed=0)[0])
    cfg = TrainerConfig(**{"algorithm": "grpo", "kl_mode": "reward", "kl_coef": 0.1, "lr": 1e-3, **kw})
    w = TrainerWorker(cfg, model_dir, task, device="cpu")
    with torch.no_grad():  # the policy away from the reference: a KL to penalise from the start
        gen = torch.Generator().manual_seed(1)
        for p in w.actor.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return w, task, model_dir


def _iteration(w, task, it):
    samples, prompts, groups = rollout(w.actor, w.tokenizer, task.prompts("train")[:4], 4, 8, seed=it,
                                       version=w.version)
    w.begin_iteration(it, prompts, groups)
    w.receive(samples)
    return samples, {p.sample_id: p for p in w.buffer.ready}


def test_rewards_use_this_iterations_beta_and_the_next_gets_the_update(tmp_path):
    w, task, _ = _worker(tmp_path, kl_target=0.01, kl_horizon=40)
    betas = []
    for it in range(2):
        samples, items = _iteration(w, task, it)
        assert len(items) == len(samples)
        beta = w.kl.value
        kls = []
        for s in samples:
            p = items[s.sample_id]
            kl = KL_ESTIMATORS["k3"](p.old_logp, p.ref_logp)  # [L] the default estimator
            assert p.reward_kl == pytest.approx(float(kl.mean()), rel=1e-5)
            assert p.reward == pytest.approx(p.score - beta * float(kl.sum()), rel=1e-5, abs=1e-6)
            kls.append(float(kl.mean()))
        res = w.step()
        mean_kl = sum(kls) / len(kls)
        assert mean_kl > 0.01  # above the target: beta grows
        assert res.metrics["reward_kl"] == pytest.approx(mean_kl, rel=1e-5)
        assert res.metrics["kl_coef"] == pytest.approx(beta)
        error = min(max(mean_kl / 0.01 - 1, -0.2), 0.2)
        assert w.kl.value == pytest.approx(beta * (1 + error * len(samples) / 40))
        betas.append(beta)
    assert betas[0] == 0.1 and betas[1] > 0.1


def test_a_fixed_beta_stays_and_is_reported(tmp_path):
    w, task, _ = _worker(tmp_path)
    for it in range(2):
        _iteration(w, task, it)
        res = w.step()
        assert res.metrics["kl_coef"] == 0.1 and res.metrics["reward_kl"] > 0
    assert w.kl.value == 0.1


def test_the_adapted_beta_is_checkpointed(tmp_path):
    w, task, model_dir = _worker(tmp_path, kl_target=0.01)
    _iteration(w, task, 0)
    w.step()
    assert w.kl.value != 0.1
    w.save_checkpoint(str(tmp_path / "ck"))
    again = TrainerWorker(w.cfg, model_dir, task, device="cpu")
    assert again.kl.value == 0.1
    again.load_checkpoint(str(tmp_path / "ck"))
    assert again.kl.value == w.kl.value
    # a run resumed with a fixed beta uses its own trainer.kl_coef, not the saved one
    fixed = TrainerWorker(TrainerConfig(algorithm="grpo", kl_mode="reward", kl_coef=0.2), model_dir, task,
                          device="cpu")
    fixed.load_checkpoint(str(tmp_path / "ck"))
    assert fixed.kl.value == 0.2


def test_an_adaptive_resume_of_a_fixed_run_starts_from_its_own_kl_coef(tmp_path):
    """A checkpoint of a run with a fixed beta (or the KL in the loss) carries no adapted beta:
    a resume that turns kl_target on starts from its own trainer.kl_coef, not the old run's."""
    w, task, model_dir = _worker(tmp_path)  # fixed beta 0.1
    _iteration(w, task, 0)
    w.step()
    w.save_checkpoint(str(tmp_path / "ck"))
    adaptive = TrainerWorker(TrainerConfig(algorithm="grpo", kl_mode="reward", kl_coef=0.3, kl_target=0.01),
                             model_dir, task, device="cpu")
    adaptive.load_checkpoint(str(tmp_path / "ck"))
    assert adaptive.kl.value == 0.3


def test_per_token_rewards_use_the_adapted_beta(tmp_path):
    """REINFORCE++'s per-token rewards (as GAE's) take -beta * KL with the current beta, not kl_coef."""
    w, task, _ = _worker(tmp_path, algorithm="reinforce_plus_plus", kl_target=0.01, whiten_advantages=False)
    w.kl.value = 0.37  # as if adapted
    samples, items = _iteration(w, task, 0)
    for s in samples:
        p = items[s.sample_id]
        want = -0.37 * KL_ESTIMATORS["k3"](p.old_logp, p.ref_logp)  # [L]
        want[-1] += p.score
        assert torch.allclose(p.token_rewards, want, rtol=1e-5, atol=1e-7)
        assert p.reward == pytest.approx(float(want.sum()), rel=1e-5, abs=1e-6)  # score - beta * sum KL


def test_config():
    cfg = from_dict({"trainer": {"kl_mode": "reward", "kl_coef": 0.05, "kl_target": 0.02, "kl_horizon": 500}})
    assert (cfg.trainer.kl_target, cfg.trainer.kl_horizon) == (0.02, 500)
    with pytest.raises(ConfigError, match="trainer.kl_target .* needs trainer.kl_mode: reward"):
        from_dict({"trainer": {"kl_coef": 0.05, "kl_target": 0.02}})
    with pytest.raises(ConfigError, match=r"trainer.kl_coef > 0 \(got 0.0\)"):
        from_dict({"trainer": {"kl_mode": "reward", "kl_target": 0.02}})
    with pytest.raises(ConfigError, match="trainer.kl_horizon .* is only used with trainer.kl_target > 0"):
        from_dict({"trainer": {"kl_mode": "reward", "kl_coef": 0.05, "kl_horizon": 500}})
    with pytest.raises(ConfigError, match="trainer.kl_target"):
        from_dict({"trainer": {"kl_mode": "reward", "kl_coef": 0.05, "kl_target": -1.0}})
    with pytest.raises(ConfigError, match="trainer.kl_horizon"):
        from_dict({"trainer": {"kl_mode": "reward", "kl_coef": 0.05, "kl_target": 0.1, "kl_horizon": 0}})
    # 64 samples an iteration: a horizon of 12 would take beta to 1 - 0.2 x 64 / 12 < 0
    big = {"train": {"batch_prompts": 16, "group_size": 4}}
    with pytest.raises(ConfigError, match=r"trainer.kl_horizon \(12\) must be > 0.2 x the samples of an iteration "
                                          r"\(64 = train.batch_prompts x train.group_size\).* = -0.0667"):
        from_dict({**big, "trainer": {"kl_mode": "reward", "kl_coef": 0.05, "kl_target": 0.1, "kl_horizon": 12}})
    assert from_dict({**big, "trainer": {"kl_mode": "reward", "kl_coef": 0.05, "kl_target": 0.1,
                                         "kl_horizon": 13}}).trainer.kl_horizon == 13
