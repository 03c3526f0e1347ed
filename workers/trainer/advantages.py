"""Advantage estimators: GAE (with a critic), GRPO group-normalised, RLOO leave-one-out, OPO's
length-weighted baseline, GRPO pass@k; the batch whitening verl applies to GAE advantages."""
from __future__ import annotations

from typing import Callable

import torch


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float,
        block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. rewards, values: [L] (V(s_t) before emitting token t; terminal value 0)
    -> (advantages [L], returns [L] = advantages + values).

    delta_t = r_t + gamma V_{t+1} - V_t;  A_t = sum_k (gamma lam)^k delta_{t+k}. Computed in
    blocks of ``block`` tokens, last block first: inside a block a triangular matrix product,
    across blocks A_t = (in-block sum) + (gamma lam)^(end - t) A_end. Memory and work are
    O(L * block), not O(L^2): a whole-sequence [L, L] matrix took 1.6 GB and 5 s at L = 8192
    (25 GB at 32k), on the receive path of every PPO sample."""
    L = rewards.shape[0]
    rewards, values = rewards.double(), values.double()
    next_v = torch.cat([values[1:], values.new_zeros(1)])  # [L]
    delta = rewards + gamma * next_v - values  # [L]
    c = gamma * lam
    k = torch.arange(min(block, L), dtype=torch.float64)  # [B]
    power = k[None, :] - k[:, None]  # [B, B]: j - t
    disc = torch.where(power >= 0, c ** power.clamp(min=0), torch.zeros(()))  # [B, B]; 0**0 = 1
    adv = torch.empty_like(delta)  # [L]
    carry = delta.new_zeros(())  # A at the first token after the block (0 past the end)
    for start in reversed(range(0, L, block)):
        n = min(start + block, L) - start
        a = disc[:n, :n] @ delta[start:start + n] + c ** (n - k[:n]) * carry  # [n]
        adv[start:start + n] = a
        carry = a[0]
    return adv.float(), (adv + values).float()


def sampled_gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float,
                sampled: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``gae`` over the policy's own tokens of a multi-turn sample: ``sampled`` [L] bool (None:
    every token, ``gae`` itself) -> (advantages [L], returns [L]), 0 on the other (observation)
    tokens. As verl's GAE, which skips the values and TD errors of tokens outside its
    response_mask: the next state of a sampled token is the next sampled token's, and gamma / lam
    discount once per sampled token. ``rewards`` off ``sampled`` must be 0 (they are dropped)."""
    if sampled is None:
        return gae(rewards, values, gamma, lam)
    adv, ret = torch.zeros_like(rewards, dtype=torch.float32), torch.zeros_like(rewards, dtype=torch.float32)
    adv[sampled], ret[sampled] = gae(rewards[sampled], values[sampled], gamma, lam)
    return adv, ret


