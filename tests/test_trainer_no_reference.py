"""Without a KL coefficient (``trainer.kl_coef`` 0, the default; DAPO's and Dr. GRPO's recipes)
there is no reference policy: it is not loaded and not run on any sample, as verl creates no
reference worker unless ``use_kl_loss`` or ``use_kl_in_reward``; no ``kl`` metric is reported.
The update is the same as with a reference whose KL nobody reads."""
import pytest
import torch

from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer.step_math import prepare_batch
from tests.test_trainer_stats import KnownRewardTask, build, model_dir  # noqa: F401

torch.set_num_threads(1)
GROUPS = [[(1.0, 3), (0.0, 5), (0.5, 4)], [(0.2, 2), (0.7, 6)]]


def _step(model_dir, cfg, data):  # noqa: F811
    samples, prompts, sizes = data
    w = TrainerWorker(cfg, model_dir, KnownRewardTask(), device="cpu")
    w.begin_iteration(0, prompts, sizes)
    w.receive(samples)
    return w, w.step().metrics


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_no_kl_coefficient_no_reference(model_dir, algorithm, monkeypatch):  # noqa: F811
    data = build(model_dir, GROUPS)
    assert not TrainerConfig().uses_reference and TrainerConfig(kl_coef=0.1, kl_mode="reward").uses_reference
    w, m = _step(model_dir, TrainerConfig(algorithm=algorithm, lr=1e-2), data)
    assert w.ref is None and "kl" not in m and m["grad_norm"] > 0
    assert all(p.ref_logp is None for p in prepare_batch(w, data[0]))
    # the same update as a run that has a reference but puts no weight on it: one whose KL
    # coefficient is too small to move anything (the reference's forward changes no number)
    with_ref, m_ref = _step(model_dir, TrainerConfig(algorithm=algorithm, lr=1e-2, kl_coef=1e-30), data)
    assert with_ref.ref is not None and m_ref["kl"] == pytest.approx(0.0, abs=1e-6)
    for (name, a), (_, b) in zip(w.actor.named_parameters(), with_ref.actor.named_parameters()):
        assert torch.equal(a, b), name
