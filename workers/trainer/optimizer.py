"""The trainer's optimizer: AdamW over the actor's (and the critic's) parameter groups, whole on
every data-parallel rank, or sharded ZeRO-1 style (``TrainerConfig.shard_optimizer``).

Sharded, torch's ``ZeroRedundancyOptimizer`` gives each rank the AdamW moments of a share of
the parameters (whole tensors, packed greedily by size): after the gradient all-reduce each rank
steps its share and broadcasts it, so every rank ends the step with the same weights as an
unsharded AdamW would give. The consolidated state dict has plain AdamW's layout (parameters
numbered in group order), so a checkpoint saved sharded resumes unsharded or on another number
of ranks, and the reverse."""
from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer


def build(cfg, groups: list[dict], world_size: int, group=None) -> torch.optim.Optimizer:
    """``cfg``: a ``TrainerConfig``; ``group``: the data-parallel process group (None: the default
    one). One rank has nothing to shard with: plain AdamW."""
    kw = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    if cfg.shard_optimizer and world_size > 1:
        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, process_group=group, **kw)
    return torch.optim.AdamW(groups, **kw)


def sharded(opt: torch.optim.Optimizer) -> bool:
    return isinstance(opt, ZeroRedundancyOptimizer)


def full_state_dict(opt: torch.optim.Optimizer, rank: int) -> dict | None:
    """The whole optimizer state on data-parallel rank 0, None on the others. Sharded, this is a
    collective (each rank sends its share to rank 0): every rank must call it."""
    if sharded(opt):
        opt.consolidate_state_dict(to=0)  # the process group's rank 0
    return opt.state_dict() if rank == 0 else None


def local_state_elements(opt: torch.optim.Optimizer) -> int:
    """Elements of the optimizer state this rank holds (AdamW: m and v of its parameters)."""
    inner = opt.optim if sharded(opt) else opt
    return sum(t.numel() for st in inner.state.values() for t in st.values()
               if torch.is_tensor(t) and t.dim() > 0)
