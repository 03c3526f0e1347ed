"""LightGBM ranker: learns a synthetic trace, save/load round trip, online update,
feature-set fingerprint refusal, bootstrap from a generate callable, bad input."""
from __future__ import annotations

import json

import numpy as np
import pytest

import ranker
from ranker.features import FeatureMismatchError
from test_ranker_synth import SMALL_LGBM, synth


@pytest.fixture(scope="module")
def fitted():
    prompts, lengths = synth(300, seed=0)
    return ranker.build("lgbm", **SMALL_LGBM).fit(prompts, lengths)


def test_recall_on_learnable_synthetic_set(fitted):
    prompts, lengths = synth(200, seed=1)
    rep = ranker.ranking_report(fitted.predict(prompts), lengths)
    assert rep["recall@20"] >= 0.85, rep
    assert rep["spearman"] >= 0.9, rep


def test_predictions_are_lengths_in_words(fitted):
    p = fitted.predict(["What is 3 + 4? Answer with a number.",
                        "Solve the tower of hanoi puzzle with 9 disks. List every move."])
    assert len(p) == 2 and all(isinstance(v, float) for v in p)
    assert 2 < p[0] < 20 and p[1] > 200, p


def test_save_load_round_trip_identical(fitted, tmp_path):
    prompts, _ = synth(50, seed=2)
    fitted.save(tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "meta.json").read_text())
    assert meta["kind"] == "lgbm" and len(meta["fingerprint"]) == 16
    loaded = ranker.load(tmp_path / "m")
    assert loaded.predict(prompts) == fitted.predict(prompts)


def test_load_refuses_other_feature_set(fitted, tmp_path):
    fitted.save(tmp_path / "m")
    meta_path = tmp_path / "m" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["fingerprint"] = "0123456789abcdef"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(FeatureMismatchError, match="trained with feature set '0123456789abcdef'.*retrain"):
        ranker.load(tmp_path / "m")


def test_load_refuses_non_model_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no meta.json"):
        ranker.load(tmp_path)


def test_update_learns_drift(tmp_path):
    prompts, lengths = synth(300, seed=0)
    r = ranker.build("lgbm", **SMALL_LGBM).fit(prompts, lengths)
    # The policy's answers to "Reverse" prompts become 50x longer.
    new_p, new_l = synth(200, seed=5)
    new_l = [ln * 50 if p.startswith("Reverse") else ln for p, ln in zip(new_p, new_l)]
    probe = "Reverse the letters of the word 'stonestone'."
    before = r.predict([probe])[0]
    r.update(new_p, new_l)
    after = r.predict([probe])[0]
    assert after > 3 * before, (before, after)
    r.save(tmp_path / "u")
    assert ranker.load(tmp_path / "u").predict([probe]) == [after]


def test_bootstrap_from_generate_callable():
    pool, _ = synth(400, seed=3)
    truth = dict(zip(*synth(400, seed=3)))
    calls = []

    def generate(batch: list[str]) -> list[float]:
        calls.append(len(batch))
        return [truth[p] for p in batch]

    r = ranker.bootstrap(generate, pool, n=250, chunk=100, **SMALL_LGBM)
    assert calls == [100, 100, 50]
    test_p, test_l = synth(200, seed=4)
    assert ranker.recall_at(r.predict(test_p), test_l, 0.2) >= 0.8


def test_bootstrap_rejects_wrong_count():
    pool, _ = synth(40, seed=3)
    with pytest.raises(ValueError, match="returned 1 lengths for 20 prompts"):
        ranker.bootstrap(lambda b: [1.0], pool, n=40, chunk=20, **SMALL_LGBM)


def test_bad_input_errors_name_the_index(fitted):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        fitted.predict(["ok prompt", "  "])
    with pytest.raises(ValueError, match="prompt 0 is int"):
        fitted.predict([3])
    with pytest.raises(ValueError, match="length 1 is nan"):
        ranker.build("lgbm", **SMALL_LGBM).fit(["a b", "c d", "e f", "g h"], [1, float("nan"), 2, 3])
    with pytest.raises(ValueError, match="2 prompts but 1 lengths"):
        fitted.update(["a", "b"], [1.0])
    with pytest.raises(ValueError, match="unknown ranker kind 'xgb'"):
        ranker.build("xgb")
    with pytest.raises(ValueError, match="lgbm objective 'poisson'"):
        ranker.build("lgbm", objective="poisson")


def test_unfitted_ranker_refuses():
    with pytest.raises(RuntimeError, match="not fitted"):
        ranker.build("lgbm", **SMALL_LGBM).predict(["x"])


@pytest.mark.parametrize("objective", ["lambdarank", "top", "rank"])
def test_score_objectives_return_lengths(objective):
    """Objectives whose score is not a log-length are mapped back to words, order kept."""
    prompts, lengths = synth(300, seed=0)
    r = ranker.build("lgbm", objective=objective, **SMALL_LGBM).fit(prompts, lengths)
    test_p, test_l = synth(200, seed=1)
    pred = np.asarray(r.predict(test_p))
    assert ranker.recall_at(pred, test_l, 0.2) >= 0.8
    assert pred.min() >= 0 and pred.max() <= max(lengths) * 1.01
