"""Learning-rate schedules: linear warmup, then constant / cosine / linear decay."""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

from workers.trainer.config import TrainerConfig


def _constant(progress: float, min_ratio: float) -> float:
    return 1.0


def _cosine(progress: float, min_ratio: float) -> float:
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _linear(progress: float, min_ratio: float) -> float:
    return 1.0 - (1.0 - min_ratio) * progress


DECAYS: dict[str, Callable[[float, float], float]] = {"constant": _constant, "cosine": _cosine, "linear": _linear}


def lr_lambda(cfg: TrainerConfig) -> Callable[[int], float]:
    """step -> multiplier of the base lr (for ``torch.optim.lr_scheduler.LambdaLR``). The warmup
    is ``cfg.warmup``: ``warmup_steps``, or ``warmup_ratio`` of ``total_steps``."""
    decay = DECAYS[cfg.lr_schedule]
    warmup = cfg.warmup

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, cfg.total_steps - warmup))
        return decay(progress, cfg.min_lr_ratio)

    return f


def group_lambdas(cfg: TrainerConfig, groups: int, actor_steps: Callable[[], int]) -> list[Callable[[int], float]]:
    """The schedule of each optimizer parameter group: the policy's (the first) at the steps that
    updated it (``actor_steps()``: ``trainer.critic_warmup``'s critic-only iterations are not, as
    verl's actor scheduler steps only with the actor; counted, so a resume that changes the
    warm-up, or a skipped step inside it, keeps the actor's place), the critic's at every step."""
    actor = lr_lambda(cfg)
    return [lambda step: actor(actor_steps())] + [lr_lambda(cfg) for _ in range(groups - 1)]


def set_total_steps(worker, total_steps: int) -> None:
    """Give a trainer (``TrainerWorker``) a schedule ``total_steps`` long before its first step:
    ``train.epochs`` derives the run's length only once the controller has checked the prompts,
    after the trainers were built. Its config, and so a ``warmup_ratio``'s warmup, follow."""
    if worker.scheduler.last_epoch > 0:
        raise RuntimeError(f"trainer.total_steps set to {total_steps} after {worker.scheduler.last_epoch} "
                           "scheduler steps")
    worker.cfg = dataclasses.replace(worker.cfg, total_steps=total_steps)
    apply_schedule(worker)


def apply_schedule(worker) -> None:
    """Put ``worker.cfg``'s schedule on its scheduler and each parameter group's lr at the
    scheduler's current step under it: after a new ``total_steps``, or a resume (whose saved lr
    was the saved run's schedule's)."""
    s = worker.scheduler
    s.lr_lambdas = group_lambdas(worker.cfg, len(worker.optimizer.param_groups), lambda: worker.actor_steps)
    for group, base, lam in zip(worker.optimizer.param_groups, s.base_lrs, s.lr_lambdas):
        group["lr"] = base * lam(s.last_epoch)
    s._last_lr = [g["lr"] for g in worker.optimizer.param_groups]
