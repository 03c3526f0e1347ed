"""Rollout correction (verl's ``algorithm.rollout_correction``, decoupled mode): ``trainer.rollout_is``
(token / sequence importance weights, ``rollout_is_threshold``, ``rollout_is_batch_normalize``) and
``trainer.rollout_rs`` (rejection sampling, ``rollout_rs_threshold``) from the sampler's log-probs
to the trainer's old ones. Weights, masks and metrics against a transcription of verl's
``rollout_corr_helper`` on padded [B, T] batches; config refusals; a TrainerWorker step in each
mode, where a rejected token passes no gradient."""
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer import rollout_correction as rc
from workers.trainer.buffer import Prepared, SampleBuffer
from workers.trainer.rollout import rollout
from workers.trainer.stat_sums import StatSums
from workers.trainer.step_math import prepare_batch, train_terms
from tests.trainer_helpers import LengthRewardTask, synthetic_task, tiny_config, tiny_model_dir

torch.set_num_threads(1)
RS_SPECS = {  # option -> (rollout_rs_threshold, its bounds as verl reads them: lower (k1 only), upper)
    "token_k1": ("0.6_1.5", (0.6, 1.5)), "token_k2": (0.3, (None, 0.3)), "token_k3": ("0.2", (None, 0.2)),
    "seq_sum_k1": (1.5, (1 / 1.5, 1.5)), "seq_sum_k2": (0.5, (None, 0.5)), "seq_sum_k3": ("0.5", (None, 0.5)),
    "seq_mean_k1": ("0.85_1.1", (0.85, 1.1)), "seq_mean_k2": (0.1, (None, 0.1)), "seq_mean_k3": (0.15, (None, 0.15)),
    "seq_max_k2": (0.4, (None, 0.4)), "seq_max_k3": (0.4, (None, 0.4)),
}


# ---- verl's formulas, transcribed on padded batches ----------------------------------------------
def masked_mean(x, mask, dim=None):
    return (x * mask).sum() / (mask.sum() + 1e-8) if dim is None else (x * mask).sum(dim) / (mask.sum(dim) + 1e-8)


def verl_weights(log_ratio, mask, level, threshold, normalize):
    """compute_rollout_correction_weights: -> (weights [B, T], untruncated [B, T], norm factor or None)."""
    if level == "token":
        w = torch.exp(log_ratio.clamp(-20, 20))
    else:
        w = torch.exp((log_ratio * mask).sum(-1, keepdim=True).clamp(-20, 20)).expand_as(log_ratio)
    w = w * mask
    raw = w
    w = w.clamp(max=threshold)
    factor = None
    if normalize:
        if level == "token":
            mean = masked_mean(w, mask)
        else:
            mean = masked_mean(w, mask, -1).sum() / (mask.sum(-1) > 0).float().sum()
        factor = float(mean) if mean > 1e-8 else 1.0
        w = w / mean if mean > 1e-8 else w
    return w, raw, factor


def verl_mask(log_ratio, mask, options):
    """compute_rollout_rejection_mask: -> the response mask with the rejected tokens 0."""
    lr = log_ratio.clamp(-20, 20)
    k = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": torch.exp(lr) - 1 - lr}
    combined = torch.ones_like(mask)
    for option in options:
        lower, upper = RS_SPECS[option][1]
        level, est = option.rsplit("_", 1)
        stat = k[est]
        if level == "seq_sum":
            stat = (stat * mask).sum(-1, keepdim=True)
        elif level == "seq_mean":
            stat = masked_mean(stat, mask, -1).unsqueeze(-1)
        elif level == "seq_max":
            stat = stat.masked_fill(mask == 0, -math.inf).max(-1, keepdim=True).values
        if est == "k1":
            keep = (stat >= math.log(lower)) & (stat <= math.log(upper))
        else:
            keep = stat <= upper
        combined = combined * keep.expand_as(mask).float()
    return mask * combined


