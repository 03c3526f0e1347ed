"""Trainer behaviour the rest of the suite let through when changed by one line (mutation review,
session 56): linear decay honours min_lr_ratio, and the total steps cannot change once the
scheduler stepped."""
from types import SimpleNamespace

import pytest
import torch

from workers.trainer import TrainerConfig
from workers.trainer.schedule import lr_lambda, set_total_steps


def test_linear_decay_ends_at_min_lr_ratio():
    g = lr_lambda(TrainerConfig(lr_schedule="linear", total_steps=4, min_lr_ratio=0.2))
    assert [g(s) for s in (0, 2, 4, 9)] == pytest.approx([1.0, 0.6, 0.2, 0.2])


def test_total_steps_cannot_change_after_the_first_scheduler_step():
    cfg = TrainerConfig(lr=1.0, lr_schedule="linear", total_steps=2)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    w = SimpleNamespace(cfg=cfg, optimizer=opt, scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg)),
                        actor_steps=0)
    opt.step()
    w.scheduler.step()
    with pytest.raises(RuntimeError, match="after 1 scheduler steps"):
        set_total_steps(w, 8)
