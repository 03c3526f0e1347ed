"""The run config's own wording around ``workers.config_schema`` (the one mapping -> dataclass
builder, with ``ConfigError``): an unknown key names verl's equivalent or a near miss.

``controller.config`` builds each section with ``build_section``; the checks across keys
(placement, modes, registries) are ``controller.config_checks``.
"""
from __future__ import annotations

from typing import Any

from workers import config_schema
from workers.config_schema import ConfigError  # noqa: F401  (the run config's error)
from workers.trainer.config_names import VERL_LOSS_AGGS, VERL_POLICY_LOSS_KEYS

# verl's names for what a run config says elsewhere (docs/migrating_from_verl.md has the rest)
VERL_KEYS = {
    "multi_turn": "the multi_turn section (multi_turn.env, tools, max_turns, max_observation_tokens, workers)",
    "tool_config_path": "multi_turn.tools (its tool_schema entries; multi_turn.env answers the calls)",
    "max_assistant_turns": "multi_turn.max_turns", "max_tool_response_length": "multi_turn.max_observation_tokens",
    "tool_response_truncate_side": "multi_turn.observation_truncate_side",
    "data": "task (the dataset) and train (batch, lengths)", "actor_rollout_ref": "trainer, engine and train",
    "algorithm": "trainer", "custom_reward_function": "task.kwargs.verifier", "train_files": "task.kwargs.files",
    "val_files": "task.kwargs.files", "train_batch_size": "train.batch_prompts",
    "max_response_length": "train.max_tokens", "total_training_steps": "train.iterations",
    "save_freq": "train.ckpt_every", "test_freq": "train.eval_every", "adv_estimator": "trainer.algorithm",
    "val_before_train": "train.eval_before_train",
    "val_only": "train.eval_only", "critic_warmup": "trainer.critic_warmup",
    "apply_chat_template_kwargs": "tokenizer.chat_template_kwargs",
    "balance_batch": "pipeline.balance_batch (default off)",
    "max_actor_ckpt_to_keep": "train.ckpt_keep",
    "max_critic_ckpt_to_keep": "train.ckpt_keep (one key: the critic is saved in the actor's checkpoint)",
    "kl_loss_coef": "trainer.kl_coef", "kl_loss_type": "trainer.kl_estimator",
    "loss_mode": "trainer.policy_loss (vanilla: ppo; gspo, sapo, geo_mean with trainer.loss_agg: seq_mean; cispo, "
                 "gpg, clip_cov, kl_cov)",
    **VERL_POLICY_LOSS_KEYS,
    "entropy_coeff": "trainer.entropy_coef",
    "enable_gradient_checkpointing": "trainer.activation_checkpointing (actor and critic)",
    "loss_agg_mode": "trainer.loss_agg (" + ", ".join(f"{v}: {o}" for v, o in VERL_LOSS_AGGS.items()) + ")",
    "clip_ratio": "trainer.clip_low and trainer.clip_high", "clip_ratio_c": "trainer.dual_clip",
    "n": "train.group_size", "default_local_dir": "logging.logdir",
    "logger": "logging.trackers ([wandb]; TensorBoard and the console are always on)",
    "project_name": "logging.project", "experiment_name": "logging.experiment",
    "rollout_data_dir": "logging.rollout_data_dir", "validation_data_dir": "logging.validation_data_dir",
    "log_val_generations": "logging.log_val_generations",
    "ppo_mini_batch_size": "trainer.mini_batches (= train_batch_size / ppo_mini_batch_size)",
    "val_kwargs": "train.eval_samples and train.eval_temperature",
    "tis_imp_ratio_cap": "trainer.tis_cap (0: off, where verl says -1; = trainer.rollout_is: token with "
                         "rollout_is_threshold)",
    "rollout_correction": "trainer.rollout_is, rollout_is_threshold, rollout_is_batch_normalize, rollout_rs, "
                          "rollout_rs_threshold (verl's names, flat under trainer), rollout_bypass (its bypass_mode) "
                          "and rollout_loss_type (its loss_type)",
    "bypass_mode": "trainer.rollout_bypass (true: the sampler's log-probs are the old ones; trainer.rollout_is / "
                   "rollout_rs then weigh the current policy against them, with trainer.rollout_loss_type)",
    "loss_type": "trainer.rollout_loss_type (ppo_clip or reinforce, with trainer.rollout_bypass: true)",
    "warmup_style": "trainer.lr_schedule", "lr_scheduler_type": "trainer.lr_schedule",
    "lr_warmup_steps": "trainer.warmup_steps", "lr_warmup_steps_ratio": "trainer.warmup_ratio",
    "total_epochs": "train.epochs",
    "truncation": "train.overlong_prompts: truncate_left / truncate_right / truncate_middle (verl's left / right / "
                  "middle; its error is overlong_prompts' default) with train.max_prompt_tokens",
    "use_kl_loss": "trainer.kl_mode: loss (with trainer.kl_coef)",
    "use_kl_in_reward": "trainer.kl_mode: reward (with trainer.kl_coef)",
    "kl_ctrl": "trainer.kl_coef with trainer.kl_mode: reward (type adaptive: trainer.kl_target, kl_horizon)",
    "target_kl": "trainer.kl_target (with trainer.kl_mode: reward)", "horizon": "trainer.kl_horizon",
    "kl_penalty": "trainer.kl_estimator", "norm_adv_by_std_in_grpo": "trainer.grpo_std_normalize",
    "clip_ratio_low": "trainer.clip_low", "clip_ratio_high": "trainer.clip_high",
    "max_num_seqs": "engine.max_batch_size",
    "lora_rank": "trainer.lora_rank", "lora_alpha": "trainer.lora_alpha",
    "penalty_factor": "trainer.overlong_penalty (with trainer.overlong_buffer: verl's overlong_buffer.len)",
    "target_modules": "trainer.lora_target_modules",
    "gpu_memory_utilization": "engine.kv_cache_tokens (the KV cache is sized in tokens)",
    "ppo_max_token_len_per_gpu": "trainer.max_tokens_per_microbatch",
    "ppo_micro_batch_size_per_gpu": "trainer.max_tokens_per_microbatch (micro-batches are packed by tokens)",
    "log_prob_micro_batch_size_per_gpu": "trainer.max_tokens_per_microbatch (micro-batches are packed by tokens)",
    "n_gpus_per_node": "placement.generation / placement.trainer with torchrun's --nproc-per-node",
    "nnodes": "placement.generation / placement.trainer with torchrun's --nnodes",
    "do_sample": "train.temperature (0: greedy)", "resume_mode": "the --resume DIR flag",
    "resume_from_path": "the --resume DIR flag (a run folder, or one of its checkpoints)",
    "del_local_ckpt_after_load": "train.ckpt_keep (the checkpoints kept; none is deleted on load)",
    "filter_overlong_prompts": "train.overlong_prompts: skip (default error)",
    "filter_groups": "trainer.filter_groups: true (with trainer.train_groups, verl's train_batch_size; "
                     "train.batch_prompts is verl's gen_batch_size)",
    "gen_batch_size": "train.batch_prompts (with trainer.filter_groups; trainer.train_groups is verl's "
                      "train_batch_size)",
    "max_num_gen_batches": "trainer.max_gen_batches (with trainer.filter_groups and trainer.train_groups; "
                           "0: no limit, as verl's)",
    "metric": "trainer.filter_metric (verl's filter_groups.metric: score, seq_reward, seq_final_reward, or a "
              "number of a dict reward: acc)",
    "critic": "trainer (trainer.algorithm: ppo trains a critic initialised from the policy's model: "
              "trainer.critic_lr, value_clip, value_coef, gamma, gae_lambda)",
}

