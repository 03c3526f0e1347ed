"""KL(pi || pi_ref) per-token estimators (Schulman's k1, k3) on sampled tokens."""
from __future__ import annotations

from typing import Callable

import torch


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """logp, ref_logp: [N] -> [N]; log(pi/pi_ref), unbiased, can be negative."""
    return logp - ref_logp


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """logp, ref_logp: [N] -> [N]; r - log r - 1 with r = pi_ref/pi: unbiased, >= 0.

    As verl's ``low_var_kl``: log r clamped to [-20, 20] (exp stays finite), the estimate to
    [-10, 10]. A clamp passes no gradient outside its range, so a token whose estimate exceeds
    10 adds a constant 10 to the loss and nothing to the gradient: one far-off token no longer
    dominates the update."""
    log_r = (ref_logp - logp).clamp(-20.0, 20.0)
    return (torch.exp(log_r) - log_r - 1.0).clamp(-10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"k1": kl_k1, "k3": kl_k3}
