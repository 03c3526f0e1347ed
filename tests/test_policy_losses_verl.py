"""verl's other policy losses (``trainer.policy_loss``: cispo, geo_mean, sapo, gpg, clip_cov,
kl_cov): each one's loss and gradient against a transcription of verl's formula (its padded
[B, T] layout, ``response_mask``, ``agg_loss``; verl/trainer/ppo/core_algos.py) on random packed
batches with clipped tokens and negative advantages; the config's keys and refusals; and a
TrainerWorker step with each (finite, the weights move; the same update for any micro-batching
where the loss does not read the micro-batch)."""
import re
from dataclasses import replace

import pytest
import torch

from controller.config import ConfigError, from_dict
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer import config_names as trainer_config
from workers.trainer.losses import (POLICY_LOSSES, PolicyKnobs, aggregate_sum, clip_cov_terms, loss_divisor,
                                    ppo_terms, sequence_geometric_mean)
from workers.trainer.step_math import policy_knobs
# a drawn, perturbed (off-policy) batch of samples from the tiny model
from tests.test_trainer_gspo import packed as gspo_packed
from tests.test_trainer_math_grad import draw, model_dir, task  # noqa: F401

torch.set_num_threads(1)
LENS = [4, 1, 7, 3, 2, 5]
NEW_MODES = ("cispo", "geo_mean", "sapo", "gpg", "clip_cov", "kl_cov")


def packed(lens, seed, noise=0.3, per_token_adv=False, zero_adv=False):
    """tests/test_trainer_gspo's packed batch (``noise`` 0.3: many tokens past a 0.2 clip, both
    sides); ``zero_adv``: some tokens (and one whole sequence) with A = 0 exactly."""
    logp, old, adv, seq_index, seq_lens = gspo_packed(lens, seed, noise, per_token_adv)
    if zero_adv:
        adv = torch.where(seq_index == 1, 0.0, adv)
        adv[::5] = 0.0
    assert (adv < 0).any() and (adv > 0).any()
    return logp, old, adv, seq_index, seq_lens


def padded(x, seq_index, lens):
    """[N] -> [B, T] (zeros past each sequence; differentiable), and the response mask [B, T]."""
    b, t = len(lens), max(lens)
    col = torch.cat([torch.arange(n) for n in lens])
    out = torch.zeros(b, t, dtype=x.dtype).index_put((seq_index, col), x)
    mask = (torch.arange(t)[None, :] < torch.tensor(lens)[:, None]).to(x.dtype)
    return out, mask


# ---- verl's formulas, transcribed (padded [B, T], masked) --------------------------------------
def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum()


def agg_loss(mat, mask, mode):
    """verl's agg_loss for one micro-batch, no global batch info."""
    if mode == "token-mean":
        return (mat * mask).sum() / mask.sum()
    assert mode == "seq-mean-token-mean"
    lens = mask.sum(-1)
    return ((mat * mask).sum(-1) / (lens + 1e-8)).sum() / (lens > 0).sum()


def verl_cispo(old, logp, adv, mask, lo, hi, mode):
    neg_kl = torch.clamp(logp - old, -20.0, 20.0)
    ratio = torch.exp(neg_kl)
    clipped_ratio = torch.clamp(ratio, 1 - lo, 1 + hi)
    losses = -clipped_ratio.detach() * adv * logp
    return agg_loss(losses, mask, mode), masked_mean((ratio != clipped_ratio).float(), mask)


def verl_geo_mean(old, logp, adv, mask, lo, hi):
    neg_kl = logp - old
    sgn = torch.sign(adv)
    neg_kl_clamp = torch.clamp(neg_kl, -lo, hi)
    neg_kl_min = sgn * torch.min(sgn * neg_kl, sgn * neg_kl_clamp)
    n = mask.sum(-1)
    ratio = torch.exp((neg_kl_min * mask).sum(-1) / (n + 1e-8))
    a = (adv * mask).sum(-1) / (n + 1e-8)
    clipped = torch.ne(neg_kl, neg_kl_clamp)
    return torch.mean(-a * ratio), masked_mean((clipped * (adv > 0)).float(), mask), ratio


