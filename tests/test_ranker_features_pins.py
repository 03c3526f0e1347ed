"""The ranker's feature columns (mutation review, session 57: every label leak planted in the
training features passed the suite): a training row's stacking columns never see its own label
and its neighbours come from the other folds, also past the first neighbour-search block; the
neighbour memory keeps each row's sizes with its label; knn_top1 is the most similar row's;
"long" is the top fifth; each text-statistics column holds what its name says; TF-IDF is
sublinear and weighs a rare word above a common one."""
import numpy as np

from ranker.features import _KNN_NAMES, _N_SIZE, FeatureBuilder, FeatureConfig
from ranker.textspace import SpaceConfig, TextSpace
from ranker.textstats import STAT_NAMES, text_stats

PROMPTS = [f"question number {i} about {w}" for i, w in enumerate(["apples", "cars", "math", "dogs", "rain"] * 4)]
RIDGE = len(STAT_NAMES)                                   # the ridge column
TOP1 = RIDGE + 1 + _KNN_NAMES.index("knn_top1")           # the nearest neighbour's label


def _builder(**kw):
    return FeatureBuilder(FeatureConfig(space=SpaceConfig(svd_dims=4, max_columns=64), **kw))


def test_training_rows_neighbours_come_from_the_other_folds(monkeypatch):
    """With knn_folds >= 2 (the default 5) and enough rows, each training row's nearest neighbour
    is a row of another fold; _CHUNK = 4 puts the rows in several search blocks (2,048 in a run)."""
    import ranker.features as F

    monkeypatch.setattr(F, "_CHUNK", 4)
    y = np.arange(20, dtype=np.float32)  # distinct labels: a label names its row
    b = _builder(knn_folds=2, knn_k=3)
    x = b.fit_transform(PROMPTS, y)
    folds = b._train_folds(len(y))
    assert folds is not None  # 20 rows >= 2 * 2 folds: out-of-fold, not leave-one-out
    for i, top1 in enumerate(x[:, TOP1]):
        j = int(np.flatnonzero(y == top1)[0])
        assert folds[j] != folds[i], f"row {i}'s nearest neighbour {j} is in its own fold"


def test_a_training_rows_stacking_columns_do_not_depend_on_its_own_label():
    """Ridge (K folds) and neighbour columns are out-of-fold: lowering the smallest label (the
    0.8 quantile, and so knn_frac_long, stay the same) leaves that row's columns unchanged."""
    rng = np.random.default_rng(0)
    y = rng.uniform(1, 6, 20).astype(np.float32)
    lo = int(np.argmin(y))
    y2 = y.copy()
    y2[lo] -= 0.9
    a = _builder().fit_transform(PROMPTS, y)
    b = _builder().fit_transform(PROMPTS, y2)
    np.testing.assert_array_equal(a[lo], b[lo])
    assert not np.array_equal(a, b)  # the label did change other rows' columns


def test_the_memory_keeps_each_rows_sizes_with_its_label():
    """Past max_memory the kept rows' sizes (rel_* columns compare against them) are those of
    the kept rows, not of the oldest ones."""
    from ranker.textstats import text_stats

    b = _builder(max_memory=20)
    b.fit_transform(PROMPTS, np.arange(20, dtype=np.float32))
    new = ["a much longer new prompt " * 20, "short", "Sort 5, 3, 9, 1, 7, 2 in order"]
    b.add_memory(new, np.array([100.0, 101.0, 102.0], dtype=np.float32))
    assert len(b.mem_s) == len(b.mem_y) == len(b.mem_z) == 20
    np.testing.assert_allclose(b.mem_s[-3:], np.log1p(text_stats(new)[:, :b.mem_s.shape[1]]), rtol=1e-6)


def test_knn_top1_is_the_most_similar_rows_label():
    """A prompt that is in the memory verbatim has similarity 1 to it: knn_sim_top1 is that
    best similarity and knn_top1 the label of a row that has it (not of the k-th neighbour)."""
    b = _builder(knn_k=5)
    y = np.arange(20, dtype=np.float32)
    b.fit_transform(PROMPTS, y)
    x = b.transform([PROMPTS[7]])
    sims = b.mem_z.astype(np.float64) @ b.space.dense(b.space.sparse([PROMPTS[7]]))[0].astype(np.float64)
    sim1 = RIDGE + 1 + _KNN_NAMES.index("knn_sim_top1")
    assert abs(x[0, sim1] - sims.max()) < 1e-5 and sims.max() > 1 - 1e-5
    assert sims[int(x[0, TOP1])] > sims.max() - 1e-5
    assert x[0, sim1] > np.sort(sims)[-5] + 1e-3  # the 5th best is clearly less similar


def test_long_means_the_top_fifth_of_training_lengths():
    """knn_frac_long counts neighbours above the LONG_QUANTILE (0.8) of the training labels."""
    y = np.arange(20, dtype=np.float32)
    b = _builder(knn_k=20, knn_folds=0)
    b.fit_transform(PROMPTS, y)
    x = b.transform(["something unrelated"])
    frac = RIDGE + 1 + _KNN_NAMES.index("knn_frac_long")
    assert b.long_log_y == np.quantile(y, 0.8) and x[0, frac] == np.float32(4 / 20)


def test_columns_hold_what_their_names_say():
    text = "Sort the list: 12, -345, 6\n\n1 2 3\n4 5 6\nab cde fgh ijk"  # the last: no grid row
    row = dict(zip(STAT_NAMES, text_stats([text])[0]))
    assert row["chars"] == len(text) and row["lines"] == 5 and row["nonblank_lines"] == 4
    assert row["numbers"] == 9 and row["max_digits"] == 3 and row["commas"] == 2
    assert row["grid_lines"] == 2 and row["grid_cells"] == 6
    assert row["kw_sort"] == 1 and row["kw_list"] == 1 and row["kw_matrix"] == 0
    assert all(not n.startswith("kw_") for n in STAT_NAMES[:_N_SIZE])


def test_keywords_are_counted_and_rows_follow_the_prompts():
    a, b = "sort sort sort", "abc zzz"
    s = text_stats([a, b])
    k = STAT_NAMES.index("kw_sort")
    assert s[0, k] == 3 and s[1, k] == 0
    np.testing.assert_array_equal(s, np.vstack([text_stats([a]), text_stats([b])]))


def _pos(space, word):
    """The kept column of ``word``'s word unigram (word columns follow the 2**bits char ones)."""
    col = 2 ** space.cfg.hash_bits + space._word.transform([word]).indices[0]
    pos = int(np.searchsorted(space.columns, col))
    assert space.columns[pos] == col
    return pos


def test_tfidf_weights_are_sublinear_and_rare_words_weigh_more():
    prompts = [f"common thing {i}" for i in range(9)] + ["common rare thing"]
    s = TextSpace(SpaceConfig(svd_dims=2, hash_bits=16))
    s.fit(prompts)
    common, rare = _pos(s, "common"), _pos(s, "rare")
    assert s.idf[rare] > s.idf[common]
    row = s.sparse(["rare rare rare rare common"]).toarray()[0]
    assert np.isclose(row[rare] / row[common],
                      np.log1p(4) * s.idf[rare] / (np.log1p(1) * s.idf[common]), rtol=1e-5)
