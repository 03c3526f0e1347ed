"""The trainer's gradient == an independent whole-batch reference, whatever the micro-batching.

The reference recomputes everything per sample with plain loops (advantages, clipped ratio,
KL, entropy, GAE and its whitening over the whole batch's tokens, clipped value loss), forms ONE
loss over the whole batch (token mean over all the batch's tokens, the mean over sequences of
per-sequence token means or token sums, or of token sums / loss_scale_factor) and
backpropagates it. The worker's gradient (after the all-reduce and the divide, before the
optimizer step) must equal it for any ``max_tokens_per_microbatch``. The sampler log-probs
are perturbed so that the ratio is off 1 and every clip branch is taken."""
import math
import random
from dataclasses import replace

import pytest
import torch

from workers.model import CausalAttention, ModelConfig, load_pretrained
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer.critic import ValueModel
from workers.trainer.packing import pack
from workers.trainer.rollout import rollout
from workers.trainer.step_math import prepare_batch
from tests.trainer_helpers import LengthRewardTask, synthetic_task, tiny_model_dir

torch.set_num_threads(1)
TINY = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory, TINY)


@pytest.fixture(scope="module")
def task():
    return LengthRewardTask(synthetic_task())


def draw(model_dir, task, temperature=1.0, noise=0.3):
    """4 groups x 3 samples; sampler log-probs perturbed (an off-policy behaviour policy)."""
    w = TrainerWorker(TrainerConfig(), model_dir, task, device="cpu")
    samples, prompts, groups = rollout(w.actor, w.tokenizer, task.prompts("train")[:4], 3, 12,
                                       temperature=temperature, seed=1)
    g = torch.Generator().manual_seed(2)
    samples = [replace(s, logprobs=s.logprobs + noise * torch.randn(s.logprobs.shape, generator=g)) for s in samples]
    return samples, prompts, groups, w.tokenizer


# ---- the reference: per sample, plain loops --------------------------------------------------
def seq_logits(model, s, temperature):
    """-> logits [L, V] predicting s.output_ids, at the temperature."""
    ids = torch.cat([s.prompt_ids, s.output_ids]).long()
    hidden = model(ids, torch.arange(len(ids)), CausalAttention([0, len(ids)]))
    p = len(s.prompt_ids)
    return model.logits(hidden[p - 1: p - 1 + len(s.output_ids)]).float() / temperature


def seq_values(critic, s):
    b = pack([s.prompt_ids], [s.output_ids], torch.device("cpu"))
    return critic(b)  # [L]


def loop_gae(r, v, gamma, lam):
    adv, last = [0.0] * len(r), 0.0
    for t in reversed(range(len(r))):
        nv = v[t + 1] if t + 1 < len(r) else 0.0
        last = r[t] + gamma * nv - v[t] + gamma * lam * last
        adv[t] = last
    return adv


def k1(lp, ref):
    return lp - ref


def k3(lp, ref):
    """verl's low_var_kl: log-ratio clamped to +-20, the estimate to +-10."""
    if isinstance(lp, float):
        x = min(max(ref - lp, -20.0), 20.0)
        return min(max(math.exp(x) - x - 1, -10.0), 10.0)
    x = (ref - lp).clamp(-20, 20)
    return (torch.exp(x) - x - 1).clamp(-10, 10)


def loop_whiten(advs):
    """verl's masked_whiten over every token of the batch (unbiased variance)."""
    flat = [a for adv in advs for a in adv]
    mean = sum(flat) / len(flat)
    var = sum((a - mean) ** 2 for a in flat) / (len(flat) - 1)
    return [[(a - mean) / math.sqrt(var + 1e-8) for a in adv] for adv in advs]


def group_adv(cfg, rewards):
    g = len(rewards)
    mean = sum(rewards) / g
    if cfg.algorithm == "rloo":
        return [0.0] * g if g < 2 else [r - (sum(rewards) - r) / (g - 1) for r in rewards]
    if g < 2:
        return [0.0]
    if cfg.algorithm == "reinforce_plus_plus_baseline" or not cfg.grpo_std_normalize:  # centred only (Dr. GRPO)
        return [r - mean for r in rewards]
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (g - 1))
    return [(r - mean) / (std + cfg.adv_eps) for r in rewards]


def token_pg(lp, old, a, cfg):
    r = torch.exp(lp - old)
    loss = torch.maximum(-a * r, -a * r.clamp(1 - cfg.clip_low, 1 + cfg.clip_high))
    if cfg.dual_clip is not None and a < 0:
        loss = torch.minimum(loss, torch.tensor(-a * cfg.dual_clip))
    return loss


