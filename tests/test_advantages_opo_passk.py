"""verl's ``opo``, ``grpo_passk`` and ``gpg`` advantage estimators (``trainer.algorithm``): the numbers of
verl's ``compute_opo_outcome_advantage`` / ``compute_grpo_passk_outcome_advantage`` / ``compute_gpg_outcome_advantage`` (core_algos,
b178a3c), transcribed here independently of workers/trainer/advantages.py, then one real
TrainerWorker step each. Difference from verl, as for grpo / rloo here: a group of one sample
gets advantage 0 (verl's opo gives it its raw score; its grpo_passk raises)."""
import random

import pytest
import torch

from workers.trainer import TrainerConfig
from workers.trainer.advantages import grpo_passk, opo
from tests.test_trainer_stats import build, model_dir, train  # noqa: F401

torch.set_num_threads(1)


def verl_opo(scores: list[float], lengths: list[int]) -> list[float]:
    baseline = sum(l * s for l, s in zip(lengths, scores)) / sum(lengths)
    return [s - baseline for s in scores]


def verl_passk(scores: list[float], eps: float = 1e-6, norm: bool = True) -> list[float]:
    order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: the first of equal bests
    best, second = order[0], order[1]
    a = scores[best] - scores[second]
    if norm:
        mean = sum(scores) / len(scores)
        std = (sum((s - mean) ** 2 for s in scores) / (len(scores) - 1)) ** 0.5
        a = a / (std + eps)
    return [a if i == best else 0.0 for i in range(len(scores))]


@pytest.mark.parametrize("seed", range(5))
def test_opo_and_passk_equal_verl_s_formulas(seed):
    rng = random.Random(seed)
    g = rng.randint(2, 8)
    scores = [rng.choice([0.0, 0.5, 1.0]) + rng.random() * (seed % 2) for _ in range(g)]
    lengths = [rng.randint(1, 300) for _ in range(g)]
    s, n = torch.tensor(scores), torch.tensor(lengths, dtype=torch.float32)
    assert torch.allclose(opo(s, n), torch.tensor(verl_opo(scores, lengths)), atol=1e-6)
    for norm in (True, False):
        assert torch.allclose(grpo_passk(s, 1e-6, norm), torch.tensor(verl_passk(scores, 1e-6, norm)), atol=1e-5)


def test_the_edges():
    assert opo(torch.tensor([0.7]), torch.tensor([5.0])).tolist() == [0.0]  # a group of one: 0 (verl: 0.7)
    assert grpo_passk(torch.tensor([0.7]), 1e-6).tolist() == [0.0]
    assert opo(torch.tensor([0.7] * 4), torch.tensor([1.0, 9.0, 3.0, 2.0])).tolist() == [0.0] * 4  # equal: exactly 0
    assert grpo_passk(torch.tensor([1.0, 0.0, 1.0, 0.0]), 1e-6).tolist() == [0.0] * 4  # two bests: no lead
    # adv_eps 0 and a group of equal scores: 0 / 0 gave the picked sample NaN (review, session 51)
    # and the trainer skipped the whole micro-batch it was packed in; grpo gives 0 there
    assert grpo_passk(torch.tensor([0.5] * 4), 0.0).tolist() == [0.0] * 4
    # a long response weighs more in the baseline: 1.0 at length 3 and 0.0 at length 1 -> b = 0.75
    assert opo(torch.tensor([1.0, 0.0]), torch.tensor([3.0, 1.0])).tolist() == [0.25, -0.75]


def test_config():
    TrainerConfig(algorithm="grpo_passk", grpo_std_normalize=False, adv_eps=1e-4)  # grpo's knobs apply
    with pytest.raises(ValueError, match="trainer.grpo_std_normalize .* is only used by algorithm"):
        TrainerConfig(algorithm="opo", grpo_std_normalize=False)
    with pytest.raises(ValueError, match="trainer.gamma"):
        TrainerConfig(algorithm="opo", gamma=0.9)
    assert TrainerConfig(algorithm="opo").grouped and TrainerConfig(algorithm="grpo_passk").grouped


GROUPS = [[(1.0, 3), (0.0, 5), (1.0, 2), (0.5, 4)], [(0.2, 2), (0.7, 6)], [(0.0, 2), (0.0, 3)]]


@pytest.mark.parametrize("algorithm", ["opo", "grpo_passk"])
def test_a_trainer_step_uses_the_estimator(model_dir, algorithm):  # noqa: F811
    """One real step (no KL in the reward: a sample's reward is its score): every token of a
    sample carries its estimator's advantage, and the update has a gradient."""
    samples, prompts, sizes = build(model_dir, GROUPS)
    expect = []
    for members in GROUPS:
        scores, lengths = [r for r, _ in members], [n for _, n in members]
        expect += verl_opo(scores, lengths) if algorithm == "opo" else verl_passk(scores)
    m = train(model_dir, TrainerConfig(algorithm=algorithm, lr=1e-3), samples, prompts, sizes)
    assert m["advantage_max"] == pytest.approx(max(expect), abs=1e-5)
    assert m["advantage_min"] == pytest.approx(min(expect), abs=1e-5)
    assert m["uniform_group_frac"] == pytest.approx(1 / 3) and m["grad_norm"] > 0


def verl_gpg(groups: list[list[float]]) -> list[float]:
    """verl's compute_gpg_outcome_advantage (f_norm 1): alpha * (r - group mean), alpha = B / M
    over the whole batch (M: nonzero scores), a group of one's mean 0 (here: advantage 0)."""
    flat = [r for g in groups for r in g]
    alpha = len(flat) / max(sum(r != 0 for r in flat), 1)
    return [alpha * (r - sum(g) / len(g)) if len(g) > 1 else 0.0 for g in groups for r in g]


def test_gpg_scales_by_the_whole_step_over_its_nonzero_rewards(model_dir):  # noqa: F811
    """gpg's alpha counts every sample of the step (all groups, both ranks' in DP): the
    advantages are known at step(), so training waits for it."""
    cfg = TrainerConfig(algorithm="gpg", lr=1e-3)
    assert cfg.trains_at_step and cfg.grouped
    samples, prompts, sizes = build(model_dir, GROUPS)
    expect = verl_gpg([[r for r, _ in members] for members in GROUPS])  # alpha = 8 / 5
    m = train(model_dir, cfg, samples, prompts, sizes, one_by_one=True)
    assert m["advantage_max"] == pytest.approx(max(expect), abs=1e-5)
    assert m["advantage_min"] == pytest.approx(min(expect), abs=1e-5)
    assert m["grad_norm"] > 0
