"""The coefficient of the KL penalty in the reward (``trainer.kl_mode: reward``): fixed, or
adapted each iteration towards a target KL (Ziegler et al. 2019, sec. 2.2; verl's
``algorithm.kl_ctrl.type: adaptive``, trl's and OpenRLHF's ``AdaptiveKLController``)."""
from __future__ import annotations

import math
from dataclasses import dataclass

MAX_ERROR = 0.2  # the proportional error's clip: one update moves beta by at most 20% x n / horizon


@dataclass
class KLCoefficient:
    """beta, the penalty's coefficient, and how it moves. ``target`` 0: fixed at ``value``.

    With a target, ``update(kl, n)`` after each iteration multiplies beta by
    ``1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon``: ``kl`` is the iteration's mean over
    its samples of each sample's mean per-token KL (old policy vs reference, the estimator the
    reward used), ``n`` its number of samples (verl's ``current_kl`` and ``batch_size``). A
    non-finite ``kl`` (one sample's bad log-probs) is skipped: verl's NaN beta would make every
    later reward NaN."""

    value: float
    target: float = 0.0
    horizon: int = 10000

    def update(self, kl: float, n: float) -> float:
        """Fold in one iteration's KL; returns the new beta (unchanged when fixed, ``n`` is 0 or
        ``kl`` is not finite)."""
        if self.target > 0 and n > 0 and math.isfinite(kl):
            error = min(max(kl / self.target - 1.0, -MAX_ERROR), MAX_ERROR)
            self.value *= 1.0 + error * n / self.horizon
        return self.value
