"""Trainer behaviour the rest of the suite let through when changed by one line (mutation review,
session 56): AdamW takes the config's weight decay and betas."""
import pytest
import torch

from workers.trainer import TrainerConfig
from workers.trainer import optimizer


@pytest.mark.parametrize("kw", [dict(), dict(weight_decay=0.1, betas=(0.5, 0.75), adam_eps=1e-3)])
def test_adamw_takes_the_configs_hyperparameters(kw):
    """trainer.weight_decay / betas / adam_eps reach AdamW, and the defaults decay nothing:
    one step on a zero gradient leaves the weights as they are with weight_decay 0."""
    cfg = TrainerConfig(lr=0.5, **kw)
    p = torch.nn.Parameter(torch.ones(3))
    opt = optimizer.build(cfg, [{"params": [p]}], world_size=1)
    g = opt.param_groups[0]
    assert (g["weight_decay"], tuple(g["betas"]), g["eps"]) == (cfg.weight_decay, cfg.betas, cfg.adam_eps)
    p.grad = torch.zeros(3)
    opt.step()
    assert torch.allclose(p.detach(), torch.full((3,), 1.0 - 0.5 * cfg.weight_decay))
