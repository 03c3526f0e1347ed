"""The value sets of the trainer's keys (``TrainerConfig``) and verl's names for them: which
algorithms and policy losses exist, which knobs each reads, the spellings refused naming ours."""
from __future__ import annotations

from workers.tasks.plugins import is_plugin

ALGORITHMS = ("ppo", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "grpo_passk",
              "gpg", "remax")
# advantages compare a group's samples (step_math.GROUP_ADVANTAGES; remax: with the group's greedy baseline)
GROUPED = ("grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "grpo_passk", "gpg", "remax")
WHITENED = ("ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")  # advantages whitened over the batch


def trains_at_step(algorithm: str, whiten: bool, filter_groups: bool = False, is_batch_normalize: bool = False) -> bool:
    """Whether training waits for the iteration's last sample (``receive`` only prepares samples):
    whitened advantages, the group filter (``filter_groups``), the importance weights' batch
    normalisation (``rollout_is_batch_normalize``), gpg's scale (the step's samples over those
    with a nonzero reward) and a user's verl estimator (handed the whole batch) need them all.
    The trainer's rule (``TrainerConfig.trains_at_step``) and the planner's (``train_at_end``)."""
    return whiten or filter_groups or is_batch_normalize or algorithm == "gpg" or is_plugin(algorithm)

# knobs only some algorithms read: set to anything but their default under another, refused
_CRITIC_KNOBS = ("critic_lr", "value_clip", "value_coef", "gae_lambda", "critic_warmup")  # GAE / value loss
_GRPO_KNOBS = ("grpo_std_normalize", "adv_eps")  # group std normalisation
UNUSED_KNOBS = {"ppo": _GRPO_KNOBS, "grpo": _CRITIC_KNOBS + ("gamma",),
                "rloo": _CRITIC_KNOBS + ("gamma",) + _GRPO_KNOBS,
                "reinforce_plus_plus": _CRITIC_KNOBS + _GRPO_KNOBS,  # gamma: its returns' discount
                "reinforce_plus_plus_baseline": _CRITIC_KNOBS + ("gamma",) + _GRPO_KNOBS,
                "opo": _CRITIC_KNOBS + ("gamma",) + _GRPO_KNOBS,
                "grpo_passk": _CRITIC_KNOBS + ("gamma",),
                "gpg": _CRITIC_KNOBS + ("gamma",) + _GRPO_KNOBS,
                "remax": _CRITIC_KNOBS + ("gamma",) + _GRPO_KNOBS}  # verl's remax returns are undiscounted
# verl's adv_estimator values that are ours under another name (refused naming ours; the
# vectorized ones compute grpo's / rloo's numbers)
VERL_ALGORITHMS = {"gae": "ppo", "grpo_vectorized": "grpo", "rloo_vectorized": "rloo"}
# a user's verl estimator (trainer.algorithm "file.py:fn") reads gamma, gae_lambda (lam) and
# grpo_std_normalize from its config argument, as verl's algorithm config; never a critic's knobs,
# nor adv_eps (verl's estimators take epsilon as their own default)
CUSTOM_UNUSED_KNOBS = ("critic_lr", "value_clip", "value_coef", "critic_warmup", "adv_eps")
# knobs a switch turns on: set to anything but their default while it is 0, refused
SWITCHED_KNOBS = {"overlong_buffer": ("overlong_penalty",), "lora_rank": ("lora_alpha", "lora_target_modules"),
                  "kl_target": ("kl_horizon",), "filter_groups": ("train_groups", "max_gen_batches", "filter_metric"),
                  "train_groups": ("max_gen_batches",),  # refills (max_gen_batches) aim at train_groups
                  "rollout_is": ("rollout_is_threshold", "rollout_is_batch_normalize"),
                  "rollout_rs": ("rollout_rs_threshold",), "rollout_bypass": ("rollout_loss_type",)}
# trainer.rollout_loss_type: the policy loss of rollout correction's bypass mode (verl's loss_type)
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")
# workers/trainer/kl.py; "+": the named estimator's value with k2's gradient (verl's straight-through)
KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "k1+", "k3+", "abs+")
# verl's kl_loss_type / kl_penalty values -> ours (refused with the name to use; mse+ is k2 itself)
VERL_KL_ESTIMATORS = {"kl": "k1", "mse": "k2", "low_var_kl": "k3", "kl+": "k1+", "mse+": "k2", "low_var_kl+": "k3+"}
# trainer.policy_loss (workers/trainer/losses.py POLICY_LOSSES, same order) -> the knobs it reads; a knob
# of this table set to anything but its default under a policy_loss that does not read it is refused
POLICY_LOSS_KNOBS = {"ppo": ("clip_low", "clip_high", "dual_clip"), "gspo": ("clip_low", "clip_high"),
                     "cispo": ("clip_low", "clip_high"), "geo_mean": ("clip_low", "clip_high"),
                     "sapo": ("sapo_tau_pos", "sapo_tau_neg"), "gpg": (),
                     "clip_cov": ("clip_low", "clip_high", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
                     "kl_cov": ("kl_cov_ratio", "kl_cov_coef")}
POLICY_LOSSES = tuple(POLICY_LOSS_KNOBS)
# verl's actor.policy_loss.loss_mode -> ours (verl's docs spell clip-cov / kl-cov; its registry does not)
VERL_POLICY_LOSSES = {"vanilla": "ppo", "clip-cov": "clip_cov", "kl-cov": "kl_cov"}
# verl's keys of these knobs -> ours (for the run config's unknown-key hint, controller/config_types.py)
VERL_POLICY_LOSS_KEYS = {"tau_pos": "trainer.sapo_tau_pos", "tau_neg": "trainer.sapo_tau_neg",
                         "ppo_kl_coef": "trainer.kl_cov_coef (kl_cov's coefficient)"}
# verl aggregates these losses seq-mean-token-mean whatever loss_agg_mode says: loss_agg seq_mean is required
SEQ_MEAN_POLICY_LOSSES = {"gspo": "verl's gspo forces seq-mean-token-mean whatever loss_agg_mode says",
                          "sapo": "verl's sapo forces seq-mean-token-mean whatever loss_agg_mode says",
                          "geo_mean": "one loss per sequence; verl's geo_mean averages them over the sequences "
                                      "whatever loss_agg_mode says"}
NO_CLIP_FLOOR = ("cispo", "geo_mean")  # clip_low >= 1 is meaningful: no lower clip / a log-space bound
KL_MODES = ("loss", "reward")
LOSS_AGGS = ("token_mean", "seq_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
# verl's loss_agg_mode values -> ours (refused with the name to use, not taken silently)
VERL_LOSS_AGGS = {"token-mean": "token_mean", "seq-mean-token-mean": "seq_mean",
                  "seq-mean-token-sum": "seq_mean_token_sum", "seq-mean-token-sum-norm": "seq_mean_token_sum_norm"}
LR_SCHEDULES = ("constant", "cosine", "linear")
BAD_SAMPLE_POLICIES = ("skip", "error")
PRECISIONS = ("auto", "bf16", "fp32")
