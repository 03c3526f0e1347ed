"""Multi-turn samples in the trainer (``Sample.loss_mask``, workers/trainer/multi_turn.py): the
environment's observation tokens stay in the forward's context but leave every loss term and
count, as verl's response_mask. The gradient equals a hand-written masked reference in each
loss_agg mode; the sampler's log-probs and the advantages at observation positions change
nothing (rollout correction, KL in the reward, GAE, REINFORCE++); an all-True mask is no mask; the
reward KL and GAE are over sampled tokens; bad masks and unsupported losses are refused; the
turns / observation metrics."""
import dataclasses
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from workers.model import load_pretrained
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer.advantages import gae
from workers.trainer.custom_advantage import batch_inputs
from workers.trainer.rollout import rollout
from workers.trainer.sample_checks import bad_sample_reason, check_caller
from workers.trainer.step_math import group_advantages, prepare_batch, train_terms
from tests.test_trainer_math_grad import group_adv, k3, seq_logits, token_pg, worker_grads
from tests.trainer_helpers import LengthRewardTask, synthetic_task, tiny_config, tiny_model_dir

torch.set_num_threads(1)


def observation_mask(i: int, n: int) -> torch.Tensor:
    """Sample i's mask over n tokens: an observation span inside (i % 3 == 1: at the end too)."""
    m = torch.ones(n, dtype=torch.bool)
    start = 3 + i % 3
    m[start:start + 2 + i % 2] = False
    if i % 3 == 1:
        m[n - 2:] = False  # the trajectory ends on a tool response
    return m


def turns_of(m: torch.Tensor) -> int:
    """Assistant turns: runs of sampled tokens."""
    return int(m[0]) + int((m[1:] & ~m[:-1]).sum())


def multi_turn(samples, obs_logprob=0.0, masks=None):
    """Copies of ``samples`` with observation spans, their sampler log-probs ``obs_logprob`` there."""
    out = []
    for i, s in enumerate(samples):
        m = observation_mask(i, s.output_ids.numel()) if masks is None else masks[i]
        out.append(replace(s, loss_mask=m, turns=turns_of(m),
                           logprobs=torch.where(m, s.logprobs, torch.full_like(s.logprobs, obs_logprob))))
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """3 groups x 3 samples of 12 tokens; sampler log-probs perturbed (every clip branch taken)."""
    model_dir, task = tiny_model_dir(tmp_path_factory, tiny_config()), LengthRewardTask(synthetic_task())
    w = TrainerWorker(TrainerConfig(), model_dir, task, device="cpu")
    samples, prompts, groups = rollout(w.actor, w.tokenizer, task.prompts("train")[:3], 3, 12, seed=1)
    g = torch.Generator().manual_seed(2)
    samples = [replace(s, logprobs=s.logprobs + 0.3 * torch.randn(s.logprobs.shape, generator=g)) for s in samples]
    assert all(s.output_ids.numel() == 12 for s in samples)
    return model_dir, task, samples, prompts, groups, w.tokenizer


def masked_reference(model_dir, task, tok, samples, prompts, cfg, masked=True):
    """grpo (KL loss k3, entropy) by hand over each sample's sampled tokens -> the gradient."""
    actor = load_pretrained(model_dir, "cpu", dtype=torch.float32)
    ref = load_pretrained(model_dir, "cpu", dtype=torch.float32)
    scores = [task.score(prompts[s.sample_id], tok.decode(s.output_ids)) for s in samples]
    adv = {}
    for gid in {s.group_id for s in samples}:
        members = [i for i, s in enumerate(samples) if s.group_id == gid]
        adv.update(zip(members, group_adv(cfg, [scores[i] for i in members])))
    per_seq = []
    for i, s in enumerate(samples):
        with torch.no_grad():
            ref_lp = torch.log_softmax(seq_logits(ref, s, 1.0), -1).gather(-1, s.output_ids[:, None]).squeeze(-1)
        logp_all = torch.log_softmax(seq_logits(actor, s, 1.0), -1)  # the whole output is context
        lp = logp_all.gather(-1, s.output_ids[:, None]).squeeze(-1)
        ts = [t for t in range(len(lp)) if not masked or bool(s.loss_mask[t])]
        terms = torch.stack([token_pg(lp[t], float(s.logprobs[t]), adv[i], cfg) + cfg.kl_coef * k3(lp[t], ref_lp[t])
                             + cfg.entropy_coef * (logp_all[t].exp() * logp_all[t]).sum() for t in ts])
        per_seq.append((terms.sum(), len(ts)))
    if cfg.loss_agg == "token_mean":
        loss = sum(x for x, _ in per_seq) / sum(n for _, n in per_seq)
    elif cfg.loss_agg == "seq_mean":
        loss = sum(x / n for x, n in per_seq) / len(per_seq)
    else:
        scale = cfg.loss_scale_factor if cfg.loss_agg == "seq_mean_token_sum_norm" else 1.0
        loss = sum(x for x, _ in per_seq) / len(per_seq) / scale
    loss.backward()
    return {"actor." + k: p.grad.clone() for k, p in actor.named_parameters()}


