"""``TrainerConfig``'s checks across keys that grew past a line or two: the algorithm and its
knobs, a policy loss against its aggregation and knobs, rollout correction against the rest.
Called from ``__post_init__``; each error names the key."""
from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

from workers.trainer.config_names import (ALGORITHMS, BYPASS_LOSS_TYPES, CUSTOM_UNUSED_KNOBS, POLICY_LOSS_KNOBS,
                                          SEQ_MEAN_POLICY_LOSSES, UNUSED_KNOBS, VERL_ALGORITHMS)

if TYPE_CHECKING:
    from workers.trainer.config import TrainerConfig


def one_of(name: str, value, allowed, verl_names: dict | None = None) -> None:
    if verl_names and value in verl_names:
        raise ValueError(f"trainer.{name}: {value!r} is verl's name; here it is {verl_names[value]!r} "
                         f"(one of {allowed})")
    if value not in allowed:
        raise ValueError(f"trainer.{name}: {value!r} is not one of {allowed}")


def first_set(cfg: "TrainerConfig", names) -> str | None:
    """The first of ``names`` set to other than its default: a knob the run does not read, set,
    is refused naming it (each caller says who reads it)."""
    defaults = {f.name: f.default for f in fields(cfg)}
    return next((n for n in names if getattr(cfg, n) != defaults[n]), None)


def check_algorithm(cfg: "TrainerConfig") -> None:
    """``algorithm``: one of ours or a user's verl estimator (loaded, its parameters checked)."""
    if not isinstance(cfg.algorithm, str):
        raise ValueError(f"trainer.algorithm must be a name, got {cfg.algorithm!r}")
    if cfg.custom_advantage:
        from workers.trainer.custom_advantage import load_estimator

        load_estimator(cfg.algorithm)
    else:
        try:
            one_of("algorithm", cfg.algorithm, ALGORITHMS, VERL_ALGORITHMS)
        except ValueError as e:
            if cfg.algorithm in VERL_ALGORITHMS:
                raise
            raise ValueError(f"{e}, or a verl estimator of yours: \"path/to/file.py:function\"") from None


def check_algorithm_knobs(cfg: "TrainerConfig") -> None:
    """The critic only with ppo; a knob the algorithm does not read, set, is refused (after the
    switches' types are checked: ``critic: "false"`` is said as a type error)."""
    custom = cfg.custom_advantage
    if cfg.algorithm == "ppo" and cfg.critic is False:
        raise ValueError("trainer.algorithm 'ppo' uses GAE and needs critic: true "
                         "(use grpo, rloo or reinforce_plus_plus(_baseline) for critic-free training)")
    if cfg.algorithm != "ppo" and cfg.critic:
        raise ValueError(f"trainer.critic: true is only used by algorithm 'ppo', not {cfg.algorithm!r}")
    name = first_set(cfg, CUSTOM_UNUSED_KNOBS if custom else UNUSED_KNOBS[cfg.algorithm])
    if name == "critic_warmup":  # verl holds its actor back whatever the estimator
        raise ValueError(f"trainer.critic_warmup ({cfg.critic_warmup}) warms up a critic, which only algorithm 'ppo' "
                         f"has, not {cfg.algorithm!r} (verl keeps the actor as it is for the first N - 1 steps with "
                         "any estimator; here that is ppo's only); leave it out")
    if name:
        users = [a for a in ALGORITHMS if name not in UNUSED_KNOBS[a]]
        raise ValueError(f"trainer.{name} ({getattr(cfg, name)!r}) is only used by algorithm "
                         f"{' / '.join(map(repr, users))}, not {cfg.algorithm!r}; leave it out "
                         f"(it would have no effect)")


def check_policy_loss(cfg: "TrainerConfig") -> None:
    """``policy_loss``'s aggregation and knobs: what verl forces, what it reads, their values."""
    mode = cfg.policy_loss
    if mode in SEQ_MEAN_POLICY_LOSSES and cfg.loss_agg != "seq_mean":
        raise ValueError(f"trainer.loss_agg: policy_loss {mode!r} averages each sequence's token losses, then the "
                         f"sequences ({SEQ_MEAN_POLICY_LOSSES[mode]}); set loss_agg: seq_mean, not "
                         f"{cfg.loss_agg!r}")
    name = first_set(cfg, [k for k in dict.fromkeys(k for knobs in POLICY_LOSS_KNOBS.values() for k in knobs)
                           if k not in POLICY_LOSS_KNOBS[mode]])
    if name:
        users = " / ".join(repr(m) for m, knobs in POLICY_LOSS_KNOBS.items() if name in knobs)
        what = f"no dual clip (verl's {mode} ignores clip_ratio_c)" if name == "dual_clip" else "no use for it"
        raise ValueError(f"trainer.{name} ({getattr(cfg, name)!r}): policy_loss {mode!r} has {what}; only "
                         f"{users} read it; leave it out")
    for name in ("clip_cov_ratio", "kl_cov_ratio"):  # a share of the micro-batch's tokens (at least one)
        if not 0 < getattr(cfg, name) <= 1:
            raise ValueError(f"trainer.{name} must be in (0, 1], got {getattr(cfg, name)}")
    if not cfg.clip_cov_lb < cfg.clip_cov_ub:
        raise ValueError(f"trainer.clip_cov_lb ({cfg.clip_cov_lb}) must be < trainer.clip_cov_ub "
                         f"({cfg.clip_cov_ub}): clip_cov draws tokens whose covariance lies between them")


