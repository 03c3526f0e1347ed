"""The worker's per-sample and per-micro-batch maths, kept out of the worker's bookkeeping.

``prepare_batch``: receive-time work (reward, reference log-probs, values, GAE for PPO; the
whitening of GAE advantages over the batch is the worker's, at ``step()``).
``group_advantages``: GRPO / RLOO once a group is complete.
``train_terms``: the micro-batch loss as a SUM plus the summed statistics for logging.
(``StatSums``, workers/trainer/stat_sums.py, sums those statistics over an iteration.)
"""
from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from typing import TYPE_CHECKING, Callable

import torch

from workers.trainer.advantages import grpo, grpo_passk, opo, rloo, sampled_gae
from workers.trainer.buffer import Prepared
from workers.trainer.config import TrainerConfig
from workers.trainer.kl import KL_ESTIMATORS
from workers.trainer.losses import (POLICY_LOSSES, PolicyKnobs, aggregate_sum, clipped_value_loss,
                                    entropy_from_logits, fraction_agg, sequence_geometric_mean)
from workers.trainer.packing import pack, response_logits, token_logprobs
from workers.trainer.rollout_dump import rollout_row
from workers.trainer import remax, rollout_bypass, rollout_correction as rc
from workers.trainer.multi_turn import item_mask, last_sampled, mean_over, sampled_mask, spread
from workers.types import prompt_text

if TYPE_CHECKING:
    from workers.trainer.worker import TrainerWorker
    from workers.types import Sample


def submit_scores(w: "TrainerWorker", samples: list["Sample"], prompts: dict | None = None,
                  iteration: int | None = None) -> dict:
    """Sample id -> the task's score of it (plus its environment rewards, ``Sample.env_rewards``),
    in flight on ``w.rewards`` (the trainer's reward pool).
    ``prompts`` / ``iteration``: those of the samples' iteration (default: the worker's current one;
    the trainer rank scores samples as they arrive, an async mode's next iteration too)."""
    prompts = w._prompts if prompts is None else prompts
    it = w.iteration if iteration is None else iteration
    pending = w.rewards.submit_many([(prompts[s.sample_id], w.tokenizer.decode(s.output_ids),
                                      f"sample {s.sample_id} (trainer rank {w.rank}, iteration {it})")
                                     for s in samples])
    # a multi-turn sample's reward is the task's score plus the rewards its environment gave
    return {s.sample_id: w.rewards.plus(p, s.env_reward) for s, p in zip(samples, pending)}


