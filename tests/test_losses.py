"""RL maths vs hand-computed numbers and independent loop-based references."""
import math

import pytest
import torch

from workers.trainer.advantages import gae, grpo, rloo, whiten
from workers.trainer.kl import kl_k1, kl_k3
from workers.trainer.losses import (aggregate_sum, entropy_from_logits, fraction_agg, loss_divisor, policy_loss,
                                    value_loss)

torch.set_num_threads(1)


def ref_policy_loss(logp, old, adv, lo, hi, dual):
    out = []
    for lp, o, a in zip(logp.tolist(), old.tolist(), adv.tolist()):
        r = math.exp(lp - o)
        loss = max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
        if dual is not None and a < 0:
            loss = min(loss, -a * dual)
        out.append(loss)
    return torch.tensor(out)


def test_policy_loss_hand_computed():
    # ratio 2 with A=+1 clipped at 1+0.28; ratio 0.5 with A=-1 clipped at 1-0.2 -> max(0.5, 0.8)
    logp = torch.log(torch.tensor([2.0, 0.5, 1.0]))
    old = torch.zeros(3)
    adv = torch.tensor([1.0, -1.0, 0.5])
    loss, clipped = policy_loss(logp, old, adv, clip_low=0.2, clip_high=0.28)
    assert torch.allclose(loss, torch.tensor([-1.28, 0.8, -0.5]), atol=1e-6)
    assert clipped.tolist() == [1.0, 1.0, 0.0]


def test_policy_loss_log_ratio_clamped_as_verl():
    """verl clamps log(ratio) to [-20, 20] before exp: a far-off token (log-ratio 100, A < 0,
    no dual clip) gives a finite loss of exp(20), not inf, and no gradient (clipped anyway)."""
    logp = torch.tensor([100.0, 0.1], requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(2), torch.tensor([-1.0, 1.0]), 0.2, 0.2)
    assert torch.isfinite(loss).all() and loss[0].item() == pytest.approx(float(torch.tensor(20.0).exp()))
    loss.sum().backward()
    assert logp.grad[0].item() == 0.0 and logp.grad[1].item() != 0.0


def test_dual_clip_bounds_negative_advantage():
    logp, old, adv = torch.log(torch.tensor([10.0])), torch.zeros(1), torch.tensor([-1.0])
    assert policy_loss(logp, old, adv, 0.2, 0.2)[0].item() == pytest.approx(10.0)
    assert policy_loss(logp, old, adv, 0.2, 0.2, dual_clip=3.0)[0].item() == pytest.approx(3.0)


@pytest.mark.parametrize("dual", [None, 3.0])
def test_policy_loss_matches_loop_reference(dual):
    g = torch.Generator().manual_seed(0)
    logp, old, adv = (torch.randn(200, generator=g) for _ in range(3))
    loss, _ = policy_loss(logp, old, adv, 0.2, 0.3, dual)
    assert torch.allclose(loss, ref_policy_loss(logp, old, adv, 0.2, 0.3, dual), atol=1e-5)


def test_aggregate_token_and_seq_mean():
    x = torch.tensor([1.0, 2.0, 3.0, 10.0])
    seq_index, seq_lens = torch.tensor([0, 0, 0, 1]), torch.tensor([3, 1])
    assert aggregate_sum(x, seq_index, seq_lens, "token_mean").item() == 16.0
    assert aggregate_sum(x, seq_index, seq_lens, "seq_mean").item() == pytest.approx(2.0 + 10.0)
    with pytest.raises(ValueError, match="loss_agg"):
        aggregate_sum(x, seq_index, seq_lens, "bogus")


def verl_agg_loss(loss_mat, loss_mask, mode, loss_scale_factor=None):
    """verl's core_algos.agg_loss (volcengine/verl b178a3c) on one batch, dp_size 1."""
    if mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    if mode == "seq-mean-token-sum":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        return (seq_losses * seq_mask).sum() / seq_mask.sum()
    if mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).float()
        return (seq_losses * seq_mask).sum() / seq_mask.sum()
    assert mode == "seq-mean-token-sum-norm"
    return torch.sum(torch.sum(loss_mat * loss_mask, dim=-1)) / (loss_scale_factor or loss_mask.shape[-1])


