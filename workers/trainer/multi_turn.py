"""Multi-turn samples in the trainer: the mask of the tokens the policy sampled.

A multi-turn sample's ``output_ids`` interleave the policy's turns with the environment's
observation tokens (``Sample.loss_mask``: True where the policy sampled the token). As verl's
``response_mask``, observation tokens stay in the forward's context but leave every loss term and
count; ``Prepared.sampled`` carries the mask and ``Prepared.keep`` (what ``train_terms``, the
advantage statistics and the custom estimator read) starts from it (docs/trainer.md, "Multi-turn
samples").
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from workers.trainer.losses import POLICY_LOSSES

if TYPE_CHECKING:
    from workers.trainer.buffer import Prepared
    from workers.trainer.config import TrainerConfig
    from workers.types import Sample

# policy losses whose terms are per sequence or pick tokens by micro-batch statistics: they would
# read observation tokens (the controller refuses multi-turn with them, and with rollout_bypass)
UNMASKED_POLICY_LOSSES = ("gspo", "geo_mean", "sapo", "clip_cov", "kl_cov")


def sampled_mask(s: "Sample") -> torch.Tensor | None:
    """``s.loss_mask`` on CPU ([L] bool, checked by ``mask_reason``), or None where every token is
    the policy's (an all-True mask is None: such a sample trains exactly as a single-turn one)."""
    m = s.loss_mask
    return None if m is None or bool(m.all()) else m.cpu()


def mask_reason(s: "Sample") -> str | None:
    """Why ``s.loss_mask`` is unusable (a message naming the sample), or None."""
    m, sid = s.loss_mask, s.sample_id
    if m is None:
        return None
    if not torch.is_tensor(m) or m.dtype != torch.bool:
        what = f"dtype {m.dtype}" if torch.is_tensor(m) else f"a {type(m).__name__}"
        return f"sample {sid}: loss_mask is {what}, expected a bool tensor (True where the policy sampled the token)"
    if tuple(m.shape) != tuple(s.output_ids.shape):
        return f"sample {sid}: loss_mask of shape {tuple(m.shape)} for {s.output_ids.numel()} output tokens"
    if not bool(m.any()):
        return f"sample {sid}: loss_mask masks every output token (no token the policy sampled to train on)"
    return None


def check_supported(s: "Sample", cfg: "TrainerConfig") -> None:
    """Raise when ``s`` has observation tokens and the config has a loss that cannot leave them out."""
    m = s.loss_mask
    if m is None or not torch.is_tensor(m) or m.dtype != torch.bool or bool(m.all()):
        return
    if cfg.policy_loss in UNMASKED_POLICY_LOSSES or cfg.rollout_bypass:
        what = "trainer.rollout_bypass" if cfg.rollout_bypass else f"trainer.policy_loss {cfg.policy_loss!r}"
        raise ValueError(f"sample {s.sample_id}: a multi-turn sample (loss_mask with observation tokens) under "
                         f"{what}, which cannot leave observation tokens out of its terms; multi-turn rollouts "
                         f"need trainer.policy_loss one of {masked_policy_losses()}, without rollout_bypass")


def masked_policy_losses() -> tuple[str, ...]:
    """The policy losses a multi-turn sample trains under (per-token terms)."""
    return tuple(k for k in POLICY_LOSSES if k not in UNMASKED_POLICY_LOSSES)


def spread(x: torch.Tensor, sampled: torch.Tensor | None, fill) -> torch.Tensor:
    """x: [S] over the S sampled tokens -> [L], ``fill`` on the others (``x`` itself: all sampled)."""
    if sampled is None:
        return x
    out = torch.full(sampled.shape, fill, dtype=x.dtype)
    out[sampled] = x
    return out


def mean_over(x: torch.Tensor, mask: torch.Tensor | None) -> float:
    """x: [L] -> its mean over ``mask`` [L] bool (None: all); 0.0 over nothing."""
    x = x if mask is None else x[mask]
    return float(x.mean()) if x.numel() else 0.0


def last_sampled(sampled: torch.Tensor | None) -> int:
    """The index of the policy's last token (where the score goes): -1 when all are sampled."""
    return -1 if sampled is None else int(sampled.nonzero()[-1])


def item_mask(items: list["Prepared"], device: torch.device) -> torch.Tensor | None:
    """[N] bool over ``items``' packed response tokens: their ``keep`` (all True where None), or
    None when no item has one."""
    if all(p.keep is None for p in items):
        return None
    return torch.cat([torch.ones(p.num_tokens, dtype=torch.bool) if p.keep is None else p.keep
                      for p in items]).to(device)
