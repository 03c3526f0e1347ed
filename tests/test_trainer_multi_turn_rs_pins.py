"""Trainer behaviour the rest of the suite let through when changed by one line (mutation review,
session 56): the logged statistics leave observation tokens out (that rollout rejection sampling
keeps none: tests/test_multi_turn_trainer.py)."""
import dataclasses

import torch

from tests.test_multi_turn_trainer import multi_turn, setup  # noqa: F401
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer.step_math import prepare_batch, train_terms

RS = dict(algorithm="grpo", rollout_is="token", rollout_is_threshold=1.5,
          rollout_rs="token_k1,seq_mean_k1", rollout_rs_threshold="0.5_2.0,0.8_1.25")


def test_statistics_leave_observation_tokens_out(setup):  # noqa: F811
    """advantage_sum (-> advantage_mean) and values_max / returns_max are over the kept tokens,
    as advantage_max is: numbers put on observation tokens change none of train_terms' stats."""
    model_dir, task, samples, prompts, groups, _ = setup
    w = TrainerWorker(TrainerConfig(algorithm="ppo"), model_dir, task, device="cpu")
    w.begin_iteration(0, prompts, groups)
    mt = multi_turn(samples)
    items = prepare_batch(w, mt)
    moved = [dataclasses.replace(p, adv=torch.where(s.loss_mask, p.adv, p.adv + 100.0),
                                 values=torch.where(s.loss_mask, p.values, p.values + 100.0),
                                 returns=torch.where(s.loss_mask, p.returns, p.returns + 100.0))
             for p, s in zip(items, mt)]
    with torch.no_grad():
        a, b = train_terms(w, items)[1], train_terms(w, moved)[1]
    for k in ("advantage_sum", "advantage_max", "values_sum", "values_max", "returns_max", "returns_sum"):
        assert torch.equal(a[k], b[k]), k