@pytest.mark.parametrize("mode,verl", [("token_mean", "token-mean"), ("seq_mean", "seq-mean-token-mean"),
                                       ("seq_mean_token_sum", "seq-mean-token-sum"),
                                       ("seq_mean_token_sum_norm", "seq-mean-token-sum-norm")])
def test_aggregation_modes_match_verl(mode, verl):
    """Our SUM / loss_divisor == verl's agg_loss over the padded batch. verl's norm mode divides
    by the padded response length (here 7, the batch's width: what train.max_tokens fills in);
    its actor then averages over the mini-batch's sequences (loss_scale_factor = micro / mini
    batch size), which is the sequence count in our divisor."""
    g = torch.Generator().manual_seed(0)
    lens = [3, 1, 7, 5]
    x = torch.randn(sum(lens), generator=g)
    seq_index = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    mat, mask = torch.zeros(len(lens), 7), torch.zeros(len(lens), 7)
    for b, part in enumerate(x.split(lens)):
        mat[b, :len(part)], mask[b, :len(part)] = part, 1.0
    want = verl_agg_loss(mat, mask, verl)
    if verl == "seq-mean-token-sum-norm":
        want = want / len(lens)
    got = aggregate_sum(x, seq_index, torch.tensor(lens), mode) / loss_divisor(sum(lens), len(lens), mode, scale=7)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    with pytest.raises(ValueError, match="scale"):
        loss_divisor(16, 4, "seq_mean_token_sum_norm")
    # per-token fractions stay fractions: token-summing modes average them over tokens
    assert fraction_agg(mode) == (mode if mode in ("token_mean", "seq_mean") else "token_mean")


def test_value_loss_clipped():
    v, old, ret = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]), torch.tensor([2.0, 1.0])
    # token 0: unclipped (1-2)^2 = 1, clipped v=0.2: (0.2-2)^2 = 3.24 -> max -> 0.5 * 3.24
    assert torch.allclose(value_loss(v, old, ret, 0.2), torch.tensor([1.62, 0.5]))


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert torch.allclose(kl_k1(logp, ref), torch.tensor([0.5, -1.0]))
    lr = ref - logp
    assert torch.allclose(kl_k3(logp, ref), lr.exp() - lr - 1)
    assert (kl_k3(torch.randn(100), torch.randn(100)) >= 0).all()
    # both unbiased for KL(p||q): E_p[k] == sum p log(p/q)
    p, q = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.3, 0.3, 0.4])
    exact = (p * (p / q).log()).sum()
    for est in (kl_k1, kl_k3):
        assert (p * est(p.log(), q.log())).sum().item() == pytest.approx(exact.item(), abs=1e-6)


def verl_low_var_kl(logprob, ref_logprob):
    """verl's kl_penalty_forward(..., "low_var_kl") (volcengine/verl b178a3c), verbatim."""
    kl = ref_logprob - logprob
    kl = torch.clamp(kl, min=-20, max=20)
    ratio = torch.exp(kl)
    kld = (ratio - kl - 1).contiguous()
    return torch.clamp(kld, min=-10, max=10)


