"""KL(pi || pi_ref) per-token estimators (Schulman's k1, k3) on sampled tokens."""
from __future__ import annotations

from typing import Callable

import torch


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """logp, ref_logp: [N] -> [N]; log(pi/pi_ref), unbiased, can be negative."""
    return logp - ref_logp


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """logp, ref_logp: [N] -> [N]; r - log r - 1 with r = pi_ref/pi: unbiased, >= 0."""
    log_r = (ref_logp - logp).clamp(-20.0, 20.0)  # keep exp finite on far-apart policies
    return torch.exp(log_r) - log_r - 1.0


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"k1": kl_k1, "k3": kl_k3}
