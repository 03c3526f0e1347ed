"""Trainer: RL maths (losses, advantages, kl), the TrainerWorker, SFT warm-start.

``from workers.trainer import TrainerConfig, TrainerWorker, StepResult, sft_warmstart``."""
from workers.trainer.config import TrainerConfig

__all__ = ["TrainerConfig", "TrainerWorker", "StepResult", "sft_warmstart"]
# these load on first use (PEP 562): every rank reads TrainerConfig with the run config, and a
# generation rank has no use for the worker's imports (torch.distributed.optim, ~1 s a process)
_LAZY = {"TrainerWorker": "workers.trainer.worker", "StepResult": "workers.trainer.worker",
         "sft_warmstart": "workers.trainer.sft"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'workers.trainer' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