def test_k3_is_verls_low_var_kl_clamps_and_gradient_included():
    # log r = ref - logp from -30 to 30: inside both clamps, past the estimate's clamp at 10
    # (log r ~ 2.53 or ~ -11), past the log-ratio's at 20
    log_r = torch.tensor([-30.0, -15.0, -11.5, -5.0, -0.3, 0.0, 0.7, 2.4, 2.6, 5.0, 19.0, 21.0, 30.0])
    ref = torch.randn(log_r.shape, generator=torch.Generator().manual_seed(0))
    lp_ours, lp_verl = (ref - log_r).requires_grad_(), (ref - log_r).requires_grad_()
    ours, want = kl_k3(lp_ours, ref), verl_low_var_kl(lp_verl, ref)
    assert torch.equal(ours, want) and ours.max().item() == 10.0  # one far-off token adds at most 10
    ours.sum().backward()
    want.sum().backward()
    assert torch.equal(lp_ours.grad, lp_verl.grad)
    # the clamp passes no gradient where the estimate is past 10; inside, d/dlogp = 1 - r
    past = ((log_r.exp() - log_r - 1) > 10)
    assert past.tolist() == [True, True, True] + [False] * 6 + [True] * 4
    assert (lp_ours.grad[past] == 0).all()
    inside = ~past
    assert torch.allclose(lp_ours.grad[inside], 1 - log_r[inside].exp(), rtol=1e-5)


def test_whiten_is_verls_masked_whiten():
    """verl's masked_whiten (verl/utils/torch_functional.py) over a padded batch == ours over
    the unpadded sequences; an all-equal batch and one token give 0, not NaN (verl: A * 1e-4 / n
    from the 1e-8 in its means' denominators, and an error for one token)."""
    g = torch.Generator().manual_seed(0)
    lens = [4, 1, 9, 6]
    advs = [3.0 + 2.0 * torch.randn(n, generator=g) for n in lens]
    vals, mask = torch.zeros(len(lens), 9), torch.zeros(len(lens), 9)
    for b, a in enumerate(advs):
        vals[b, :len(a)], mask[b, :len(a)] = a, 1.0
    mean = (vals * mask).sum() / (mask.sum() + 1e-8)  # masked_mean
    var = (((vals - mean) ** 2) * mask).sum() / (mask.sum() + 1e-8) * mask.sum() / (mask.sum() - 1)  # masked_var
    want = (vals - mean) * torch.rsqrt(var + 1e-8)
    got = whiten(advs)
    assert [len(a) for a in got] == lens
    for b, a in enumerate(got):
        assert torch.allclose(a, want[b, :len(a)], atol=1e-6)
    flat = torch.cat(got).double()
    assert abs(flat.mean().item()) < 1e-6 and flat.std().item() == pytest.approx(1.0, abs=1e-6)
    assert torch.cat(whiten([torch.full((3,), 0.7), torch.full((2,), 0.7)])).abs().max().item() < 1e-9
    assert whiten([torch.tensor([5.0])])[0].tolist() == [0.0]
    assert whiten([]) == []  # a data-parallel rank with no sample still takes part


def ref_entropy(logits):
    x = logits.double()
    return -(torch.softmax(x, -1) * torch.log_softmax(x, -1)).sum(-1)


def test_entropy():
    assert entropy_from_logits(torch.zeros(2, 4)).tolist() == pytest.approx([math.log(4)] * 2)
    # random logits from near-uniform (scale 0.1) to near-one-hot (scale 30), with a per-row
    # offset (softmax is shift-invariant), against a float64 reference
    g = torch.Generator().manual_seed(0)
    scale = torch.tensor([0.1, 1.0, 5.0, 30.0]).repeat_interleave(16)[:, None]  # [64, 1]
    logits = torch.randn(64, 300, generator=g) * scale + 3 * torch.randn(64, 1, generator=g)  # [64, 300]
    want = ref_entropy(logits)  # [64]
    assert want.min() < 1e-3 and want.max() > 5.0 and want.std() > 1.0  # the rows span the range
    got = entropy_from_logits(logits)
    assert got.shape == (64,) and got.dtype == torch.float32
    assert (got.double() - want).abs().max().item() < 5e-6  # fp32 rounding: <= 1.8e-6 measured over 5 seeds
    # bf16 logits (autocast) are computed in fp32: exact entropy of the bf16-rounded logits
    lb = logits.bfloat16()
    got = entropy_from_logits(lb)
    assert got.dtype == torch.float32 and (got.double() - ref_entropy(lb)).abs().max().item() < 5e-6