def whiten(advs: list[torch.Tensor], all_reduce: Callable[[torch.Tensor], None] = lambda t: None,
           device: torch.device | str = "cpu", masks: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
    """verl's ``masked_whiten`` over every token of ``advs`` ([L_i] each) and of the other
    data-parallel ranks' (``all_reduce``: an in-place SUM over them, of tensors on ``device``;
    every rank must call this, with or without samples) -> the whitened [L_i] each, float32:
    ``(A - mean) * rsqrt(var + 1e-8)``, ``var`` unbiased, in float64 (two passes: no
    cancellation). verl's means divide by ``n + 1e-8``; here by ``n``, so a batch of equal
    advantages gives ~0 rather than ``A * 1e-4 / n``. One token (verl raises): var 0, so 0.
    ``masks``: [L_i] bool each (None: every token), the tokens the mean and variance are of
    (verl's response mask after rollout_rs rejection); every token is whitened with them."""
    counted = advs if masks is None else [a if m is None else a[m] for a, m in zip(advs, masks)]
    sums = torch.tensor([sum(float(a.double().sum()) for a in counted), float(sum(a.numel() for a in counted))],
                        dtype=torch.float64, device=device)  # [sum, n]
    all_reduce(sums)
    total, n = sums.tolist()
    mean = total / max(n, 1.0)
    sq = torch.tensor([sum(float(((a.double() - mean) ** 2).sum()) for a in counted)], dtype=torch.float64,
                      device=device)
    all_reduce(sq)
    var = float(sq) / (n - 1) if n > 1 else 0.0
    inv_std = (var + 1e-8) ** -0.5
    return [((a.double() - mean) * inv_std).float() for a in advs]


def grpo(scores: torch.Tensor, eps: float = 1e-6, std_normalize: bool = True) -> torch.Tensor:
    """scores: [G] of one group -> [G]: (r - mean) / (std + eps) (std unbiased; 0 for G = 1).
    Centred around the first score before the mean (shift-invariant): a group of equal
    scores gets exact zeros. In float32, the mean of eight scores of 0.7 missed them by ~1e-8,
    and dividing that by a std of the same size gave every sample the same ~0.05 advantage: a
    full Adam step driven by rounding."""
    s = (scores - scores[:1]).double()  # equal scores -> exact zeros, whatever their value
    centred = s - s.mean()
    denom = s.std() + eps if std_normalize and scores.numel() > 1 else None
    if denom is None or denom == 0:  # adv_eps 0 and equal scores: 0 / 0 would be NaN, not 0
        return centred.to(scores.dtype)
    return (centred / denom).to(scores.dtype)


def rloo(scores: torch.Tensor) -> torch.Tensor:
    """scores: [G] -> [G]: r_i - mean_{j != i} r_j (0 for G = 1)."""
    g = scores.numel()
    if g < 2:
        return torch.zeros_like(scores)
    s = (scores - scores[:1]).double()  # shift-invariant; equal scores -> exact zeros (as grpo)
    return (s - (s.sum() - s) / (g - 1)).to(scores.dtype)


def opo(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline"; verl's ``opo``).
    scores, lengths: [G] of one group (lengths: response tokens, those rollout_rs keeps) -> [G]:
    r_i - b with the length-weighted baseline b = sum_j l_j r_j / sum_j l_j (0 for G = 1, or
    when no length is > 0)."""
    if scores.numel() < 2 or not bool((lengths > 0).any()):  # nothing to weigh (verl: 0 / 0)
        return torch.zeros_like(scores)
    s, w = (scores - scores[:1]).double(), lengths.double()  # shift-invariant, as grpo
    return (s - (w * s).sum() / w.sum()).to(scores.dtype)


def grpo_passk(scores: torch.Tensor, eps: float = 1e-6, std_normalize: bool = True) -> torch.Tensor:
    """Pass@k training (Chen et al. 2025, arXiv 2503.19595; verl's ``grpo_passk``). scores: [G] ->
    [G]: zero except one best sample's (``torch.topk``'s pick; a tied best gets r_max - r_second
    = 0 wherever it goes), which gets r_max - r_second, divided by (std + eps) with
    ``std_normalize`` (std unbiased). 0 for G = 1."""
    adv = torch.zeros_like(scores)
    if scores.numel() < 2:
        return adv
    top = torch.topk(scores.double(), 2)
    a = top.values[0] - top.values[1]
    denom = scores.double().std() + eps
    if std_normalize and denom != 0:  # adv_eps 0 and equal scores: 0 / 0 would be NaN (as grpo)
        a = a / denom
    adv[top.indices[0]] = a.to(scores.dtype)
    return adv


def gpg_alpha(counts: torch.Tensor) -> float:
    """GPG (Chu et al. 2025, "GPG: A Simple and Strong RL Baseline"; verl's ``gpg`` estimator):
    its advantages ``alpha * (r - group mean)`` are scaled by ``alpha = B / M`` over the step's
    whole batch, B samples of which M have a nonzero reward. ``counts``: [2] (B, M), summed over
    the data-parallel ranks -> alpha (B when M is 0, as verl's ``clamp(min=1)``)."""
    b, m = counts.tolist()
    return b / max(m, 1.0)