@torch.no_grad()
def prepare_batch(w: "TrainerWorker", samples: list["Sample"], scores: dict | None = None) -> list[Prepared | str]:
    """Reward, reference log-probs, values (and GAE) for each sample; where the task's score
    failed (raised, no finite number, past ``reward_timeout_s``), why, naming the sample.
    ``scores``: ``submit_scores`` of these samples (or more), in flight while the forwards run
    (None: submitted here)."""
    scores = submit_scores(w, samples) if scores is None else scores
    cfg = w.cfg
    batch = pack([s.prompt_ids for s in samples], [s.output_ids for s in samples], w.device,
                 [s.min_tokens for s in samples])
    lens = batch.seq_lens.tolist()
    with w.autocast():
        ref = (token_logprobs(_logits(w.ref, batch, cfg, w.eos_ids), batch.resp_ids).float().cpu()  # [N]
               if w.ref is not None else None)
        sampler = torch.cat([s.logprobs.float().cpu() for s in samples]) if cfg.uses_sampler_logprobs else None
        if cfg.recomputes_old_logprobs:
            old = token_logprobs(_logits(w.actor, batch, cfg, w.eos_ids), batch.resp_ids).float().cpu()
        else:
            old = sampler
        values = w.critic(batch).float().cpu() if w.critic is not None else None
    # [N], behaviour policy vs reference (none without a KL coefficient: nothing reads it then)
    kl = KL_ESTIMATORS[cfg.kl_estimator](old, ref) if ref is not None else torch.zeros_like(old)
    ref_of = ref.split(lens) if ref is not None else [None] * len(samples)
    sampler_of = sampler.split(lens) if sampler is not None else None
    penalise = cfg.kl_in_reward
    beta = w.kl.value  # this iteration's coefficient (adapted after each step with trainer.kl_target)
    overlong = [overlong_penalty(len(s.output_ids), cfg) for s in samples]
    checks = cfg.rejection_checks
    out: list[Prepared | str] = []
    for i, (s, old_i, ref_i, kl_i) in enumerate(zip(samples, old.split(lens), ref_of, kl.split(lens))):
        score, why, info = _score(w, s, scores[s.sample_id])
        if why:
            out.append(f"sample {s.sample_id}: {why}")
            continue
        shaped = score + overlong[i]
        sampled = sampled_mask(s)  # [L] bool, or None: every token the policy's
        if sampled is not None:  # no KL on observation tokens (their log-probs are not the policy's)
            kl_i = torch.where(sampled, kl_i, torch.zeros_like(kl_i))
        p = Prepared(sample_id=s.sample_id, group_id=s.group_id, prompt_ids=s.prompt_ids.cpu(),
                     output_ids=s.output_ids.cpu(), old_logp=old_i, ref_logp=ref_i, score=score,
                     reward=shaped - (beta * float(kl_i.sum()) if penalise else 0.0),
                     weight_version=s.weight_version, min_tokens=s.min_tokens, overlong=overlong[i],
                     reward_kl=mean_over(kl_i, sampled), keep=sampled, sampled=sampled, turns=s.turns,
                     env_reward=s.env_reward, info=info)
        if cfg.corrects_rollout:  # pi_old / pi_sampler: importance weights, rejection, their metrics
            correct_sample(p, sampler_of[i], cfg, checks)
        # per-token rewards: GAE, REINFORCE++'s / remax's returns, a user's estimator's input; the
        # score on the policy's last token (an observation token's reward would be dropped by the GAE)
        if values is not None or cfg.token_returns or cfg.custom_advantage:
            p.token_rewards = -beta * kl_i if penalise else torch.zeros_like(kl_i)
            p.token_rewards[last_sampled(sampled)] += shaped
        if values is not None:
            p.values = values.split(lens)[i]
            p.adv, p.returns = sampled_gae(p.token_rewards, p.values, cfg.gamma, cfg.gae_lambda, sampled)
        elif cfg.token_returns:  # sum_k gamma^k r_{t+k}: GAE with no values and lambda 1
            p.adv = sampled_gae(p.token_rewards, torch.zeros_like(kl_i), cfg.gamma, 1.0, sampled)[0]
        out.append(p)
        if w.rollout_rows is not None:  # logging.rollout_data_dir: decoded and written at the step
            w.rollout_rows.append(rollout_row(w, s, score))
    return out


def correct_sample(p: Prepared, sampler: torch.Tensor, cfg: TrainerConfig, checks: tuple) -> None:
    """Fill ``p.tis_weight`` [L] (with ``rollout_is`` / ``tis_cap``), ``p.keep`` [L] (with
    ``rollout_rs``: ``checks``, its parse; ANDed into ``p.sampled``) and ``p.correction`` from
    ``p.old_logp`` (the trainer's) and ``sampler`` [L] (the sample's own log-probs). Over the
    policy's own tokens (``p.sampled``) only: an observation token's log-probs are no policy's, so
    it has weight 1, is neither rejected nor counted, and leaves the sequence-level weights and
    rejection statistics alone (verl's response_mask)."""
    old, sampler = (p.old_logp, sampler) if p.sampled is None else (p.old_logp[p.sampled], sampler[p.sampled])
    log_r = old - sampler  # [S], the S sampled tokens
    raw, keep = None, None
    if cfg.is_level is not None:
        weights, raw = rc.is_weights(log_r, cfg.is_level, cfg.is_threshold)
        p.tis_weight = spread(weights, p.sampled, 1.0)
    if checks:
        keep = rc.keep_mask(log_r, checks)
        p.keep = spread(keep, p.sampled, False)
    p.correction = rc.sample_stats(old, sampler, cfg.is_level, cfg.is_threshold, raw, keep)


