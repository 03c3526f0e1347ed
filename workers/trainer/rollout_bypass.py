"""Rollout correction's bypass mode (verl's ``rollout_correction.bypass_mode: true``;
``trainer.rollout_bypass``): two policies, not three. The PPO "old" log-probs are the sampler's
(``Sample.logprobs``: no recompute forward at receive time), and ``rollout_is`` / ``rollout_rs``
are of the CURRENT policy against them, log r = log pi_theta - log pi_rollout (detached), taken
in each training forward (verl's ``compute_policy_loss_bypass_mode``), with
``trainer.rollout_loss_type`` (verl's ``loss_type``):

* ``ppo_clip``: PPO's clipped surrogate with the ratio pi_theta / pi_rollout (no weights: the
  ratio is the importance ratio; verl's ``compute_policy_loss_vanilla``);
* ``reinforce``: -sg[w_t] A_t log pi_theta(y_t), w the truncated ``rollout_is`` weights (1
  without; verl's ``compute_policy_loss_reinforce``).

A token ``rollout_rs`` rejects leaves the policy loss only (verl masks the policy term; its KL
and entropy keep the response mask), and the loss is divided by ALL the update's tokens (or
sequences), as verl's engine workers' global counts (``batch_num_tokens``, ``global_batch_size``)
taken before the loss rejects anything; under ``loss_agg: seq_mean`` a sequence's policy loss is
the mean over its kept tokens (verl's ``agg_loss`` with the rejection mask). The ``rollout_corr/*``
metrics are of the same forward (``rollout_correction.batch_stats``, on the device, no host sync)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from workers.trainer.losses import PolicyTerms, ppo_terms, seq_sum
from workers.trainer.rollout_correction import IS_LEVELS, SAFETY_BOUND, RejectionCheck, batch_stats

if TYPE_CHECKING:
    from workers.trainer.config import TrainerConfig


def is_weights(log_r: torch.Tensor, level: str, seq_index: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """log r: [N] of a packed batch -> the untruncated weights [N] (``rollout_correction.IS_WEIGHTS``
    of each sequence): ``token`` exp(clamp(log r_t)), ``sequence`` exp(clamp(sum over its tokens))."""
    assert level in IS_LEVELS, level
    if level == "token":
        return torch.exp(log_r.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    seq = seq_sum(log_r, seq_index, seq_lens.numel())  # [B]
    return torch.exp(seq.clamp(-SAFETY_BOUND, SAFETY_BOUND))[seq_index]


def keep_mask(log_r: torch.Tensor, checks: tuple[RejectionCheck, ...], seq_index: torch.Tensor,
              seq_lens: torch.Tensor) -> torch.Tensor:
    """log r: [N] of a packed batch -> [N] bool, the tokens every check keeps
    (``rollout_correction.keep_mask`` of each sequence)."""
    keep = torch.ones_like(log_r, dtype=torch.bool)
    for c in checks:
        keep &= c.keep(log_r, seq_index, seq_lens)
    return keep


def policy_terms(cfg: "TrainerConfig", logp: torch.Tensor, sampler: torch.Tensor, adv: torch.Tensor,
                 seq_index: torch.Tensor, seq_lens: torch.Tensor
                 ) -> tuple[PolicyTerms, dict[str, torch.Tensor]]:
    """One packed micro-batch's policy loss in bypass mode. logp (with grad), sampler, adv,
    seq_index: [N]; seq_lens: [B] -> (``PolicyTerms`` [N] each, to be aggregated over every token
    with the full sequence lengths; the ``rollout_corr/*`` terms of ``rollout_correction.batch_stats``)."""
    log_r = logp.detach() - sampler  # [N] log pi_theta / pi_rollout: weights and masks are constants
    raw = is_weights(log_r, cfg.rollout_is, seq_index, seq_lens) if cfg.rollout_is is not None else None
    checks = cfg.rejection_checks
    keep = keep_mask(log_r, checks, seq_index, seq_lens) if checks else None
    if cfg.rollout_loss_type == "reinforce":
        weighted = -adv * logp if raw is None else -adv * logp * raw.clamp(max=cfg.is_threshold)
        terms = PolicyTerms(weighted, torch.zeros_like(adv), torch.exp(log_r.clamp(-20.0, 20.0)))
    else:  # ppo_clip: the ratio to the sampler is the correction (verl applies no weights then)
        terms = ppo_terms(logp, sampler, adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip)
    loss, clipped = terms.loss, terms.clipped
    if keep is not None:  # where, not *: a rejected token's inf or NaN stays out
        loss = torch.where(keep, loss, torch.zeros_like(loss))
        clipped = clipped * keep  # a rejected token's loss took no clipped term
        if cfg.loss_agg == "seq_mean":  # each sequence's mean over its kept tokens, not all of them
            kept = seq_sum(keep.to(loss.dtype), seq_index, seq_lens.numel())  # [B]
            loss = loss * (seq_lens.to(loss.dtype) / kept.clamp(min=1))[seq_index]
    stats = batch_stats(logp.detach(), sampler, seq_index, seq_lens, cfg.rollout_is, cfg.is_threshold, raw, keep)
    return PolicyTerms(loss, clipped, terms.ratio), stats

