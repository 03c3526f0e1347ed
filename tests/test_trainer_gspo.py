"""``trainer.policy_loss: gspo`` (GSPO, Zheng et al. 2025; verl's ``policy_loss.loss_mode: gspo``):
the loss and its gradient against independent references on packed batches of unequal lengths
(the paper's sequence-level objective, and the token form written out), clipping decided per
sequence, PPO's loss when every sequence has one token, verl's clamp, the config's refusals, and
the TrainerWorker's gradient against a whole-batch reference (any micro-batching), which is not
PPO's."""
import math
import re
from dataclasses import replace

import pytest
import torch

from controller.config import ConfigError, from_dict
from workers.model import load_pretrained
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer import config_names as trainer_config
from workers.trainer.losses import POLICY_LOSSES, aggregate_sum, gspo_terms, ppo_terms
# the whole-batch reference's helpers and its tiny model / task fixtures
from tests.test_trainer_math_grad import draw, group_adv, model_dir, seq_logits, task  # noqa: F401

torch.set_num_threads(1)
LENS = [4, 1, 7, 3, 2, 5]


def packed(lens, seed, noise=0.3, per_token_adv=False):
    """-> logp (leaf, float64) [N], old [N], adv [N], seq_index [N], seq_lens [B]."""
    g = torch.Generator().manual_seed(seed)
    n, b = sum(lens), len(lens)
    seq_index = torch.repeat_interleave(torch.arange(b), torch.tensor(lens))
    old = -1.0 - torch.rand(n, generator=g, dtype=torch.float64)
    logp = (old + noise * torch.randn(n, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(n if per_token_adv else b, generator=g, dtype=torch.float64)
    return logp, old, adv if per_token_adv else adv[seq_index], seq_index, torch.tensor(lens)


def gspo_mean(logp, old, adv, seq_index, seq_lens, lo, hi):
    """Ours under loss_agg seq_mean, divided by the sequences: (loss, terms)."""
    terms = gspo_terms(logp, old, adv, seq_index, seq_lens, lo, hi)
    return aggregate_sum(terms.loss, seq_index, seq_lens, "seq_mean") / len(seq_lens), terms


def sequence_level_reference(logp, old, adv, lens, lo, hi):
    """The paper's objective, one sequence at a time: s_i = (pi(y_i) / pi_old(y_i))^(1 / |y_i|)
    differentiated as a whole, loss_i = max(-A_i s_i, -A_i clip(s_i)), averaged over sequences."""
    total, start = 0.0, 0
    for n in lens:
        lp, o, a = logp[start:start + n], old[start:start + n], float(adv[start])
        s = torch.exp((lp.sum() - o.sum()) / n)
        total = total + torch.maximum(-a * s, -a * s.clamp(1 - lo, 1 + hi))
        start += n
    return total / len(lens)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_and_gradient_equal_the_sequence_level_objective(seed):
    """A constant over each sequence (GRPO / RLOO): the token form's gradient is the gradient of
    the sequence-level objective, s_i * A_i * mean_t grad logp_t, clipped or not as a whole."""
    lo, hi = 0.04, 0.05
    logp, old, adv, seq_index, seq_lens = packed(LENS, seed)
    loss, terms = gspo_mean(logp, old, adv, seq_index, seq_lens, lo, hi)
    (grad,) = torch.autograd.grad(loss, logp)
    ref_logp = logp.detach().clone().requires_grad_()
    want = sequence_level_reference(ref_logp, old, adv, LENS, lo, hi)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert torch.allclose(grad, ref_logp.grad, rtol=1e-12, atol=1e-15)
    per_seq = terms.clipped.split(LENS)
    assert all(len(set(c.tolist())) == 1 for c in per_seq)  # clipped (or not) as a whole sequence
    assert 0 < sum(c[0].item() for c in per_seq) < len(LENS)  # both branches taken


def test_gradient_of_each_token_is_the_formula_with_token_advantages():
    """A per token (GAE): token t of sequence i gets -A_t * s_i / (|y_i| B) where its clipped
    surrogate is not the larger, else 0; the value of every token of sequence i is s_i."""
    lo, hi = 0.03, 0.04
    logp, old, adv, seq_index, seq_lens = packed(LENS, seed=3, per_token_adv=True)
    loss, terms = gspo_mean(logp, old, adv, seq_index, seq_lens, lo, hi)
    (grad,) = torch.autograd.grad(loss, logp)
    b, start, want_loss, want_grad, clipped = len(LENS), 0, 0.0, [], []
    for n in LENS:
        s = math.exp(sum(logp[start + t].item() - old[start + t].item() for t in range(n)) / n)
        for t in range(n):
            a = adv[start + t].item()
            clip = (a > 0 and s > 1 + hi) or (a < 0 and s < 1 - lo)
            want_loss += -a * (min(max(s, 1 - lo), 1 + hi) if clip else s) / (n * b)
            want_grad.append(0.0 if clip else -a * s / (n * b))
            clipped.append(float(clip))
            assert terms.ratio[start + t].item() == pytest.approx(s, rel=1e-12)
        start += n
    assert loss.item() == pytest.approx(want_loss, rel=1e-12)
    assert grad.tolist() == pytest.approx(want_grad, rel=1e-10, abs=1e-15)
    assert terms.clipped.tolist() == clipped and 0 < sum(clipped) < len(clipped)


def test_a_sequence_out_of_range_gets_no_gradient_on_the_clipped_side():
    """Sequence ratios 1.5 and 0.5 (clip 0.2), each from tokens whose own ratios straddle the
    range: with A pushing further out (A > 0 at 1.5, A < 0 at 0.5) every token of the sequence is
    clipped and gets 0; with A pulling back it is not clipped and every token gets -A s / L. PPO
    on the same tokens clips some of a sequence's tokens and not others."""
    shape = torch.tensor([0.5, -0.5, 0.0], dtype=torch.float64)  # token log-ratios around the mean
    means = [math.log(1.5), math.log(1.5), math.log(0.5), math.log(0.5)]
    advs = [1.0, -1.0, -1.0, 1.0]
    old = torch.full((12,), -1.0, dtype=torch.float64)
    logp = (old + torch.cat([m + shape for m in means])).requires_grad_()
    adv = torch.tensor(advs, dtype=torch.float64).repeat_interleave(3)
    seq_index, seq_lens = torch.arange(4).repeat_interleave(3), torch.tensor([3] * 4)
    loss, terms = gspo_mean(logp, old, adv, seq_index, seq_lens, 0.2, 0.2)
    (grad,) = torch.autograd.grad(loss, logp)
    grad, clipped = grad.view(4, 3), terms.clipped.view(4, 3)
    assert torch.allclose(terms.ratio.view(4, 3)[:, 0], torch.tensor([1.5, 1.5, 0.5, 0.5], dtype=torch.float64))
    for i, (a, s) in enumerate(zip(advs, (1.5, 1.5, 0.5, 0.5))):
        if i in (0, 2):  # pushed further out: clipped, no gradient
            assert clipped[i].tolist() == [1.0] * 3 and grad[i].tolist() == [0.0] * 3
        else:
            assert clipped[i].tolist() == [0.0] * 3
            assert grad[i].tolist() == pytest.approx([-a * s / (3 * 4)] * 3, rel=1e-12)
    ppo = ppo_terms(logp, old, adv, 0.2, 0.2)
    assert ppo.clipped.view(4, 3)[0].tolist() == [1.0, 0.0, 1.0]  # ratios 2.47, 0.91, 1.5 with A > 0


def test_equals_ppo_when_every_sequence_has_one_token():
    lens = [1] * 40
    logp, old, adv, seq_index, seq_lens = packed(lens, seed=4, noise=0.5)
    gspo = gspo_terms(logp, old, adv, seq_index, seq_lens, 0.2, 0.28)
    ppo = ppo_terms(logp, old, adv, 0.2, 0.28)
    assert torch.allclose(gspo.loss, ppo.loss, rtol=1e-14) and torch.equal(gspo.clipped, ppo.clipped)
    assert torch.allclose(gspo.ratio, ppo.ratio, rtol=1e-14) and 0 < ppo.clipped.sum() < len(lens)
    (g_gspo,) = torch.autograd.grad(gspo.loss.sum(), logp)
    (g_ppo,) = torch.autograd.grad(ppo.loss.sum(), logp)
    assert torch.allclose(g_gspo, g_ppo, rtol=1e-14)
    # the registry passes the packed layout through
    via = POLICY_LOSSES["gspo"](logp, old, adv, seq_index, seq_lens, 0.2, 0.28, None)
    assert torch.equal(via.loss, gspo.loss)


def test_log_ratio_clamped_at_10_as_verl():
    """verl clamps log s_i,t at 10 (above only): a sequence whose mean log-ratio is 12 has ratio
    e^10 and no gradient (even on its unclipped side, A < 0); one at -30 keeps e^-30."""
    old = torch.zeros(4, dtype=torch.float64)
    logp = torch.tensor([11.0, 13.0, -29.0, -31.0], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([-1.0, -1.0, 1.0, 1.0], dtype=torch.float64)
    terms = gspo_terms(logp, old, adv, torch.tensor([0, 0, 1, 1]), torch.tensor([2, 2]), 0.2, 0.2)
    assert terms.ratio.tolist() == pytest.approx([math.exp(10)] * 2 + [math.exp(-30)] * 2, rel=1e-12)
    (grad,) = torch.autograd.grad(terms.loss.sum(), logp)
    assert grad[:2].tolist() == [0.0, 0.0] and (grad[2:] < 0).all()


def test_config_takes_gspo_with_seq_mean_and_refuses_the_rest():
    assert trainer_config.POLICY_LOSSES == tuple(POLICY_LOSSES)
    assert TrainerConfig().policy_loss == "ppo"
    cfg = TrainerConfig(policy_loss="gspo", loss_agg="seq_mean", clip_low=3e-4, clip_high=4e-4, tis_cap=2.0)
    assert cfg.policy_loss == "gspo"  # tis_cap: its per-token weights multiply the loss, as verl's
    for agg in ("token_mean", "seq_mean_token_sum"):
        with pytest.raises(ValueError, match=rf"^trainer.loss_agg: policy_loss 'gspo' .*set loss_agg: seq_mean, "
                                             rf"not '{agg}'"):
            TrainerConfig(policy_loss="gspo", loss_agg=agg)
    with pytest.raises(ValueError, match=r"^trainer.loss_agg: policy_loss 'gspo'"):
        TrainerConfig(policy_loss="gspo", loss_agg="seq_mean_token_sum_norm", loss_scale_factor=16)
    with pytest.raises(ValueError, match=r"^trainer.dual_clip \(3.0\): policy_loss 'gspo' has no dual clip"):
        TrainerConfig(policy_loss="gspo", loss_agg="seq_mean", dual_clip=3.0)
    with pytest.raises(ValueError, match=r"^trainer.policy_loss: 'vanilla' is verl's name; here it is 'ppo'"):
        TrainerConfig(policy_loss="vanilla")
    with pytest.raises(ValueError, match=re.escape("trainer.policy_loss: 'bypass_mode' is not one of ('ppo', 'gspo', "
                                                   "'cispo', 'geo_mean', 'sapo', 'gpg', 'clip_cov', 'kl_cov')")):
        TrainerConfig(policy_loss="bypass_mode")
    # a run config: the same message, as a config error
    with pytest.raises(ConfigError, match=r"trainer.loss_agg: policy_loss 'gspo'"):
        from_dict({"trainer": {"policy_loss": "gspo"}})
    assert from_dict({"trainer": {"policy_loss": "gspo", "loss_agg": "seq_mean"}}).trainer.policy_loss == "gspo"


# ---- the TrainerWorker: gradient against a whole-batch reference, and not PPO's -----------------
def reference(model_dir, task, tok, samples, prompts, cfg):
    """GRPO advantages, the sequence-level GSPO objective with s_i differentiated whole, plus
    kl_coef * the sequence's mean of k2 (k3+'s gradient), averaged over sequences; -> (grads,
    mean ratio, fraction of sequences clipped)."""
    actor = load_pretrained(model_dir, "cpu", dtype=torch.float32)
    ref = load_pretrained(model_dir, "cpu", dtype=torch.float32)
    scores = [task.score(prompts[s.sample_id], tok.decode(s.output_ids)) for s in samples]
    adv = [0.0] * len(samples)
    for gid in {s.group_id for s in samples}:
        members = [i for i, s in enumerate(samples) if s.group_id == gid]
        for i, a in zip(members, group_adv(cfg, [scores[i] for i in members])):
            adv[i] = a
    loss, ratios, clipped = 0.0, [], 0
    for i, s in enumerate(samples):
        lp = torch.log_softmax(seq_logits(actor, s, 1.0), -1).gather(-1, s.output_ids[:, None]).squeeze(-1)
        with torch.no_grad():
            rlp = torch.log_softmax(seq_logits(ref, s, 1.0), -1).gather(-1, s.output_ids[:, None]).squeeze(-1)
        ratio = torch.exp((lp - s.logprobs).mean())
        unclipped, clip = -adv[i] * ratio, -adv[i] * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
        loss = loss + torch.maximum(unclipped, clip) + cfg.kl_coef * (0.5 * (lp - rlp) ** 2).mean()
        ratios.append(ratio.item())
        clipped += int(clip.item() > unclipped.item())
    (loss / len(samples)).backward()
    grads = {"actor." + k: p.grad.clone() for k, p in actor.named_parameters()}
    return grads, sum(ratios) / len(ratios), clipped / len(samples)


def train_one_step(model_dir, task, samples, prompts, groups, cfg):
    """-> (worker after its step, its gradient at the optimizer step, step result)."""
    w = TrainerWorker(cfg, model_dir, task, device="cpu")
    got = {}
    w.optimizer.register_step_pre_hook(
        lambda *_: got.update({"actor." + n: p.grad.clone() for n, p in w.actor.named_parameters()}))
    w.begin_iteration(0, prompts, groups)
    w.receive(samples)
    return w, got, w.step()


def test_worker_update_is_gspo_for_any_microbatching_and_differs_from_ppo(model_dir, task):
    samples, prompts, groups, tok = draw(model_dir, task)
    cfg = TrainerConfig(grad_clip=0.0, algorithm="grpo", policy_loss="gspo", loss_agg="seq_mean", clip_low=0.04,
                        clip_high=0.05, kl_coef=0.1, kl_estimator="k3+", lr=1e-2)
    want, ratio, clipfrac = reference(model_dir, task, tok, samples, prompts, cfg)
    scale = max(v.abs().max().item() for v in want.values())
    assert scale > 1e-3 and 0 < clipfrac < 1  # a real gradient; both clip branches
    for budget in (10**6, 25):  # one micro-batch, and sequences spread over many
        w, got, res = train_one_step(model_dir, task, samples, prompts, groups,
                                     replace(cfg, max_tokens_per_microbatch=budget))
        assert res.version == 1 and res.metrics["step_skipped"] == 0 and set(got) == set(want)
        for k in want:
            err = (got[k] - want[k]).abs().max().item()
            assert err <= 1e-5 * scale, (budget, k, err, scale)
        # the logged ratio is the mean sequence ratio, clipfrac the fraction of sequences clipped
        assert res.metrics["ratio"] == pytest.approx(ratio, rel=1e-5)
        assert res.metrics["clipfrac"] == pytest.approx(clipfrac, abs=1e-6)  # float32 sums
    gspo_weights = {k: v.clone() for k, v in w.actor.state_dict().items()}
    w_ppo, ppo_grads, res_ppo = train_one_step(model_dir, task, samples, prompts, groups,
                                               replace(cfg, policy_loss="ppo"))
    assert res_ppo.version == 1
    assert max((ppo_grads[k] - want[k]).abs().max().item() for k in want) > 0.05 * scale
    moved = max((gspo_weights[k] - v).abs().max().item() for k, v in w_ppo.actor.state_dict().items())
    assert moved > 1e-4  # the two updates land on different weights