def overlong_penalty(length: int, cfg: TrainerConfig) -> float:
    """DAPO's soft overlong punishment (verl's ``reward_model.overlong_buffer``): 0 up to
    ``max_response_tokens - overlong_buffer`` tokens, then falling linearly to
    ``-overlong_penalty`` at ``max_response_tokens``; 0 when ``overlong_buffer`` is 0."""
    if not cfg.overlong_buffer:
        return 0.0
    over = length - (cfg.max_response_tokens - cfg.overlong_buffer)
    return min(-over / cfg.overlong_buffer * cfg.overlong_penalty, 0.0)


def _logits(model, batch, cfg: TrainerConfig, eos_ids: torch.Tensor) -> torch.Tensor:
    """-> [N, V] logits of the sampling distribution: divided by the rollout temperature, and
    EOS (``eos_ids``: [E]) masked where the sample's ``min_tokens`` kept it from being sampled,
    as the sampler's ``Sample.logprobs`` are (the PPO ratio, the KL and the entropy are all
    taken at it)."""
    # in place: [N, V] is the largest tensor of a step (2.5 GB at 4k tokens x 152k vocabulary),
    # and the head's matmul does not keep its output for backward
    logits = response_logits(model, batch)  # [N, V] float32
    if cfg.temperature != 1.0:
        logits.div_(cfg.temperature)
    if batch.eos_blocked is not None and eos_ids.numel():
        # a large finite value, not -inf: exp() is exactly 0 either way, and entropy's p * log p
        # stays 0 instead of NaN
        rows = batch.eos_blocked.nonzero()  # [R, 1]
        logits[rows, eos_ids.to(logits.device)[None, :]] = -1e9  # [R, E] entries
    return logits


def _score(w: "TrainerWorker", s: "Sample", pending) -> tuple[float, str, dict]:
    """The sample's reward and its reward's extra numbers and texts (``Scored.info``), or (NaN,
    why, {}) when the task's score fails: the sample is skipped
    (said once per kind of failure: every sample may fail the same way), or with
    ``on_bad_sample: error`` refused with that reason (``TrainerWorker._reject``)."""
    t0 = time.perf_counter()
    scored = w.rewards.result(pending)
    w.stats.add("score_wait_s", time.perf_counter() - t0)  # what the trainer waited, past its forwards
    w.stats.add("score_s", scored.seconds)  # the reward's own time (verl's timing_s/reward)
    score, why = scored.score, scored.why
    kind = failure_kind(why) if why else ""
    if kind and w.cfg.on_bad_sample == "skip" and kind not in w.score_failures \
            and len(w.score_failures) < MAX_FAILURE_KINDS:
        w.score_failures.add(kind)
        more = "; other kinds of failure are not logged" if len(w.score_failures) == MAX_FAILURE_KINDS else ""
        item = w._prompts.get(s.sample_id)  # which prompt: a reward failing on one row is found by it
        text = prompt_text(item) if item is not None else ""
        logging.getLogger("streamrl.trainer").warning(
            "sample %d (prompt %r): %s; skipped (samples failing the same way are counted in skipped_samples, "
            "not logged again%s)", s.sample_id, text[:80] + ("..." if len(text) > 80 else ""), why, more)
    return score, why, scored.info


MAX_FAILURE_KINDS = 32  # kinds of reward failure said in a run (each once)

# what varies per sample in a reason: numbers, and quoted values (a reward returning the text
# 'n/a' for one sample and 'x' for another is one kind; an apostrophe in a word is no quote)
_VARYING = re.compile(r"\d+(?:\.\d+)?|(?<!\w)'[^']*'|(?<!\w)\"[^\"]*\"")


def failure_kind(why: str) -> str:
    """What a reward failure is, without what varies per sample: the exception's type when it
    raised (a ``ValueError("cannot parse '3x'")`` and one for ``'7y'`` are one kind, said once),
    else the reason with its numbers and quoted values blanked."""
    raised = re.match(r".*? raised [\w.]+", why)
    return raised.group(0) if raised else _VARYING.sub("_", why)[:200]