AGGS = {"token_mean": {}, "seq_mean": {}, "seq_mean_token_sum": {},
        "seq_mean_token_sum_norm": dict(loss_scale_factor=12)}


@pytest.mark.parametrize("agg", list(AGGS))
def test_gradient_equals_the_masked_reference_and_counts_are_of_sampled_tokens(setup, agg):
    model_dir, task, single, prompts, groups, tok = setup
    samples = multi_turn(single)
    cfg = TrainerConfig(grad_clip=0.0, algorithm="grpo", kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01,
                        loss_agg=agg, **AGGS[agg])
    want = masked_reference(model_dir, task, tok, samples, prompts, cfg)
    unmasked = masked_reference(model_dir, task, tok, single, prompts, cfg, masked=False)  # all tokens trained
    scale = max(v.abs().max().item() for v in want.values())
    assert max((want[k] - unmasked[k]).abs().max().item() for k in want) > 0.05 * scale  # the mask matters
    sampled = sum(int(s.loss_mask.sum()) for s in samples)
    for budget, order_seed, chunk in ((10**6, None, None), (25, 0, 2)):
        got, res = worker_grads(model_dir, task, samples, prompts, groups,
                                replace(cfg, max_tokens_per_microbatch=budget), order_seed, chunk)
        for k in want:
            err = (got[k] - want[k]).abs().max().item()
            assert err <= 1e-5 * scale, (agg, budget, k, err, scale)
        assert res.metrics["num_tokens"] == sampled and res.num_tokens == sampled
        assert res.metrics["num_seqs"] == len(samples)
        assert res.metrics["response_len_mean"] == 12  # observation tokens included, as verl's response_length


CONFIGS = {
    "grpo_kl_reward": dict(algorithm="grpo", kl_coef=0.1, kl_mode="reward", kl_estimator="k1"),
    "grpo_token_is_rs": dict(algorithm="grpo", rollout_is="token", rollout_is_threshold=1.5,
                             rollout_rs="token_k1,seq_mean_k1", rollout_rs_threshold="0.5_2.0,0.8_1.25"),
    "grpo_sequence_is_normalized": dict(algorithm="grpo", rollout_is="sequence", rollout_is_threshold=3.0,
                                        rollout_is_batch_normalize=True, kl_coef=0.1),
    "opo_seq_sum_rs": dict(algorithm="opo", rollout_rs="seq_sum_k2", rollout_rs_threshold=1.0),
    "ppo_gae_kl_reward": dict(algorithm="ppo", kl_coef=0.05, kl_mode="reward", gamma=0.99, gae_lambda=0.9),
    "rfpp_kl_reward": dict(algorithm="reinforce_plus_plus", gamma=0.9, kl_coef=0.05, kl_mode="reward"),
    "cispo_seq_mean": dict(algorithm="grpo", policy_loss="cispo", loss_agg="seq_mean", entropy_coef=0.01),
}


def same_metrics(a: dict, b: dict) -> bool:
    keys = [k for k in a if not k.endswith("_s")]  # timings
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in keys)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_observation_log_probs_change_nothing(setup, name):
    """The sampler's log-prob at an observation token (0.0 from the engine, or anything) is read by
    no term: the gradient and every metric (rollout_corr/*, reward_kl, num_tokens) are bitwise the
    same; the run trains, and under rejection an observation token is never counted rejected."""
    model_dir, task, samples, prompts, groups, _ = setup
    cfg = TrainerConfig(grad_clip=0.0, max_tokens_per_microbatch=30, **CONFIGS[name])
    runs = [worker_grads(model_dir, task, multi_turn(samples, lp), prompts, groups, cfg) for lp in (0.0, -7.0)]
    (g0, r0), (g1, r1) = runs
    assert all(torch.equal(g0[k], g1[k]) for k in g0)
    assert same_metrics(r0.metrics, r1.metrics), name
    m = r0.metrics
    assert m["step_skipped"] == 0 and math.isfinite(m["pg_loss"]) and m["turns_mean"] > 1
    if cfg.rollout_rs is not None:  # -7 on an observation token would be rejected were it read
        assert m["rollout_corr/rollout_rs_masked_fraction"] < 1


