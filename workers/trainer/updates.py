"""The optimizer updates of one trainer step: all-reduce the gradient sums over the data-parallel
group, divide, clip, check finiteness, step; ``ppo_epochs`` passes over the iteration's
micro-batches, or ``mini_batches`` updates per pass. Functions of the ``TrainerWorker`` whose
gradients they apply (``workers/trainer/worker.py``: it accumulates them as samples stream in)."""
from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from workers.trainer.buffer import microbatches, mini_batch_shares
from workers.trainer.grads import all_reduce_sum, clip_norm
from workers.trainer.losses import loss_divisor

if TYPE_CHECKING:
    from workers.trainer.worker import TrainerWorker

log = logging.getLogger("streamrl.trainer")


def update(w: "TrainerWorker", params: list[torch.nn.Parameter], divisor: float) -> dict[str, float] | None:
    """All-reduce the gradient sums, divide, clip, check, step. None: skipped (not finite)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if w.world_size > 1:
        all_reduce_sum([p.grad for p in params], w.group)
    for p in params:
        p.grad.div_(divisor)
    norms = {"grad_norm": float(clip_norm(w.policy_parameters(), w.cfg.grad_clip))}
    if w.critic is not None:
        norms["critic_grad_norm"] = float(clip_norm(list(w.critic.parameters()), w.cfg.grad_clip))
    ok = all(math.isfinite(v) for v in norms.values())
    if ok:
        if w.iteration < w.cfg.critic_only_iterations:  # trainer.critic_warmup: the actor as it is
            for p in w.policy_parameters():
                p.grad = None  # (AdamW leaves a parameter with no gradient alone: no decay, no moments)
        w.optimizer.step()
    else:
        log.warning("trainer rank %d: non-finite gradient norm at iteration %d; update skipped, "
                    "weights kept", w.rank, w.iteration)
    w.optimizer.zero_grad(set_to_none=True)
    return norms if ok else None


def accumulate_all(w: "TrainerWorker", batches: list[list], log_stats: bool, later: bool = False) -> float:
    """Forward + backward of every micro-batch of ``batches`` (gradient sums); the loss divisor of
    those kept (a non-finite loss is skipped), over all ranks (one all-reduce, on every rank).
    ``later``: a pass after the first, whose per-token statistics are averaged in (``StatSums.later``)."""
    units = torch.zeros(2, dtype=torch.float64, device=w.device)  # tokens, sequences
    for items in batches:
        counts = w.accumulate(items, log_stats=log_stats, later=later)
        if counts is not None:
            units += torch.stack([counts["num_tokens"], counts["num_seqs"]]).double().to(w.device)
    if w.world_size > 1:
        dist.all_reduce(units, group=w.group)
    return loss_divisor(float(units[0]), float(units[1]), w.cfg.loss_agg, w.cfg.loss_scale_factor)


def streamed_updates(w: "TrainerWorker", params: list[torch.nn.Parameter], divisor: float
                     ) -> tuple[int, dict[str, float] | None]:
    """``ppo_epochs`` updates on the whole iteration: the first from the gradients accumulated
    while samples streamed in (``divisor``: their kept micro-batches'), each further one
    re-running its micro-batches at the current weights, divided by what that pass kept.
    -> (updates applied, their norms' means: ``_mean``)."""
    norms_of: list[dict[str, float]] = []
    for epoch in range(w.cfg.ppo_epochs):
        if epoch > 0:  # the micro-batches this pass keeps (one whose loss is not finite now is not)
            divisor = accumulate_all(w, w.trained_batches, log_stats=False, later=True)
            w.stats.later_passes += 1
        if divisor <= 0:
            w.optimizer.zero_grad(set_to_none=True)
            break
        norms = update(w, params, divisor)
        if norms is None:
            break
        norms_of.append(norms)
    return len(norms_of), _mean(norms_of)


def mini_batch_updates(w: "TrainerWorker", params: list[torch.nn.Parameter]) -> tuple[int, dict[str, float] | None]:
    """``mini_batches`` updates per epoch: each rank splits its samples (whole prompt groups in a
    seeded random order, ``shuffle``; else in arrival order) into that many shares, each
    re-packed into micro-batches (every rank runs the same number of all-reduces; a share
    with no sample on any rank makes no update).
    Per-token statistics: every epoch's, averaged (``StatSums.later``). -> (updates applied, their
    norms' means)."""
    items = [p for mb in w.trained_batches for p in mb]  # samples in arrival order
    seed = w.cfg.seed * 1_000_003 + w.version if w.cfg.shuffle else None  # a new order every step
    shares = [microbatches(share, w.cfg.max_tokens_per_microbatch)
              for share in mini_batch_shares(items, w.cfg.mini_batches, seed)]
    norms_of: list[dict[str, float]] = []
    for epoch in range(w.cfg.ppo_epochs):
        w.stats.later_passes += epoch > 0
        for share in shares:
            divisor = accumulate_all(w, share, log_stats=epoch == 0, later=epoch > 0)
            if divisor <= 0:
                w.optimizer.zero_grad(set_to_none=True)
                continue
            norms = update(w, params, divisor)
            if norms is not None:
                norms_of.append(norms)
    return len(norms_of), _mean(norms_of)


def _mean(norms_of: list[dict[str, float]]) -> dict[str, float] | None:
    """The updates' gradient norms, each key's mean over them (verl logs ``actor/grad_norm`` per
    mini-batch update and reduces it by the mean; only the first update's was reported here until
    session 51). None: no update applied."""
    if not norms_of:
        return None
    return {k: sum(n[k] for n in norms_of) / len(norms_of) for k in norms_of[0]}


def gathered_metrics(w: "TrainerWorker") -> tuple[dict[str, float], float]:
    """The iteration's statistics over every rank (sums all-reduced, extremes global) and the
    loss divisor of the micro-batches trained while streaming; with the KL in the reward, the
    beta these samples' rewards used (``kl_coef``), then the next iteration's adapted."""
    totals, extremes = w.stats.packed(), w.stats.packed_extremes()
    if w.world_size > 1:
        dist.all_reduce(totals, group=w.group)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=w.group)  # minima negated
    cfg = w.cfg
    metrics = w.stats.metrics(totals, cfg.loss_agg, cfg.loss_scale_factor, extremes,
                              critic=w.critic is not None, tis=cfg.tis_cap > 0, kl=w.ref is not None,
                              overlong=cfg.overlong_buffer > 0, reward_kl=cfg.kl_in_reward,
                              grouped=cfg.grouped, filtered=cfg.filter_groups, baselines=cfg.algorithm == "remax",
                              dual_clip=cfg.dual_clip is not None)
    divisor = metrics.pop("_divisor")
    w.first_divisors = (divisor, metrics.pop("_frac_divisor"))  # (fold_later_passes)
    if cfg.kl_in_reward:
        metrics["kl_coef"] = w.kl.value
        w.kl.update(metrics["reward_kl"], metrics["num_samples"])
    return metrics, divisor


def fold_later_passes(w: "TrainerWorker", metrics: dict[str, float]) -> None:
    """The per-token statistics (``pg_loss``, ``ppo_kl``, ``clipfrac``, ``ratio``, ``entropy``, ...)
    averaged over every pass, as verl averages them over every mini-batch update of every epoch:
    the first pass's alone said nothing of the later updates (an on-policy run's ``ppo_kl`` stayed
    0 with ``ppo_epochs: 2``; review, s54). One all-reduce, on every rank (the passes are the same
    on each)."""
    if not w.stats.later_passes:
        return
    totals = torch.stack([torch.as_tensor(w.stats.later[k], dtype=torch.float64, device=w.device)
                          for k in w.stats.LATER])
    if w.world_size > 1:
        dist.all_reduce(totals, group=w.group)
    w.stats.fold_later(metrics, totals, w.cfg.loss_agg, w.cfg.loss_scale_factor, w.first_divisors)