# trainer.algorithm -> (the group's rewards [G], their response lengths [G], config) -> advantages [G]
GROUP_ADVANTAGES: dict[str, Callable[[torch.Tensor, torch.Tensor, TrainerConfig], torch.Tensor]] = {
    "grpo": lambda r, n, cfg: grpo(r, cfg.adv_eps, cfg.grpo_std_normalize),
    "rloo": lambda r, n, cfg: rloo(r),
    "reinforce_plus_plus_baseline": lambda r, n, cfg: grpo(r, std_normalize=False),  # r - group mean
    "opo": lambda r, n, cfg: opo(r, n),
    "grpo_passk": lambda r, n, cfg: grpo_passk(r, cfg.adv_eps, cfg.grpo_std_normalize),
    "gpg": lambda r, n, cfg: grpo(r, std_normalize=False),  # r - group mean; x alpha at step() (gpg_alpha)
}


def group_advantages(cfg: TrainerConfig, members: list[Prepared], baseline: float | None = None) -> None:
    """Fill ``adv`` [L] of every member from the group's sequence rewards (remax: from their
    returns and the group's greedy ``baseline``)."""
    if cfg.algorithm == "remax":
        return remax.advantages(members, baseline)
    rewards = torch.tensor([p.reward for p in members], dtype=torch.float32)  # [G]
    # [G] tokens of each (those rollout_rs keeps: verl rejects before its advantages, so opo's weights are those)
    lengths = torch.tensor([p.num_tokens if p.keep is None else int(p.keep.sum()) for p in members],
                           dtype=torch.float32)
    adv = GROUP_ADVANTAGES[cfg.algorithm](rewards, lengths, cfg)  # [G]
    for p, a in zip(members, adv):
        p.adv = a.expand(p.num_tokens).clone()