@pytest.mark.parametrize("extra", [{}, dict(rollout_is="token", rollout_is_threshold=1.5,
                                            rollout_rs="token_k1,seq_mean_k1",
                                            rollout_rs_threshold="0.5_2.0,0.8_1.25")])
def test_observation_advantages_change_nothing(setup, extra):
    """An advantage on an observation token passes no gradient (as a rejected token's); under
    rollout_rs too, whose rejection mask keeps no observation token (correct_sample spreads it
    with False there: the mutation review, s56)."""
    model_dir, task, samples, prompts, groups, _ = setup
    w = TrainerWorker(TrainerConfig(algorithm="grpo", kl_coef=0.1, entropy_coef=0.01, **extra), model_dir, task,
                      device="cpu")
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


@pytest.mark.parametrize("name", ["grpo_kl_reward", "grpo_token_is_rs", "ppo_gae_kl_reward"])
def test_an_all_true_mask_is_no_mask(setup, name):
    model_dir, task, samples, prompts, groups, _ = setup
    cfg = TrainerConfig(grad_clip=0.0, max_tokens_per_microbatch=30, **CONFIGS[name])
    full = [replace(s, loss_mask=torch.ones(s.output_ids.numel(), dtype=torch.bool)) for s in samples]
    (g0, r0), (g1, r1) = (worker_grads(model_dir, task, ss, prompts, groups, cfg) for ss in (samples, full))
    assert all(torch.equal(g0[k], g1[k]) for k in g0)
    assert same_metrics(r0.metrics, r1.metrics)
    assert r0.metrics["turns_mean"] == 1 and r0.metrics["observation_tokens_mean"] == 0


def test_reward_kl_and_gae_are_over_sampled_tokens(setup):
    """kl_mode reward: the sample's KL penalty and reward_kl are of its sampled tokens; the score
    sits on the policy's last token (not a trailing observation); GAE skips observation tokens
    (verl's): it is the GAE of the sampled tokens alone, 0 elsewhere."""
    model_dir, task, samples, prompts, groups, _ = setup
    cfg = TrainerConfig(algorithm="ppo", kl_coef=0.05, kl_mode="reward", kl_estimator="k1", gamma=0.99,
                        gae_lambda=0.9, whiten_advantages=False)
    w = TrainerWorker(cfg, model_dir, task, device="cpu")
    w.begin_iteration(0, prompts, groups)
    mt = multi_turn(samples, -7.0)
    for s, p in zip(mt, prepare_batch(w, mt)):
        m = s.loss_mask
        kl = (p.old_logp - p.ref_logp)[m]  # k1 over the sampled tokens
        assert p.reward_kl == pytest.approx(float(kl.mean()), abs=1e-6)
        assert p.reward == pytest.approx(p.score + p.overlong - 0.05 * float(kl.sum()), abs=1e-5)
        last = int(m.nonzero()[-1])
        want_r = torch.zeros(12)
        want_r[m] = -0.05 * kl
        want_r[last] += p.score + p.overlong
        assert torch.allclose(p.token_rewards, want_r, atol=1e-6) and bool((p.token_rewards[~m] == 0).all())
        adv, ret = gae(want_r[m], p.values[m], 0.99, 0.9)
        assert torch.allclose(p.adv[m], adv, atol=1e-6) and torch.allclose(p.returns[m], ret, atol=1e-6)
        assert bool((p.adv[~m] == 0).all())
        assert torch.equal(p.keep, m) and p.turns == turns_of(m)
        inputs = batch_inputs([p])  # a user's estimator's response_mask: the sampled tokens
        assert torch.equal(inputs[1][0].bool(), m)


