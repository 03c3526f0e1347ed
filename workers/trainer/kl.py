"""KL(pi || pi_ref) per-token estimators on sampled tokens (Schulman's k1, k2, k3; verl's abs and
its straight-through "+" variants)."""
from __future__ import annotations

from typing import Callable

import torch

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """logp, ref_logp: [N] -> [N]; log(pi/pi_ref), unbiased, can be negative."""
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """logp, ref_logp: [N] -> [N]; 0.5 * log(pi/pi_ref)^2 (verl's ``mse`` / ``k2``), >= 0. Biased
    as a value, but its gradient, (logp - ref_logp) d logp, is in expectation the gradient of
    KL(pi || pi_ref) (k1's and k3's are not): the gradient the "+" estimators take."""
    return 0.5 * (logp - ref_logp).square()


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """logp, ref_logp: [N] -> [N]; r - log r - 1 with r = pi_ref/pi: unbiased, >= 0.

    As verl's ``low_var_kl``: log r clamped to [-20, 20] (exp stays finite), the estimate to
    [-10, 10]. A clamp passes no gradient outside its range, so a token whose estimate exceeds
    10 adds a constant 10 to the loss and nothing to the gradient: one far-off token no longer
    dominates the update."""
    log_r = (ref_logp - logp).clamp(-20.0, 20.0)
    return (torch.exp(log_r) - log_r - 1.0).clamp(-10.0, 10.0)


def kl_abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """logp, ref_logp: [N] -> [N]; |log(pi/pi_ref)| (verl's ``abs``), >= 0."""
    return (logp - ref_logp).abs()


def straight_through(forward: KLEstimator) -> KLEstimator:
    """verl's ``<name>+``: the value of ``forward``, the gradient of ``kl_k2`` (unclamped: a
    token past k3's clamp still gets k2's gradient)."""

    def estimate(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
        k2 = kl_k2(logp, ref_logp)  # [N]
        return k2 - k2.detach() + forward(logp, ref_logp).detach()

    return estimate


KL_ESTIMATORS: dict[str, KLEstimator] = {
    "k1": kl_k1, "k2": kl_k2, "k3": kl_k3, "abs": kl_abs,
    # k2+ would be k2 itself
    "k1+": straight_through(kl_k1), "k3+": straight_through(kl_k3), "abs+": straight_through(kl_abs),
}
