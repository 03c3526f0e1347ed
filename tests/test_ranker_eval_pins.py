"""What `ranker train` / `eval` / `ceiling` report (mutation review, session 57): train fits on
--train only and eval's baselines score the --data rows; the baselines rank as they should; the
noise ceiling's decomposition, oracle and matched q; the bootstrap's seeded draw; recall's tie
rule; a saved folder's file list stays inside it and lists the LightGBM model files, and its
format_version is checked."""
import json
import shutil

import numpy as np
import pytest
from scipy.stats import spearmanr

import ranker
from ranker.baselines import TfidfRidge, prompt_length
from ranker.bootstrap import bootstrap, sample_prompts
from ranker.ceiling import _decompose, noise_ceiling
from ranker.cli import main
from ranker.data import read_traces
from ranker.metrics import ranking_report
from test_ranker_synth import synth, write_trace
from workers.atomic import file_digest

SMALL = {"rounds": 20, "update_rounds": 2, "threads": 1,
         "features": {"space": {"max_columns": 500, "svd_dims": 8, "hash_bits": 14}, "knn_k": 5}}


def test_train_fits_on_the_train_file_only(tmp_path, capsys):
    train = write_trace(tmp_path / "s.train.jsonl.gz", 120, seed=0)
    val = write_trace(tmp_path / "s.val.jsonl.gz", 60, seed=1)
    assert main(["train", "--train", str(train), "--val", str(val), "--out", str(tmp_path / "m"),
                 "--config", json.dumps(SMALL)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    got = ranker.load(tmp_path / "m")
    rows = read_traces(train)
    same = ranker.build("lgbm", **SMALL).fit([x.prompt for x in rows], [x.target for x in rows])
    vp = [x.prompt for x in read_traces(val)]
    np.testing.assert_array_equal(got.predict(vp), same.predict(vp))
    assert len(got.features.mem_y) == summary["train_rows"] == 120
    # eval: each baseline scores the --data rows (the TF-IDF ridge fit on --baseline-train)
    assert main(["eval", "--model", str(tmp_path / "m"), "--data", str(val), "--baseline-train", str(train)]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    vt = [x.target for x in read_traces(val)]
    ridge = TfidfRidge().fit([x.prompt for x in rows], [x.target for x in rows])
    for name, pred in (("model", got.predict(vp)), ("prompt_length", prompt_length(vp)),
                       ("tfidf_ridge", ridge.predict(vp))):
        assert rep[name] == ranking_report(pred, vt), name


def test_tfidf_ridge_ranks_held_out_prompts():
    tr_p, tr_y = synth(300, seed=0)
    va_p, va_y = synth(100, seed=1)
    pred = TfidfRidge().fit(tr_p, tr_y).predict(va_p)
    assert spearmanr(pred, va_y).statistic > 0.6
    # one prompt's prediction does not depend on its neighbours in the list
    np.testing.assert_allclose(TfidfRidge().fit(tr_p, tr_y).predict(va_p[:1]), pred[:1])


def test_prompt_length_is_characters():
    assert prompt_length(["ab cd", "x"]).tolist() == [5.0, 1.0]


def test_the_bootstrap_sample_is_a_seeded_draw_of_the_whole_dataset():
    prompts = [f"p{i}" for i in range(1000)]
    a, b = sample_prompts(prompts, 50, seed=0), sample_prompts(prompts, 50, seed=1)
    assert len(set(a)) == 50 and a != b and a == sample_prompts(prompts, 50, seed=0)
    assert max(int(p[1:]) for p in a) > 500  # not the first 50


def test_recall_in_the_report_counts_picks_tied_at_the_true_cut_as_right():
    """Capped answers tie at the true cut: a pick among them is right (recall_at(pred, true))."""
    pred = [0, 10, 0, 0, 0, 0, 0, 0, 0, 0]
    true = [9, 9, 9, 1, 1, 1, 1, 1, 1, 1]
    assert ranking_report(pred, true)["recall@10"] == 1.0


def test_bootstrap_fits_every_measured_prompt_with_its_own_length_and_seed():
    prompts, lengths = synth(200, seed=3)
    truth = dict(zip(prompts, lengths))
    seen = []

    def generate(ps):
        seen.append(list(ps))
        return [truth[p] for p in ps]

    small = {"rounds": 5, "update_rounds": 2, "min_child_samples": 2, "threads": 1}
    m = bootstrap(generate, prompts, n=41, chunk=16, options=small, sample_seed=1)
    got = [p for c in seen for p in c]
    assert got == sample_prompts(prompts, 41, 1) and got != sample_prompts(prompts, 41, 0)
    np.testing.assert_allclose(m.features.mem_y, np.log1p([truth[p] for p in got]), rtol=1e-6)


def test_location_variance_is_the_spread_minus_the_noise_of_an_n_mean():
    rng = np.random.default_rng(0)
    n = 3
    answers = np.exp(rng.normal(5, 1, size=(400, 1)) + rng.normal(0, 0.6, size=(400, n)))
    logs = np.log1p(answers)
    mu, resid, pools = _decompose(answers, np.array(["t"] * 400))
    noise = np.var(logs, axis=1, ddof=1).mean() / n  # an n-mean's variance from sampling alone
    np.testing.assert_allclose(np.var(mu), np.var(logs.mean(1)) - noise, rtol=1e-9)
    np.testing.assert_allclose(np.mean(mu), np.mean(logs.mean(1)), rtol=1e-12)
    np.testing.assert_allclose((resid ** 2).mean(), np.var(logs, axis=1, ddof=1).mean(), rtol=1e-9)


def test_at_q_one_the_oracle_knows_which_prompts_run_away():
    """Every prompt has the same log-mean; half answer steadily, half spread widely. At q = 1 a
    simulated prompt draws its own residuals, so only the spread ones can run long, and the
    oracle (expected mean under its own residuals) ranks them first: its recall@20 is the share
    of the 100 tied spread prompts it picks, 40/100. Ranking by the pool (or simulating from it)
    gives chance, 0.2."""
    steady = np.full((100, 3), 100.0)
    spread = np.expm1(np.log1p(100.0) + np.array([-1.5, 0.0, 1.5]))[None, :].repeat(100, 0)
    rep = noise_ceiling(np.vstack([steady, spread]), ["t"] * 200, q_grid=(1.0,), repeats=5)
    assert rep["grid"][0]["oracle"] > 0.35, rep["grid"]


def test_the_matched_q_reproduces_the_observed_split_half():
    rng = np.random.default_rng(2)
    loc = rng.normal(5, 1, size=400)
    answers = np.exp(loc[:, None] + rng.normal(0, 0.5, size=(400, 3)) * rng.uniform(0.2, 2, size=(400, 1)))
    rep = noise_ceiling(answers, ["t"] * 400, repeats=5)
    qs, half = [g["q"] for g in rep["grid"]], [g["split_half"] for g in rep["grid"]]
    assert min(half) < rep["observed_split_half"] < max(half), rep  # inside the grid: interpolated
    i = next(j for j in range(len(qs) - 1) if min(half[j:j + 2]) <= rep["observed_split_half"] <= max(half[j:j + 2]))
    at_q = np.interp(rep["matched_q"], qs[i:i + 2], half[i:i + 2])
    assert abs(at_q - rep["observed_split_half"]) < 1e-9, rep


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    prompts = [f"question {i} " + "word " * (i % 7) for i in range(40)]
    r = ranker.build("lgbm", rounds=5, update_rounds=2, min_child_samples=2, threads=1)
    r.fit(prompts, [10.0 + i for i in range(40)])
    root = tmp_path_factory.mktemp("store")
    ranker.save(r, root / "model")
    return root / "model"


def _edit_meta(folder, fn):
    meta = json.loads((folder / "meta.json").read_text())
    fn(meta)
    (folder / "meta.json").write_text(json.dumps(meta))


def test_a_file_list_naming_a_file_outside_the_folder_is_refused(saved, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(saved, d)
    outside = tmp_path / "outside.txt"
    outside.write_text("not the model's")
    _edit_meta(d, lambda m: m["files"].update({"../outside.txt": file_digest(outside, "sha256")}))
    with pytest.raises(ValueError, match="bad file name"):
        ranker.load(d)
    # an absolute path too: it was checksummed outside the folder (mutation review, s60: only
    # ".." was tested)
    _edit_meta(d, lambda m: (m["files"].pop("../outside.txt"),
                             m["files"].update({str(outside): file_digest(outside, "sha256")})))
    with pytest.raises(ValueError, match=rf"bad file name '{outside}' in 'files'"):
        ranker.load(d)


def test_another_format_version_is_refused(saved, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(saved, d)
    _edit_meta(d, lambda m: m.update(format_version=999))
    with pytest.raises(ValueError, match="format_version 999"):
        ranker.load(d)


@pytest.mark.parametrize("name, files", [("lgbm.txt", {}), ("lgbm.txt", "without"), ("lgbm_base.txt", "without")])
def test_a_file_list_that_leaves_out_a_lightgbm_model_is_refused_before_it_is_parsed(saved, tmp_path, name, files):
    """meta.json's 'files' (hand-edited, half copied) that does not list lgbm.txt skipped its
    checksum, and a truncated lgbm.txt then took the whole process down in LightGBM (SIGSEGV;
    ranker review, s60); lgbm_base.txt likewise at the first online update (diff review, s60).
    Loaded in a child process: the old behaviour would kill pytest."""
    import subprocess
    import sys

    d = tmp_path / "m"
    shutil.copytree(saved, d)
    (d / name).write_bytes((d / name).read_bytes()[:len((d / name).read_bytes()) // 2])
    _edit_meta(d, lambda m: m.update(files={} if files == {} else {k: v for k, v in m["files"].items() if k != name}))
    res = subprocess.run([sys.executable, "-c", f"import ranker; ranker.load({str(d)!r})"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, (res.returncode, res.stderr[-500:])
    assert f"ValueError: {d}/meta.json: 'files' does not list {name}, so it cannot be checked" in res.stderr
    # (lgbm_base.txt: the base an online update boosts from, parsed at the first update: SIGABRT)
