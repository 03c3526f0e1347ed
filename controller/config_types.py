"""The run config's own wording around ``workers.config_schema`` (the one mapping -> dataclass
builder, with ``ConfigError``): an unknown key names verl's equivalent or a near miss.

``controller.config`` builds each section with ``build_section``; the checks across keys
(placement, modes, registries) are ``controller.config_checks``.
"""
from __future__ import annotations

from typing import Any

from workers import config_schema
from workers.config_schema import ConfigError, Range  # noqa: F401  (ConfigError: the run config's error)
from workers.trainer.config import VERL_LOSS_AGGS

# verl's names for what a run config says elsewhere (docs/migrating_from_verl.md has the rest)
VERL_KEYS = {
    "data": "task (the dataset) and train (batch, lengths)", "actor_rollout_ref": "trainer, engine and train",
    "algorithm": "trainer", "custom_reward_function": "task.kwargs.verifier", "train_files": "task.kwargs.files",
    "val_files": "task.kwargs.files", "train_batch_size": "train.batch_prompts",
    "max_response_length": "train.max_tokens", "total_training_steps": "train.iterations",
    "save_freq": "train.ckpt_every", "test_freq": "train.eval_every", "adv_estimator": "trainer.algorithm",
    "max_actor_ckpt_to_keep": "train.ckpt_keep",
    "max_critic_ckpt_to_keep": "train.ckpt_keep (one key: the critic is saved in the actor's checkpoint)",
    "kl_loss_coef": "trainer.kl_coef", "kl_loss_type": "trainer.kl_estimator",
    "entropy_coeff": "trainer.entropy_coef",
    "enable_gradient_checkpointing": "trainer.activation_checkpointing (actor and critic)",
    "loss_agg_mode": "trainer.loss_agg (" + ", ".join(f"{v}: {o}" for v, o in VERL_LOSS_AGGS.items()) + ")",
    "clip_ratio": "trainer.clip_low and trainer.clip_high", "clip_ratio_c": "trainer.dual_clip",
    "n": "train.group_size", "default_local_dir": "logging.logdir",
    "ppo_mini_batch_size": "trainer.mini_batches (= train_batch_size / ppo_mini_batch_size)",
    "val_kwargs": "train.eval_samples and train.eval_temperature",
    "tis_imp_ratio_cap": "trainer.tis_cap (0: off, where verl says -1)",
}


def key_hint(key: str, known) -> str:
    """', did you mean X?' for a near miss or a verl name, else ''."""
    if key in VERL_KEYS:
        return f"; verl's {key!r} is {VERL_KEYS[key]} here (docs/migrating_from_verl.md)"
    return config_schema.near_miss(key, known)


def build_section(cls, section: str, data: Any, ranges: dict[str, Range] | None = None):
    """``config_schema.build_section`` with verl's names in the unknown-key hint."""
    return config_schema.build_section(cls, section, data, hint=key_hint, ranges=ranges)
