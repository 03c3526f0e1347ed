"""Rollout correction's bypass mode (verl's ``rollout_correction.bypass_mode: true``):
``trainer.rollout_bypass`` and ``trainer.rollout_loss_type`` (ppo_clip / reinforce). The loss, its
gradient and the ``rollout_corr/*`` metrics against a transcription of verl's
``compute_policy_loss_bypass_mode`` (its ``compute_policy_loss_vanilla`` / ``_reinforce`` and
``agg_loss`` with the engine workers' global counts; the rollout_corr_helper transcription is
tests/test_rollout_correction.py's) on random packed batches; the config's refusals; TrainerWorker
steps whose gradient is that of verl's loss over the whole batch for any micro-batching."""
import math
from dataclasses import replace

import pytest
import torch

from controller.config import ConfigError, from_dict
from workers.model import load_pretrained
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer import rollout_bypass as rb
from workers.trainer import rollout_correction as rc
from workers.trainer.losses import aggregate_sum, loss_divisor
from workers.trainer.stat_sums import StatSums
from workers.trainer.step_math import prepare_batch
from tests.test_policy_losses_verl import padded
from tests.test_rollout_correction import RS_SPECS, masked_mean, random_batch, verl_mask, verl_metrics, verl_weights
from tests.test_trainer_math_grad import draw, group_adv, model_dir, seq_logits, task, worker_grads  # noqa: F401

torch.set_num_threads(1)
LENS = [5, 1, 8, 3, 6, 2, 7, 4]
AGG = {"token_mean": "token-mean", "seq_mean": "seq-mean-token-mean", "seq_mean_token_sum": "seq-mean-token-sum"}


# ---- verl's bypass-mode loss, transcribed (padded [B, T], masked) -----------------------------------
def verl_agg_loss(mat, mask, mode, batch_num_tokens, global_batch_size):
    """agg_loss with global_batch_info (dp_size 1): counts of the whole batch, taken before the loss."""
    if mode == "token-mean":
        return (mat * mask).sum() / batch_num_tokens
    n = mask.sum(-1)
    seq_losses = (mat * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        seq_losses = seq_losses / (n + 1e-8)
    assert mode in ("seq-mean-token-mean", "seq-mean-token-sum")
    return (seq_losses * (n > 0).float()).sum() / global_batch_size


def verl_vanilla(old, logp, adv, mask, lo, hi, clip_c, mode, n_tok, n_seq):
    """compute_policy_loss_vanilla (rollout_is_weights None) -> (loss, pg_clipfrac)."""
    neg_kl = torch.clamp(logp - old, -20.0, 20.0)
    ratio = torch.exp(neg_kl)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - lo, 1 + hi)
    clip1 = torch.maximum(pg1, pg2)
    clipfrac = masked_mean(torch.gt(pg2, pg1).float(), mask)
    clip2 = torch.min(-adv * clip_c, clip1)
    return verl_agg_loss(torch.where(adv < 0, clip2, clip1), mask, mode, n_tok, n_seq), clipfrac


def verl_reinforce(rollout, logp, adv, mask, weights, mode, n_tok, n_seq):
    """compute_policy_loss_reinforce -> (loss, ppo_kl)."""
    losses = -adv * logp * weights if weights is not None else -adv * logp
    return verl_agg_loss(losses, mask, mode, n_tok, n_seq), masked_mean(rollout - logp, mask)


def verl_bypass(rollout, logp, adv, mask, loss_type, level, threshold, options, mode, lo=0.2, hi=0.2, clip_c=3.0):
    """compute_policy_loss_bypass_mode: weights and rejection of the current policy (no gradient),
    the rejection mask on the policy loss -> (loss, the rollout_corr/* metrics, the effective mask,
    pg_clipfrac (ppo_clip) or ppo_kl (reinforce), over the kept tokens)."""
    with torch.no_grad():
        log_ratio = logp - rollout
        weights = verl_weights(log_ratio, mask, level, threshold, False)[0] if level else None
        effective = verl_mask(log_ratio, mask, options) if options else mask
        metrics = verl_metrics(logp.detach(), rollout, mask, level, threshold, effective if options else None)
    n_tok, n_seq = mask.sum(), mask.shape[0]  # the engine's global counts of the response mask
    if loss_type == "reinforce":
        loss, extra = verl_reinforce(rollout, logp, adv, effective, weights, mode, n_tok, n_seq)
    else:
        loss, extra = verl_vanilla(rollout, logp, adv, effective, lo, hi, clip_c, mode, n_tok, n_seq)
    return loss, metrics, effective, extra