def test_batch_normalisation_is_over_sampled_tokens(setup):
    model_dir, task, samples, prompts, groups, _ = setup
    cfg = TrainerConfig(algorithm="grpo", rollout_is="token", rollout_is_threshold=1.5, rollout_is_batch_normalize=True)
    mt = multi_turn(samples)
    w = TrainerWorker(cfg, model_dir, task, device="cpu")
    w.begin_iteration(0, prompts, groups)
    weights = torch.cat([p.tis_weight[p.sampled] for p in prepare_batch(w, mt)])
    assert bool((torch.cat([p.tis_weight[~p.sampled] for p in prepare_batch(w, mt)]) == 1).all())
    w = TrainerWorker(cfg, model_dir, task, device="cpu")
    w.begin_iteration(0, prompts, groups)
    w.receive(mt)
    m = w.step().metrics
    assert m["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(float(weights.double().mean()), rel=1e-6)


def test_bad_masks_are_refused_naming_the_sample(setup):
    _, _, samples, _, _, _ = setup
    s, cfg = samples[0], TrainerConfig()
    model = SimpleNamespace(vocab_size=300, max_position_embeddings=4096)
    bad = {"dtype torch.int64": torch.ones(12, dtype=torch.long), "shape (11,)": torch.ones(11, dtype=torch.bool),
           "masks every output token": torch.zeros(12, dtype=torch.bool)}
    for said, mask in bad.items():
        why = bad_sample_reason(replace(s, loss_mask=mask), 0, cfg, model)
        assert why is not None and why.startswith(f"sample {s.sample_id}: loss_mask") and said in why, why
    assert bad_sample_reason(replace(s, loss_mask=observation_mask(0, 12)), 0, cfg, model) is None


@pytest.mark.parametrize("kw", [dict(policy_loss="gspo", loss_agg="seq_mean"), dict(policy_loss="sapo", loss_agg="seq_mean"),
                                dict(policy_loss="clip_cov"), dict(rollout_bypass=True)])
def test_unmasked_losses_refuse_a_multi_turn_sample(setup, kw):
    _, _, samples, prompts, groups, _ = setup
    cfg = TrainerConfig(algorithm="grpo", **kw)
    mt = multi_turn(samples)[0]
    with pytest.raises(ValueError, match=f"sample {mt.sample_id}: a multi-turn sample.*ppo"):
        check_caller(mt, prompts, groups, 0, cfg, 0)
    check_caller(samples[0], prompts, groups, 0, cfg, 0)  # single-turn: fine
    check_caller(replace(samples[0], loss_mask=torch.ones(12, dtype=torch.bool)), prompts, groups, 0, cfg, 0)


def test_turn_and_observation_metrics(setup):
    model_dir, task, samples, prompts, groups, _ = setup
    mt = multi_turn(samples)
    w = TrainerWorker(TrainerConfig(algorithm="grpo"), model_dir, task, device="cpu")
    w.begin_iteration(0, prompts, groups)
    w.receive(mt)
    m = w.step().metrics
    assert m["turns_mean"] == pytest.approx(sum(s.turns for s in mt) / len(mt))
    assert m["observation_tokens_mean"] == pytest.approx(sum(int((~s.loss_mask).sum()) for s in mt) / len(mt))
    assert m["observation_tokens_mean"] > 0 and m["turns_mean"] > 1


def test_remax_returns_are_verls_on_sampled_tokens(setup):
    """remax with the KL in the reward: a sampled token's advantage is verl's masked return minus the
    greedy baseline (observation tokens carry no reward; they are left out of the loss)."""
    model_dir, task, samples, prompts, groups, _ = setup
    w = TrainerWorker(TrainerConfig(algorithm="remax", kl_coef=0.3, kl_mode="reward"), model_dir, task, device="cpu")
    w._prompts = prompts
    mt = multi_turn(samples)
    items = prepare_batch(w, mt)
    group_advantages(w.cfg, items, 0.5)
    for s, p in zip(mt, items):
        m = s.loss_mask.float()
        assert bool((p.token_rewards[~s.loss_mask] == 0).all()) and bool((p.token_rewards[s.loss_mask] != 0).all())
        verl = (p.token_rewards * m).flip(-1).cumsum(-1).flip(-1) - 0.5 * m  # compute_remax_outcome_advantage
        assert torch.allclose(p.adv[s.loss_mask], verl[s.loss_mask], atol=1e-5)


def test_a_micro_batch_mixing_no_tool_call_and_multi_turn_samples_trains_sampled_tokens_only(setup):
    """In a multi-turn run a trajectory with no tool call has an all-True mask (keep None); packed
    beside samples with observation tokens, those still leave every loss term (item_mask)."""
    model_dir, task, single, prompts, groups, tok = setup
    masks = [torch.ones(12, dtype=torch.bool) if i % 2 == 0 else observation_mask(i, 12) for i in range(len(single))]
    samples = multi_turn(single, masks=masks)
    cfg = TrainerConfig(grad_clip=0.0, algorithm="grpo", kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01,
                        loss_agg="token_mean", max_tokens_per_microbatch=10**6)
    want = masked_reference(model_dir, task, tok, samples, prompts, cfg)
    got, res = worker_grads(model_dir, task, samples, prompts, groups, cfg)
    scale = max(v.abs().max().item() for v in want.values())
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5 * scale
    assert res.metrics["num_tokens"] == sum(int(m.sum()) for m in masks)