def reference_grads(model_dir, task, tok, samples, prompts, cfg):
    actor = load_pretrained(model_dir, "cpu", dtype=torch.float32)
    ref = load_pretrained(model_dir, "cpu", dtype=torch.float32)
    critic = ValueModel(actor) if cfg.algorithm == "ppo" else None
    kl_fn = {"k1": k1, "k3": k3}[cfg.kl_estimator]
    T = cfg.temperature
    scores = [task.score(prompts[s.sample_id], tok.decode(s.output_ids)) for s in samples]
    with torch.no_grad():
        ref_lp = [torch.log_softmax(seq_logits(ref, s, T), -1).gather(-1, s.output_ids[:, None]).squeeze(-1)
                  for s in samples]
    in_reward = cfg.kl_mode == "reward" and cfg.kl_coef > 0
    # advantages
    adv = [None] * len(samples)
    if cfg.algorithm in ("ppo", "reinforce_plus_plus"):
        old_v = []
        for i, s in enumerate(samples):
            with torch.no_grad():
                v = seq_values(critic, s).tolist() if critic is not None else [0.0] * len(s.output_ids)
            r = [0.0] * len(v)
            if in_reward:
                r = [-cfg.kl_coef * kl_fn(o, q) for o, q in zip(s.logprobs.tolist(), ref_lp[i].tolist())]
            r[-1] += scores[i]
            a = loop_gae(r, v, cfg.gamma, cfg.gae_lambda if critic is not None else 1.0)  # REINFORCE++: returns
            adv[i] = a
            old_v.append((torch.tensor(v), torch.tensor([x + y for x, y in zip(a, v)])))  # returns: not whitened
        if cfg.whiten_advantages is not False:
            adv = loop_whiten(adv)
    else:
        rewards = [scores[i] - (cfg.kl_coef * sum(kl_fn(o, q) for o, q in zip(s.logprobs.tolist(), ref_lp[i].tolist()))
                                if in_reward else 0.0) for i, s in enumerate(samples)]
        for gid in {s.group_id for s in samples}:
            members = [i for i, s in enumerate(samples) if s.group_id == gid]
            for i, a in zip(members, group_adv(cfg, [rewards[i] for i in members])):
                adv[i] = [a] * len(samples[i].output_ids)
        if cfg.algorithm == "reinforce_plus_plus_baseline" and cfg.whiten_advantages is not False:
            adv = loop_whiten(adv)
    # one loss over the whole batch
    per_seq = []  # (sum of token terms, number of tokens) per sample
    for i, s in enumerate(samples):
        logits = seq_logits(actor, s, T)  # [L, V]
        logp_all = torch.log_softmax(logits, -1)
        lp = logp_all.gather(-1, s.output_ids[:, None]).squeeze(-1)  # [L]
        terms = torch.stack([token_pg(lp[t], float(s.logprobs[t]), adv[i][t], cfg) for t in range(len(lp))])
        if cfg.kl_mode == "loss" and cfg.kl_coef > 0:
            terms = terms + cfg.kl_coef * kl_fn(lp, ref_lp[i])
        if cfg.entropy_coef > 0:
            terms = terms - cfg.entropy_coef * (-(logp_all.exp() * logp_all).sum(-1))
        if critic is not None:
            v = seq_values(critic, s)
            ov, ret = old_v[i]
            vc = ov + (v - ov).clamp(-cfg.value_clip, cfg.value_clip)
            terms = terms + cfg.value_coef * 0.5 * torch.maximum((v - ret) ** 2, (vc - ret) ** 2)
        per_seq.append((terms.sum(), len(lp)))
    if cfg.loss_agg == "token_mean":
        loss = sum(x for x, _ in per_seq) / sum(n for _, n in per_seq)
    elif cfg.loss_agg == "seq_mean":
        loss = sum(x / n for x, n in per_seq) / len(per_seq)
    elif cfg.loss_agg == "seq_mean_token_sum":
        loss = sum(x for x, _ in per_seq) / len(per_seq)
    else:  # seq_mean_token_sum_norm (Dr. GRPO)
        loss = sum(x / cfg.loss_scale_factor for x, _ in per_seq) / len(per_seq)
    loss.backward()
    out = {"actor." + k: p.grad.clone() for k, p in actor.named_parameters()}
    if critic is not None:
        out.update({"critic." + k: p.grad.clone() for k, p in critic.named_parameters()})
    return out