def train_terms(w: "TrainerWorker", items: list[Prepared]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward one packed micro-batch -> (loss SUM (scalar, with grad), summed statistics)."""
    cfg, dev = w.cfg, w.device
    batch = pack([p.prompt_ids for p in items], [p.output_ids for p in items], dev, [p.min_tokens for p in items])
    logits = _logits(w.actor, batch, cfg, w.eos_ids)  # [N, V] at the rollout temperature
    logp = token_logprobs(logits, batch.resp_ids)  # [N]
    old = torch.cat([p.old_logp for p in items]).to(dev)
    ref = torch.cat([p.ref_logp for p in items]).to(dev) if w.ref is not None else None
    adv = torch.cat([p.adv for p in items]).to(dev)
    # observation tokens (multi-turn) and rollout_rs's rejected ones leave every term, and the token /
    # sequence counts (verl's response_mask); they stay in the forward's context
    keep = item_mask(items, dev)  # [N] bool, or None: every token counts
    lens = batch.seq_lens if keep is None else (  # [B] the tokens of each sequence that count
        torch.zeros_like(batch.seq_lens).index_add_(0, batch.seq_index, keep.long()))

    def agg(x: torch.Tensor, mode: str = cfg.loss_agg) -> torch.Tensor:
        if keep is not None:  # where, not *: a rejected token's NaN or inf stays out
            x = torch.where(keep, x, torch.zeros_like(x))
        return aggregate_sum(x, batch.seq_index, lens.clamp(min=1), mode)

    def kept_sum(x: torch.Tensor) -> torch.Tensor:
        return x.sum() if keep is None else torch.where(keep, x, torch.zeros_like(x)).sum()

    frac = fraction_agg(cfg.loss_agg)

    bypassed = {}  # rollout_bypass: old is the sampler's; rollout_is / rollout_rs of this forward (rollout_corr/*)
    if cfg.rollout_bypass:
        (pg, clipped, ratio), bypassed = rollout_bypass.policy_terms(cfg, logp, old, adv, batch.seq_index,
                                                                     batch.seq_lens)
    else:
        pg, clipped, ratio = POLICY_LOSSES[cfg.policy_loss](logp, old, adv, batch.seq_index, batch.seq_lens,
                                                            cfg.clip_low, cfg.clip_high, cfg.dual_clip,
                                                            policy_knobs(cfg))  # [N] each
    tis = torch.cat([p.tis_weight for p in items]).to(dev) if cfg.is_level and cfg.corrects_rollout else None
    if tis is not None:
        if cfg.tis_per_sequence:  # geo_mean: one loss per sequence, weighted by the geometric mean (verl's)
            tis = sequence_geometric_mean(tis, batch.seq_index, batch.seq_lens)
        pg = pg * tis  # rollout_is / tis_cap: sampler -> trainer's old policy (constant weights)
    kl = KL_ESTIMATORS[cfg.kl_estimator](logp, ref) if ref is not None else None  # [N]
    terms = pg
    if cfg.kl_mode == "loss" and kl is not None:
        terms = terms + cfg.kl_coef * kl
    if cfg.entropy_coef > 0:
        ent = entropy_from_logits(logits)
        terms = terms - cfg.entropy_coef * ent
    else:
        with torch.no_grad():
            ent = entropy_from_logits(logits)
    loss = agg(terms)
    # verl's ppo_kl: old - new log-prob, the approximate KL(old || new), clamped as its ratio is
    ppo_kl = (old - logp.detach()).clamp(-20.0, 20.0)
    if keep is None:
        counts = {"num_tokens": torch.tensor(float(batch.num_tokens)), "num_seqs": torch.tensor(float(len(items))),
                  "advantage_max": adv.max(), "advantage_min": adv.min()}
    else:  # over the kept tokens (none kept: -inf / +inf, a maximum / minimum over nothing); a
        # sequence rejected whole still counts in seq_mean's divisor, as verl's global_batch_size
        counts = {"num_tokens": keep.sum().float(), "num_seqs": torch.tensor(float(len(items))),
                  "advantage_max": adv.masked_fill(~keep, -math.inf).max(),
                  "advantage_min": adv.masked_fill(~keep, math.inf).min()}
    stats = {**counts, **bypassed, "pg_loss": agg(pg).detach(), "entropy": agg(ent).detach(),
             "clipfrac": agg(clipped, frac), "ratio": agg(ratio, frac),
             "ppo_kl": agg(ppo_kl, frac), "advantage_sum": kept_sum(adv)}
    if kl is not None:
        stats["kl"] = agg(kl).detach()
    if tis is not None:
        stats["tis_weight"] = agg(tis, frac)
    if cfg.dual_clip is not None:  # verl's pg_clipfrac_lower: A < 0 tokens whose loss the dual clip bounded
        surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high))
        stats["clipfrac_lower"] = agg(((surrogate > -adv * cfg.dual_clip) & (adv < 0)).float(), frac)
    if w.critic is not None:
        values = w.critic(batch)  # [N]
        old_v = torch.cat([p.values for p in items]).to(dev)
        ret = torch.cat([p.returns for p in items]).to(dev)
        vl_tokens, v_clipped = clipped_value_loss(values, old_v, ret, cfg.value_clip)
        vl = agg(vl_tokens)
        loss = loss + cfg.value_coef * vl
        stats.update(value_loss=vl.detach(), vf_clipfrac=agg(v_clipped, frac), values_sum=kept_sum(old_v),
                     returns_sum=kept_sum(ret), vpred_sum=kept_sum(values.detach()), returns_sq_sum=kept_sum(ret * ret),
                     residual_sum=kept_sum(ret - old_v), residual_sq_sum=kept_sum((ret - old_v) ** 2))
        for name, x in (("values", old_v), ("returns", ret)):  # over the kept tokens, as advantage_max / min
            stats[f"{name}_max"] = (x if keep is None else x.masked_fill(~keep, -math.inf)).max()
            stats[f"{name}_min"] = (x if keep is None else x.masked_fill(~keep, math.inf)).min()
    return loss, stats


def policy_knobs(cfg: TrainerConfig) -> PolicyKnobs:
    """The ``trainer.*`` keys only some policy losses read (``PolicyKnobs``' fields, same names)."""
    return PolicyKnobs(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(PolicyKnobs)})