def verl_metrics(old, rollout_lp, mask, level, threshold, rs_mask):
    """compute_is_metrics (before truncation), the rejection fractions, compute_offpolicy_metrics."""
    log_ratio = old - rollout_lp
    m = {}
    if level is not None:
        _, w, _ = verl_weights(log_ratio, mask, level, threshold, False)
        low = 1.0 / threshold
        if level == "sequence":
            seq_log = (log_ratio * mask).sum(-1)
            m.update(rollout_is_max=float(torch.exp(seq_log.max().clamp(max=20))), rollout_is_min=float(torch.exp(seq_log.min())),
                     rollout_is_ratio_fraction_high=float((seq_log > math.log(threshold)).float().mean()),
                     rollout_is_ratio_fraction_low=float((seq_log < math.log(low)).float().mean()))
        else:
            m.update(rollout_is_max=float(w.masked_fill(mask == 0, -math.inf).max()),
                     rollout_is_min=float(w.masked_fill(mask == 0, math.inf).min()),
                     rollout_is_ratio_fraction_high=float(masked_mean((w > threshold).float(), mask)),
                     rollout_is_ratio_fraction_low=float(masked_mean((w < low).float(), mask)))
        m["rollout_is_mean"] = float(masked_mean(w, mask))
        wc = w.clamp(low, threshold)
        mean_c = masked_mean(wc, mask)
        m["rollout_is_std"] = float(torch.sqrt((masked_mean(wc ** 2, mask) - mean_c ** 2).clamp(min=0)))
        m["rollout_is_eff_sample_size"] = 1.0 / float(masked_mean((wc / (mean_c + 1e-8)) ** 2, mask))
        seq = masked_mean(w, mask, -1)
        m.update(rollout_is_seq_mean=float(seq.mean()), rollout_is_seq_std=float(seq.std()),
                 rollout_is_seq_max=float(seq.max()), rollout_is_seq_min=float(seq.min()),
                 rollout_is_seq_max_deviation=float((seq - 1).abs().max()),
                 rollout_is_seq_fraction_high=float((seq > threshold).float().mean()),
                 rollout_is_seq_fraction_low=float((seq < low).float().mean()))
    if rs_mask is not None:
        m["rollout_rs_masked_fraction"] = float(masked_mean(1 - rs_mask, mask))
        m["rollout_rs_seq_masked_fraction"] = float(((rs_mask == 0) & (mask > 0)).any(-1).float().mean())
    mean_old, mean_roll = masked_mean(old, mask, -1), masked_mean(rollout_lp, mask, -1)
    diff = mean_roll - mean_old
    m.update(kl=float(masked_mean(rollout_lp - old, mask)),
             k3_kl=float(masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask)),
             training_ppl=float(torch.exp(-mean_old).mean()), training_log_ppl=float((-mean_old).mean()),
             rollout_ppl=float(torch.exp(-mean_roll).mean()), rollout_log_ppl=float((-mean_roll).mean()),
             log_ppl_diff=float(diff.mean()), log_ppl_abs_diff=float(diff.abs().mean()),
             log_ppl_diff_max=float(diff.max()), log_ppl_diff_min=float(diff.min()),
             ppl_ratio=float(torch.exp(diff).mean()),
             chi2_token=float(masked_mean(torch.exp(log_ratio.clamp(-20, 20)) ** 2, mask)) - 1.0,
             chi2_seq=float(torch.exp(2 * (log_ratio * mask).sum(-1).clamp(-20, 20)).mean()) - 1.0)
    return {f"rollout_corr/{k}": v for k, v in m.items()}