def verl_sapo(old, logp, adv, mask, tau_pos, tau_neg):
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    taus = torch.where(adv > 0, torch.as_tensor(tau_pos, dtype=adv.dtype), torch.as_tensor(tau_neg, dtype=adv.dtype))
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    return agg_loss(-gates * adv, mask, "seq-mean-token-mean")


def verl_gpg(old, logp, adv, mask, mode):
    return agg_loss(-logp * adv, mask, mode)


def verl_clip_cov(old, logp, adv, mask, lo, hi, ratio_k, lb, ub, mode):
    """Deterministic only when the candidates are at most clip_num (then all are taken)."""
    ratio = torch.exp(logp - old)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - lo, 1 + hi)
    by_origin = (pg2 > pg1) & (mask > 0)
    cov = (adv - masked_mean(adv, mask)) * (logp - masked_mean(logp.detach(), mask))
    cov[mask == 0] = -torch.inf
    cov[by_origin] = -torch.inf
    clip_num = max(int(ratio_k * mask.sum().item()), 1)
    idx = torch.nonzero((cov < ub) & (cov > lb) & (mask > 0))
    assert 0 < len(idx) <= clip_num, (len(idx), clip_num)
    corr = torch.ones_like(adv)
    corr[idx[:, 0], idx[:, 1]] = 0
    return agg_loss(torch.maximum(pg1, pg2) * corr, mask, mode), masked_mean((corr == 0).float(), mask)


