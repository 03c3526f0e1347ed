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
    if not sharded(opt):
        return opt.state_dict() if rank == 0 else None
    opt.consolidate_state_dict(to=0)  # the process group's rank 0
    state = opt.state_dict() if rank == 0 else None
    # torch keeps the gathered shares (a private list) until the next consolidation: on rank 0
    # that is the whole state, held for the rest of the run, the memory sharding was to save
    opt._all_state_dicts = []
    return state


def load_state_dict(opt: torch.optim.Optimizer, state: dict) -> None:
    """Load a whole (plain AdamW layout) state; sharded, each rank keeps its share only."""
    opt.load_state_dict(state)
    if sharded(opt):
        # torch also copies this rank's share into the wrapper's own ``state``, which its
        # steps never read (on a GPU a second copy of the share); its state_dict() rebuilds
        # from the gathered shares, not from it
        opt.state.clear()


def local_state_elements(opt: torch.optim.Optimizer) -> int:
    """Elements of the optimizer state this rank holds (AdamW: m and v of its parameters)."""
    inner = opt.optim if sharded(opt) else opt
    return sum(t.numel() for st in inner.state.values() for t in st.values()
               if torch.is_tensor(t) and t.dim() > 0)
