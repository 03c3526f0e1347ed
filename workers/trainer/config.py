"""``TrainerConfig``: every trainer knob, typed and validated once (at the edge; a mapping is
built by ``workers.config_schema.build_section``, as the run config's ``trainer:`` section)."""
from __future__ import annotations

import typing
from dataclasses import dataclass, fields

from workers.config_schema import SEEDS, Range, ranged
from workers.tasks.reward_pool import REWARD_POOLS

ALGORITHMS = ("ppo", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "grpo_passk")
# advantages compare a group's samples (step_math.GROUP_ADVANTAGES)
GROUPED = ("grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "grpo_passk")
WHITENED = ("ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")  # advantages whitened over the batch
# knobs only some algorithms read: set to anything but their default under another, refused
_CRITIC_KNOBS = ("critic_lr", "value_clip", "value_coef", "gae_lambda")  # GAE / value loss
_GRPO_KNOBS = ("grpo_std_normalize", "adv_eps")  # group std normalisation
UNUSED_KNOBS = {"ppo": _GRPO_KNOBS, "grpo": _CRITIC_KNOBS + ("gamma",),
                "rloo": _CRITIC_KNOBS + ("gamma",) + _GRPO_KNOBS,
                "reinforce_plus_plus": _CRITIC_KNOBS + _GRPO_KNOBS,  # gamma: its returns' discount
                "reinforce_plus_plus_baseline": _CRITIC_KNOBS + ("gamma",) + _GRPO_KNOBS,
                "opo": _CRITIC_KNOBS + ("gamma",) + _GRPO_KNOBS,
                "grpo_passk": _CRITIC_KNOBS + ("gamma",)}
# knobs a switch turns on: set to anything but their default while it is 0, refused
SWITCHED_KNOBS = {"overlong_buffer": ("overlong_penalty",), "lora_rank": ("lora_alpha", "lora_target_modules"),
                  "kl_target": ("kl_horizon",), "filter_groups": ("train_groups", "max_gen_batches"),
                  "train_groups": ("max_gen_batches",),  # refills (max_gen_batches) aim at train_groups
                  "rollout_is": ("rollout_is_threshold", "rollout_is_batch_normalize"),
                  "rollout_rs": ("rollout_rs_threshold",)}
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


@dataclass(frozen=True)
class TrainerConfig:
    """Trainer hyper-parameters.

    algorithm: ``ppo`` (GAE with a critic), ``grpo`` (group-normalised scores), ``rloo``
    (leave-one-out baseline), ``reinforce_plus_plus`` (REINFORCE++: each token's discounted return
    of the reward, ``gamma``, whitened over the batch), ``reinforce_plus_plus_baseline`` (the score
    minus its group's mean, whitened over the batch), ``opo`` (the score minus the group's
    length-weighted mean score), ``grpo_passk`` (pass@k: only a group's best sample learns, from
    its lead over the second best, std-normalised as grpo). ``clip_low`` / ``clip_high``: ratio clipped to
    [1 - clip_low, 1 + clip_high] (clip-higher when high > low). ``dual_clip``: c > 1 bounds the
    loss of negative-advantage tokens by ``c * |A|`` (None: off). ``policy_loss`` (verl's
    ``actor.policy_loss.loss_mode``): ``ppo`` (verl's vanilla: a ratio per token), ``gspo``
    (GSPO: one ratio per sequence, the geometric mean of its tokens'; its clip ranges are tiny, the
    paper's 3e-4 / 4e-4), ``cispo`` (clipped IS weight, constant, times logp), ``geo_mean`` (GMPO:
    the geometric mean of the tokens' clipped ratios; clip_low / clip_high bound log r),
    ``sapo`` (a sigmoid gate, ``sapo_tau_pos`` / ``sapo_tau_neg``), ``gpg`` (-A logp),
    ``clip_cov`` / ``kl_cov`` (tokens picked by their covariance of A and logp within a
    micro-batch: ``clip_cov_*``, ``kl_cov_*``); gspo, sapo and geo_mean need ``loss_agg:
    seq_mean`` (verl forces it), and only ppo takes ``dual_clip`` (``workers/trainer/losses.py``).
    ``kl_estimator``: ``k1``, ``k2`` (verl's mse), ``k3`` (verl's
    low_var_kl), ``abs``, or ``k1+`` / ``k3+`` / ``abs+`` (the value of that estimator, the
    gradient of k2). ``kl_mode`` ``loss`` adds
    ``kl_coef * KL`` to the loss, ``reward`` subtracts it from the reward; there ``kl_target`` > 0
    adapts the coefficient after each iteration towards that mean KL (``KLCoefficient``, horizon
    ``kl_horizon`` samples), starting from ``kl_coef``. ``loss_agg`` (verl's
    ``loss_agg_mode``): ``token_mean`` (sum over tokens / total tokens of the update),
    ``seq_mean`` (mean over a sequence's tokens, summed / total sequences; verl's
    seq-mean-token-mean), ``seq_mean_token_sum`` (a sequence's token sum, summed / total
    sequences) or ``seq_mean_token_sum_norm`` (the same / ``loss_scale_factor``, a constant:
    Dr. GRPO; verl divides by the padded response length, max_response_length, and the run config
    fills it from ``train.max_tokens``). ``whiten_advantages`` (None: on for ppo and REINFORCE++, as verl):
    the GAE advantages of the iteration (every rank's) are whitened over their tokens, verl's
    ``masked_whiten``; that needs every sample, so with it on ``receive`` only prepares samples
    and all the training compute runs at ``step()``. ``max_staleness``: samples generated by a
    version older than ``version - max_staleness`` are refused (``on_bad_sample``: skip with a
    warning, or raise). ``recompute_old_logprobs``: use the trainer's own log-probs at
    receive time as the PPO "old" policy instead of the sampler's ``Sample.logprobs``.
    ``tis_cap`` (verl's ``actor.tis_imp_ratio_cap``; 0: off): truncated importance sampling.
    The old log-probs are then the trainer's (as ``recompute_old_logprobs``) and each token's
    policy loss is weighted by ``min(pi_old / pi_sampler, tis_cap)``, the sampler's being the
    distribution the token was drawn from: one-step-stale weights in the async modes, top-k /
    top-p filtering, engine-vs-trainer numerics. Without it, recomputed old log-probs make the
    PPO ratio 1 on stale samples (verl's one-step-off-policy does the same). It is
    ``rollout_is: token`` with ``rollout_is_threshold: tis_cap`` (setting both is refused).
    Rollout correction (verl's ``algorithm.rollout_correction``, its decoupled mode;
    ``workers/trainer/rollout_correction.py``): ``rollout_is`` (None: off) ``token`` weights each
    token's policy loss by min(pi_old / pi_sampler, ``rollout_is_threshold``), ``sequence`` by
    min(prod_t pi_old / pi_sampler, threshold) on every token of the sequence (the threshold's
    default, None, is verl's 2.0); ``rollout_is_batch_normalize`` divides the weights by their
    mean over the iteration's tokens (token) or sequences (sequence), all ranks, at ``step()``,
    so with it training waits for the iteration's last sample, as with whitening.
    ``rollout_rs`` (None: off): rejection sampling, verl's comma-separated options (token_k1..3,
    seq_sum_k1..3, seq_mean_k1..3, seq_max_k2/k3) with ``rollout_rs_threshold`` (one per
    option or one for all; k1: ``lower_upper`` ratio bounds, or an upper one whose reciprocal is
    the lower); a rejected token (or sequence) is dropped from every loss term and from the
    token / sequence counts the loss is divided by. Either turns the trainer's old log-probs on.
    ``temperature``: the sampling temperature the samples were drawn at; every log-prob the
    trainer takes (policy, old, reference; entropy) is of ``softmax(logits / temperature)``,
    the distribution the sampler's log-probs are of (as verl divides the logits by the rollout
    temperature). It must equal the generator's (``train.temperature``).
    ``ppo_epochs``: optimizer updates per iteration; the first uses the gradients accumulated
    while streaming, each further one re-runs the iteration's micro-batches at ``step()`` (the
    clipped ratio then bounds how far the policy moves). The weight version bumps once.
    ``mini_batches``: optimizer updates per epoch (verl's train_batch_size / ppo_mini_batch_size):
    each rank's samples split into this many mini-batches, each one update with its own token
    (or sequence) count. ``shuffle`` (verl's ``actor.shuffle``; on here, off in verl): the
    mini-batches hold whole prompt groups in an order drawn from ``seed`` and the step, because
    samples arrive shortest first (streamed as they finish) where verl's batch is in prompt
    order; off: arrival order. Above 1 the training compute runs at
    ``step()`` (gradients of the whole iteration cannot be accumulated while streaming).
    ``activation_checkpointing`` (verl's ``enable_gradient_checkpointing``): the actor's and the
    critic's training forwards keep only each decoder layer's input and recompute the layer in
    backward (the same update; one more forward of every layer per micro-batch). Off by default:
    a tiny CPU model has activation memory to spare, while a 7B policy on long responses needs it.
    ``shard_optimizer`` (ZeRO-1): with several data-parallel ranks, each keeps the AdamW moments
    of its share of the parameters only, steps that share and broadcasts it (the same update;
    ``workers/trainer/optimizer.py``). It is the only trainer state this shards: the weights and
    the gradients accumulated while samples stream in stay whole on every rank.
    ``overlong_buffer`` (DAPO, verl's ``reward_model.overlong_buffer.len``; 0: off): a response
    longer than ``max_response_tokens - overlong_buffer`` tokens gets
    ``-(length - (max_response_tokens - overlong_buffer)) / overlong_buffer * overlong_penalty``
    added to its reward (down to ``-overlong_penalty`` at the cap); the logged ``reward_*`` stay
    the task's scores, ``overlong_penalty_mean`` says the penalty.
    ``lora_rank`` > 0 (verl's ``lora_rank``): the actor's base weights are frozen and low-rank
    adapters of that rank train on ``lora_target_modules`` (``all-linear``: q, k, v, o, gate, up,
    down), scaled by ``lora_alpha / lora_rank``; the reference policy is the actor with its adapters
    off, and the engines get the merged weights (``workers/trainer/lora.py``). A PPO critic still
    trains every parameter of its own copy.
    """

    algorithm: str = "grpo"
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = ranged((0.9, 0.999), Range(0, 1, open_hi=True))
    adam_eps: float = 1e-8
    # ZeRO-1: each data-parallel rank keeps the AdamW state (m, v) of its share of the parameters
    # (torch's ZeroRedundancyOptimizer); weights and gradients stay whole on every rank
    shard_optimizer: bool = False
    # DAPO's soft overlong punishment (verl's reward_model.overlong_buffer.len / penalty_factor): 0: off
    overlong_buffer: int = ranged(0, Range(0, note="0: off"))
    overlong_penalty: float = ranged(1.0, Range(0, open_lo=True))
    max_response_tokens: int | None = None  # the response cap it counts from; a run config: train.max_tokens
    # LoRA (verl's lora_rank, lora_alpha, target_modules): 0 trains every parameter
    lora_rank: int = ranged(0, Range(0, note="0: off, every parameter trains"))
    lora_alpha: float = ranged(16.0, Range(0, open_lo=True))
    lora_target_modules: str | tuple[str, ...] = "all-linear"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    # verl's actor.policy_loss.loss_mode (vanilla: ppo): POLICY_LOSS_KNOBS, docs/trainer.md
    policy_loss: str = "ppo"
    # policy_loss sapo's gate temperatures where A > 0 / A <= 0 (verl's actor.tau_pos / tau_neg)
    sapo_tau_pos: float = ranged(1.0, Range(0, open_lo=True))
    sapo_tau_neg: float = ranged(1.05, Range(0, open_lo=True))
    # policy_loss clip_cov / kl_cov (verl's actor.policy_loss.*): the share of a micro-batch's tokens
    # detached / penalised, clip_cov's covariance range, kl_cov's coefficient (verl's ppo_kl_coef)
    clip_cov_ratio: float = ranged(2e-4, Range(0, 1, open_lo=True))
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = ranged(2e-4, Range(0, 1, open_lo=True))
    kl_cov_coef: float = ranged(0.1, Range(0, open_lo=True))
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_mode: str = "loss"
    # adaptive beta for kl_mode reward (verl's algorithm.kl_ctrl type adaptive, target_kl, horizon)
    kl_target: float = ranged(0.0, Range(0, note="0: kl_coef stays fixed"))
    kl_horizon: int = ranged(10000, Range(1))
    entropy_coef: float = 0.0
    loss_agg: str = "token_mean"
    loss_scale_factor: int | None = None  # seq_mean_token_sum_norm's constant divisor (verl's name)
    max_tokens_per_microbatch: int = 4096
    max_staleness: int = 1
    on_bad_sample: str = "skip"
    grad_clip: float = 1.0
    warmup_steps: int = 0
    # verl's lr_warmup_steps_ratio: int(warmup_ratio * total_steps) warmup steps (``warmup``)
    warmup_ratio: float = ranged(0.0, Range(0, 1, open_hi=True, note="0: warmup_steps says"))
    lr_schedule: str = "constant"
    total_steps: int = 1000
    min_lr_ratio: float = ranged(0.0, Range(0, 1, note="the fraction of lr the schedule decays to"))
    # critic / GAE (ppo)
    critic: bool | None = None  # None: on for ppo, off otherwise
    critic_lr: float = 1e-4
    value_clip: float = 0.2
    value_coef: float = 0.5
    gamma: float = 1.0
    gae_lambda: float = 0.95
    # group baselines (grpo / rloo)
    whiten_advantages: bool | None = None  # None: on for WHITENED (as verl), off otherwise
    # DAPO's dynamic sampling (verl's algorithm.filter_groups): at step(), a group whose samples all
    # got the same task score is dropped, and of the rest the first train_groups (prompt order, over
    # all ranks; 0: all) train. With train_groups > 0 the controller generates more batches of
    # train.batch_prompts (verl's gen_batch_size) until train_groups survive, at most max_gen_batches
    # an iteration (verl's max_num_gen_batches; 0: no limit); short after the last, what is left trains
    filter_groups: bool = False
    train_groups: int = ranged(0, Range(0, note="0: every group left after the filter"))
    max_gen_batches: int = ranged(10, Range(0, note="0: no limit"))
    grpo_std_normalize: bool = True
    adv_eps: float = 1e-6
    recompute_old_logprobs: bool = False
    tis_cap: float = 0.0  # truncated importance sampling cap (verl's actor.tis_imp_ratio_cap); 0: off
    # rollout correction (verl's algorithm.rollout_correction, decoupled): pi_old / pi_sampler per sample
    rollout_is: str | None = None  # importance weights: token / sequence (None: off)
    rollout_is_threshold: float | None = None  # their truncation (None: 2.0, verl's default)
    rollout_is_batch_normalize: bool = False  # weights / their iteration mean (training waits for step())
    rollout_rs: str | None = None  # rejection sampling: comma-separated options (rollout_correction.RS_OPTIONS)
    rollout_rs_threshold: str | float | None = None  # one per option, or one for all (k1: "lower_upper")
    temperature: float = 1.0  # the rollout's sampling temperature: log-probs are taken at it
    ppo_epochs: int = 1  # passes over the iteration's samples
    mini_batches: int = 1  # optimizer updates per pass (verl: train_batch_size / ppo_mini_batch_size)
    shuffle: bool = True  # mini_batches > 1: shares of whole groups in a seeded random order (else arrival order)
    precision: str = "auto"  # auto: bf16 autocast (fp32 master weights) on CUDA, fp32 on CPU
    activation_checkpointing: bool = False  # recompute each layer in backward (actor and critic)
    # the task's score of each sample (workers/tasks/reward_pool.py): this many at once per trainer
    # rank, on threads or in spawned processes (CPU-bound rewards), each past reward_timeout_s skipped
    reward_workers: int = ranged(1, Range(1, 256))
    reward_pool: str = "threads"
    reward_timeout_s: float | None = None  # null: no deadline (a score past 60 s is said once)
    # a task with score_batch: at most this many samples a call (the deadline is a call's)
    reward_batch_size: int | None = ranged(None, Range(1, note="null: each arrival, or an evaluation, in one call"))
    seed: int = ranged(0, SEEDS)

    def __post_init__(self):
        _one_of("algorithm", self.algorithm, ALGORITHMS)
        _one_of("kl_estimator", self.kl_estimator, KL_ESTIMATORS, VERL_KL_ESTIMATORS)
        _one_of("kl_mode", self.kl_mode, KL_MODES)
        _one_of("loss_agg", self.loss_agg, LOSS_AGGS, VERL_LOSS_AGGS)
        _one_of("policy_loss", self.policy_loss, POLICY_LOSSES, VERL_POLICY_LOSSES)
        self._check_policy_loss()
        self._check_rollout_correction()
        if self.loss_agg == "seq_mean_token_sum_norm" and self.loss_scale_factor is None:
            raise ValueError("trainer.loss_scale_factor: loss_agg 'seq_mean_token_sum_norm' divides each sequence's "
                             "token sum by this constant (verl: the padded response length, max_response_length); "
                             "set it (a run config takes train.max_tokens unless set)")
        if self.loss_scale_factor is not None:
            if self.loss_agg != "seq_mean_token_sum_norm":
                raise ValueError(f"trainer.loss_scale_factor is only used by loss_agg 'seq_mean_token_sum_norm', "
                                 f"not {self.loss_agg!r}")
            if not self.loss_scale_factor > 0:
                raise ValueError(f"trainer.loss_scale_factor must be > 0, got {self.loss_scale_factor}")
        _one_of("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _one_of("on_bad_sample", self.on_bad_sample, BAD_SAMPLE_POLICIES)
        _one_of("precision", self.precision, PRECISIONS)
        _one_of("reward_pool", self.reward_pool, REWARD_POOLS)
        if self.reward_timeout_s is not None and not self.reward_timeout_s > 0:
            raise ValueError(f"trainer.reward_timeout_s must be > 0 seconds (or null: no deadline), "
                             f"got {self.reward_timeout_s}")
        hints = typing.get_type_hints(type(self))  # resolved types (the annotations are strings)
        for f in fields(self):  # "false" or 0 given to a switch would be read as truthy / falsy
            value, nullable = getattr(self, f.name), hints[f.name] == typing.Optional[bool]
            if (hints[f.name] is bool or nullable) and not (isinstance(value, bool) or (value is None and nullable)):
                raise ValueError(f"trainer.{f.name} must be true or false{' (or null)' if nullable else ''}, "
                                 f"got {value!r}")
        for name in ("lr", "critic_lr", "adam_eps", "max_tokens_per_microbatch", "total_steps", "ppo_epochs",
                     "mini_batches", "temperature", "lora_alpha", "overlong_penalty"):
            if not getattr(self, name) > 0:
                raise ValueError(f"trainer.{name} must be > 0, got {getattr(self, name)}")
        for name in ("clip_low", "clip_high", "kl_coef", "entropy_coef", "weight_decay", "grad_clip",
                     "warmup_steps", "max_staleness", "value_clip", "value_coef", "adv_eps", "min_lr_ratio",
                     "tis_cap"):
            if getattr(self, name) < 0:
                raise ValueError(f"trainer.{name} must be >= 0, got {getattr(self, name)}")
        if self.warmup_steps > self.total_steps:
            raise ValueError(f"trainer.warmup_steps ({self.warmup_steps}) must be <= trainer.total_steps "
                             f"({self.total_steps}): the schedule would end before the warmup does")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"trainer.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.warmup_ratio and self.warmup_steps:
            raise ValueError(f"trainer.warmup_steps ({self.warmup_steps}) and trainer.warmup_ratio "
                             f"({self.warmup_ratio}) both set the LR warmup; set one")
        if self.clip_low >= 1 and self.policy_loss not in NO_CLIP_FLOOR:
            raise ValueError(f"trainer.clip_low must be < 1, got {self.clip_low} (policy_loss cispo or geo_mean "
                             f"take more)")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"trainer.dual_clip must be > 1 (or null), got {self.dual_clip}")
        if not (0 <= self.gamma <= 1 and 0 <= self.gae_lambda <= 1):
            raise ValueError("trainer.gamma and trainer.gae_lambda must be in [0, 1]")
        if self.algorithm == "ppo" and self.critic is False:
            raise ValueError("trainer.algorithm 'ppo' uses GAE and needs critic: true "
                             "(use grpo, rloo or reinforce_plus_plus(_baseline) for critic-free training)")
        if self.algorithm != "ppo" and self.critic:
            raise ValueError(f"trainer.critic: true is only used by algorithm 'ppo', not {self.algorithm!r}")
        defaults = {f.name: f.default for f in fields(self)}
        for name in UNUSED_KNOBS[self.algorithm]:
            if getattr(self, name) != defaults[name]:
                users = [a for a in ALGORITHMS if name not in UNUSED_KNOBS[a]]
                raise ValueError(f"trainer.{name} ({getattr(self, name)!r}) is only used by algorithm "
                                 f"{' / '.join(map(repr, users))}, not {self.algorithm!r}; leave it out "
                                 f"(it would have no effect)")
        if self.overlong_buffer:
            if self.max_response_tokens is None:
                raise ValueError("trainer.overlong_buffer counts from the longest response, "
                                 "trainer.max_response_tokens: set it (a run config takes train.max_tokens)")
            if not 0 < self.overlong_buffer <= self.max_response_tokens:
                raise ValueError(f"trainer.overlong_buffer must be in [0, max_response_tokens "
                                 f"{self.max_response_tokens}] (train.max_tokens), got {self.overlong_buffer}")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"trainer.lora_rank must be an integer >= 0 (0: no LoRA), got {self.lora_rank!r}")
        targets = self.lora_target_modules
        if targets != "all-linear":
            from workers.trainer.lora import TARGETS

            if isinstance(targets, str) or not targets or any(t not in TARGETS for t in targets):
                raise ValueError(f"trainer.lora_target_modules: {targets!r}: 'all-linear' or a list of names "
                                 f"from {list(TARGETS)}")
        for switch, knobs in SWITCHED_KNOBS.items():
            if not getattr(self, switch):
                for name in knobs:
                    if getattr(self, name) != defaults[name]:
                        on = (": true" if isinstance(defaults[switch], bool) else
                              " set" if defaults[switch] is None else " > 0")
                        raise ValueError(f"trainer.{name} ({getattr(self, name)!r}) is only used with trainer.{switch}"
                                         f"{on}; leave it out or set {switch}")
        if self.kl_target > 0 and not self.kl_in_reward:
            raise ValueError(f"trainer.kl_target ({self.kl_target}) adapts the KL penalty in the reward: it needs "
                             f"trainer.kl_mode: reward (got {self.kl_mode!r}) and trainer.kl_coef > 0 (got "
                             f"{self.kl_coef}), its starting value")
        if self.algorithm not in WHITENED and self.whiten_advantages:
            raise ValueError(f"trainer.whiten_advantages: true is only used by algorithm "
                             f"{' / '.join(map(repr, WHITENED))}, not {self.algorithm!r} (its advantages are "
                             f"normalised within each group)")

    def _check_policy_loss(self) -> None:
        """``policy_loss``'s aggregation and knobs: what verl forces, what it reads, their values."""
        mode = self.policy_loss
        if mode in SEQ_MEAN_POLICY_LOSSES and self.loss_agg != "seq_mean":
            raise ValueError(f"trainer.loss_agg: policy_loss {mode!r} averages each sequence's token losses, then the "
                             f"sequences ({SEQ_MEAN_POLICY_LOSSES[mode]}); set loss_agg: seq_mean, not "
                             f"{self.loss_agg!r}")
        defaults = {f.name: f.default for f in fields(self)}
        for name in dict.fromkeys(k for knobs in POLICY_LOSS_KNOBS.values() for k in knobs):
            if name not in POLICY_LOSS_KNOBS[mode] and getattr(self, name) != defaults[name]:
                users = " / ".join(repr(m) for m, knobs in POLICY_LOSS_KNOBS.items() if name in knobs)
                what = f"no dual clip (verl's {mode} ignores clip_ratio_c)" if name == "dual_clip" else "no use for it"
                raise ValueError(f"trainer.{name} ({getattr(self, name)!r}): policy_loss {mode!r} has {what}; only "
                                 f"{users} read it; leave it out")
        for name in ("sapo_tau_pos", "sapo_tau_neg", "kl_cov_coef"):
            if not getattr(self, name) > 0:
                raise ValueError(f"trainer.{name} must be > 0, got {getattr(self, name)}")
        for name in ("clip_cov_ratio", "kl_cov_ratio"):  # a share of the micro-batch's tokens (at least one)
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"trainer.{name} must be in (0, 1], got {getattr(self, name)}")
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ValueError(f"trainer.clip_cov_lb ({self.clip_cov_lb}) must be < trainer.clip_cov_ub "
                             f"({self.clip_cov_ub}): clip_cov draws tokens whose covariance lies between them")

    def _check_rollout_correction(self) -> None:
        """trainer.rollout_is / rollout_rs: their values, tis_cap beside them, the policy losses
        whose sequence statistics a token-level rejection would change."""
        from workers.trainer.rollout_correction import IS_WEIGHTS, parse_rejection

        if self.rollout_is is not None and self.rollout_is not in IS_WEIGHTS:
            raise ValueError(f"trainer.rollout_is: {self.rollout_is!r} is not one of {tuple(IS_WEIGHTS)} (or null: off)")
        if self.rollout_is_threshold is not None and not self.rollout_is_threshold > 0:
            raise ValueError(f"trainer.rollout_is_threshold must be > 0, got {self.rollout_is_threshold}")
        if self.tis_cap > 0 and self.rollout_is is not None:
            raise ValueError(f"trainer.tis_cap ({self.tis_cap}) is trainer.rollout_is: token with rollout_is_threshold: "
                             f"{self.tis_cap} (verl's older actor.tis_imp_ratio_cap); set one, not both")
        if self.rollout_rs is None:
            return
        checks = parse_rejection(self.rollout_rs, self.rollout_rs_threshold)
        if self.policy_loss in ("clip_cov", "kl_cov"):
            raise ValueError(f"trainer.rollout_rs: policy_loss {self.policy_loss!r} picks its tokens by statistics of "
                             f"the micro-batch's tokens, and here those would include rejected ones (verl's exclude "
                             f"them); rejection sampling is not available with it")
        token_level = [c.option for c in checks if c.level == "token"]
        if token_level and self.policy_loss in ("gspo", "geo_mean"):
            raise ValueError(f"trainer.rollout_rs: {', '.join(token_level)} rejects single tokens, and policy_loss "
                             f"{self.policy_loss!r} averages each sequence's tokens over all of them here (verl: over "
                             f"the kept ones); use a sequence-level option (seq_sum_*, seq_mean_*, seq_max_*)")

    @property
    def is_level(self) -> str | None:
        """The importance weights' level: ``rollout_is``, or ``token`` under ``tis_cap`` (None: none)."""
        return "token" if self.tis_cap > 0 else self.rollout_is

    @property
    def is_threshold(self) -> float:
        """Their truncation: ``tis_cap``, or ``rollout_is_threshold`` (verl's 2.0 unless set)."""
        if self.tis_cap > 0:
            return self.tis_cap
        return 2.0 if self.rollout_is_threshold is None else self.rollout_is_threshold

    @property
    def rejection_checks(self) -> tuple:
        """``rollout_rs`` parsed: ``rollout_correction.RejectionCheck`` each (empty: no rejection)."""
        from workers.trainer.rollout_correction import parse_rejection

        return parse_rejection(self.rollout_rs, self.rollout_rs_threshold) if self.rollout_rs is not None else ()

    @property
    def corrects_rollout(self) -> bool:
        """Importance weights or rejection from the sampler's to the trainer's old log-probs."""
        return self.is_level is not None or self.rollout_rs is not None

    @property
    def tis_per_sequence(self) -> bool:
        """The importance weights (``tis_cap``, ``rollout_is``) enter as each sequence's geometric
        mean (geo_mean's loss is one per sequence; verl's)."""
        return self.policy_loss == "geo_mean"

    @property
    def kl_in_reward(self) -> bool:
        """The KL to the reference is a penalty in the reward (its beta: ``KLCoefficient``)."""
        return self.kl_mode == "reward" and self.kl_coef > 0

    @property
    def warmup(self) -> int:
        """The LR schedule's warmup steps: ``warmup_steps``, or ``int(warmup_ratio * total_steps)``
        (verl's rounding, down), following ``total_steps``."""
        return self.warmup_steps or int(self.warmup_ratio * self.total_steps)

    @property
    def token_returns(self) -> bool:
        """Advantages are each token's discounted return, no critic (REINFORCE++)."""
        return self.algorithm == "reinforce_plus_plus"

    @property
    def use_critic(self) -> bool:
        return self.algorithm == "ppo"

    @property
    def whiten(self) -> bool:
        """Advantages (GAE's, REINFORCE++'s) whitened over the iteration's tokens (at ``step()``)."""
        return self.algorithm in WHITENED and self.whiten_advantages is not False

    @property
    def trains_at_step(self) -> bool:
        """Training waits for the iteration's last sample: whitening, the group filter and the
        importance weights' batch normalisation need them all (``receive`` only prepares samples)."""
        return self.whiten or self.filter_groups or self.rollout_is_batch_normalize

    @property
    def grouped(self) -> bool:
        """Advantages need every sample of a group (``GROUPED``)."""
        return self.algorithm in GROUPED

    @property
    def recomputes_old_logprobs(self) -> bool:
        """The PPO "old" log-probs are the trainer's own at receive time (rollout correction,
        ``tis_cap`` included, needs them)."""
        return self.recompute_old_logprobs or self.corrects_rollout

    @property
    def uses_sampler_logprobs(self) -> bool:
        """The samples' own log-probs are read: as the PPO old policy, or as rollout correction's
        pi_sampler."""
        return not self.recomputes_old_logprobs or self.corrects_rollout


def _one_of(name: str, value, allowed, verl_names: dict | None = None) -> None:
    if verl_names and value in verl_names:
        raise ValueError(f"trainer.{name}: {value!r} is verl's name; here it is {verl_names[value]!r} "
                         f"(one of {allowed})")
    if value not in allowed:
        raise ValueError(f"trainer.{name}: {value!r} is not one of {allowed}")
