"""Trainer behaviour the rest of the suite let through when changed by one line (mutation
review, session 56): k3's log-ratio clamp keeps the gradient finite far from the reference, the
group filter's refill count leaves failed rewards out, gpg's alpha with one nonzero reward."""
import math
from types import SimpleNamespace

import pytest
import torch

from test_advantages_opo_passk import verl_gpg
from test_trainer_stats import build, model_dir, train  # noqa: F401
from workers.tasks.reward_pool import Scored
from workers.trainer import TrainerConfig
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


def test_gpg_scales_every_sample_and_counts_negative_rewards(model_dir):  # noqa: F811
    groups = [[(1.0, 3), (-1.0, 5), (1.0, 2), (0.5, 4)], [(-0.5, 2), (0.7, 6)], [(0.0, 2), (0.0, 3)]]
    samples, prompts, sizes = build(model_dir, groups)
    expect = verl_gpg([[r for r, _ in g] for g in groups])  # alpha = 10 / 6 (verl: count_nonzero)
    lens = [n for g in groups for _, n in g]
    m = train(model_dir, TrainerConfig(algorithm="gpg", lr=1e-3), samples, prompts, sizes, one_by_one=True)
    assert m["advantage_max"] == pytest.approx(max(expect), abs=1e-5)
    assert m["advantage_min"] == pytest.approx(min(expect), abs=1e-5)
    assert m["advantage_mean"] == pytest.approx(sum(a * n for a, n in zip(expect, lens)) / sum(lens), abs=1e-5)


def test_whitening_leaves_a_non_finite_advantage_out_of_the_statistics():
    from tests.test_review_s44 import _prepared
    from workers.trainer.advantages import whiten
    from workers.trainer.buffer import SampleBuffer
    from workers.trainer.step_passes import whiten_pass

    g = torch.Generator().manual_seed(0)
    advs = [torch.randn(n, generator=g) for n in (5, 3, 4)]
    buffer = SampleBuffer()
    buffer.push_ready([_prepared(i, a.clone(), None) for i, a in enumerate(advs + [torch.full((6,), float("nan"))])])
    w = SimpleNamespace(_trained_any=False, buffer=buffer, world_size=1, group=None, device=torch.device("cpu"))
    whiten_pass(w)
    for p, want in zip(list(buffer.ready)[:3], whiten(advs)):
        assert torch.allclose(p.adv, want, atol=1e-6)