def ref_gae(rewards, values, gamma, lam):
    adv, last = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        nv = values[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + gamma * nv - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv


def test_gae_hand_computed():
    adv, ret = gae(torch.tensor([0.0, 1.0]), torch.tensor([0.5, 0.5]), gamma=1.0, lam=0.5)
    # delta1 = 1 - 0.5 = 0.5; delta0 = 0 + 0.5 - 0.5 = 0; A0 = 0 + 0.5*0.5 = 0.25
    assert adv.tolist() == pytest.approx([0.25, 0.5])
    assert ret.tolist() == pytest.approx([0.75, 1.0])


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_loop_reference(gamma, lam):
    g = torch.Generator().manual_seed(1)
    r, v = torch.randn(37, generator=g), torch.randn(37, generator=g)
    adv, ret = gae(r, v, gamma, lam)
    want = ref_gae(r.tolist(), v.tolist(), gamma, lam)
    assert adv.tolist() == pytest.approx(want, abs=1e-4)
    assert torch.allclose(ret, adv + v, atol=1e-5)


def test_grpo_and_rloo_vs_loops():
    s = torch.tensor([1.0, 0.0, 0.5, 0.5])
    mean = sum(s.tolist()) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in s.tolist()) / 3)
    assert grpo(s, eps=0.0).tolist() == pytest.approx([(x - mean) / std for x in s.tolist()], abs=1e-6)
    assert grpo(s, std_normalize=False).tolist() == pytest.approx([x - mean for x in s.tolist()])
    loo = [x - (sum(s.tolist()) - x) / 3 for x in s.tolist()]
    assert rloo(s).tolist() == pytest.approx(loo)
    assert rloo(torch.tensor([1.0])).tolist() == [0.0]
    assert grpo(torch.ones(4)).abs().max().item() == 0.0  # equal rewards: no signal, no NaN
    assert grpo(torch.full((4,), 0.5), eps=0.0).tolist() == [0.0] * 4  # adv_eps 0: was 0 / 0 = NaN
    # equal rewards that float32 cannot average exactly (0.7 x 8, 1/3 x 7): still exact zeros
    # (once ~0.05 each: the rounding of the mean divided by a std of the same size)
    for v, g in ((0.7, 8), (1 / 3, 8), (0.3, 7)):
        r = torch.full((g,), v)
        assert grpo(r).abs().max().item() == 0.0 and rloo(r).abs().max().item() == 0.0
        assert grpo(r, std_normalize=False).abs().max().item() == 0.0


@pytest.mark.parametrize("block", [1, 7, 37, 256])
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 0.0), (0.0, 0.5)])
def test_gae_blocked_scan_matches_loop_reference(block, gamma, lam):
    # blocks smaller than, dividing, equal to and larger than L = 37; gamma * lam == 0 too
    g = torch.Generator().manual_seed(2)
    r, v = torch.randn(37, generator=g), torch.randn(37, generator=g)
    adv, ret = gae(r, v, gamma, lam, block=block)
    assert adv.tolist() == pytest.approx(ref_gae(r.tolist(), v.tolist(), gamma, lam), abs=1e-5)
    assert torch.allclose(ret, adv + v, atol=1e-5)


def test_gae_long_sequence_matches_loop_reference():
    # many blocks, a sparse terminal reward carried back over all of them (the former
    # whole-sequence [L, L] float64 matrices: 1.6 GB peak and 5 s at L = 8192 were measured,
    # ~25 GB at 32k; blocked: O(L * 256))
    L = 6_000
    g = torch.Generator().manual_seed(3)
    r, v = torch.zeros(L), 0.1 * torch.randn(L, generator=g)
    r[-1] = 1.0
    adv, _ = gae(r, v, 1.0, 0.95)
    want = ref_gae(r.tolist(), v.tolist(), 1.0, 0.95)
    assert adv.tolist() == pytest.approx(want, abs=1e-5)
