"""The passes over the whole iteration at ``TrainerWorker.step()``, before anything trains: each
needs every sample of the step on every data-parallel rank (each rank runs each pass once per
step, with or without samples: their all-reduces / all-gathers stay in lock-step), which is
why training waits for ``step()`` when one is on (``TrainerConfig.trains_at_step``). In order:
DAPO's group filter, a user's verl estimator, the whitening of GAE / REINFORCE++ advantages,
gpg's scale, the importance weights' batch normalisation (``rollout_correction.batch_normalize``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from workers.trainer.advantages import gpg_alpha, whiten
from workers.trainer.custom_advantage import custom_pass
from workers.trainer.group_filter import filter_groups, gather_over, metric_value
from workers.trainer.rollout_correction import batch_normalize

if TYPE_CHECKING:
    from workers.trainer.worker import TrainerWorker


def iteration_passes(w: "TrainerWorker") -> None:
    """Every pass the config turns on, in order."""
    if w.cfg.filter_groups:
        filter_groups_pass(w)
    if w.cfg.custom_advantage:  # a user's verl estimator, over the samples the filter kept
        custom_pass(w)
    if w.cfg.whiten:
        whiten_pass(w)
    if w.cfg.algorithm == "gpg":
        gpg_pass(w)
    if w.cfg.rollout_is_batch_normalize:
        batch_normalize(w)


def filter_groups_pass(w: "TrainerWorker") -> None:
    """DAPO's dynamic sampling filter over the iteration's groups on all ranks."""
    assert not w._trained_any, "filtering after training started"
    metric = w.cfg.filter_metric
    kept, counts = filter_groups(list(w.buffer.ready), w.cfg.train_groups,
                                 gather_over(w.group, w.world_size, w.device), drop_single=w.cfg.grouped,
                                 value=lambda p: metric_value(metric, p.score, p.overlong, p.info, p.reward,
                                                              f"sample {p.sample_id}"))
    dropped = {p.sample_id for p in w.buffer.ready} - {p.sample_id for p in kept}
    w.buffer.keep_ready(kept)
    w.filtered_ids = dropped  # (the rollout dump marks them: rollout_dump.take_rows)
    for k, v in counts.items():
        w.stats.add(k, v)


def whiten_pass(w: "TrainerWorker") -> None:
    """Whiten the advantages (GAE's, REINFORCE++'s) of every sample received this iteration,
    over all ranks. Nothing has trained yet (``receive`` defers it), so every forward uses the whitened values. A sample with a
    non-finite advantage stays out of the statistics (its micro-batch's loss is not finite
    and is skipped). Returns (= GAE advantages + values) are not whitened, as in verl. The
    mean and variance are of the tokens rollout_rs keeps (verl rejects before its advantages)."""
    assert not w._trained_any, "whitening after training started"
    items = [p for p in w.buffer.ready if bool(torch.isfinite(p.adv).all())]
    reduce = (lambda t: dist.all_reduce(t, group=w.group)) if w.world_size > 1 else (lambda t: None)
    for p, a in zip(items, whiten([p.adv for p in items], reduce, w.device, [p.keep for p in items])):
        p.adv = a


def gpg_pass(w: "TrainerWorker") -> None:
    """gpg's ``alpha`` over the step's samples on all ranks, after the group filter."""
    assert not w._trained_any, "scaling after training started"
    items = list(w.buffer.ready)
    counts = torch.tensor([len(items), sum(p.reward != 0 for p in items)], dtype=torch.float64,
                          device=w.device)
    if w.world_size > 1:
        dist.all_reduce(counts, group=w.group)
    alpha = gpg_alpha(counts)
    for p in items:
        p.adv = p.adv * alpha
