"""Per-token loss terms and their aggregation. Each returns tensors; no host syncs.

Terms are per token ``[N]`` (N response tokens of a packed micro-batch); ``aggregate_sum``
turns them into a SUM whose divisor (total tokens or total sequences of the iteration) is
applied once at the optimizer step, so micro-batching and data parallelism do not change the
update."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch


class PolicyTerms(NamedTuple):
    """A policy loss per token: ``loss`` [N] (with grad), ``clipped`` [N] float 0/1 (where the
    clipped surrogate was the larger: verl's ``pg_clipfrac`` per token), ``ratio`` [N] (the
    importance ratio the loss used, detached: the logged ``ratio``)."""

    loss: torch.Tensor
    clipped: torch.Tensor
    ratio: torch.Tensor


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
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))  # [N]; verl's clamp: exp stays finite
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
    log_r = (logp - old_logp).detach()  # [N]
    seq_sum = torch.zeros(seq_lens.shape[0], dtype=log_r.dtype, device=log_r.device).index_add_(0, seq_index, log_r)
    seq_log_s = seq_sum / seq_lens.clamp(min=1).to(log_r.dtype)  # [B], mean log-ratio of each sequence
    log_s = (logp - logp.detach() + seq_log_s[seq_index]).clamp(max=10.0)  # [N]: value log s_i, grad of logp
    ratio = torch.exp(log_s)  # [N]
    loss, was_clipped = _clipped_surrogate(ratio, adv, clip_low, clip_high)
    return PolicyTerms(loss, was_clipped, ratio.detach())


# trainer.policy_loss -> (logp, old_logp, adv, seq_index [N], seq_lens [B], clip_low, clip_high, dual_clip) -> terms
PolicyLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float,
                       float | None], PolicyTerms]
POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo": lambda logp, old, adv, seq_index, seq_lens, lo, hi, dual: ppo_terms(logp, old, adv, lo, hi, dual),
    "gspo": gspo_terms,
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
