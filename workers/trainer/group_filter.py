"""DAPO's dynamic sampling filter (Yu et al. 2025; verl's ``algorithm.filter_groups``), applied
at ``step()`` to an iteration's prepared samples on every data-parallel rank.

A group whose samples all got the same ``trainer.filter_metric`` (verl's ``filter_groups.metric``;
``metric_value``) has nothing to compare (advantage 0 under grpo when it is the task score): it is
dropped. A group of one sample (the others skipped) is kept, as verl keeps it,
except under the grouped algorithms (grpo, rloo, reinforce_plus_plus_baseline, opo,
grpo_passk, gpg, remax), which give it advantage 0 here (verl's grpo gives it its raw score): there it is dropped as well. Of
the groups left, the first ``train_groups`` in prompt order (group id) over all ranks train:
verl concatenates its filtered generation batches in prompt order and keeps the first
``train_batch_size`` groups. While fewer than ``train_groups`` pass, the controller generates
more batches of ``train.batch_prompts`` (verl's ``gen_batch_size``) for the iteration, at most
``trainer.max_gen_batches`` (verl's ``max_num_gen_batches``): ``controller/program.py``
``_refill``, which counts the groups that pass on each rank (``TrainerRank.kept_groups``) from
the rewards as they come back from the reward pool (``passing_groups``): the count does not
wait for the trainer to take the samples (reference log-probs, values).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")  # a prepared sample: has .group_id

# trainer.filter_metric's names that are no key of a dict reward (verl's): the task's score, it
# plus the overlong penalty (verl's token_level_scores summed), and that less the KL penalty in
# the reward (token_level_rewards summed); any other name is a number of the reward's dict (acc)
SCORE_METRICS = ("score", "seq_reward", "seq_final_reward")

GatherIds = Callable[[list[int]], list[int]]  # this rank's kept group ids -> every rank's


def gather_over(group, world_size: int, device: torch.device) -> GatherIds:
    """The all-gather of kept group ids over the data-parallel ``group`` of ``world_size`` ranks
    (every rank calls it once per step, with or without samples)."""
    if world_size == 1:
        return lambda ids: ids

    def gather(ids: list[int]) -> list[int]:
        every: list = [None] * world_size
        # NCCL stages the pickled ids on the calling thread's current GPU: GPU 0 on the RPC
        # thread step() runs on (workers.model.rank_device), the same for every rank of a node
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            dist.all_gather_object(every, ids, group=group)
        return [g for rank_ids in every for g in rank_ids]

    return gather


def metric_value(metric: str, score: float, overlong: float, info: dict, final: float | None,
                 what: str) -> float:
    """A sample's ``trainer.filter_metric``: ``score`` (the task's), ``seq_reward`` (plus the
    overlong penalty ``overlong``), ``seq_final_reward`` (``final``: less the KL penalty in the
    reward; None before the reference has run: then the same as seq_reward, which it is without a
    KL in the reward), or the number a dict reward gave under that name (``info``: ``Scored.info``);
    ``acc`` of a reward that gave a plain number is that number, as verl's DAPO reward manager
    records it (``reward_extra_info["acc"] = score``). A reward without the number is a ValueError
    naming the metric and ``what`` (the sample), as verl's filter raises on a missing key."""
    if metric == "score":
        return score
    if metric == "seq_reward" or (metric == "seq_final_reward" and final is None):
        return score + overlong
    if metric == "seq_final_reward":
        return final
    value = info.get(metric)
    if metric == "acc" and not info:  # a plain number reward (verl's DAPO recipe: metric acc)
        return score
    if isinstance(value, str) or value is None:
        given = ", ".join(sorted(info)) or "none: it returned a number, not a dict"
        raise ValueError(f"trainer.filter_metric {metric!r}: {what}'s reward gave no number {metric!r} (its "
                         f"reward's keys: {given}); name a number of the reward's dict or one of {SCORE_METRICS}")
    return float(value)


def same_scores(scores: Sequence[float]) -> bool:
    """Two or more scores, all equal: a group with nothing to compare."""
    return len(scores) > 1 and len(set(scores)) == 1


def passes(scores: Sequence[float], drop_single: bool = False) -> bool:
    """A group whose members (those not skipped) got ``scores`` is kept by the filter."""
    return not (same_scores(scores) or (drop_single and len(scores) == 1))


def passing_groups(scores: dict[int, Sequence[float]], drop_single: bool = False) -> int:
    """group id -> its members' ``metric_value``: how many groups the filter keeps (before
    ``train_groups``)."""
    return sum(1 for group in scores.values() if group and passes(group, drop_single))


def count_passing(pending: dict[int, list[tuple[int, object, int]]], result: Callable, metric: str,
                  overlong: Callable[[int], float], drop_single: bool = False) -> int:
    """The refill's count (``TrainerRank.kept_groups``): group id -> its members' (sample id,
    score in flight, output length); ``result``: a score in flight -> its ``Scored``; ``overlong``:
    a length -> its overlong penalty. A sample whose score failed is left out, as ``receive``
    skips it; a group counts with the members left."""
    values = {g: [metric_value(metric, r.score, overlong(length), r.info, None, f"sample {sid}")
                  for sid, r, length in ((sid, result(p), length) for sid, p, length in members) if not r.why]
              for g, members in pending.items()}
    return passing_groups(values, drop_single)


def filter_groups(items: Sequence[T], train_groups: int, gather: GatherIds = lambda ids: ids,
                  drop_single: bool = False, value: Callable[[T], float] = lambda p: p.score
                  ) -> tuple[list[T], dict[str, float]]:
    """``items``: this rank's prepared samples of the iteration (whole groups). ``gather``: every
    rank's kept group ids from this rank's (an all-gather; every rank calls it once per step,
    with or without samples). ``drop_single``: a group of one is dropped too (its advantage is 0).
    ``value``: a sample's number the filter compares (``trainer.filter_metric``).
    -> (the samples that train, counts of this rank's groups: ``filtered_groups`` dropped,
    ``surplus_groups`` kept but past ``train_groups``)."""
    groups: dict[int, list[T]] = {}
    for p in items:
        groups.setdefault(p.group_id, []).append(p)
    kept = sorted(g for g, members in groups.items() if passes([value(m) for m in members], drop_single))
    chosen = set(kept)
    if train_groups > 0:
        first = sorted(gather(kept))[:train_groups]  # over all ranks, in prompt order
        chosen &= set(first)
    counts = {"filtered_groups": float(len(groups) - len(kept)), "surplus_groups": float(len(kept) - len(chosen))}
    return [p for p in items if p.group_id in chosen], counts
