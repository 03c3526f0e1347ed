"""What a trainer rank refuses in a received sample.

* ``check_caller`` and ``check_group_counts`` raise on a caller bug (a sample of no registered
  prompt, from newer weights than the trainer's, of a group with no size, or more distinct
  samples of a group than its size), whatever ``on_bad_sample`` says.
* ``bad_sample_reason`` says why a sample is bad input (stale, failed, empty, too long, a token
  outside the vocabulary, an unusable multi-turn ``loss_mask``, unusable sampler log-probs), or
  None: the worker skips it (counted) or raises, as ``on_bad_sample`` says.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from workers.finite import finite_number
from workers.trainer.config import TrainerConfig
from workers.trainer.multi_turn import check_supported, mask_reason
from workers.types import Sample

# a log-probability is <= 0; float rounding of one near 0 stays far below this
LOGPROB_SLACK = 1e-3


def check_caller(s: Sample, prompts: dict, group_sizes: dict[int, int], version: int, cfg: TrainerConfig,
                 iteration: int) -> None:
    """Raise on a caller bug: ``s`` has no prompt registered for ``iteration``, is a greedy
    baseline but the algorithm is not remax, comes from weights newer than ``version``, or
    (grouped algorithms, the group filter) names a group with no size, or is a multi-turn sample
    under a loss that cannot mask its observation tokens (``multi_turn.check_supported``)."""
    sid = s.sample_id
    if sid not in prompts:
        raise KeyError(f"sample {sid}: no prompt registered for it in begin_iteration({iteration})")
    if s.baseline and cfg.algorithm != "remax":
        raise ValueError(f"sample {sid}: a greedy baseline sample (Request.baseline) for trainer.algorithm "
                         f"{cfg.algorithm!r}; only remax has one")
    if s.weight_version > version:
        raise ValueError(f"sample {sid}: weight_version {s.weight_version} is newer than the trainer's {version}")
    if (cfg.grouped or cfg.filter_groups) and s.group_id not in group_sizes:
        needs = f"algorithm {cfg.algorithm!r}" if cfg.grouped else "trainer.filter_groups"
        raise ValueError(f"sample {sid}: group_id {s.group_id} has no size in begin_iteration "
                         f"({needs} needs groups)")
    check_supported(s, cfg)


def check_new_ids(where: str, prompts: dict, group_sizes: dict, known_prompts: dict, known_groups: dict) -> None:
    """An iteration's extension (``extend_iteration``) registers sample and group ids it does not hold yet."""
    clash = (prompts.keys() & known_prompts.keys()) or (group_sizes.keys() & known_groups.keys())
    if clash:
        raise ValueError(f"{where}: ids already registered: {sorted(clash)[:5]}")


def check_group_counts(samples: Sequence[Sample], seen: set[int], group_seen: dict[int, int],
                       group_sizes: dict[int, int], iteration: int) -> None:
    """More distinct samples of a group than begin_iteration declared is a caller bug: the
    extra one used to open a second group of that id that never completed (trained with
    advantage 0). ``seen``: sample ids received before; ``group_seen``: their count per group."""
    new: dict[int, set[int]] = {}
    for s in samples:
        if s.sample_id not in seen:  # a resent sample is a duplicate, dropped by the worker
            new.setdefault(s.group_id, set()).add(s.sample_id)
    for gid, ids in new.items():
        total, size = group_seen.get(gid, 0) + len(ids), group_sizes[gid]
        if total > size:
            raise ValueError(f"group {gid}: {total} distinct samples received in iteration {iteration}, "
                             f"but begin_iteration gave it size {size}")


def env_rewards_reason(s: Sample) -> str | None:
    """Why ``s.env_rewards`` cannot be added to its reward (not finite numbers), or None."""
    rewards = s.env_rewards
    values = [finite_number(r) for r in rewards] if isinstance(rewards, (tuple, list)) else [None]
    if None in values:
        return f"sample {s.sample_id}: env_rewards {str(rewards)[:80]} are not finite numbers"
    if not math.isfinite(sum(values)):
        return f"sample {s.sample_id}: env_rewards {str(rewards)[:80]} sum to an infinity"
    return None


def bad_sample_reason(s: Sample, version: int, cfg: TrainerConfig, model_config) -> str | None:
    """Why ``s`` cannot be trained on by a trainer at weight ``version`` (a message naming the
    sample), or None. ``model_config``: the actor's (vocab_size, max_position_embeddings)."""
    sid, vocab, prompt, output = s.sample_id, model_config.vocab_size, s.prompt_ids, s.output_ids
    if s.weight_version < version - cfg.max_staleness:
        return (f"sample {sid}: stale, weight_version {s.weight_version} < trainer version "
                f"{version} - max_staleness {cfg.max_staleness}")
    if s.finish_reason == "error":
        return f"sample {sid}: generation failed ({s.error})"
    if prompt.dim() != 1 or output.dim() != 1:  # ([1, L] crashed the step's packing, under skip too)
        return (f"sample {sid}: prompt_ids and output_ids must be 1-D token ids, got shapes {tuple(prompt.shape)} "
                f"and {tuple(output.shape)}")
    if output.numel() == 0:
        return f"sample {sid}: empty output"
    if prompt.numel() == 0:  # nothing predicts output[0]: packing would read another sequence's state
        return f"sample {sid}: empty prompt"
    if prompt.numel() + output.numel() > model_config.max_position_embeddings:
        return (f"sample {sid}: {prompt.numel()} + {output.numel()} tokens exceed the model's "
                f"max_position_embeddings {model_config.max_position_embeddings}")
    if bool(((prompt < 0) | (prompt >= vocab)).any() or ((output < 0) | (output >= vocab)).any()):
        return f"sample {sid}: a token id outside the model's vocabulary [0, {vocab})"
    why = mask_reason(s) or env_rewards_reason(s)  # multi-turn: the mask, the environment's rewards
    if why is not None:
        return why
    if not cfg.uses_sampler_logprobs:
        return None
    if s.logprobs.shape != output.shape:
        return f"sample {sid}: logprobs of shape {tuple(s.logprobs.shape)} for {output.numel()} output tokens"
    if not bool(torch.isfinite(s.logprobs).all()):
        return f"sample {sid}: non-finite sampler logprobs"
    if bool((s.logprobs > LOGPROB_SLACK).any()):
        return (f"sample {sid}: sampler logprobs above 0 (max {float(s.logprobs.max()):.4g}): "
                "probabilities rather than log-probabilities?")
    return None