# ---- ours against it -------------------------------------------------------------------------------
def packed(seed, per_token_adv=False, noise=0.4):
    """-> logp (leaf, float64) [N], sampler [N], adv [N], seq_index [N], seq_lens [B]."""
    g = torch.Generator().manual_seed(seed)
    n, b = sum(LENS), len(LENS)
    seq_index = torch.repeat_interleave(torch.arange(b), torch.tensor(LENS))
    sampler = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    logp = (sampler + noise * torch.randn(n, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(n if per_token_adv else b, generator=g, dtype=torch.float64)
    return logp, sampler, adv if per_token_adv else adv[seq_index], seq_index, torch.tensor(LENS)


def bypass_config(loss_type, options=None, **kw):
    rs = dict(rollout_rs=",".join(options), rollout_rs_threshold=",".join(str(RS_SPECS[o][0]) for o in options)
              ) if options else {}
    return TrainerConfig(rollout_bypass=True, rollout_loss_type=loss_type, **rs, **kw)


def ours(cfg, logp, sampler, adv, seq_index, seq_lens):
    """-> (the mean loss as the update divides it: by every token / sequence, the terms, the metrics)."""
    terms, stats = rb.policy_terms(cfg, logp, sampler, adv, seq_index, seq_lens)
    total = aggregate_sum(terms.loss, seq_index, seq_lens, cfg.loss_agg)
    sums = StatSums(torch.device("cpu"))
    sums.add_counts(stats)
    m = sums.metrics(sums.packed(), cfg.loss_agg, extremes=sums.packed_extremes())
    corr = {k: v for k, v in m.items() if k.startswith("rollout_corr/")}
    return total / loss_divisor(float(len(logp)), float(len(seq_lens)), cfg.loss_agg), terms, corr


CASES = {  # name -> (rollout_loss_type, rollout_rs options, other keys)
    "ppo_clip": ("ppo_clip", None, {}),
    "ppo_clip_dual_clip_higher": ("ppo_clip", None, dict(dual_clip=3.0, clip_high=0.28)),
    "ppo_clip_geo_rs": ("ppo_clip", ["seq_mean_k1"], {}),
    "ppo_clip_token_k3_rs": ("ppo_clip", ["token_k3"], dict(dual_clip=3.0)),
    "reinforce": ("reinforce", None, {}),
    "reinforce_token_is": ("reinforce", None, dict(rollout_is="token", rollout_is_threshold=1.5)),
    "reinforce_seq_is": ("reinforce", None, dict(rollout_is="sequence", rollout_is_threshold=3.0)),
    "reinforce_seq_is_geo_rs": ("reinforce", ["seq_mean_k1"], dict(rollout_is="sequence")),
    "reinforce_token_is_token_and_seq_rs": ("reinforce", ["token_k2", "seq_max_k3"], dict(rollout_is="token")),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("agg", list(AGG))
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_gradient_and_metrics_are_verls(name, agg, seed):
    loss_type, options, kw = CASES[name]
    cfg = bypass_config(loss_type, options, loss_agg=agg, **kw)
    logp, sampler, adv, seq_index, seq_lens = packed(seed, per_token_adv=seed == 1)
    loss, terms, metrics = ours(cfg, logp, sampler, adv, seq_index, seq_lens)
    (grad,) = torch.autograd.grad(loss, logp)
    (lp2, mask), (roll2, _), (adv2, _) = (padded(x, seq_index, LENS) for x in (logp, sampler, adv))
    want, want_metrics, effective, clipfrac = verl_bypass(roll2, lp2, adv2, mask, loss_type, cfg.rollout_is,
                                                          cfg.is_threshold, options, AGG[agg], cfg.clip_low,
                                                          cfg.clip_high, cfg.dual_clip or 1e9)
    (want_grad,) = torch.autograd.grad(want, logp)
    # verl divides a sequence's sum by len + 1e-8: ~1e-9 relative in float64
    assert torch.allclose(loss, want, rtol=1e-7, atol=1e-12), (float(loss), float(want))
    assert torch.allclose(grad, want_grad, rtol=1e-7, atol=1e-12)
    assert metrics.keys() == want_metrics.keys() and "rollout_corr/kl" in metrics
    for k in want_metrics:
        assert metrics[k] == pytest.approx(want_metrics[k], rel=1e-6, abs=1e-9), k
    kept = effective[mask > 0] > 0
    if options:  # some rejected, some kept: a rejected token passes no gradient
        assert 0 < int(kept.sum()) < len(kept)
        assert bool((grad[~kept] == 0).all()) and bool((grad[kept] != 0).any())
    if loss_type == "ppo_clip":  # verl's pg_clipfrac is over the kept tokens: ours counts their clips only
        assert 0 < float(terms.clipped.sum()) < len(grad)  # both branches of the clip are exercised
        assert float(terms.clipped.sum()) / int(kept.sum()) == pytest.approx(float(clipfrac), rel=1e-6)


def test_the_weights_are_truncated_and_the_dual_clip_binds():
    """The random batches reach the thresholds these tests use: weights past them (truncated), and
    ppo_clip's dual clip on tokens with A < 0 and ratio > 3."""
    logp, sampler, adv, seq_index, seq_lens = packed(0)
    log_r = logp.detach() - sampler
    for level, threshold in (("token", 1.5), ("sequence", 3.0)):
        raw = rb.is_weights(log_r, level, seq_index, seq_lens)
        assert float(raw.max()) > threshold and float(raw.min()) < 1.0
    logp, sampler, adv, seq_index, seq_lens = packed(0, noise=1.5)
    a = ours(bypass_config("ppo_clip", dual_clip=3.0), logp, sampler, adv, seq_index, seq_lens)[0]
    b = ours(bypass_config("ppo_clip"), logp, sampler, adv, seq_index, seq_lens)[0]
    assert float(a) < float(b)


@pytest.mark.parametrize("big", [False, True])
def test_packed_weights_masks_and_stats_are_the_per_sample_ones(big):
    """The packed forms equal rollout_correction's per-sample ones (the decoupled mode's code)."""
    old, roll, *_ = random_batch(5, big)
    lens = [len(o) for o in old]
    seq_index = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    seq_lens = torch.tensor(lens)
    log_r = torch.cat(old) - torch.cat(roll)
    for level in rc.IS_LEVELS:
        want = torch.cat([rc.is_weights(o - r, level, 2.0)[1] for o, r in zip(old, roll)])
        assert torch.allclose(rb.is_weights(log_r, level, seq_index, seq_lens), want, rtol=1e-12, atol=0)
    for option, (spec, _) in RS_SPECS.items():
        checks = rc.parse_rejection(option, spec)
        want = torch.cat([rc.keep_mask(o - r, checks) for o, r in zip(old, roll)])
        assert torch.equal(rb.keep_mask(log_r, checks, seq_index, seq_lens), want), option
    checks = rc.parse_rejection("token_k1,seq_mean_k3", "0.6_1.5,0.15")
    for level in (None, *rc.IS_LEVELS):
        raw = rb.is_weights(log_r, level, seq_index, seq_lens) if level else None
        keep = rb.keep_mask(log_r, checks, seq_index, seq_lens)
        got = rc.batch_stats(torch.cat(old), torch.cat(roll), seq_index, seq_lens, level, 1.8, raw, keep)
        per = [rc.sample_stats(o, r, level, 1.8, rc.is_weights(o - r, level, 1.8)[1] if level else None,
                               rc.keep_mask(o - r, checks)) for o, r in zip(old, roll)]
        assert set(got) == set(per[0])
        for k, v in got.items():
            fold = (max if k in rc.MAXIMA else min if k in rc.MINIMA else sum)(p[k] for p in per)
            assert float(v) == pytest.approx(fold, rel=1e-9, abs=1e-12), k


# ---- config ----------------------------------------------------------------------------------------
BYPASS = dict(rollout_bypass=True)


@pytest.mark.parametrize("kw, said", [
    (dict(rollout_loss_type="reinforce"), "trainer.rollout_loss_type ('reinforce') is only used with "
                                          "trainer.rollout_bypass: true"),
    (dict(BYPASS, rollout_loss_type="pg"), "trainer.rollout_loss_type: 'pg' is not one of ('ppo_clip', 'reinforce')"),
    (dict(rollout_bypass="yes"), "trainer.rollout_bypass: expected bool, got str 'yes'"),
    (dict(BYPASS, recompute_old_logprobs=True), "trainer.recompute_old_logprobs: true recomputes the old log-probs, "
                                                "and trainer.rollout_bypass: true takes the sampler's"),
    (dict(BYPASS, tis_cap=2.0), "trainer.tis_cap (2.0) weights by pi_old / pi_sampler with recomputed old log-probs, "
                                "which trainer.rollout_bypass has none of"),
    (dict(BYPASS, policy_loss="cispo"), "trainer.policy_loss ('cispo'): with trainer.rollout_bypass the policy loss "
                                        "is trainer.rollout_loss_type's"),
    (dict(BYPASS, rollout_loss_type="reinforce", rollout_is="token", rollout_is_batch_normalize=True),
     "trainer.rollout_is_batch_normalize: with trainer.rollout_bypass the weights are the current policy's"),
    (dict(BYPASS, rollout_is="sequence"), "trainer.rollout_is ('sequence') with trainer.rollout_bypass and "
                                          "rollout_loss_type 'ppo_clip'"),
    (dict(BYPASS, rollout_loss_type="reinforce", clip_high=0.28), "trainer.clip_high (0.28): trainer.rollout_loss_type "
                                                                  "'reinforce' has no clip"),
    (dict(BYPASS, rollout_loss_type="reinforce", dual_clip=3.0), "trainer.dual_clip (3.0): trainer.rollout_loss_type "
                                                                 "'reinforce' has no clip"),
    (dict(BYPASS, rollout_rs="seq_mean_k3"), "trainer.rollout_rs_threshold: trainer.rollout_rs 'seq_mean_k3' needs"),
])
def test_bad_settings_are_refused_naming_the_keys(kw, said):
    with pytest.raises(ValueError) as e:
        TrainerConfig(**kw)
    assert said in str(e.value), str(e.value)


def test_what_bypass_turns_on_and_off():
    for kw in (dict(), dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"),
               dict(rollout_loss_type="reinforce", rollout_is="sequence", rollout_rs="token_k2",
                    rollout_rs_threshold=0.5)):
        cfg = TrainerConfig(rollout_bypass=True, **kw)  # verl's bypass presets
        assert not cfg.recomputes_old_logprobs and cfg.uses_sampler_logprobs and not cfg.corrects_rollout, kw
        assert not cfg.trains_at_step
    assert TrainerConfig(rollout_is="token").corrects_rollout  # the decoupled mode is unchanged


def test_run_config_keys_and_verls_names():
    cfg = from_dict({"trainer": {"rollout_bypass": True, "rollout_loss_type": "reinforce", "rollout_is": "sequence",
                                 "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"}})
    assert cfg.trainer.rollout_bypass and cfg.trainer.rollout_loss_type == "reinforce"
    with pytest.raises(ConfigError, match="verl's 'bypass_mode' is trainer.rollout_bypass"):
        from_dict({"trainer": {"bypass_mode": True}})
    with pytest.raises(ConfigError, match="verl's 'loss_type' is trainer.rollout_loss_type"):
        from_dict({"trainer": {"rollout_bypass": True, "loss_type": "reinforce"}})
    with pytest.raises(ConfigError, match="rollout_bypass \\(its bypass_mode\\) and rollout_loss_type"):
        from_dict({"trainer": {"rollout_correction": {"bypass_mode": True}}})
    with pytest.raises(ConfigError, match="trainer.rollout_bypass: takes the samples' log-probs as the old policy, "
                                          "and with train.top_k / train.top_p"):
        from_dict({"trainer": {"rollout_bypass": True}, "train": {"top_p": 0.9}})
    with pytest.raises(ConfigError, match="trainer.rollout_loss_type: 'ppo' is not one of"):
        from_dict({"trainer": {"rollout_bypass": True, "rollout_loss_type": "ppo"}})


# ---- the trainer -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def drawn(model_dir, task):  # noqa: F811
    return draw(model_dir, task)  # 4 groups x 3 samples, sampler log-probs moved by 0.3 N(0, 1) a token


def reference_grads(model_dir, task, tok, samples, prompts, cfg):  # noqa: F811
    """verl's bypass loss over the whole batch (grpo advantages; k3 KL and entropy over every token of
    the response mask, verl's kl_loss and entropy terms) -> the actor's gradient, the metrics, the
    tokens the rejection keeps."""
    actor = load_pretrained(model_dir, "cpu", dtype=torch.float32)
    ref = load_pretrained(model_dir, "cpu", dtype=torch.float32)
    rewards = [task.score(prompts[s.sample_id], tok.decode(s.output_ids)) for s in samples]
    adv = {}
    for gid in {s.group_id for s in samples}:
        members = [i for i, s in enumerate(samples) if s.group_id == gid]
        adv.update(zip(members, group_adv(cfg, [rewards[i] for i in members])))
    lp, ref_lp, ent = [], [], []
    for s in samples:
        logp_all = torch.log_softmax(seq_logits(actor, s, 1.0), -1)
        lp.append(logp_all.gather(-1, s.output_ids[:, None]).squeeze(-1))
        ent.append(-(logp_all.exp() * logp_all).sum(-1))
        with torch.no_grad():
            ref_lp.append(torch.log_softmax(seq_logits(ref, s, 1.0), -1).gather(-1, s.output_ids[:, None]).squeeze(-1))

    def pad(xs):
        return torch.nn.utils.rnn.pad_sequence(xs, batch_first=True)

    mask = pad([torch.ones(len(s.output_ids)) for s in samples])
    logp, rollout = pad(lp), pad([s.logprobs.float() for s in samples])
    adv_p = pad([torch.full((len(s.output_ids),), float(adv[i])) for i, s in enumerate(samples)])
    options = cfg.rollout_rs.split(",") if cfg.rollout_rs else None
    mode = AGG[cfg.loss_agg]
    pg, metrics, effective, _ = verl_bypass(rollout, logp, adv_p, mask, cfg.rollout_loss_type, cfg.rollout_is,
                                         cfg.is_threshold, options, mode, cfg.clip_low, cfg.clip_high,
                                         cfg.dual_clip or 1e9)
    kl = (pad(ref_lp) - logp).clamp(-20, 20)  # verl's low_var_kl
    kld = (torch.exp(kl) - kl - 1).clamp(-10, 10)
    n_tok, n_seq = mask.sum(), len(samples)
    loss = (pg + cfg.kl_coef * verl_agg_loss(kld, mask, mode, n_tok, n_seq)
            - cfg.entropy_coef * verl_agg_loss(pad(ent), mask, mode, n_tok, n_seq))
    loss.backward()
    kept = effective[mask > 0] > 0  # [tokens] the tokens verl's rejection keeps
    return {"actor." + k: p.grad.clone() for k, p in actor.named_parameters()}, metrics, kept


E2E = {  # tests/test_rollout_correction's thresholds (its verl_mask's): the drawn samples pass them in part
    "reinforce_seq_is_geo_rs": dict(rollout_loss_type="reinforce", rollout_is="sequence", rollout_rs="seq_mean_k1"),
    "reinforce_token_is_token_rs_seq_mean_token_sum": dict(
        rollout_loss_type="reinforce", rollout_is="token", rollout_is_threshold=1.2, rollout_rs="token_k1",
        loss_agg="seq_mean_token_sum"),
    "ppo_clip_token_rs_seq_mean": dict(rollout_rs="token_k3", loss_agg="seq_mean", clip_high=0.28, dual_clip=3.0),
}


@pytest.mark.parametrize("name", list(E2E))
def test_a_step_is_verls_bypass_loss_for_any_microbatching(model_dir, task, drawn, name):  # noqa: F811
    samples, prompts, groups, tok = drawn
    kw = E2E[name]
    cfg = TrainerConfig(algorithm="grpo", grad_clip=0.0, rollout_bypass=True, kl_coef=0.1, entropy_coef=0.01,
                        rollout_rs_threshold=RS_SPECS[kw["rollout_rs"]][0], **kw)
    want, want_metrics, kept = reference_grads(model_dir, task, tok, samples, prompts, cfg)
    assert 0 < int(kept.sum()) < kept.numel()  # the rejection takes some tokens, not all
    scale = max(v.abs().max().item() for v in want.values())
    assert scale > 1e-3
    for budget, order_seed, chunk in ((10**6, None, None), (25, 0, 1), (1, 1, 5)):
        got, res = worker_grads(model_dir, task, samples, prompts, groups,
                                replace(cfg, max_tokens_per_microbatch=budget), order_seed, chunk)
        assert set(got) == set(want)
        for k in want:
            err = (got[k] - want[k]).abs().max().item()
            assert err <= 1e-5 * scale, (name, budget, k, err, scale)
        m = res.metrics
        assert m["num_tokens"] == sum(len(s.output_ids) for s in samples)  # the divisor: every token (verl's)
        for k, v in want_metrics.items():  # the first forward's policy is the one verl's loss sees
            assert m[k] == pytest.approx(v, rel=1e-4, abs=1e-6), (name, budget, k)
        assert 0 < m["rollout_corr/rollout_rs_masked_fraction"] < 1 and m["rollout_corr/kl"] != 0


def test_no_old_logprob_forward_and_the_weights_move(model_dir, task, drawn):  # noqa: F811
    """At receive time the old log-probs are the sampler's, with no actor forward (verl's bypass
    skips it) and nothing corrected yet; the step trains, the metrics say what the forward saw."""
    samples, prompts, groups, _ = drawn
    cfg = TrainerConfig(algorithm="grpo", rollout_bypass=True, rollout_loss_type="reinforce", rollout_is="sequence",
                        rollout_rs="seq_mean_k1", rollout_rs_threshold="0.95_1.05", lr=1e-2)
    w = TrainerWorker(cfg, model_dir, task, device="cpu")
    w.begin_iteration(0, prompts, groups)
    calls = []
    hook = w.actor.register_forward_hook(lambda *_: calls.append(1))
    items = prepare_batch(w, samples)
    hook.remove()
    assert not calls  # no recompute forward (no reference either: kl_coef 0)
    for p, s in zip(items, samples):
        assert torch.equal(p.old_logp, s.logprobs.float())
        assert p.tis_weight is None and p.keep is None and p.correction == {}
    before = [p.detach().clone() for p in w.policy_parameters()]
    w.receive(samples)
    res = w.step()
    assert res.version == 1 and res.metrics["step_skipped"] == 0
    assert any(not torch.equal(a, b) for a, b in zip(before, w.policy_parameters()))
    m = res.metrics
    assert math.isfinite(m["pg_loss"]) and m["clipfrac"] == 0.0  # reinforce: no clip
    assert 0 < m["rollout_corr/rollout_is_mean"] and 0 < m["rollout_corr/rollout_rs_seq_masked_fraction"] < 1
    assert "tis_weight" not in m and "rollout_corr/rollout_is_batch_norm_factor" not in m
