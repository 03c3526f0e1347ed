"""Per-token loss terms and their aggregation. Each returns tensors; no host syncs.

Terms are per token ``[N]`` (N response tokens of a packed micro-batch); ``aggregate_sum``
turns them into a SUM whose divisor (total tokens or total sequences of the iteration) is
applied once at the optimizer step, so micro-batching and data parallelism do not change the
update (but under ``clip_cov`` / ``kl_cov``, which pick tokens by statistics of the micro-batch)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch


class PolicyTerms(NamedTuple):
    """A policy loss per token: ``loss`` [N] (with grad), ``clipped`` [N] float 0/1 (where the
    clipped surrogate was the larger: verl's ``pg_clipfrac`` per token), ``ratio`` [N] (the
    importance ratio the loss used, detached: the logged ``ratio``)."""

    loss: torch.Tensor
    clipped: torch.Tensor
    ratio: torch.Tensor


def _ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """-> pi / pi_old [N], log clamped to [-20, 20] (verl's clamp: exp stays finite)."""
    return torch.exp((logp - old_logp).clamp(-20.0, 20.0))


def seq_sum(x: torch.Tensor, seq_index: torch.Tensor, b: int) -> torch.Tensor:
    """x: [N] of a packed batch of ``b`` sequences -> [B] each sequence's sum (differentiable)."""
    return torch.zeros(b, dtype=x.dtype, device=x.device).index_add(0, seq_index, x)


def _seq_mean(x: torch.Tensor, seq_index: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """x: [N] -> [B] the mean of each sequence's tokens (differentiable)."""
    return seq_sum(x, seq_index, seq_lens.shape[0]) / seq_lens.clamp(min=1).to(x.dtype)


def _clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, clip_low: float,
                       clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ratio, adv: [N] -> (max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) [N], clipped [N] 0/1)."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def ppo_terms(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip_low: float,
              clip_high: float, dual_clip: float | None = None) -> PolicyTerms:
    """PPO clipped surrogate, a ratio per token. logp, old_logp, adv: [N] -> ``PolicyTerms``.

    ratio clipped to [1 - clip_low, 1 + clip_high]; with ``dual_clip`` c, the loss of tokens
    with A < 0 is at most ``-c * A`` (bounded when the ratio explodes). As verl, log(ratio) is
    clamped to [-20, 20] before ``exp`` (no gradient beyond: such a token is clipped anyway)."""
    ratio = _ratio(logp, old_logp)  # [N]
    loss, was_clipped = _clipped_surrogate(ratio, adv, clip_low, clip_high)  # [N], [N]
    if dual_clip is not None:
        bound = -adv * dual_clip
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    return PolicyTerms(loss, was_clipped, ratio.detach())


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip_low: float,
                clip_high: float, dual_clip: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate. logp, old_logp, adv: [N] -> (loss [N], clipped [N] float 0/1);
    ``ppo_terms`` without the ratio."""
    terms = ppo_terms(logp, old_logp, adv, clip_low, clip_high, dual_clip)
    return terms.loss, terms.clipped


def gspo_terms(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, seq_index: torch.Tensor,
               seq_lens: torch.Tensor, clip_low: float, clip_high: float,
               dual_clip: float | None = None) -> PolicyTerms:
    """GSPO-token (Zheng et al. 2025; verl's ``loss_mode: gspo``): one ratio per sequence.
    logp, old_logp, adv, seq_index: [N]; seq_lens: [B] (every sequence whole in the batch).

    s_i = exp(mean over sequence i's tokens of (logp - old_logp)), in the token form
    s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]: each token of sequence i has the value s_i and the
    gradient s_i * d logp_t (with A constant over the sequence, the sequence-level objective's
    gradient once the loss averages the sequence's tokens: ``loss_agg: seq_mean``). Clipped to
    [1 - clip_low, 1 + clip_high] as PPO's ratio: a sequence out of range on the side its
    advantage pushes gets no gradient. As verl, log s_i,t is clamped at 10 (not below: the mean
    of a sequence's log-ratios is not clamped token by token), so past it a sequence passes no
    gradient. No ``dual_clip`` (verl's gspo has none; ``TrainerConfig`` refuses it)."""
    if dual_clip is not None:
        raise ValueError("gspo has no dual clip (verl's gspo ignores clip_ratio_c)")
    seq_log_s = _seq_mean((logp - old_logp).detach(), seq_index, seq_lens)  # [B], mean log-ratio of each sequence
    log_s = (logp - logp.detach() + seq_log_s[seq_index]).clamp(max=10.0)  # [N]: value log s_i, grad of logp
    ratio = torch.exp(log_s)  # [N]
    loss, was_clipped = _clipped_surrogate(ratio, adv, clip_low, clip_high)
    return PolicyTerms(loss, was_clipped, ratio.detach())


@dataclass(frozen=True)
class PolicyKnobs:
    """The hyper-parameters only some policy losses read: the ``trainer.*`` keys of the same
    names, verl's defaults (``TrainerConfig`` checks them)."""

    sapo_tau_pos: float = 1.0  # sapo's gate temperature where A > 0 (verl's actor.tau_pos)
    sapo_tau_neg: float = 1.05  # ... where A <= 0 (verl's actor.tau_neg)
    clip_cov_ratio: float = 2e-4  # clip_cov: share of the micro-batch's tokens detached, at most
    clip_cov_lb: float = 1.0  # clip_cov: the covariance range a detached token is drawn from
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4  # kl_cov: share of the micro-batch's tokens penalised
    kl_cov_coef: float = 0.1  # kl_cov: the |log ratio| penalty's coefficient (verl's ppo_kl_coef)


KNOBS = PolicyKnobs()


def cispo_terms(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip_low: float,
                clip_high: float) -> PolicyTerms:
    """CISPO (MiniMax-M1, Chen et al. 2025; verl's ``loss_mode: cispo``). logp, old_logp, adv: [N].

    loss_t = -sg[clip(r_t, 1 - clip_low, 1 + clip_high)] * A_t * logp_t: the importance weight
    is clipped and constant, so every token keeps its REINFORCE gradient, -w_t A_t grad logp_t,
    however far its ratio is (PPO drops clipped tokens' gradients). ``clip_low`` >= 1: no lower
    clip (the paper's). ``clipped``: r_t outside the range, either side (verl's pg_clipfrac)."""
    ratio = _ratio(logp, old_logp)  # [N]
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high).detach()  # [N]
    return PolicyTerms(-weight * adv * logp, (ratio != weight).float(), ratio.detach())


def geo_mean_terms(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, seq_index: torch.Tensor,
                   seq_lens: torch.Tensor, clip_low: float, clip_high: float) -> PolicyTerms:
    """GMPO (Zhao et al. 2025; verl's ``loss_mode: geo_mean``): the geometric mean of a
    sequence's token ratios, each clipped first. logp, old_logp, adv, seq_index: [N]; seq_lens: [B].

    log r_t is clipped on the side its advantage pushes, in LOG space: A_t > 0 caps it at
    ``clip_high``, A_t < 0 floors it at ``-clip_low`` (a ratio in [e^-clip_low, e^clip_high]),
    A_t = 0 makes it 0. Sequence i's loss is -mean_t(A_t) * exp(mean_t clipped log r_t), the same
    on each of its tokens, so ``aggregate_sum(..., "seq_mean")`` sums it once per sequence (verl
    averages it over the micro-batch's sequences whatever loss_agg_mode says). No clamp at +-20:
    verl has none here. ``clipped``: A_t > 0 and log r_t outside [-clip_low, clip_high] (verl's
    pg_clipfrac); ``ratio``: the sequence's, on each of its tokens."""
    log_r = logp - old_logp  # [N]
    capped = torch.where(adv > 0, log_r.clamp(max=clip_high), log_r.clamp(min=-clip_low))  # [N]
    capped = torch.where(adv == 0, torch.zeros_like(log_r), capped)
    seq_ratio = torch.exp(_seq_mean(capped, seq_index, seq_lens))  # [B]
    seq_loss = -_seq_mean(adv, seq_index, seq_lens) * seq_ratio  # [B]
    outside = (log_r < -clip_low) | (log_r > clip_high)
    return PolicyTerms(seq_loss[seq_index], (outside & (adv > 0)).float(), seq_ratio.detach()[seq_index])


def sapo_terms(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, tau_pos: float,
               tau_neg: float) -> PolicyTerms:
    """SAPO (Gao et al. 2025; verl's ``loss_mode: sapo``): a smooth gate instead of a clip.
    logp, old_logp, adv: [N].

    loss_t = -A_t * f(r_t), f(r) = sigmoid(tau (r - 1)) * 4 / tau with tau = ``tau_pos`` where
    A_t > 0, else ``tau_neg``. f'(1) = 1: on-policy the gradient is PPO's, -A_t grad logp_t;
    away from r = 1 it fades smoothly (f'(r) = 4 s (1 - s), s the sigmoid) instead of stopping at
    a clip edge, faster for the larger tau. No clamp but PPO's +-20 on log r (verl's); nothing is
    clipped (``clipped`` 0, as verl's). verl averages it per sequence whatever loss_agg_mode says."""
    ratio = _ratio(logp, old_logp)  # [N]
    tau = torch.where(adv > 0, adv.new_tensor(tau_pos), adv.new_tensor(tau_neg))  # [N]
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return PolicyTerms(-gate * adv, torch.zeros_like(adv), ratio.detach())


def gpg_terms(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor) -> PolicyTerms:
    """GPG (Chu et al. 2025; verl's ``loss_mode: gpg``): the plain policy gradient,
    loss_t = -A_t * logp_t, no ratio, no clip. logp, old_logp, adv: [N]. ``ratio``: r_t, logged
    only (the loss does not read it)."""
    return PolicyTerms(-logp * adv, torch.zeros_like(adv), _ratio(logp, old_logp).detach())


def _covariance(adv: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """adv, logp: [N] -> [N] each token's term of cov(A, logp) over the N tokens (no gradient)."""
    lp = logp.detach()
    return (adv - adv.mean()) * (lp - lp.mean())


def clip_cov_terms(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip_low: float,
                   clip_high: float, cov_ratio: float, cov_lb: float, cov_ub: float) -> PolicyTerms:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"; verl's
    ``loss_mode: clip_cov``). logp, old_logp, adv: [N], the tokens of ONE micro-batch: the
    covariance and the count are over them.

    PPO's clipped surrogate (no dual clip), except that of the tokens PPO does not clip whose
    cov_t = (A_t - mean A) (logp_t - mean logp) lies in (``cov_lb``, ``cov_ub``), a uniformly random
    max(int(``cov_ratio`` N), 1) (or all, if fewer) get loss 0 and no gradient: the tokens driving
    the entropy down. ``clipped``: those tokens (verl's pg_clipfrac; PPO's own clips not counted).
    The draw uses torch's global generator, on the device, with no host sync."""
    ratio = _ratio(logp, old_logp)  # [N]
    loss, ppo_clipped = _clipped_surrogate(ratio, adv, clip_low, clip_high)  # [N], [N]
    cov = _covariance(adv, logp)  # [N]
    candidate = (cov > cov_lb) & (cov < cov_ub) & (ppo_clipped == 0)  # [N]
    # random keys, non-candidates below every candidate: the top k are a uniform draw of the candidates
    keys = torch.where(candidate, torch.rand(adv.shape, device=adv.device), -1.0)
    k = min(max(int(cov_ratio * adv.numel()), 1), adv.numel())
    chosen = torch.zeros_like(candidate).index_fill(0, keys.topk(k).indices, True) & candidate  # [N]
    return PolicyTerms(loss * (~chosen).to(loss.dtype), chosen.float(), ratio.detach())


def kl_cov_terms(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, cov_ratio: float,
                 coef: float) -> PolicyTerms:
    """KL-Cov (Cui et al. 2025; verl's ``loss_mode: kl_cov``). logp, old_logp, adv: [N], the tokens
    of ONE micro-batch: the covariance and the count are over them.

    The unclipped surrogate -A_t r_t, plus ``coef`` * |logp_t - old_logp_t| on the
    max(int(``cov_ratio`` N), 1) tokens of largest cov_t = (A_t - mean A) (logp_t - mean logp).
    ``clipped``: those tokens (verl logs no clip fraction for kl_cov)."""
    ratio = _ratio(logp, old_logp)  # [N]
    k = min(max(int(cov_ratio * adv.numel()), 1), adv.numel())
    top = _covariance(adv, logp).topk(k).indices  # [k]
    penalised = torch.zeros(adv.shape, dtype=torch.bool, device=adv.device).index_fill(0, top, True)  # [N]
    penalty = torch.where(penalised, coef * (logp - old_logp).abs(), torch.zeros_like(ratio))
    return PolicyTerms(-adv * ratio + penalty, penalised.float(), ratio.detach())


def sequence_geometric_mean(w: torch.Tensor, seq_index: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """w: [N] > 0 -> [N] its sequence's geometric mean on each token, exp(mean_t log(w_t + 1e-10)):
    how verl weights geo_mean's one loss per sequence by per-token rollout-correction weights."""
    return torch.exp(_seq_mean(torch.log(w + 1e-10), seq_index, seq_lens))[seq_index]


class PolicyLoss(Protocol):
    """``trainer.policy_loss``: logp, old_logp, adv, seq_index: [N] (one packed micro-batch);
    seq_lens: [B]; clip_low, clip_high, dual_clip (None unless ppo); knobs -> ``PolicyTerms``."""

    def __call__(self, logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, seq_index: torch.Tensor,
                 seq_lens: torch.Tensor, clip_low: float, clip_high: float, dual_clip: float | None,
                 knobs: PolicyKnobs = KNOBS) -> PolicyTerms: ...


# the order of workers/trainer/config.py POLICY_LOSS_KNOBS
POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo": lambda lp, old, adv, idx, lens, lo, hi, dual, k=KNOBS: ppo_terms(lp, old, adv, lo, hi, dual),
    "gspo": lambda lp, old, adv, idx, lens, lo, hi, dual, k=KNOBS: gspo_terms(lp, old, adv, idx, lens, lo, hi, dual),
    "cispo": lambda lp, old, adv, idx, lens, lo, hi, dual, k=KNOBS: cispo_terms(lp, old, adv, lo, hi),
    "geo_mean": lambda lp, old, adv, idx, lens, lo, hi, dual, k=KNOBS: geo_mean_terms(lp, old, adv, idx, lens, lo, hi),
    "sapo": lambda lp, old, adv, idx, lens, lo, hi, dual, k=KNOBS: sapo_terms(lp, old, adv, k.sapo_tau_pos,
                                                                              k.sapo_tau_neg),
    "gpg": lambda lp, old, adv, idx, lens, lo, hi, dual, k=KNOBS: gpg_terms(lp, old, adv),
    "clip_cov": lambda lp, old, adv, idx, lens, lo, hi, dual, k=KNOBS: clip_cov_terms(
        lp, old, adv, lo, hi, k.clip_cov_ratio, k.clip_cov_lb, k.clip_cov_ub),
    "kl_cov": lambda lp, old, adv, idx, lens, lo, hi, dual, k=KNOBS: kl_cov_terms(lp, old, adv, k.kl_cov_ratio,
                                                                                  k.kl_cov_coef),
}


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """values, old_values, returns: [N] -> (loss [N] = 0.5 * max(sq, sq_clipped), clipped [N]
    float 0/1: where the clipped term was the larger, verl's ``vf_clipfrac`` per token). Clamped
    as verl's ``clip_by_value``: inside the range the clipped value is exactly ``values``
    (``old + (values - old)`` can be an ulp off, and then counted as clipped)."""
    v_clipped = torch.clamp(values, old_values - clip, old_values + clip)
    sq, sq_clipped = (values - returns) ** 2, (v_clipped - returns) ** 2
    return 0.5 * torch.maximum(sq, sq_clipped), (sq_clipped > sq).float()


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip: float) -> torch.Tensor:
    """Clipped value loss. values, old_values, returns: [N] -> [N] = 0.5 * max(sq, sq_clipped)."""
    return clipped_value_loss(values, old_values, returns, clip)[0]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """logits: [N, V] -> entropy [N] of softmax(logits)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def aggregate_sum(x: torch.Tensor, seq_index: torch.Tensor, seq_lens: torch.Tensor, mode: str) -> torch.Tensor:
    """x: [N] per-token values, seq_index: [N] (0..B-1), seq_lens: [B] -> scalar SUM.

    ``token_mean`` (verl ``token-mean``): sum_i x_i, divided by the update's total tokens later.
    ``seq_mean`` (verl ``seq-mean-token-mean``): sum_b mean_{i in b} x_i, divided by its total
    sequences later. ``seq_mean_token_sum`` (verl ``seq-mean-token-sum``): sum_i x_i, divided by
    the total sequences. ``seq_mean_token_sum_norm`` (verl ``seq-mean-token-sum-norm``, Dr. GRPO):
    sum_i x_i, divided by the total sequences times a constant (``loss_divisor``'s ``scale``)."""
    if mode == "seq_mean":
        return (x / seq_lens[seq_index].to(x.dtype)).sum()
    if mode in ("token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"):
        return x.sum()
    raise ValueError(f"loss_agg {mode!r} is not one of 'token_mean', 'seq_mean', 'seq_mean_token_sum', "
                     "'seq_mean_token_sum_norm'")


def loss_divisor(num_tokens: float, num_seqs: float, mode: str, scale: float | None = None) -> float:
    """What the SUMs of ``aggregate_sum`` over some samples are divided by: their tokens
    (``token_mean``), their sequences (``seq_mean``, ``seq_mean_token_sum``), or their sequences
    times ``scale`` (``seq_mean_token_sum_norm``; verl's ``loss_scale_factor``)."""
    if mode == "token_mean":
        return float(num_tokens)
    if mode == "seq_mean_token_sum_norm":
        if scale is None:
            raise ValueError("loss_agg 'seq_mean_token_sum_norm' needs a scale (trainer.loss_scale_factor)")
        return float(num_seqs) * float(scale)
    return float(num_seqs)


def fraction_agg(mode: str) -> str:
    """How per-token fractions (clip fraction, ratio) are averaged for the metrics under loss
    aggregation ``mode``: as the loss where it averages tokens, over all tokens where the loss
    sums a sequence's tokens (a summed fraction would not be one)."""
    return mode if mode in ("token_mean", "seq_mean") else "token_mean"
