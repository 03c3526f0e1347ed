"""The controller's side of the ranker (mutation review, session 57): online-update rows and
quality estimates pair each prompt / sample with its own lengths, a resumed run refuses a
checkpoint ranker of another kind, the bootstrap draws with train.seed; length calibration for
dispatch (mid-rank quantiles, empty bins, an estimate on a bin edge)."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from controller.config import ConfigError, RankerSection
from controller.length_estimates import BinnedPosterior, _nearest_filled, calibrate_by_rank
from controller.ranker_feedback import ranking_quality, update_rows
from controller.ranker_setup import run_ranker
import ranker
from ranker.bootstrap import sample_prompts
from test_ranker_synth import synth
from workers.types import SAMPLE_STRIDE, Request, TaskPrompt

SMALL = {"rounds": 5, "update_rounds": 2, "min_child_samples": 2, "threads": 1}


def test_update_rows_keep_each_prompt_with_its_own_samples_when_one_has_none():
    items = [TaskPrompt(prompt=f"prompt {i}", answer="", task="t") for i in range(3)]
    b = SimpleNamespace(iteration=2, items=items)
    base = 2 * SAMPLE_STRIDE
    # per_prompt 2: prompt 0 -> samples 0, 1; prompt 1 -> 2, 3 (dropped); prompt 2 -> 4, 5
    rows = update_rows(b, {base + 0: 10, base + 1: 20, base + 4: 100, base + 5: 300}, per_prompt=2)
    assert rows == [("prompt 0", 15.0), ("prompt 2", 200.0)]


def test_estimates_pair_with_their_own_samples_length_whatever_the_request_order():
    base = 3 * SAMPLE_STRIDE
    reqs = [Request(sample_id=base + i, prompt_ids=torch.tensor([1]), max_tokens=64, est_len=e)
            for i, e in [(2, 20.0), (0, 10.0), (3, 30.0), (1, 40.0)]]  # dispatch order, not id order
    q = ranking_quality(SimpleNamespace(requests=reqs), {base + 0: 5, base + 1: 50, base + 2: 20, base + 3: 40})
    assert q["spearman"] == 1.0 and q["kendall_tau"] == 1.0


def _cfg(tmp_path, kind="lgbm", seed=3):
    return SimpleNamespace(ranker=RankerSection(kind=kind, path=str(tmp_path / "r"), bootstrap_prompts=40,
                                                options=dict(SMALL) if kind == "lgbm" else {}),
                           train=SimpleNamespace(seed=seed, group_size=2, eval_only=False))


def test_a_checkpoint_ranker_of_another_kind_is_refused(tmp_path):
    pool, lengths = synth(60, seed=1)
    (tmp_path / "ckpt").mkdir()
    ranker.save(ranker.build("lgbm", **SMALL).fit(pool, lengths), tmp_path / "ckpt" / "ranker")
    with pytest.raises(ConfigError, match="checkpoint resumed from holds a 'lgbm' ranker"):
        run_ranker(_cfg(tmp_path, kind="ensemble"), None, tmp_path / "ckpt", lambda ps: [1.0] * len(ps), pool)


def test_the_bootstrap_draws_its_prompts_with_the_train_seed(tmp_path):
    pool, lengths = synth(200, seed=1)
    truth, seen = dict(zip(pool, lengths)), []

    def measure(ps):
        seen.extend(ps)
        return [truth[p] for p in ps]

    run_ranker(_cfg(tmp_path, seed=3), None, None, measure, pool)
    assert seen == sample_prompts(pool, 40, 3) != sample_prompts(pool, 40, 0)


def test_rank_calibration_takes_the_mid_rank_quantile():
    ref = np.arange(101.0)  # quantile q of 0..100 is 100 q
    np.testing.assert_allclose(calibrate_by_rank([30.0, 10.0, 20.0, 40.0], ref), [62.5, 12.5, 37.5, 87.5])


def test_an_empty_bin_stands_for_the_nearest_filled_bin_below_it():
    assert _nearest_filled(np.array([False, True, False, False, True, False])).tolist() == [1, 1, 1, 1, 4, 4]


def test_an_estimate_on_an_edge_draws_from_the_bin_its_reference_twins_are_in():
    ref_est = [0.0] * 10 + [1.0] * 10
    post = BinnedPosterior(ref_est, [10.0] * 10 + [100.0] * 10, bins=4)  # edges 0, 0.5, 1
    assert post.draw([1.0, 0.0], np.random.default_rng(0)).tolist() == [100.0, 10.0]