# verl keys with no key here, and what to do instead
VERL_NOTES = {
    "use_dynamic_bsz": "micro-batches are always packed up to trainer.max_tokens_per_microbatch tokens",
    "reward_model": "rewards come from task.kwargs.verifier: a model-based reward model (verl's reward_model.enable, "
                    "model.path) is verifier: reward_model with verifier_kwargs: {path: RM_FOLDER} (a "
                    "Qwen2/Llama ForSequenceClassification), a rule, or a function of yours; verl's reward_manager "
                    "prime (a process pool "
                    "with a timeout) is trainer.reward_pool: processes, reward_workers, reward_timeout_s; reward_manager "
                    "batch is a verifier with verl's batch names (compute_score(data_sources, solution_strs, "
                    "ground_truths, extra_infos))",
    "ulysses_sequence_parallel_size": "no sequence parallelism: each sample is on one trainer rank",
    "param_offload": "no CPU offload of parameters or optimizer state",
    "optimizer_offload": "no CPU offload of parameters or optimizer state; trainer.shard_optimizer: true shards the "
                         "AdamW state over the trainer ranks (ZeRO-1)",
    "use_remove_padding": "nothing to set: micro-batches are always packed without padding",
    "use_fused_kernels": "nothing to set: the trainer's logits and log-probs are computed in chunks of the "
                         "vocabulary always",
    "tensor_model_parallel_size": "no tensor parallelism: one GPU per generation instance (engine.backend: vllm "
                                  "passes engine.backend_options to vllm.EngineArgs, untested with several GPUs)",
    "fsdp_config": "no FSDP: each trainer rank holds the whole model, data parallel (trainer.shard_optimizer "
                   "shards the AdamW state, ZeRO-1)",
    "optim": "trainer.lr, trainer.weight_decay, trainer.warmup_steps / warmup_ratio, trainer.lr_schedule, "
             "trainer.min_lr_ratio, trainer.total_steps (actor), trainer.critic_lr (critic)",
    "reward_manager": "naive is the default; prime is trainer.reward_pool: processes (reward_workers, "
                      "reward_timeout_s); batch is a verifier with verl's batch names; dapo is trainer.overlong_buffer "
                      "and trainer.overlong_penalty with any verifier",
}


