"""Trainer behaviour the rest of the suite let through when changed by one line (mutation
review, session 56): k3's log-ratio clamp keeps the gradient finite far from the reference, the
group filter's refill count leaves failed rewards out, gpg's alpha with one nonzero reward."""
import math

import pytest
import torch

from workers.tasks.reward_pool import Scored
from workers.trainer.advantages import gpg_alpha
from workers.trainer.group_filter import count_passing
from workers.trainer.kl import KL_ESTIMATORS


@pytest.mark.parametrize("name", ["k3", "k3+"])
def test_k3_far_from_the_reference_has_a_finite_zero_gradient(name):
    """log(pi_ref / pi) = 100: exp overflows without the [-20, 20] clamp and the gradient is NaN
    (the loss stays 10, so micro-batch skipping does not see it: the whole update was dropped
    as a non-finite gradient norm). k3+ takes k2's gradient: finite, the log-ratio itself."""
    logp = torch.tensor([-100.0], requires_grad=True)
    value = KL_ESTIMATORS[name](logp, torch.zeros(1))
    value.sum().backward()
    assert value.item() == pytest.approx(10.0)
    assert torch.isfinite(logp.grad).all()
    assert logp.grad.item() == pytest.approx(0.0 if name == "k3" else -100.0)


def _scored(score, why="", info=None):
    return Scored(score, why, 0.0, info or {})


def test_the_refill_count_leaves_failed_rewards_out():
    """A group [1, 1, <timed out>] has nothing to compare once its failed member is left out (as
    ``receive`` skips it): it does not count, so the controller refills until ``train_groups``."""
    failed = _scored(math.nan, "reward timed out")
    res = {"a": _scored(1.0), "b": _scored(1.0), "c": failed, "d": _scored(1.0), "e": _scored(0.0)}
    pending = {0: [(0, "a", 5), (1, "b", 5), (2, "c", 5)], 1: [(3, "d", 5), (4, "e", 5)]}
    assert count_passing(pending, res.__getitem__, "score", lambda n: 0.0) == 1
    lone = {0: [(0, "d", 5), (1, "c", 5)]}  # one member left: dropped by drop_single
    assert count_passing(lone, res.__getitem__, "score", lambda n: 0.0, drop_single=True) == 0
    # a dict metric: the failed sample has no 'correct' and is left out, not an error
    ok = {"x": _scored(1.0, info={"correct": 1.0}), "y": _scored(0.0, info={"correct": 0.0}), "c": failed}
    assert count_passing({0: [(0, "x", 5), (1, "y", 5), (2, "c", 5)]}, ok.__getitem__, "correct",
                         lambda n: 0.0) == 1


@pytest.mark.parametrize("b, m, alpha", [(8.0, 1.0, 8.0), (8.0, 0.0, 8.0), (8.0, 5.0, 1.6), (8.0, 8.0, 1.0)])
def test_gpg_alpha_is_the_batch_over_its_nonzero_rewards(b, m, alpha):
    assert gpg_alpha(torch.tensor([b, m])) == pytest.approx(alpha)
