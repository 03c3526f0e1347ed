"""Review of the rollout correction (trainer.rollout_rs) against verl, where a rejected token is
dropped from verl's ``response_mask`` BEFORE ``compute_advantage`` (ray_trainer: rollout
correction, then advantages), so the advantages of the kept tokens are computed without it:

* the batch whitening (GAE, REINFORCE++, REINFORCE++-baseline: verl's ``masked_whiten`` over the
  response mask) takes its mean and variance over the kept tokens only;
* OPO's length-weighted baseline weighs each sample by its kept tokens (a sequence rejected whole
  weighs nothing)."""
from types import SimpleNamespace

import torch

from workers.trainer import TrainerConfig
from workers.trainer.buffer import Prepared, SampleBuffer
from workers.trainer.step_math import group_advantages
from workers.trainer.step_passes import whiten_pass

torch.set_num_threads(1)


def _prepared(i, adv, keep, group=0, reward=0.0):
    n = adv.numel()
    return Prepared(sample_id=i, group_id=group, prompt_ids=torch.ones(2, dtype=torch.long),
                    output_ids=torch.ones(n, dtype=torch.long), old_logp=torch.zeros(n), ref_logp=torch.zeros(n),
                    score=reward, reward=reward, adv=adv, keep=keep)


def _verl_masked_whiten(vals, mask):
    """verl_F.masked_whiten on a padded [B, T] batch (masked_mean, unbiased masked_var)."""
    mean = (vals * mask).sum() / (mask.sum() + 1e-8)
    var = (((vals - mean) ** 2) * mask).sum() / (mask.sum() + 1e-8) * mask.sum() / (mask.sum() - 1)
    return (vals - mean) * torch.rsqrt(var + 1e-8)


def test_whitening_takes_its_statistics_over_the_kept_tokens_only():
    g = torch.Generator().manual_seed(0)
    lens = [5, 3, 7, 4]
    advs = [torch.randn(n, generator=g, dtype=torch.float64).float() * 2 + 1 for n in lens]
    keeps = [torch.ones(5, dtype=torch.bool), torch.zeros(3, dtype=torch.bool),  # sample 1 rejected whole
             torch.tensor([True, False, True, True, False, True, True]), torch.ones(4, dtype=torch.bool)]
    advs[1] += 50.0  # a rejected sequence far off: verl's whitening does not see it
    buffer = SampleBuffer()
    buffer.push_ready([_prepared(i, a.clone(), k) for i, (a, k) in enumerate(zip(advs, keeps))])
    w = SimpleNamespace(_trained_any=False, buffer=buffer, world_size=1, group=None, device=torch.device("cpu"))
    whiten_pass(w)
    T = max(lens)
    vals, mask = torch.zeros(len(lens), T), torch.zeros(len(lens), T)
    for b, (a, k) in enumerate(zip(advs, keeps)):
        vals[b, :len(a)], mask[b, :len(a)] = a, k.float()
    want = _verl_masked_whiten(vals, mask)
    for b, p in enumerate(buffer.ready):
        k = keeps[b]
        assert torch.allclose(p.adv[k], want[b, :lens[b]][k], atol=1e-5), b


def test_opo_baseline_weighs_samples_by_their_kept_tokens():
    cfg = TrainerConfig(algorithm="opo", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.1)
    rewards, lens = [1.0, 0.0, 0.5], [4, 6, 3]
    keeps = [torch.ones(4, dtype=torch.bool), torch.zeros(6, dtype=torch.bool),  # sample 1 rejected whole
             torch.tensor([True, True, False])]
    members = [_prepared(i, torch.zeros(n), k, reward=r) for i, (r, n, k) in enumerate(zip(rewards, lens, keeps))]
    group_advantages(cfg, members)
    kept = [int(k.sum()) for k in keeps]  # verl: response_mask.sum(-1) after the rejection
    baseline = sum(n * r for n, r in zip(kept, rewards)) / sum(kept)
    for p, r in zip(members, rewards):
        assert torch.allclose(p.adv, torch.full_like(p.adv, r - baseline)), (p.sample_id, p.adv, r - baseline)
    # a group rejected whole has nothing to weigh (verl: 0 / 0): finite advantages, not NaN
    members = [_prepared(i, torch.zeros(3), torch.zeros(3, dtype=torch.bool), reward=float(i)) for i in range(2)]
    group_advantages(cfg, members)
    assert all(bool(torch.isfinite(p.adv).all()) for p in members)