def worker_grads(model_dir, task, samples, prompts, groups, cfg, order_seed=None, chunk=None):
    """The worker's gradient at its optimizer step (after all-reduce + divide; grad_clip 0)."""
    w = TrainerWorker(cfg, model_dir, task, device="cpu")
    got = {}

    def capture(optimizer, args, kwargs):
        got.update({"actor." + n: p.grad.clone() for n, p in w.actor.named_parameters()})
        if w.critic is not None:
            got.update({"critic." + n: p.grad.clone() for n, p in w.critic.named_parameters()})

    w.optimizer.register_step_pre_hook(capture)
    order = list(samples)
    if order_seed is not None:
        random.Random(order_seed).shuffle(order)
    chunk = chunk or len(order)
    w.begin_iteration(0, prompts, groups)
    for i in range(0, len(order), chunk):
        w.receive(order[i:i + chunk])
    res = w.step()
    assert res.metrics["step_skipped"] == 0 and got
    return got, res


CONFIGS = {
    "grpo_token_mean_kl_loss_entropy": dict(algorithm="grpo", kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01,
                                            clip_high=0.28),
    "rloo_seq_mean_kl_reward": dict(algorithm="rloo", loss_agg="seq_mean", kl_coef=0.1, kl_estimator="k1",
                                    kl_mode="reward"),
    # PPO whitens its GAE advantages over the batch by default (as verl)
    "ppo_dual_clip_kl_reward": dict(algorithm="ppo", kl_coef=0.05, kl_mode="reward", dual_clip=3.0, gamma=0.99,
                                    gae_lambda=0.9, value_clip=0.05),
    "ppo_seq_mean_kl_loss": dict(algorithm="ppo", loss_agg="seq_mean", kl_coef=0.1, kl_estimator="k1"),
    "ppo_no_whiten_kl_reward": dict(algorithm="ppo", whiten_advantages=False, kl_coef=0.05, kl_mode="reward",
                                    dual_clip=3.0, value_clip=0.05),
    "ppo_seq_mean_token_sum_norm_k3": dict(algorithm="ppo", loss_agg="seq_mean_token_sum_norm", loss_scale_factor=12,
                                           kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01),
    "grpo_seq_mean_token_sum": dict(algorithm="grpo", loss_agg="seq_mean_token_sum", kl_coef=0.1, kl_mode="reward"),
    "grpo_temperature": dict(algorithm="grpo", temperature=0.6, kl_coef=0.1, entropy_coef=0.01),
    # Dr. GRPO: no group std division (rewards' std is ~0.4: dividing changes the gradient)
    "grpo_dr_no_std_normalize": dict(algorithm="grpo", grpo_std_normalize=False, loss_agg="seq_mean_token_sum_norm",
                                     loss_scale_factor=12, kl_coef=0.1),
    # REINFORCE++: discounted per-token returns (KL in the reward), whitened over the batch
    "rfpp_gamma_kl_reward": dict(algorithm="reinforce_plus_plus", gamma=0.9, kl_coef=0.05, kl_mode="reward",
                                 kl_estimator="k1"),
    "rfpp_baseline_kl_loss": dict(algorithm="reinforce_plus_plus_baseline", kl_coef=0.1, clip_high=0.28),
    "rfpp_baseline_no_whiten": dict(algorithm="reinforce_plus_plus_baseline", whiten_advantages=False,
                                    kl_coef=0.05, kl_mode="reward"),
    # an adv_eps comparable to the groups' reward std, so it must reach the advantages
    "grpo_adv_eps": dict(algorithm="grpo", adv_eps=0.5, kl_coef=0.1, kl_estimator="k1"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gradient_equals_whole_batch_reference_for_any_microbatching(model_dir, task, name):
    kw = CONFIGS[name]
    samples, prompts, groups, tok = draw(model_dir, task, temperature=kw.get("temperature", 1.0))
    cfg = TrainerConfig(grad_clip=0.0, **kw)
    want = reference_grads(model_dir, task, tok, samples, prompts, cfg)
    scale = max(v.abs().max().item() for v in want.values())
    assert scale > 1e-3  # a real gradient
    for budget, order_seed, chunk in ((10**6, None, None), (25, 0, 1), (1, 1, 5)):
        got, res = worker_grads(model_dir, task, samples, prompts, groups,
                                replace(cfg, max_tokens_per_microbatch=budget), order_seed, chunk)
        assert 0 < res.metrics["clipfrac"] < 1  # the clip branches are exercised; a fraction in every mode
        assert 0.5 < res.metrics["ratio"] < 2  # a mean ratio, not a per-sequence sum of ratios
        assert set(got) == set(want)
        for k in want:
            err = (got[k] - want[k]).abs().max().item()
            assert err <= 1e-5 * scale, (name, budget, k, err, scale)


def test_dual_clip_bounds_the_loss_of_negative_advantage_tokens(model_dir, task):
    """Sampler log-probs perturbed enough that tokens with A < 0 reach ratio > dual_clip: the
    dual clip caps their loss at -c * A (no gradient), so it changes the gradient, and the
    worker's equals the reference that applies it (not the one without it)."""
    samples, prompts, groups, tok = draw(model_dir, task, noise=1.0)
    cfg = TrainerConfig(grad_clip=0.0, algorithm="grpo", dual_clip=2.0, kl_coef=0.1)
    want = reference_grads(model_dir, task, tok, samples, prompts, cfg)
    plain = reference_grads(model_dir, task, tok, samples, prompts, replace(cfg, dual_clip=None))
    scale = max(v.abs().max().item() for v in want.values())
    assert scale > 1e-3
    assert max((want[k] - plain[k]).abs().max().item() for k in want) > 0.05 * scale  # the dual clip matters
    got, _ = worker_grads(model_dir, task, samples, prompts, groups, replace(cfg, max_tokens_per_microbatch=25), 0, 5)
    assert set(got) == set(want)
    for k in want:
        err = (got[k] - want[k]).abs().max().item()
        assert err <= 1e-5 * scale, (k, err, scale)


def test_whitening_defers_all_training_to_step(model_dir, task):
    """With whitening, no sample's advantage is final until the last one arrives, so receive()
    trains nothing, even when micro-batches fill (and step() trains them all, after the
    whitening); without it, receive() trains as samples stream in."""
    samples, prompts, groups, _ = draw(model_dir, task)
    for whiten, trained in ((None, False), (False, True)):
        w = TrainerWorker(TrainerConfig(algorithm="ppo", whiten_advantages=whiten, max_tokens_per_microbatch=1),
                          model_dir, task, device="cpu")
        assert w.cfg.whiten == (whiten is None)
        w.begin_iteration(0, prompts, groups)
        w.receive(samples)
        assert any(p.grad is not None for p in w.actor.parameters()) == trained
        assert w.step().metrics["updates"] == 1.0


def test_whitening_is_for_gae_and_reinforce_plus_plus_only():
    assert TrainerConfig(algorithm="ppo").whiten and not TrainerConfig(algorithm="grpo").whiten
    assert TrainerConfig(algorithm="reinforce_plus_plus").whiten  # verl whitens both REINFORCE++ estimators
    assert TrainerConfig(algorithm="reinforce_plus_plus_baseline").whiten
    assert not TrainerConfig(algorithm="reinforce_plus_plus", whiten_advantages=False).whiten
    with pytest.raises(ValueError, match="trainer.whiten_advantages: true is only used by algorithm 'ppo'"):
        TrainerConfig(algorithm="rloo", whiten_advantages=True)


def test_temperature_makes_on_policy_ratio_one(model_dir, task):
    """Samples drawn at T by the trainer's own weights are on-policy: the trainer's log-probs
    (taken at ``temperature``) equal the sampler's, the ratio is 1 and nothing is clipped.
    Taking them at T = 1 instead made every ratio pi_1 / pi_T (what verl avoids by dividing
    the logits by the rollout temperature)."""
    samples, prompts, groups, _ = draw(model_dir, task, temperature=0.5, noise=0.0)
    w = TrainerWorker(TrainerConfig(temperature=0.5, recompute_old_logprobs=True, kl_coef=0.1), model_dir, task,
                      device="cpu")
    w._prompts = prompts
    for p, s in zip(prepare_batch(w, samples), samples):
        assert torch.allclose(p.old_logp, s.logprobs, atol=2e-5), (p.old_logp - s.logprobs).abs().max()
        assert torch.allclose(p.ref_logp, s.logprobs, atol=2e-5)
    w = TrainerWorker(TrainerConfig(temperature=0.5, kl_coef=0.1), model_dir, task, device="cpu")
    w.begin_iteration(0, prompts, groups)
    w.receive(samples)
    m = w.step().metrics
    assert m["ratio"] == pytest.approx(1.0, abs=1e-5) and m["clipfrac"] == 0.0
    assert m["kl"] == pytest.approx(0.0, abs=1e-5)  # the reference is the same weights


def test_temperature_must_be_positive():
    with pytest.raises(ValueError, match="temperature"):
        TrainerConfig(temperature=0.0)
