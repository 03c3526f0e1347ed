"""ReMax (Li et al. 2023, arXiv:2310.10505; verl's ``adv_estimator: remax``): the baseline of a
prompt's sampled responses is the reward of one greedy response to the same prompt.

The controller adds that greedy request to every group (``Request.baseline``: the group's id,
greedy sampling, the sample id after the group's ``train.group_size``; controller/program.py),
so it streams in with the group and is generated beside it; verl generates it in a second pass
after the batch (its ``gen_max`` timer). The trainer scores it (the task's score plus the
overlong penalty: verl's reward function summed over tokens, no KL), runs no forward on it and
never trains it. Each sampled token's advantage is its undiscounted return (the shaped score
at the last token, minus beta x KL per token with ``kl_mode: reward``) minus the baseline, as
verl's ``compute_remax_outcome_advantage``: not whitened, no std, no ``gamma``.

A group registers ``train.group_size + 1`` samples, one of them flagged ``Sample.baseline``. A
group whose greedy sample was refused (bad input, its score failed: counted in
``skipped_samples``) or never arrived has no baseline: its sampled members do not train (counted in
``groups_without_baseline``; they stay in ``num_samples``, the population of ``reward_mean``,
as a skipped micro-batch's do), where verl would stop the run.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from workers.trainer.buffer import GroupState, Prepared
from workers.trainer.rollout_dump import rollout_row

if TYPE_CHECKING:
    from workers.trainer.worker import TrainerWorker
    from workers.types import Sample

log = logging.getLogger("streamrl.trainer")


def take_baseline(w: "TrainerWorker", s: "Sample", pending) -> None:
    """Score the greedy sample ``s`` (its score in flight: ``pending``) and set it as its group's
    baseline; a failed score refuses it, as any sample's (``TrainerWorker._reject``)."""
    from workers.trainer.step_math import _score, overlong_penalty

    score, why, _ = _score(w, s, pending)
    if why:
        w._reject(s, f"sample {s.sample_id}: {why}", logged=True)
        return
    g = w.buffer.groups.get(s.group_id)
    if g is None:
        g = w.buffer.groups[s.group_id] = GroupState(w._group_sizes[s.group_id])
    g.baseline_score, g.baseline = score, score + overlong_penalty(len(s.output_ids), w.cfg)
    if w.rollout_rows is not None:  # logging.rollout_data_dir: the greedy sample too (baseline: true)
        w.rollout_rows.append(rollout_row(w, s, score))
    w.stats.add("baselines", 1.0)
    w.stats.add("baseline_sum", g.baseline)
    w._maybe_complete(s.group_id)


def advantages(members: list[Prepared], baseline: float) -> None:
    """Each member's ``adv`` [L] (its per-token returns, from ``prepare_batch``) minus ``baseline``."""
    for p in members:
        p.adv = p.adv - baseline


def drop_unbased(w: "TrainerWorker", group_id: int, members: list[Prepared]) -> None:
    """A group complete without its baseline: its members do not train (said once an iteration)."""
    if "no baseline" not in w._skip_kinds:
        log.warning("trainer rank %d: group %d has no greedy baseline sample (refused, lost, or never sent: a remax "
                    "group registers group_size + 1 samples, one with Sample.baseline); its %d samples do not train "
                    "(more such groups are counted in groups_without_baseline, not listed)",
                    w.rank, group_id, len(members))
    w._skip_kinds["no baseline"] = w._skip_kinds.get("no baseline", 0) + 1
    w.stats.add("unbased_groups", 1.0)