def check_rollout_correction(cfg: "TrainerConfig") -> None:
    """trainer.rollout_is / rollout_rs: their values, tis_cap beside them, the policy losses
    whose sequence statistics a token-level rejection would change."""
    from workers.trainer.rollout_correction import IS_WEIGHTS, parse_rejection

    check_bypass(cfg)
    if cfg.rollout_is is not None and cfg.rollout_is not in IS_WEIGHTS:
        raise ValueError(f"trainer.rollout_is: {cfg.rollout_is!r} is not one of {tuple(IS_WEIGHTS)} (or null: off)")
    if cfg.rollout_is_threshold is not None and not cfg.rollout_is_threshold > 0:
        raise ValueError(f"trainer.rollout_is_threshold must be > 0, got {cfg.rollout_is_threshold}")
    if cfg.tis_cap > 0 and cfg.rollout_is is not None:
        raise ValueError(f"trainer.tis_cap ({cfg.tis_cap}) is trainer.rollout_is: token with rollout_is_threshold: "
                         f"{cfg.tis_cap} (verl's older actor.tis_imp_ratio_cap); set one, not both")
    if cfg.rollout_rs is None:
        return
    checks = parse_rejection(cfg.rollout_rs, cfg.rollout_rs_threshold)
    if cfg.policy_loss in ("clip_cov", "kl_cov"):
        raise ValueError(f"trainer.rollout_rs: policy_loss {cfg.policy_loss!r} picks its tokens by statistics of "
                         f"the micro-batch's tokens, and here those would include rejected ones (verl's exclude "
                         f"them); rejection sampling is not available with it")
    token_level = [c.option for c in checks if c.level == "token"]
    if token_level and cfg.policy_loss in ("gspo", "geo_mean"):
        raise ValueError(f"trainer.rollout_rs: {', '.join(token_level)} rejects single tokens, and policy_loss "
                         f"{cfg.policy_loss!r} averages each sequence's tokens over all of them here (verl: over "
                         f"the kept ones); use a sequence-level option (seq_sum_*, seq_mean_*, seq_max_*)")


def check_bypass(cfg: "TrainerConfig") -> None:
    """trainer.rollout_bypass (verl's bypass_mode) and rollout_loss_type (its loss_type): what
    bypass mode replaces (the old log-probs' recomputation, the policy loss) and what it cannot take."""
    one_of("rollout_loss_type", cfg.rollout_loss_type, BYPASS_LOSS_TYPES)
    if not cfg.rollout_bypass:
        return  # rollout_loss_type without it: refused as a switched knob
    if cfg.recompute_old_logprobs:
        raise ValueError("trainer.recompute_old_logprobs: true recomputes the old log-probs, and "
                         "trainer.rollout_bypass: true takes the sampler's as the old ones instead (verl's bypass_mode "
                         "skips that forward); set one")
    if cfg.tis_cap > 0:
        raise ValueError(f"trainer.tis_cap ({cfg.tis_cap}) weights by pi_old / pi_sampler with recomputed old "
                         f"log-probs, which trainer.rollout_bypass has none of; with it, set trainer.rollout_is: "
                         f"token, rollout_is_threshold: {cfg.tis_cap} and rollout_loss_type: reinforce")
    if cfg.policy_loss != "ppo":
        raise ValueError(f"trainer.policy_loss ({cfg.policy_loss!r}): with trainer.rollout_bypass the policy loss is "
                         f"trainer.rollout_loss_type's (ppo_clip: ppo's clipped surrogate, or reinforce), as verl's "
                         f"bypass mode replaces loss_mode; leave policy_loss out")
    if cfg.rollout_is_batch_normalize:
        raise ValueError("trainer.rollout_is_batch_normalize: with trainer.rollout_bypass the weights are the current "
                         "policy's, taken in each training forward, and verl normalises them over one micro-batch of "
                         "all ranks at once; not available here (leave it out)")
    if cfg.rollout_loss_type == "ppo_clip" and cfg.rollout_is is not None:
        raise ValueError(f"trainer.rollout_is ({cfg.rollout_is!r}) with trainer.rollout_bypass and rollout_loss_type "
                         f"'ppo_clip': the PPO ratio pi / pi_rollout is the importance ratio already, and verl's "
                         f"ppo_clip applies no weights (it takes them for its metrics only); set rollout_loss_type: "
                         f"reinforce, or leave rollout_is out")
    name = first_set(cfg, ("clip_low", "clip_high", "dual_clip")) if cfg.rollout_loss_type == "reinforce" else None
    if name:
        raise ValueError(f"trainer.{name} ({getattr(cfg, name)!r}): trainer.rollout_loss_type 'reinforce' has "
                         f"no clip (verl's REINFORCE loss, -w A log pi); leave it out")
