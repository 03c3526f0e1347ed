"""Learning-rate schedules: linear warmup, then constant / cosine / linear decay."""
from __future__ import annotations

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
    """step -> multiplier of the base lr (for ``torch.optim.lr_scheduler.LambdaLR``)."""
    decay = DECAYS[cfg.lr_schedule]

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
        return decay(progress, cfg.min_lr_ratio)

    return f
