"""Trainer behaviour the rest of the suite let through when changed by one line (mutation review,
session 56): rollout rejection sampling never keeps an observation token, and the logged
statistics leave them out."""
import dataclasses

import torch

from tests.test_multi_turn_trainer import multi_turn, setup  # noqa: F401
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer.step_math import prepare_batch, train_terms

RS = dict(algorithm="grpo", rollout_is="token", rollout_is_threshold=1.5,
          rollout_rs="token_k1,seq_mean_k1", rollout_rs_threshold="0.5_2.0,0.8_1.25")


def test_rollout_rs_never_keeps_an_observation_token(setup):  # noqa: F811
    """Under rollout_rs a multi-turn sample's observation tokens stay out of every loss term
    (correct_sample spreads the rejection mask with False there): moving their advantages by
    100 changes neither the loss nor the gradient, and they are never in ``keep``."""
    model_dir, task, samples, prompts, groups, _ = setup
    w = TrainerWorker(TrainerConfig(kl_coef=0.1, entropy_coef=0.01, **RS), model_dir, task, device="cpu")
    w.begin_iteration(0, prompts, groups)
    mt = multi_turn(samples)
    items = prepare_batch(w, mt)
    for p, s in zip(items, mt):
        assert not bool(p.keep[~s.loss_mask].any())
        p.adv = torch.linspace(-1.0, 1.0, p.num_tokens)
    moved = [dataclasses.replace(p, adv=torch.where(s.loss_mask, p.adv, p.adv + 100.0)) for p, s in zip(items, mt)]

    def loss_and_grad(batch):
        w.actor.zero_grad(set_to_none=True)
        loss = train_terms(w, batch)[0]
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in w.policy_parameters()]

    (a, ga), (b, gb) = loss_and_grad(items), loss_and_grad(moved)
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ga, gb))


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