def verl_kl_cov(old, logp, adv, mask, ratio_k, coef, mode):
    neg_kl = logp - old
    ratio = torch.exp(neg_kl)
    losses = -adv * ratio
    losses_kl = -adv * ratio + coef * neg_kl.abs()
    valid = mask > 0
    valid_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    a, lp = adv[valid].detach().reshape(-1), logp[valid].detach().reshape(-1)
    cov = (a - a.mean()) * (lp - lp.mean())
    top = valid_idx[torch.topk(cov, max(1, int(len(cov) * ratio_k)), largest=True).indices]
    losses = losses.clone()
    t = adv.shape[1]
    losses[top // t, top % t] = losses_kl[top // t, top % t]
    return agg_loss(losses, mask, mode)


# ---- ours vs verl's -----------------------------------------------------------------------------
AGG = {"token_mean": "token-mean", "seq_mean": "seq-mean-token-mean"}


def ours(mode, logp, old, adv, seq_index, seq_lens, lo=0.2, hi=0.2, knobs=PolicyKnobs(), agg="token_mean"):
    """-> (the mean loss as the update divides it, terms)."""
    terms = POLICY_LOSSES[mode](logp, old, adv, seq_index, seq_lens, lo, hi, None, knobs)
    total = aggregate_sum(terms.loss, seq_index, seq_lens, agg)
    return total / loss_divisor(float(len(logp)), float(len(seq_lens)), agg), terms


def both(loss_mode, verl_fn, seed, agg, per_token_adv, **kw):
    """-> (our loss, our grad, verl's loss, verl's grad, our terms, verl's extra outputs)."""
    logp, old, adv, seq_index, seq_lens = packed(LENS, seed, per_token_adv=per_token_adv,
                                                 zero_adv=kw.pop("zero_adv", False))
    loss, terms = ours(loss_mode, logp, old, adv, seq_index, seq_lens, agg=agg, **kw.pop("ours", {}))
    (grad,) = torch.autograd.grad(loss, logp)
    (lp2, mask), (old2, _), (adv2, _) = (padded(x, seq_index, LENS) for x in (logp, old, adv))
    out = verl_fn(old2, lp2, adv2, mask, **kw)
    want = out[0] if isinstance(out, tuple) else out
    (want_grad,) = torch.autograd.grad(want, logp)
    return loss, grad, want, want_grad, terms, out


def close(a, b, rtol=1e-7):
    """verl divides a sequence's sum by len + 1e-8: equal to ~1e-8 relative in float64 (exactly in float32)."""
    a, b = (torch.as_tensor(x, dtype=torch.float64) for x in (a, b))
    return torch.allclose(a, b, rtol=rtol, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("lo, hi", [(0.2, 0.28), (10.0, 0.2)])  # clip_low >= 1: no lower clip (MiniMax's)
def test_cispo_is_verls(seed, agg, lo, hi):
    loss, grad, want, want_grad, terms, (_, clipfrac) = both(
        "cispo", verl_cispo, seed, agg, per_token_adv=seed == 2, ours={"lo": lo, "hi": hi}, lo=lo, hi=hi,
        mode=AGG[agg])
    assert close(loss, want) and close(grad, want_grad)
    assert close(terms.clipped.mean(), clipfrac) and 0 < terms.clipped.sum() < len(grad)
    # every token keeps a gradient (the weight is constant), clipped or not
    assert (grad != 0).all()


def test_cispo_gradient_is_the_clipped_weight_times_reinforce():
    """d loss_t / d logp_t = -clip(r_t) A_t: the weight is a constant, logp the only live term."""
    logp, old, adv, seq_index, seq_lens = packed(LENS, seed=5)
    terms = POLICY_LOSSES["cispo"](logp, old, adv, seq_index, seq_lens, 0.2, 0.28, None)
    (grad,) = torch.autograd.grad(terms.loss.sum(), logp)
    assert torch.allclose(grad, -torch.exp(logp - old).clamp(0.8, 1.28).detach() * adv, rtol=1e-14)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_geo_mean_is_verls(seed):
    """Per-token advantages with zeros (seed 3's: verl's sign(A) = 0 makes that log-ratio 0),
    per-sequence ones otherwise; clip 0.2 / 0.3 in log space; loss_agg seq_mean = verl's mean of
    its sequence losses."""
    lo, hi = 0.2, 0.3
    loss, grad, want, want_grad, terms, (_, clipfrac, seq_ratio) = both(
        "geo_mean", verl_geo_mean, seed, "seq_mean", per_token_adv=seed >= 2, zero_adv=seed == 3,
        ours={"lo": lo, "hi": hi}, lo=lo, hi=hi)
    assert close(loss, want) and close(grad, want_grad)
    assert close(terms.clipped.mean(), clipfrac) and terms.clipped.sum() > 0
    first = torch.cumsum(torch.tensor([0] + LENS[:-1]), 0)
    assert close(terms.ratio[first], seq_ratio)  # the sequence's ratio, on each of its tokens
    # clipped on the advantage's side only (or A = 0): some tokens have no gradient, others do
    assert (grad == 0).any() and (grad != 0).sum() >= len(grad) // 2


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("taus", [(1.0, 1.05), (0.5, 3.0)])
def test_sapo_is_verls(seed, taus):
    knobs = PolicyKnobs(sapo_tau_pos=taus[0], sapo_tau_neg=taus[1])
    loss, grad, want, want_grad, terms, _ = both("sapo", verl_sapo, seed, "seq_mean", per_token_adv=seed == 1,
                                                 ours={"knobs": knobs}, tau_pos=taus[0], tau_neg=taus[1])
    assert close(loss, want) and close(grad, want_grad)
    assert terms.clipped.sum() == 0


def test_sapo_gradient_is_ppos_on_policy():
    """At r = 1 the gate's slope is 1: the gradient is -A grad logp, whatever tau."""
    logp, _, adv, seq_index, seq_lens = packed(LENS, seed=6)
    terms = POLICY_LOSSES["sapo"](logp, logp.detach(), adv, seq_index, seq_lens, 0.2, 0.2, None,
                                  PolicyKnobs(sapo_tau_pos=0.7, sapo_tau_neg=4.0))
    (grad,) = torch.autograd.grad(terms.loss.sum(), logp)
    assert torch.allclose(grad, -adv, rtol=1e-12)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_gpg_is_verls(agg):
    loss, grad, want, want_grad, terms, _ = both("gpg", verl_gpg, 0, agg, per_token_adv=True, mode=AGG[agg])
    assert close(loss, want) and close(grad, want_grad) and terms.clipped.sum() == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_clip_cov_is_verls_when_every_candidate_is_taken(seed, agg):
    """cov range (0.02, 0.3) and a share of 0.5 of the 22 tokens: a few candidates, all taken,
    so verl's random draw does not matter; they get loss 0 and no gradient."""
    knobs = PolicyKnobs(clip_cov_ratio=0.5, clip_cov_lb=0.02, clip_cov_ub=0.3)
    loss, grad, want, want_grad, terms, (_, clipfrac) = both(
        "clip_cov", verl_clip_cov, seed, agg, per_token_adv=seed == 2, ours={"lo": 0.2, "hi": 0.2, "knobs": knobs},
        lo=0.2, hi=0.2, ratio_k=0.5, lb=0.02, ub=0.3, mode=AGG[agg])
    assert close(loss, want) and close(grad, want_grad)
    assert close(terms.clipped.mean(), clipfrac) and terms.clipped.sum() > 0
    assert (grad[terms.clipped > 0] == 0).all()


def test_clip_cov_draws_uniformly_among_more_candidates_than_it_takes():
    """More candidates than max(int(ratio N), 1): exactly that many, all candidates (PPO-unclipped,
    cov in range), each about equally often; the others keep PPO's loss."""
    logp, old, adv, seq_index, seq_lens = packed([40, 60], seed=7)
    cov = (adv - adv.mean()) * (logp.detach() - logp.detach().mean())
    ppo = ppo_terms(logp, old, adv, 0.2, 0.2)
    candidate = (cov > 0.01) & (cov < 5.0) & (ppo.clipped == 0)
    k = int(0.05 * 100)
    assert candidate.sum() > 2 * k
    counts = torch.zeros(100)
    torch.manual_seed(0)
    for _ in range(400):
        t = clip_cov_terms(logp, old, adv, 0.2, 0.2, 0.05, 0.01, 5.0)
        chosen = t.clipped > 0
        assert chosen.sum() == k and not (chosen & ~candidate).any()
        assert (t.loss[chosen] == 0).all() and torch.equal(t.loss[~chosen], ppo.loss[~chosen])
        counts += chosen.double()
    expect = 400 * k / candidate.sum().item()
    assert counts[~candidate].sum() == 0
    assert counts[candidate].min() > 0.4 * expect and counts[candidate].max() < 1.8 * expect


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_kl_cov_is_verls(seed, agg):
    knobs = PolicyKnobs(kl_cov_ratio=0.2, kl_cov_coef=0.5)
    loss, grad, want, want_grad, terms, _ = both("kl_cov", verl_kl_cov, seed, agg, per_token_adv=seed == 2,
                                                 ours={"knobs": knobs}, ratio_k=0.2, coef=0.5, mode=AGG[agg])
    assert close(loss, want) and close(grad, want_grad)
    assert terms.clipped.sum() == int(0.2 * sum(LENS))  # the penalised tokens
    # with verl's default share (2e-4) one token of a micro-batch is penalised
    assert POLICY_LOSSES["kl_cov"](*packed(LENS, seed)[:5], 0.2, 0.2, None).clipped.sum() == 1


def test_geo_mean_truncated_weights_enter_as_each_sequences_geometric_mean():
    """verl's geo_mean weights its sequence loss by exp(mean log(w_t + 1e-10))."""
    w = torch.tensor([0.5, 2.0, 1.0, 1e-3, 4.0], dtype=torch.float64)
    got = sequence_geometric_mean(w, torch.tensor([0, 0, 1, 1, 1]), torch.tensor([2, 3]))
    want = [1.0, 1.0] + [(1.0 * (1e-3 + 1e-10) * 4.0) ** (1 / 3)] * 3
    assert got.tolist() == pytest.approx(want, rel=1e-9)


# ---- the config ---------------------------------------------------------------------------------
def test_config_registry_and_knobs_match_the_losses():
    assert trainer_config.POLICY_LOSSES == tuple(POLICY_LOSSES)
    cfg = TrainerConfig()
    assert policy_knobs(cfg) == PolicyKnobs()  # verl's defaults, the same names
    assert (cfg.sapo_tau_pos, cfg.sapo_tau_neg, cfg.clip_cov_ratio, cfg.clip_cov_lb, cfg.clip_cov_ub,
            cfg.kl_cov_ratio, cfg.kl_cov_coef) == (1.0, 1.05, 2e-4, 1.0, 5.0, 2e-4, 0.1)
    fields = set(TrainerConfig.__dataclass_fields__)
    for knobs in trainer_config.POLICY_LOSS_KNOBS.values():
        assert set(knobs) <= fields
    for ours_ in trainer_config.VERL_POLICY_LOSS_KEYS.values():
        assert ours_.split()[0].removeprefix("trainer.") in fields


@pytest.mark.parametrize("mode", NEW_MODES)
def test_config_takes_each_mode(mode):
    agg = "seq_mean" if mode in trainer_config.SEQ_MEAN_POLICY_LOSSES else "token_mean"
    cfg = from_dict({"trainer": {"policy_loss": mode, "loss_agg": agg}}).trainer
    assert cfg.policy_loss == mode and cfg.tis_per_sequence == (mode == "geo_mean")


def test_config_refusals_name_the_key():
    def refused(match, **kw):
        with pytest.raises(ValueError, match=match):
            TrainerConfig(**kw)

    for mode in ("sapo", "geo_mean"):  # verl forces seq-mean-token-mean
        refused(rf"^trainer.loss_agg: policy_loss '{mode}' .*set loss_agg: seq_mean, not 'token_mean'",
                policy_loss=mode)
    for mode in ("cispo", "geo_mean", "sapo", "gpg", "clip_cov", "kl_cov"):
        agg = "seq_mean" if mode in ("sapo", "geo_mean") else "token_mean"
        refused(rf"^trainer.dual_clip \(3.0\): policy_loss '{mode}' has no dual clip", policy_loss=mode,
                loss_agg=agg, dual_clip=3.0)
    refused(r"^trainer.sapo_tau_pos \(2.0\): policy_loss 'ppo' has no use for it; only 'sapo' read it",
            sapo_tau_pos=2.0)
    refused(r"^trainer.clip_high \(0.28\): policy_loss 'sapo' has no use for it; only 'ppo' / 'gspo' / 'cispo'",
            policy_loss="sapo", loss_agg="seq_mean", clip_high=0.28)
    refused(r"^trainer.clip_low \(0.1\): policy_loss 'kl_cov'", policy_loss="kl_cov", clip_low=0.1)
    refused(r"^trainer.kl_cov_ratio \(0.01\): policy_loss 'clip_cov' .*only 'kl_cov' read it", policy_loss="clip_cov",
            kl_cov_ratio=0.01)
    refused(r"^trainer.clip_cov_ub \(3.0\): policy_loss 'gpg'", policy_loss="gpg", clip_cov_ub=3.0)
    refused(r"^trainer.sapo_tau_neg must be > 0, got 0.0", policy_loss="sapo", loss_agg="seq_mean", sapo_tau_neg=0.0)
    refused(r"^trainer.kl_cov_coef must be > 0, got -0.1", policy_loss="kl_cov", kl_cov_coef=-0.1)
    for bad in (0.0, 1.5):
        refused(rf"^trainer.clip_cov_ratio must be in \(0, 1\], got {bad}", policy_loss="clip_cov", clip_cov_ratio=bad)
        refused(rf"^trainer.kl_cov_ratio must be in \(0, 1\], got {bad}", policy_loss="kl_cov", kl_cov_ratio=bad)
    refused(r"^trainer.clip_cov_lb \(5.0\) must be < trainer.clip_cov_ub \(5.0\)", policy_loss="clip_cov",
            clip_cov_lb=5.0)
    refused(r"^trainer.clip_low must be < 1, got 1.5", clip_low=1.5)
    refused(r"^trainer.clip_low must be < 1, got 1.5", policy_loss="clip_cov", clip_low=1.5)
    assert TrainerConfig(policy_loss="cispo", clip_low=10.0).clip_low == 10.0  # no lower clip
    assert TrainerConfig(policy_loss="geo_mean", loss_agg="seq_mean", clip_low=1.2).clip_low == 1.2  # log space
    for verl, ours_ in (("vanilla", "ppo"), ("clip-cov", "clip_cov"), ("kl-cov", "kl_cov")):
        refused(rf"^trainer.policy_loss: '{verl}' is verl's name; here it is '{ours_}'", policy_loss=verl)
    refused(re.escape("trainer.policy_loss: 'bypass_mode' is not one of ('ppo', 'gspo', 'cispo', 'geo_mean', "
                      "'sapo', 'gpg', 'clip_cov', 'kl_cov')"), policy_loss="bypass_mode")


def test_run_config_refuses_bad_values_and_verls_key_names():
    with pytest.raises(ConfigError, match=r"trainer.clip_cov_ratio must be in \(0, 1\]"):
        from_dict({"trainer": {"policy_loss": "clip_cov", "clip_cov_ratio": 0}})
    with pytest.raises(ConfigError, match=r"trainer.loss_agg: policy_loss 'sapo'"):
        from_dict({"trainer": {"policy_loss": "sapo"}})
    with pytest.raises(ConfigError, match=r"trainer.sapo_tau_pos \(1.5\): policy_loss 'cispo'"):
        from_dict({"trainer": {"policy_loss": "cispo", "sapo_tau_pos": 1.5}})
    for verl in trainer_config.VERL_POLICY_LOSS_KEYS:  # verl's names are not keys here
        with pytest.raises(ConfigError, match=rf"^trainer.{verl}: unknown key"):
            from_dict({"trainer": {"policy_loss": "sapo", "loss_agg": "seq_mean", verl: 1.0}})


# ---- a TrainerWorker step with each -------------------------------------------------------------
@pytest.fixture(scope="module")
def drawn(model_dir, task):
    return draw(model_dir, task)[:3]


def train_one_step(model_dir, task, drawn, cfg):
    """-> (step result, the gradient at the optimizer step, the weights before, the worker)."""
    samples, prompts, groups = drawn
    w = TrainerWorker(cfg, model_dir, task, device="cpu")
    before = {k: v.clone() for k, v in w.actor.state_dict().items()}
    got = {}
    w.optimizer.register_step_pre_hook(
        lambda *_: got.update({n: p.grad.clone() for n, p in w.actor.named_parameters()}))
    w.begin_iteration(0, prompts, groups)
    w.receive(samples)
    return w.step(), got, before, w


def step_config(mode, **kw):
    agg = "seq_mean" if mode in trainer_config.SEQ_MEAN_POLICY_LOSSES else "token_mean"
    knobs = {"clip_cov": {"clip_cov_ratio": 0.1, "clip_cov_lb": 0.0}, "kl_cov": {"kl_cov_ratio": 0.1}}.get(mode, {})
    return TrainerConfig(algorithm="grpo", policy_loss=mode, loss_agg=agg, lr=1e-2, grad_clip=0.0, **knobs, **kw)


@pytest.mark.parametrize("mode", NEW_MODES)
def test_worker_step_trains(model_dir, task, drawn, mode):
    res, grads, before, w = train_one_step(model_dir, task, drawn, step_config(mode))
    m = res.metrics
    assert res.version == 1 and m["step_skipped"] == 0
    assert all(torch.isfinite(torch.tensor(m[k])) for k in ("pg_loss", "clipfrac", "ratio", "grad_norm"))
    assert m["grad_norm"] > 1e-4
    moved = max((before[k] - v).abs().max().item() for k, v in w.actor.state_dict().items())
    assert moved > 1e-4
    if mode in ("cispo", "geo_mean", "clip_cov", "kl_cov"):  # the drawn samples are off-policy: some clipped / picked
        assert 0 < m["clipfrac"] < 1


@pytest.mark.parametrize("mode", ["cispo", "geo_mean", "sapo", "gpg"])
def test_worker_update_does_not_depend_on_the_microbatching(model_dir, task, drawn, mode):
    """The losses that read no micro-batch statistic: one micro-batch or many, the same gradient
    (geo_mean: with truncated importance weights, one per sequence)."""
    cfg = step_config(mode, tis_cap=2.0 if mode == "geo_mean" else 0.0)
    _, want, _, _ = train_one_step(model_dir, task, drawn, replace(cfg, max_tokens_per_microbatch=10**6))
    _, got, _, _ = train_one_step(model_dir, task, drawn, replace(cfg, max_tokens_per_microbatch=25))
    scale = max(v.abs().max().item() for v in want.values())
    assert scale > 1e-4
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5 * scale
