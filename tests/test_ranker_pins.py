"""Ranker behaviour the rest of the suite let through when changed by one line (mutation
review, session 56): the ensemble blends its LM by weight, a constant LM keeps the estimates
finite, ``spearman`` is Spearman's rho, the neighbour memory keeps the newest rows,
leave-one-out never lists a row as its own neighbour, bin calibration keeps the ranker's order,
the LM's RankNet term pulls towards the true order, LightGBM's replay keeps the newest rows."""
import numpy as np
import pytest
import torch

import ranker
from ranker.lgbm import LgbmConfig, LgbmRanker
from ranker.lm import _ranknet
from test_ranker_lm import TINY_LM
from test_ranker_synth import SMALL_LGBM, synth


@pytest.fixture(scope="module")
def ensemble():
    torch.set_num_threads(1)
    prompts, lengths = synth(160, seed=0)
    return ranker.build("ensemble", lgbm=SMALL_LGBM, lm={**TINY_LM, "epochs": 1}, lm_embedding=False,
                        lgbm_weight=0.5).fit(prompts, lengths)


def test_the_ensemble_blends_its_lm_by_weight(ensemble):
    """w * z(lgbm) + (1 - w) * z(lm), mapped back with LightGBM's scale (ranker/ensemble.py);
    an ensemble whose LM never counted (w < 1 read as w < 0) gave LightGBM's alone."""
    prompts, _ = synth(40, seed=1)
    ma, sa, mb, sb = ensemble.stats
    za = (ensemble.lgbm.predict_log(prompts) - ma) / sa
    zb = (ensemble.lm.predict_log(prompts) - mb) / sb
    np.testing.assert_allclose(ensemble.predict_log(prompts), (0.5 * za + 0.5 * zb) * sa + ma, rtol=1e-9)
    assert not np.allclose(za, zb)  # the two members disagree somewhere, so the blend is not either one


def test_a_constant_lm_keeps_the_estimates_finite(monkeypatch):
    """An LM that predicts one length for every training row (a collapsed fine-tune) has a
    standard deviation of 0: the blend divided by it. Its predictions are set here (no training
    makes one collapse on demand); LightGBM is the real one."""
    prompts, lengths = synth(160, seed=0)
    r = ranker.build("ensemble", lgbm=SMALL_LGBM, lm=TINY_LM, lm_embedding=False, lgbm_weight=0.5)
    monkeypatch.setattr(r.lm, "pretrain", lambda p: None)
    monkeypatch.setattr(r.lm, "finetune", lambda p, lengths: None)
    monkeypatch.setattr(r.lm, "predict_log", lambda p: np.full(len(p), 3.0))
    r.fit(prompts, lengths)
    assert np.all(np.isfinite(r.predict_log(synth(20, seed=2)[0])))


def test_spearman_is_spearmans_rho():
    rep = ranker.ranking_report([1, 2, 3, 4, 5], [1, 2, 3, 5, 4])
    assert rep["spearman"] == pytest.approx(0.9) and rep["kendall_tau"] == pytest.approx(0.8)


def _builder(**kw):
    from ranker.features import FeatureBuilder, FeatureConfig
    from ranker.textspace import SpaceConfig
    return FeatureBuilder(FeatureConfig(space=SpaceConfig(svd_dims=4, max_columns=64), **kw))


PROMPTS = [f"question number {i} about {w}" for i, w in enumerate(["apples", "cars", "math", "dogs", "rain"] * 4)]


def test_the_neighbour_memory_keeps_the_newest_rows():
    b = _builder(max_memory=20)
    b.fit_transform(PROMPTS, np.arange(20, dtype=np.float32))
    b.add_memory(PROMPTS[:3], np.array([100.0, 101.0, 102.0], dtype=np.float32))
    assert len(b.mem_y) == 20 and list(b.mem_y[-3:]) == [100.0, 101.0, 102.0]


def test_leave_one_out_never_lists_a_row_as_its_own_neighbour(monkeypatch):
    import ranker.features as F

    monkeypatch.setattr(F, "_CHUNK", 4)  # several chunks (2,048 rows each in a run)
    b = _builder(knn_folds=0, knn_k=3)
    b.fit_transform(PROMPTS, np.arange(20, dtype=np.float32))
    idx, _ = b._neighbours(b.mem_z, 3, True, None)
    assert not any(i in row for i, row in enumerate(idx.tolist()))


def test_bin_calibration_keeps_the_rankers_order():
    from controller.length_estimates import calibrate_by_bins

    ref_est = np.arange(40, dtype=float)
    ref_true = np.where(ref_est < 20, 100.0, 50.0)  # the upper bin's true lengths are shorter
    out = calibrate_by_bins([5.0, 35.0], ref_est, ref_true, bins=2)
    assert out[0] <= out[1]

def test_ranknet_loss_is_lower_for_the_right_order_and_pulls_towards_it():
    y = torch.tensor([1.0, 2.0, 3.0])
    good = torch.tensor([0.0, 1.0, 2.0], requires_grad=True)
    assert _ranknet(good, y) < _ranknet(-good.detach(), y)
    _ranknet(good, y).backward()
    # descending the loss raises the longest's score and lowers the shortest's
    assert good.grad[2] < 0 < good.grad[0]


def test_lgbm_update_keeps_the_newest_rows_for_replay():
    prompts = [f"question {i} " + "word " * (i % 7) for i in range(40)]
    r = LgbmRanker(LgbmConfig(rounds=5, update_rounds=2, replay=30, min_child_samples=2))
    r.fit(prompts, [10.0 + i for i in range(40)])
    r.update([f"new prompt {i}" for i in range(5)], [100.0] * 5)
    assert len(r.replay_y) == 30
    assert np.allclose(r.replay_y[-5:], np.log1p(100.0))