def key_hint(key: str, known, section: str = "") -> str:
    """', did you mean X?' for a near miss or a verl name, the section a key of another one is
    in (``train.lr``: ``trainer.lr``), else ''."""
    if key in VERL_KEYS:
        return f"; verl's {key!r} is {VERL_KEYS[key]} here (docs/migrating_from_verl.md)"
    if key in VERL_NOTES:
        return f"; verl's {key!r} has no key here: {VERL_NOTES[key]} (docs/migrating_from_verl.md)"
    elsewhere = [f"{other}.{key}" for other, keys in _section_keys().items() if other != section and key in keys]
    if section and elsewhere:
        return f"; {key!r} is a key of another section: {' or '.join(elsewhere)}"
    return config_schema.near_miss(key, known)


def _section_keys() -> dict[str, set[str]]:
    """Each run-config section's keys (the written ones: topology and weight_sync's YAML keys)."""
    import typing

    from controller.config import Config  # (imports this module)
    from workers.weight_sync.config import WeightSyncSection
    from workers.weight_sync.topology import _CONFIG_KEYS

    hints = typing.get_type_hints(Config)
    out = {name: set(config_schema.key_fields(hints[name])) for name in config_schema.key_fields(Config)
           if name not in ("topology", "weight_sync")}
    return {**out, "topology": set(_CONFIG_KEYS), "weight_sync": set(config_schema.key_fields(WeightSyncSection))}


# verl's nested sections whose name is a flat key here: what their keys are
VERL_NESTED = {
    "filter_groups": "trainer.filter_groups: true (enable), trainer.max_gen_batches (max_num_gen_batches), "
                     "trainer.train_groups (the batch it fills), trainer.filter_metric (metric)",
    "overlong_buffer": "trainer.overlong_buffer: LEN (enable and len), trainer.overlong_penalty (penalty_factor)",
}


def build_section(cls, section: str, data: Any):
    """``config_schema.build_section`` with verl's names in the unknown-key hint, and verl's
    nested sections given to a flat key here named with the keys they are."""
    try:
        return config_schema.build_section(cls, section, data, hint=lambda k, known: key_hint(k, known, section))
    except ConfigError as e:
        nested = [k for k, v in (data or {}).items() if isinstance(v, dict) and k in VERL_NESTED] \
            if isinstance(data, dict) else []
        if nested and str(e).startswith(f"{section}.{nested[0]}:"):
            raise ConfigError(f"{e}; verl's {nested[0]} section is flat keys here: {VERL_NESTED[nested[0]]} "
                              "(docs/migrating_from_verl.md)") from None
        raise
