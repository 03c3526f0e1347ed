"""Trainer: RL maths (losses, advantages, kl), the TrainerWorker, SFT warm-start.

``from workers.trainer import TrainerConfig, TrainerWorker, StepResult, sft_warmstart``."""
from workers.trainer.config import TrainerConfig
from workers.trainer.sft import sft_warmstart
from workers.trainer.worker import StepResult, TrainerWorker

__all__ = ["TrainerConfig", "TrainerWorker", "StepResult", "sft_warmstart"]
