"""Mapping -> typed config dataclass: the checks every run-config key passes on its own (type,
range, known name) and ``ConfigError``, the one error a bad config raises, naming the key.

``controller.config`` builds each section with ``build_section``; the checks across keys
(placement, modes, registries) are ``controller.config_checks``.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from controller.config_ranges import range_error
from workers.trainer.config import VERL_LOSS_AGGS


class ConfigError(ValueError):
    """A config value is wrong; the message names the key."""


def _check_range(key: str, value: Any) -> None:
    why = range_error(key, value)
    if why is not None:
        raise ConfigError(why)


def check_type(key: str, value: Any, hint: Any) -> Any:
    """Check ``value`` against a simple type hint (int, float, bool, str, list, dict, tuple[X, ...],
    X | None); floats must be finite."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is not type(None):
                return check_type(key, value, a)
    if hint is Any:
        return value
    base = origin or hint
    if base is tuple and isinstance(value, list):
        value = tuple(value)
    if base is tuple and isinstance(value, tuple) and typing.get_args(hint):
        args = typing.get_args(hint)
        if args[-1] is Ellipsis:
            args = args[:1] * len(value)
        elif len(value) != len(args):
            raise ConfigError(f"{key}: expected {len(args)} values, got {len(value)}: {list(value)!r}")
        return tuple(check_type(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if base is float and isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if base is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: expected a finite number, got {value}")
    if base is int and isinstance(value, bool) or not isinstance(value, base):
        quote = (" (YAML read the value as a mapping or a list: ': ', '{', '[' in it; put it in YAML quotes, '...')"
                 if isinstance(value, (dict, list)) and base is str else "")
        raise ConfigError(f"{key}: expected {getattr(base, '__name__', base)}, got "
                          f"{type(value).__name__} {value!r}{quote}")
    return value


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
}


def key_hint(key: str, known) -> str:
    """', did you mean X?' for a near miss or a verl name, else ''."""
    import difflib

    if key in VERL_KEYS:
        return f"; verl's {key!r} is {VERL_KEYS[key]} here (docs/migrating_from_verl.md)"
    close = difflib.get_close_matches(str(key), [str(k) for k in known], n=1, cutoff=0.75)
    return f"; did you mean {close[0]!r}?" if close else ""


def _none_as_empty(cls, name: str, value: Any, hint: Any) -> Any:
    """YAML null (``profile:``, ``profile: null``, ``--set dispatch.profile=null``) for a string
    key whose default is empty (empty: none, off) reads as that empty string."""
    if value is None and hint is str:
        default = next(f.default for f in dataclasses.fields(cls) if f.name == name)
        if default == "":
            return ""
    return value


def build_section(cls, section: str, data: Any):
    """Instantiate dataclass ``cls`` from a mapping, naming unknown keys and wrong types."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{section}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            raise ConfigError(f"{section}.{k}: unknown key{key_hint(k, names)} (known: {sorted(names)})")
    kwargs = {k: check_type(f"{section}.{k}", _none_as_empty(cls, k, v, hints[k]), hints[k])
              for k, v in data.items()}
    for k, v in kwargs.items():
        _check_range(f"{section}.{k}", v)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith(section) else f"{section}: {msg}") from e
