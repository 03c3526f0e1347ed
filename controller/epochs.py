"""``train.epochs`` (verl's ``total_epochs``): the run's length derived at start.

verl runs ``len(train_dataloader) * total_epochs`` steps, its dataloader dropping the last
partial batch of each epoch (``drop_last=True``): ``epochs x (prompts // batch_prompts)``. The
prompts are those the start check kept (``train.overlong_prompts: skip`` may drop some), so the
number is known once the engines' context is, after the config was loaded: ``with_epochs``
turns the loaded config into the run's, ``train.iterations`` and (unless the file set it) the
LR schedule's ``trainer.total_steps`` set to it. A resumed run derives it again from the same
prompts, so it ends where the first attempt would have.

The prompt stream (``controller/data.py``) does not drop the partial batch: it runs on into
the next epoch, so the run trains ``iterations x batch_prompts`` prompts, as many as verl's.
"""
from __future__ import annotations

import dataclasses

from controller.config_types import ConfigError


def iterations_of(epochs: int, prompts: int, batch_prompts: int) -> int:
    """verl's total_training_steps: ``epochs`` x the full batches of ``batch_prompts`` in ``prompts``."""
    return epochs * (prompts // batch_prompts)


def with_epochs(cfg, prompts: int, dropped: int = 0):
    """``cfg`` with its length derived from ``train.epochs`` over ``prompts`` kept train prompts
    (``dropped``: how many the start check dropped, for the messages), and the ``[controller]``
    line that says it; ``cfg`` itself (and None) without ``train.epochs``. Fewer prompts than one
    batch, or a derived schedule shorter than ``trainer.warmup_steps``, raise ``ConfigError``."""
    t = cfg.train
    if t.epochs is None:
        return cfg, None
    after = f" (after the start check dropped {dropped})" if dropped else ""
    if prompts < t.batch_prompts:
        raise ConfigError(f"train.epochs: the train split has {prompts} prompts{after}, fewer than one batch of "
                          f"train.batch_prompts {t.batch_prompts}: an epoch would be no iteration (verl drops the "
                          "last partial batch); lower train.batch_prompts, or set train.iterations instead")
    n = iterations_of(t.epochs, prompts, t.batch_prompts)
    trainer = cfg.trainer
    if "total_steps" in cfg.follows:
        try:
            trainer = dataclasses.replace(trainer, total_steps=n)
        except ValueError as e:  # warmup_steps longer than the derived schedule
            raise ConfigError(f"{e} (trainer.total_steps follows the {n} iterations train.epochs {t.epochs} "
                              f"derives from {prompts} train prompts{after})") from None
    left = prompts % t.batch_prompts
    rest = (f"; the {left} prompts left over an epoch are not dropped: the prompt stream runs on into the next "
            "epoch" if left else "")
    warm = f", LR warmup {trainer.warmup} steps (trainer.warmup_ratio {trainer.warmup_ratio})" \
        if trainer.warmup_ratio else ""
    line = (f"train.epochs {t.epochs}: {n} iterations = {t.epochs} x ({prompts} train prompts{after} // "
            f"train.batch_prompts {t.batch_prompts}), the LR schedule's trainer.total_steps {trainer.total_steps}"
            f"{warm}{rest}")
    train = dataclasses.replace(t)
    object.__setattr__(train, "iterations", n)  # beside epochs, which a file may not set together
    return cfg.replace(train=train, trainer=trainer), line
