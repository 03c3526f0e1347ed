"""recall@k with ties (ranker/metrics.py): a pick as long as the k-th longest is right (every
response capped at max_tokens is among the longest), tied predictions count as random
tie-breaking would on average, so neither the rows' order nor a constant prediction scores."""
import numpy as np
import pytest

from ranker.metrics import recall_at


def test_a_constant_prediction_scores_chance_whatever_the_order():
    true = np.arange(100.0)
    for order in (true, true[::-1]):
        assert recall_at(np.ones(100), order, 0.2) == pytest.approx(0.2)  # was 1.0 longest-first


def test_a_pick_tied_for_the_longest_is_right():
    # two rows tie for the longest: predicting either is a perfect top 1 (was 0 for row 1)
    assert recall_at([0.0, 9.0, 1.0, 2.0], [5.0, 5.0, 1.0, 2.0], 0.25) == 1.0
    # the controller's shape: a prompt's samples share its estimate, the capped ones tie at the cap
    pred = [3.0] * 3 + [2.0] * 3 + [1.0] * 3
    true = [64.0] * 3 + [40.0, 50.0, 60.0] + [10.0, 20.0, 30.0]
    assert recall_at(pred, true, 1 / 3) == 1.0


def test_tied_predictions_count_as_random_tie_breaking_would():
    rng = np.random.default_rng(0)
    for _ in range(100):
        n = int(rng.integers(1, 20))
        pred, true = rng.integers(0, 3, n).astype(float), rng.permutation(n).astype(float)
        k = max(1, int(round(0.3 * n)))
        draws = []
        for _ in range(2000):  # Monte Carlo over random tie-breaks of the predictions
            top = np.lexsort((rng.random(n), -pred))[:k]
            draws.append(np.isin(top, np.argsort(-true)[:k]).sum() / k)
        assert recall_at(pred, true, 0.3) == pytest.approx(np.mean(draws), abs=0.04)


def test_no_ties_is_plain_recall():
    rng = np.random.default_rng(1)
    true, pred = rng.random(50), rng.random(50)
    k = 10
    want = len(np.intersect1d(np.argsort(-true)[:k], np.argsort(-pred)[:k])) / k
    assert recall_at(pred, true, 0.2) == want and recall_at(true, true, 0.2) == 1.0


def test_a_nan_ranks_lowest():
    """(A diverged model's NaN prediction: a ZeroDivisionError, or recall above the truth.)"""
    pred = [np.nan, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    true = [float(x) for x in range(10)]
    assert recall_at(pred, true, 0.1) == 1.0 and recall_at(pred, true, 0.3) == 1.0
    assert recall_at([10.0] + pred[1:], [np.nan] + true[1:], 0.1) == 0.0  # the NaN truth is not the longest