# ---- random batches ------------------------------------------------------------------------------
def random_batch(seed, big=False):
    """7 samples of 1..12 tokens: per-sample log-probs (old, rollout) and their padded [B, T] forms."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 13, (7,), generator=g).tolist()
    old = [-torch.rand(n, generator=g, dtype=torch.float64) * 3 for n in lens]
    shift = [torch.randn(n, generator=g, dtype=torch.float64) * 0.4 for n in lens]
    if big:  # past the +-20 safety bound, both ways
        shift[0][0], shift[1][-1] = 25.0, -30.0
    rollout_lp = [o + s for o, s in zip(old, shift)]
    T = max(lens)

    def pad(xs):
        return torch.stack([torch.cat([x, x.new_zeros(T - len(x))]) for x in xs])

    mask = pad([torch.ones(n, dtype=torch.float64) for n in lens])
    return old, rollout_lp, pad(old), pad(rollout_lp), mask


def unpad(x, mask):
    return [row[: int(n)] for row, n in zip(x, mask.sum(-1))]


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [1.5, 2.0, 5.0])
@pytest.mark.parametrize("big", [False, True])
def test_is_weights_are_verls(level, threshold, big):
    old, roll, old_p, roll_p, mask = random_batch(1, big)
    want, want_raw, _ = verl_weights(old_p - roll_p, mask, level, threshold, False)
    for o, r, w, w_raw in zip(old, roll, unpad(want, mask), unpad(want_raw, mask)):
        got, raw = rc.is_weights(o - r, level, threshold)
        assert torch.allclose(got, w, rtol=1e-12, atol=0) and torch.allclose(raw, w_raw, rtol=1e-12, atol=0)
    assert float(want.max()) <= threshold


@pytest.mark.parametrize("options", [[o] for o in RS_SPECS] + [["token_k1", "seq_mean_k3"],
                                                                 ["seq_sum_k2", "seq_max_k3", "token_k2"]])
@pytest.mark.parametrize("big", [False, True])
def test_rejection_masks_are_verls(options, big):
    old, roll, old_p, roll_p, mask = random_batch(2, big)
    want = verl_mask(old_p - roll_p, mask, options)
    checks = rc.parse_rejection(",".join(options), ",".join(str(RS_SPECS[o][0]) for o in options))
    got = [rc.keep_mask(o - r, checks) for o, r in zip(old, roll)]
    for g, w in zip(got, unpad(want, mask)):
        assert g.tolist() == (w > 0).tolist()
    kept = sum(int(g.sum()) for g in got)
    assert 0 < kept < int(mask.sum()) or big  # the thresholds are chosen to reject some, not all


def test_threshold_specs_as_verl_reads_them():
    (k1,) = rc.parse_rejection("token_k1", 2.0)  # one upper ratio bound: lower is its reciprocal
    assert (k1.lower, k1.upper) == pytest.approx((math.log(0.5), math.log(2.0)))
    (k1,) = rc.parse_rejection(" seq_mean_k1 ", "0.999_1.001")  # verl's Geo-RS preset
    assert (k1.lower, k1.upper) == pytest.approx((math.log(0.999), math.log(1.001)))
    a, b = rc.parse_rejection("token_k2,seq_max_k3,token_k2", "0.5")  # duplicates dropped, one for all
    assert (a.option, a.upper, b.option, b.upper, b.lower) == ("token_k2", 0.5, "seq_max_k3", 0.5, None)
    a, b = rc.parse_rejection("seq_sum_k1,seq_mean_k3", "0.5_2,0.01")  # one per option
    assert (a.upper, b.upper) == pytest.approx((math.log(2.0), 0.01))


@pytest.mark.parametrize("level", [None, "token", "sequence"])
@pytest.mark.parametrize("options", [None, ["seq_mean_k1"], ["token_k2", "seq_sum_k3"]])
def test_metrics_are_verls(level, options):
    """The rollout_corr/* metrics from per-sample sums, as verl computes them over the batch."""
    threshold = 1.8
    old, roll, old_p, roll_p, mask = random_batch(3)
    checks = rc.parse_rejection(",".join(options), ",".join(str(RS_SPECS[o][0]) for o in options)) if options else ()
    stats = StatSums(torch.device("cpu"))
    for i, (o, r) in enumerate(zip(old, roll)):
        raw = rc.is_weights(o - r, level, threshold)[1] if level else None
        keep = rc.keep_mask(o - r, checks) if checks else None
        p = prepared(i, o, correction=rc.sample_stats(o, r, level, threshold, raw, keep))
        stats.add_sample(p, 0)
    got = {k: v for k, v in stats.metrics(stats.packed(), "token_mean", extremes=stats.packed_extremes()).items()
           if k.startswith("rollout_corr/")}
    rs_mask = verl_mask(old_p - roll_p, mask, options) if options else None
    want = verl_metrics(old_p, roll_p, mask, level, threshold, rs_mask)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-9), k


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalize_is_verls_over_the_iteration(level):
    old, roll, old_p, roll_p, mask = random_batch(4)
    want, _, factor = verl_weights(old_p - roll_p, mask, level, 2.0, True)
    cfg = TrainerConfig(rollout_is=level, rollout_is_batch_normalize=True)
    buffer, stats = SampleBuffer(), StatSums(torch.device("cpu"))
    for i, (o, r) in enumerate(zip(old, roll)):
        weights, raw = rc.is_weights(o - r, level, 2.0)
        buffer.push_ready([prepared(i, o, tis_weight=weights, correction=rc.sample_stats(o, r, level, 2.0, raw, None))])
        stats.add_sample(buffer.ready[-1], 0)
    w = SimpleNamespace(cfg=cfg, _trained_any=False, buffer=buffer, world_size=1, device=torch.device("cpu"),
                        stats=stats)
    rc.batch_normalize(w)
    for p, row in zip(buffer.ready, unpad(want, mask)):
        assert torch.allclose(p.tis_weight, row, rtol=1e-8, atol=0)
    m = w.stats.metrics(w.stats.packed(), "token_mean", extremes=w.stats.packed_extremes())
    assert m["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(factor, rel=1e-8)  # verl: masked_mean + 1e-8
    assert factor != pytest.approx(1.0, abs=1e-3)  # it did something


def prepared(i, old, **kw):
    n = old.numel()
    return Prepared(sample_id=i, group_id=i, prompt_ids=torch.ones(2, dtype=torch.long),
                    output_ids=torch.ones(n, dtype=torch.long), old_logp=old.float(), ref_logp=old.float(),
                    score=0.0, reward=0.0, **kw)


# ---- config --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, said", [
    (dict(rollout_is="seq"), "trainer.rollout_is: 'seq' is not one of ('token', 'sequence')"),
    (dict(rollout_is="token", rollout_is_threshold=0.0), "trainer.rollout_is_threshold must be > 0"),
    (dict(rollout_is_threshold=3.0), "trainer.rollout_is_threshold (3.0) is only used with trainer.rollout_is set"),
    (dict(rollout_is_batch_normalize=True), "trainer.rollout_is_batch_normalize (True) is only used with "
                                            "trainer.rollout_is set"),
    (dict(tis_cap=2.0, rollout_is_batch_normalize=True), "only used with trainer.rollout_is set"),
    (dict(tis_cap=2.0, rollout_is="token"), "trainer.tis_cap (2.0) is trainer.rollout_is: token with "
                                            "rollout_is_threshold: 2.0"),
    (dict(rollout_rs_threshold=0.1), "trainer.rollout_rs_threshold (0.1) is only used with trainer.rollout_rs set"),
    (dict(rollout_rs="seq_mean_k3"), "trainer.rollout_rs_threshold: trainer.rollout_rs 'seq_mean_k3' needs"),
    (dict(rollout_rs="seq_max_k1", rollout_rs_threshold=2.0), "trainer.rollout_rs: 'seq_max_k1' is not one of"),
    (dict(rollout_rs=" , ", rollout_rs_threshold=2.0), "trainer.rollout_rs: ' , ' names no option"),
    (dict(rollout_rs="token_k1,seq_sum_k2,seq_max_k3", rollout_rs_threshold="2,0.5"),
     "gives 2 thresholds for 3 trainer.rollout_rs options"),
    (dict(rollout_rs="token_k3", rollout_rs_threshold="0.1_0.2"), "only k1 options take lower_upper ratio bounds"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold="0.5_1_2"), "expected lower_upper or an upper bound"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold=-0.1), "bounds must be finite and > 0"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold="abc"), "for option 'token_k2': not a number"),
    (dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01, policy_loss="kl_cov"),
     "policy_loss 'kl_cov' picks its tokens by statistics"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold=0.5, policy_loss="gspo", loss_agg="seq_mean",
          clip_low=3e-4, clip_high=4e-4), "token_k2 rejects single tokens, and policy_loss 'gspo'"),
])
def test_bad_settings_are_refused_naming_the_key(kw, said):
    with pytest.raises(ValueError) as e:
        TrainerConfig(**kw)
    assert said in str(e.value), str(e.value)


def test_what_the_keys_turn_on():
    plain = TrainerConfig()
    assert not plain.corrects_rollout and not plain.recomputes_old_logprobs and plain.uses_sampler_logprobs
    for kw in (dict(rollout_is="sequence"), dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
               dict(tis_cap=2.0)):
        cfg = TrainerConfig(**kw)  # both log-probs: the trainer's old ones and the sampler's
        assert cfg.corrects_rollout and cfg.recomputes_old_logprobs and cfg.uses_sampler_logprobs, kw
        assert not cfg.trains_at_step
    assert (TrainerConfig(tis_cap=3.0).is_level, TrainerConfig(tis_cap=3.0).is_threshold) == ("token", 3.0)
    assert TrainerConfig(rollout_is="token").is_threshold == 2.0  # verl's default
    assert TrainerConfig(rollout_is="token", rollout_is_batch_normalize=True).trains_at_step
    # a sequence-level rejection is fine with the losses that average a sequence's tokens
    TrainerConfig(rollout_rs="seq_max_k2", rollout_rs_threshold=0.5, policy_loss="geo_mean", loss_agg="seq_mean")


def test_run_config_names_verls_section_and_keys():
    from controller.config import ConfigError, from_dict

    cfg = from_dict({"trainer": {"rollout_is": "token", "rollout_is_threshold": 3, "rollout_rs": "token_k1,seq_mean_k3",
                                 "rollout_rs_threshold": "0.5_2.0,0.01"}})
    assert cfg.trainer.rollout_is_threshold == 3.0 and len(cfg.trainer.rejection_checks) == 2
    assert from_dict({"trainer": {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"}}
                     ).trainer.rollout_rs_threshold == "0.999_1.001"  # not read as a float
    with pytest.raises(ConfigError, match="verl's 'rollout_correction' is trainer.rollout_is, rollout_is_threshold"):
        from_dict({"trainer": {"rollout_correction": {"rollout_is": "token"}}})
    with pytest.raises(ConfigError, match="verl's 'bypass_mode' is trainer.rollout_bypass"):
        from_dict({"trainer": {"bypass_mode": True}})
    with pytest.raises(ConfigError, match="verl's 'loss_type' is trainer.rollout_loss_type"):
        from_dict({"trainer": {"loss_type": "reinforce"}})
    with pytest.raises(ConfigError, match="trainer.rollout_is_threshold"):
        from_dict({"trainer": {"rollout_is_threshold": 3}})


# ---- the trainer ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Samples whose sampler log-probs were moved: sample 0 by +2 on every token (pi_old / pi_sampler
    = e^-2: every mode rejects it), sample 1 by +2 on every third token, the rest by +-0.05."""
    model_dir, task = tiny_model_dir(tmp_path_factory, tiny_config(layers=2)), LengthRewardTask(synthetic_task())
    w = TrainerWorker(TrainerConfig(), model_dir, task, device="cpu")
    samples, prompts, groups = rollout(w.actor, w.tokenizer, task.prompts("train")[:3], 2, 8, seed=3)
    for i, s in enumerate(samples):
        n = s.output_ids.numel()
        d = torch.tensor([2.0 if i == 0 or (i == 1 and j % 3 == 1) else (0.05, -0.05)[(i + j) % 2] for j in range(n)])
        s.logprobs = s.logprobs + d
    return model_dir, task, samples, prompts, groups


MODES = {"token_is": dict(rollout_is="token", rollout_is_threshold=1.5),
         "sequence_is": dict(rollout_is="sequence"),
         "token_is_normalized": dict(rollout_is="token", rollout_is_batch_normalize=True),
         "sequence_is_normalized": dict(rollout_is="sequence", rollout_is_threshold=3.0,
                                        rollout_is_batch_normalize=True),
         **{o: dict(rollout_rs=o, rollout_rs_threshold=RS_SPECS[o][0]) for o in RS_SPECS},
         "token_is_seq_rs": dict(rollout_is="token", rollout_rs="seq_mean_k1,token_k3",
                                 rollout_rs_threshold="0.8_1.3,0.2")}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_step_trains_and_a_rejected_token_passes_no_gradient(setup, mode):
    model_dir, task, samples, prompts, groups = setup
    cfg = TrainerConfig(algorithm="grpo", seed=0, **MODES[mode])
    w = TrainerWorker(cfg, model_dir, task, device="cpu")
    w.begin_iteration(0, prompts, groups)
    items = prepare_batch(w, samples)
    for p in items:
        p.adv = torch.linspace(-1.0, 1.0, p.num_tokens)
    if cfg.rollout_rs is not None:
        assert not items[0].keep.any()  # every token moved by e^2: rejected whole
        assert all(p.keep.any() for p in items[2:])  # the small moves pass
        # a rejected token's advantage changes nothing: its loss term and gradient are gone
        moved = [dataclasses.replace(p, adv=torch.where(p.keep, p.adv, p.adv + 100.0)) for p in items]
        loss, grad = loss_and_grad(w, items)
        loss_moved, grad_moved = loss_and_grad(w, moved)
        assert torch.equal(loss, loss_moved) and all(torch.equal(a, b) for a, b in zip(grad, grad_moved))
        # a sequence rejected whole is as if it were not there (token_mean: a SUM, divided at the step)
        loss_without, grad_without = loss_and_grad(w, items[1:])
        assert torch.allclose(loss, loss_without, atol=1e-6)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grad, grad_without))
        counts = train_terms(w, items)[1]
        assert float(counts["num_tokens"]) == sum(int(p.keep.sum()) for p in items)
    if cfg.is_level is not None:
        raw_weights = torch.cat([p.tis_weight for p in items])
        assert float(raw_weights.max()) <= cfg.is_threshold and float(raw_weights.min()) < 0.2  # e^-2 and below
    # a whole step: receive, step, weights moved
    before = [p.detach().clone() for p in w.policy_parameters()]
    w.receive(samples)
    res = w.step()
    assert res.metrics["step_skipped"] == 0 and res.version == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, w.policy_parameters()))
    m = res.metrics
    assert math.isfinite(m["pg_loss"]) and m["rollout_corr/kl"] > 0  # the sampler's log-probs were moved down
    if cfg.rollout_rs is not None:
        assert 0 < m["rollout_corr/rollout_rs_masked_fraction"] < 1
        assert m["rollout_corr/rollout_rs_seq_masked_fraction"] >= 1 / len(samples)
        assert m["num_tokens"] < sum(s.output_ids.numel() for s in samples)  # rejected tokens are not counted
    if cfg.is_level is not None:
        assert 0 < m["rollout_corr/rollout_is_mean"] and "tis_weight" not in m
    if cfg.rollout_is_batch_normalize:
        assert m["rollout_corr/rollout_is_batch_norm_factor"] < 1  # most weights below 1: e^-2 and e^-0.05


def loss_and_grad(w, items):
    w.actor.zero_grad(set_to_none=True)
    loss = train_terms(w, items)[0]
    loss.backward()
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in w.policy_parameters()]
    w.actor.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_tis_cap_is_token_rollout_is(setup):
    """trainer.tis_cap C gives rollout_is: token with rollout_is_threshold C's weights and loss."""
    model_dir, task, samples, prompts, groups = setup
    out = []
    for kw in (dict(tis_cap=1.5), dict(rollout_is="token", rollout_is_threshold=1.5)):
        w = TrainerWorker(TrainerConfig(algorithm="grpo", seed=0, **kw), model_dir, task, device="cpu")
        w.begin_iteration(0, prompts, groups)
        items = prepare_batch(w, samples)
        for p in items:
            p.adv = torch.linspace(-1.0, 1.0, p.num_tokens)
        out.append((torch.cat([p.tis_weight for p in items]), train_terms(w, items)[0]))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
