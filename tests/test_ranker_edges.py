"""The ranker and the dispatchers at their edges (review, session 50): a chat item's online
update row, a diverged fit, a damaged ``meta.json`` kind, a wide skew noise, empty posterior
bins, numpy batch caps; options fit would refuse (session 52)."""
import json
import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

import ranker
from controller.length_estimates import BinnedPosterior, calibrate_by_bins
from controller.own_dispatcher import checked_plan
from controller.ranker_feedback import update_rows
from controller.scheduling import DispatchPlan, PTLProfile, make_dispatcher
from workers.types import TaskPrompt, prompt_text

PROMPTS = [f"solve puzzle {i} with {'x ' * (i % 7)} grid" for i in range(40)]
LENGTHS = [float(10 + (i % 7) * 20) for i in range(40)]


def test_the_online_update_row_is_the_text_the_ranker_predicts_from():
    """A chat item (prompt "", its turns in messages) gave an empty row and the update raised
    'prompt 0 is empty': the run stopped at its first ranker.update_every iteration."""
    item = TaskPrompt(prompt="", answer="4", task="t",
                      messages=({"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}))
    rows = update_rows(SimpleNamespace(iteration=0, items=[item]), {0: 10, 1: 20}, per_prompt=2)
    assert rows == [(prompt_text(item), 15.0)] and rows[0][0] == "2+2?"


@pytest.mark.parametrize("kind, options, key", [
    ("lm", dict(hidden=16, heads=2, kv_heads=1, layers=1, intermediate=32, epochs=3, max_tokens=32,
                vocab_size=300, lr=1000.0), "lr"),
    ("lgbm", dict(rounds=20, learning_rate=1e30, objective="l2"), "learning_rate"),
])
def test_a_diverged_fit_is_refused_naming_the_learning_rate(kind, options, key):
    """It fitted and predicted NaN (lm) or inf (lgbm) for every prompt; a run saved it and every
    request got a NaN length."""
    prompts = [f"p {i} " + "y " * i for i in range(40)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=f"{kind} ranker: training diverged.*'{key}'"):
            ranker.build(kind, **options).fit(prompts, [float(i * i) for i in range(40)])


def test_predictions_stay_words():
    r = ranker.build("lgbm", rounds=5).fit(PROMPTS, LENGTHS)
    r.predict_log = lambda prompts: np.array([800.0, -3.0])  # expm1: inf, negative
    assert r.predict(["a", "b"]) == [1e9, 0.0]


def test_a_meta_kind_that_is_not_a_string_is_a_value_error_naming_the_file(tmp_path):
    d = tmp_path / "r"
    ranker.build("lgbm", rounds=5).fit(PROMPTS, LENGTHS).save(d)
    meta = json.loads((d / "meta.json").read_text())
    meta["kind"] = ["lgbm"]
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"meta.json: unknown ranker kind \['lgbm'\]"):
        ranker.load(d)


def test_a_wide_skew_noise_plans_within_the_cache():
    """exp(N(0, 1000)) overflowed and int(round(inf)) raised at the first dispatch."""
    prof = PTLProfile([1, 64], [1.0, 2.0], kv_tokens=8192, block_size=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = make_dispatcher("skew", noise=1000.0).plan([0.0, 10.0, 20.0, 400.0] * 5, [prof, prof])
    assert sorted(i for idx in plan.per_instance for i in idx) == list(range(20))
    assert all(math.isfinite(t) for t in plan.predicted_s)


def test_an_estimate_under_a_floor_of_ties_draws_as_the_floor_does():
    """30% of the held-out estimates tie at 1.0: the first bin was empty and took the whole pool,
    so an estimate of 0.5 drew a mean ~350 where 1.0 drew 5."""
    ref_est = [1.0] * 30 + list(np.linspace(2, 100, 70))
    ref_true = [5.0] * 30 + list(np.linspace(10, 1000, 70))
    post = BinnedPosterior(ref_est, ref_true, bins=10)
    rng = np.random.default_rng(0)
    assert post.draw([0.5] * 500, rng).mean() == post.draw([1.0] * 500, rng).mean() == 5.0
    assert calibrate_by_bins([0.5, 1.0], ref_est, ref_true, bins=10) == [5.0, 5.0]
    top = post.draw([100.0] * 200, rng)
    assert top.min() >= 10.0 and top.mean() > 500  # the tail still draws from the tail


def test_numpy_batch_caps_are_taken_as_ints():
    plan = checked_plan(DispatchPlan([[0], [1]], [np.int64(4), 4], "mine"), 2, 2, "mine")
    assert plan.batch_caps == [4, 4] and all(type(c) is int for c in plan.batch_caps)
    with pytest.raises(ValueError, match="batch caps must be ints >= 1"):
        checked_plan(DispatchPlan([[0], [1]], [np.float64(4.0), 4], "mine"), 2, 2, "mine")


def test_options_fit_would_refuse_are_refused_when_the_ranker_is_built(tmp_path):
    """Each failed only in ``fit``, after the bootstrap had generated every length (review,
    session 52): a model_dir that is not there, LightGBM's num_leaves bound, an ensemble's
    lgbm.features.lm_dims (which the ensemble sets)."""
    with pytest.raises(ValueError, match=r"lm config key 'model_dir': '.*nothere' has no config.json and no "
                                         r"tokenizer.json"):
        ranker.build("lm", model_dir=str(tmp_path / "nothere"))
    with pytest.raises(ValueError, match=r"lgbm config key 'num_leaves' must be in \[2, 131072\], got 200000"):
        ranker.build("lgbm", num_leaves=200000)
    with pytest.raises(ValueError, match="ensemble config key 'lgbm.features.lm_dims': the ensemble sets it"):
        ranker.build("ensemble", lgbm={"features": {"lm_dims": 5}}, lm_embedding=False)


def test_the_rank_objective_gives_equal_lengths_equal_targets():
    """Tied lengths (answers cut at max_tokens) got percentiles by their rows' order: a ramp of
    targets for equal lengths (review, session 52)."""
    from ranker.lgbm import OBJECTIVES

    _, y, _ = OBJECTIVES["rank"](np.log1p(np.array([100.0, 5.0, 100.0, 100.0, 7.0, 100.0])))
    assert y.tolist() == pytest.approx([2 / 3, 0.5, 2 / 3, 2 / 3, 0.5, 2 / 3])  # ranks 2-5 share 3.5: (3.5+.5)/6
    _, y, _ = OBJECTIVES["rank"](np.zeros(10))
    assert set(y.tolist()) == {0.5}
    _, y, _ = OBJECTIVES["rank"](np.log1p(np.arange(8.0)))  # no ties: as before
    assert y.tolist() == pytest.approx(np.maximum((np.arange(8) + 0.5) / 8, 0.5).tolist())


def test_a_saved_lm_ranker_loads_after_the_folder_it_started_from_is_gone(tmp_path):
    """Its own LM and tokenizer are in its folder: the model_dir check (made for a ranker built
    to fit) refused to load it once that folder was moved (review of session 52's change)."""
    import shutil

    from test_ranker_synth import synth

    tiny = {"vocab_size": 300, "hidden": 16, "layers": 1, "heads": 2, "kv_heads": 1, "intermediate": 32,
            "max_tokens": 24, "pretrain_epochs": 0, "epochs": 1, "batch_size": 16, "lr": 5e-3, "update_steps": 1,
            "threads": 1}
    prompts, lengths = synth(40, seed=0)
    ranker.build("lm", **tiny).fit(prompts, lengths).save(tmp_path / "base")
    tuned = ranker.build("lm", **{**tiny, "model_dir": str(tmp_path / "base" / "lm")}).fit(prompts, lengths)
    tuned.save(tmp_path / "tuned")
    want = tuned.predict(prompts[:5])
    shutil.rmtree(tmp_path / "base")
    assert ranker.load(tmp_path / "tuned").predict(prompts[:5]) == want
    with pytest.raises(ValueError, match="lm config key 'model_dir': .* has no config.json"):
        ranker.build("lm", **{**tiny, "model_dir": str(tmp_path / "base" / "lm")})
