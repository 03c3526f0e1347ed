"""``trainer.tis_cap``: truncated importance sampling from the sampler's distribution to the
trainer's old policy (verl's ``tis_imp_ratio_cap``). Each token's weight is
``min(pi_old / pi_sampler, cap)`` with pi_old the trainer's own log-prob at receive time, and
the weighted loss is the unweighted one with every token's advantage scaled by its weight."""
import dataclasses
import math

import pytest
import torch

from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer.rollout import rollout
from workers.trainer.step_math import prepare_batch, train_terms
from tests.trainer_helpers import LengthRewardTask, synthetic_task, tiny_config, tiny_model_dir

torch.set_num_threads(1)
CAP = 2.0


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir, task = tiny_model_dir(tmp_path_factory, tiny_config(layers=2)), LengthRewardTask(synthetic_task())
    w = TrainerWorker(TrainerConfig(algorithm="grpo", tis_cap=CAP, seed=0), model_dir, task, device="cpu")
    samples, prompts, groups = rollout(w.actor, w.tokenizer, task.prompts("train")[:2], 2, 6, seed=3)
    # the sampler's log-probs moved by known amounts: as if drawn from another distribution
    shifts = []
    for i, s in enumerate(samples):
        d = torch.tensor([(-0.5, -1.0, 0.3)[(i + j) % 3] for j in range(s.output_ids.numel())])
        s.logprobs = s.logprobs + d
        shifts.append(d)
    w.begin_iteration(0, prompts, groups)  # prepare_batch reads the iteration's prompts
    return w, samples, shifts, (model_dir, task, prompts, groups)


def test_weights_are_the_capped_ratio_of_trainer_and_sampler(setup):
    w, samples, shifts, _ = setup
    prepared = prepare_batch(w, samples)
    for p, s, d in zip(prepared, samples, shifts):
        # the trainer's old log-probs are its own (here the rollout's policy: equal to the sampler's unshifted)
        assert torch.allclose(p.old_logp, s.logprobs - d, atol=1e-5)
        want = torch.exp(-d).clamp(max=CAP)  # shift -0.5 -> 1.65, -1.0 -> 2.72 capped at 2, +0.3 -> 0.74
        assert torch.allclose(p.tis_weight, want, atol=1e-4), (p.tis_weight, want)
    assert {round(v, 2) for p in prepared for v in p.tis_weight.tolist()} == {1.65, 2.0, 0.74}


def test_the_weighted_loss_is_the_loss_with_weighted_advantages(setup):
    w, samples, _, _ = setup
    items = prepare_batch(w, samples)
    for p in items:
        p.adv = torch.linspace(-1.0, 1.0, p.num_tokens)
    loss, stats = train_terms(w, items)
    plain = dataclasses.replace(w.cfg, tis_cap=0.0)
    scaled = [dataclasses.replace(p, adv=p.adv * p.tis_weight, tis_weight=None) for p in items]
    w_cfg, w.cfg = w.cfg, plain
    try:
        loss_ref, stats_ref = train_terms(w, scaled)
    finally:
        w.cfg = w_cfg
    assert torch.allclose(loss, loss_ref, rtol=1e-5, atol=1e-6)
    weights = torch.cat([p.tis_weight for p in items])
    assert float(stats["tis_weight"]) == pytest.approx(float(weights.sum()), rel=1e-5)  # token_mean: a token sum
    assert "tis_weight" not in stats_ref


def test_a_step_reports_the_mean_weight(setup):
    w, samples, _, (model_dir, task, prompts, groups) = setup
    fresh = TrainerWorker(w.cfg, model_dir, task, device="cpu")
    fresh.begin_iteration(0, prompts, groups)
    fresh.receive(samples)
    m = fresh.step().metrics
    weights = torch.cat([p.tis_weight for p in prepare_batch(w, samples)])
    assert m["tis_weight"] == pytest.approx(float(weights.mean()), rel=1e-4)
    assert math.isfinite(m["pg_loss"]) and m["num_samples"] == len(samples)


def test_a_negative_cap_is_refused_and_a_cap_recomputes_old_logprobs():
    with pytest.raises(ValueError, match="trainer.tis_cap must be >= 0"):
        TrainerConfig(tis_cap=-1.0)
    assert TrainerConfig(tis_cap=2.0).recomputes_old_logprobs
    assert not TrainerConfig().recomputes_old_logprobs


def test_a_sequence_rejected_whole_counts_in_seq_means_divisor(setup):
    """``rollout_rs`` rejects sequences after the advantages: under ``seq_mean`` a rejected one adds
    0 to the loss and still counts in its divisor, as verl's ``agg_loss`` with the global batch
    size (only sequences with a kept token were counted before: a loss n_all / n_kept too big)."""
    w, samples, _, _ = setup
    items = prepare_batch(w, samples)
    for p in items:
        p.adv = torch.linspace(-1.0, 1.0, p.num_tokens)
        p.keep = torch.ones(p.num_tokens, dtype=torch.bool)
    items[1].keep = torch.zeros(items[1].num_tokens, dtype=torch.bool)
    w_cfg, w.cfg = w.cfg, dataclasses.replace(w.cfg, loss_agg="seq_mean")
    try:
        loss, stats = train_terms(w, items)
        loss_kept, stats_kept = train_terms(w, items[:1] + items[2:])
    finally:
        w.cfg = w_cfg
    assert float(stats["num_seqs"]) == len(items) and float(stats_kept["num_seqs"]) == len(items) - 1
    assert torch.allclose(loss, loss_kept, rtol=1e-5, atol=1e-7)  # the same sum, divided by one more
