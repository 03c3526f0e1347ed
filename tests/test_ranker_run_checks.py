"""A run's ranker.path is checked before any work (controller.ranker_setup.saved_ranker, first thing in controller.session.Session): a saved ranker
is loaded then, so a damaged one is one config error instead of a traceback after the model
bootstrap; a path that cannot take the ranker a run bootstraps is refused before the
bootstrap's generations and fit (they were lost at its save). Plus the config's own checks."""
import json
from types import SimpleNamespace

import pytest

from controller.config import ConfigError, RankerSection
from controller.ranker_setup import run_ranker, saved_ranker
from ranker.store import FORMAT, FORMAT_VERSION
from runtime_helpers import tiny_model  # noqa: F401  (a fixture: the session-wide model folder)
from test_resume import models  # noqa: F401  (a fixture: small model folders and a task)


def _check(path, kind="lgbm"):
    return saved_ranker(SimpleNamespace(ranker=RankerSection(kind=kind, path=str(path))))


def test_an_empty_or_new_folder_takes_the_bootstrapped_ranker(tmp_path):
    assert _check(tmp_path / "new") is None
    (tmp_path / "empty").mkdir()
    assert _check(tmp_path / "empty") is None
    assert not (tmp_path / "new").exists()  # nothing created by the check
    assert _check(tmp_path / "x", kind="none") is None


def test_a_file_or_a_folder_of_other_things_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"ranker.path: .*f: exists and is not a folder"):
        _check(tmp_path / "f")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"ranker.path: .*d: exists and is not a ranker folder"):
        _check(tmp_path / "d")


def test_a_damaged_ranker_folder_is_refused_naming_the_file(tmp_path):
    d = tmp_path / "r"
    d.mkdir()
    (d / "lgbm.txt").write_text("tree\n")
    (d / "meta.json").write_text(json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, "kind": "lgbm",
                                             "files": {"lgbm.txt": "0" * 64}}))
    with pytest.raises(ConfigError, match=r"ranker.path: .*lgbm.txt: checksum mismatch"):
        _check(d)


def test_update_every_without_a_ranker_is_refused():
    with pytest.raises(ConfigError, match=r"ranker.update_every: 2 updates a ranker online, but ranker.kind is 'none'"):
        RankerSection(kind="none", update_every=2)
    assert RankerSection(kind="none", update_every=0).update_every == 0


def test_each_iteration_reports_how_the_estimates_ranked_the_true_lengths():
    # iterations.jsonl / TensorBoard had nothing to tell whether the ranker helps
    import torch

    from controller.ranker_feedback import ranking_quality
    from workers.types import Request

    reqs = [Request(sample_id=i, prompt_ids=torch.tensor([1]), max_tokens=64, est_len=e)
            for i, e in enumerate([10.0, 40.0, 20.0, 30.0])]
    b = SimpleNamespace(requests=reqs)
    q = ranking_quality(b, {0: 5, 1: 50, 2: 20, 3: 40})  # sample_id -> length, as the trainers took them
    assert q["spearman"] == 1.0 and q["kendall_tau"] == 1.0 and q["recall@30"] == 1.0
    assert q["est_mean"] == 25.0 and q["true_mean"] == 28.75
    q = ranking_quality(b, dict.fromkeys(range(4), 16))  # forced lengths: rank undefined
    assert q["spearman"] is None and q["true_mean"] == 16.0


def test_a_bootstrapped_ranker_takes_its_seed_from_the_options(tmp_path):
    # ranker.options.seed passed config validation, then the bootstrap got two "seed"
    # keywords (its prompt-sampling seed and the model's) and the run died with a TypeError
    from test_ranker_synth import SMALL_LGBM, synth

    cfg = SimpleNamespace(ranker=RankerSection(kind="lgbm", path=str(tmp_path / "r"), bootstrap_prompts=40,
                                               options={**SMALL_LGBM, "seed": 7}),
                          train=SimpleNamespace(seed=3, group_size=2, eval_only=False))
    pool, lengths = synth(60, seed=1)
    truth = dict(zip(pool, lengths))
    model = run_ranker(cfg, saved_ranker(cfg), None, lambda ps: [truth[p] for p in ps], pool)
    assert model.cfg.seed == 7 and (tmp_path / "r" / "meta.json").exists()


def test_options_a_loaded_ranker_does_not_hold_are_refused(tmp_path):
    # a saved ranker (and a checkpoint's) keeps its own config: update_rounds 50 / seed 7 in the
    # options ran with its 5 / 0, and nothing said so (review, s54); the same options load it
    from test_ranker_synth import SMALL_LGBM, synth

    import ranker

    pool, lengths = synth(60, seed=1)
    ranker.build("lgbm", **SMALL_LGBM).fit(pool, lengths).save(tmp_path / "r")
    cfg = SimpleNamespace(ranker=RankerSection(kind="lgbm", path=str(tmp_path / "r"), update_every=1,
                                               options={**SMALL_LGBM, "update_rounds": 50, "seed": 7}),
                          train=SimpleNamespace(seed=3, group_size=2, eval_only=False))
    held = ranker.load(tmp_path / "r").cfg
    with pytest.raises(ConfigError, match=rf"^ranker.options: update_rounds: 50 \(it has {held.update_rounds}\), "
                                          rf"seed: 7 \(it has {held.seed}\); the ranker saved at ranker.path"):
        saved_ranker(cfg)
    ckpt = tmp_path / "iter_000002"
    ranker.load(tmp_path / "r").save(ckpt / "ranker")
    with pytest.raises(ConfigError, match=r"update_rounds: 50 .*; the checkpoint's ranker"):
        run_ranker(cfg, None, ckpt, lambda ps: [1.0] * len(ps), pool)
    cfg.ranker = RankerSection(kind="lgbm", path=str(tmp_path / "r"), options=dict(SMALL_LGBM))
    assert saved_ranker(cfg).cfg == held


def test_too_few_bootstrap_prompts_for_the_kind_is_a_config_error(tmp_path):
    # an lgbm ranker fits on >= 2 x min_child_samples (20) pairs: 16 failed with a traceback
    # after the model bootstrap and the engines' start; now said when the config loads
    from controller.config_checks import _check_ranker

    few = RankerSection(kind="lgbm", path=str(tmp_path / "r"), bootstrap_prompts=16)
    with pytest.raises(ConfigError, match=r"ranker.bootstrap_prompts: 16, but a lgbm ranker with these options "
                                          r"fits on at least 20 prompts"):
        _check_ranker(few)
    _check_ranker(RankerSection(kind="lgbm", path=str(tmp_path / "r"), bootstrap_prompts=16,
                                options={"min_child_samples": 8}))
    _check_ranker(RankerSection(kind="lm", path=str(tmp_path / "r"), bootstrap_prompts=2))
    # a train split smaller than the kind needs: said naming the key, before any generation
    cfg = SimpleNamespace(ranker=RankerSection(kind="lgbm", path=str(tmp_path / "r2"), bootstrap_prompts=64),
                          train=SimpleNamespace(seed=0, group_size=2, eval_only=False))
    asked = []
    with pytest.raises(ConfigError, match=r"ranker.bootstrap_prompts: lgbm ranker needs at least 20 \(prompt, "
                                          r"length\) pairs to fit \(12 prompts given"):
        run_ranker(cfg, None, None, lambda ps: asked.extend(ps) or [1.0] * len(ps), [f"p{i}" for i in range(12)])
    assert asked == []


@pytest.mark.slow  # ~60 s on 2 cores (a job, then its refused resume): the CI's slow tier runs it
def test_a_damaged_ranker_in_the_checkpoint_is_refused_before_the_trainers_load_it(tmp_path, tiny_model):  # noqa: F811
    """A checkpoint's online-updated ranker (ranker.update_every) damaged: the resume failed after
    the trainers had loaded the checkpoint, blamed the last ranker --set, and did not offer the
    previous checkpoint as it does for any other damaged file (flows review, s59)."""
    from runtime_helpers import torchrun, write_config  # noqa: F811

    cfg = write_config(tmp_path, tiny_model, train__iterations=2, train__eval_every=0, train__ckpt_every=1,
                       ranker__kind="lgbm", ranker__path=str(tmp_path / "ranker"), ranker__update_every=1,
                       ranker__bootstrap_prompts=24)
    p = torchrun(cfg, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    ckpts = tmp_path / "run" / "checkpoints"
    with open(ckpts / "iter_000002" / "ranker" / "lgbm.txt", "a") as f:
        f.write("x")
    again = torchrun(cfg, extra=["--resume", str(tmp_path / "run"), "--set", "train.iterations=3",
                                 "--set", "ranker.update_every=2"], timeout=300)
    assert again.returncode != 0
    said = [ln for ln in again.stderr.splitlines() if ln.startswith("config error:")]
    assert len(said) == 1 and said[0].startswith(f"config error: --resume {tmp_path / 'run'}: "), said
    assert "lgbm.txt" in said[0] and said[0].endswith(
        f"; the previous checkpoint, {ckpts / 'iter_000001'}, is complete: --resume {ckpts / 'iter_000001'}"), said


def test_a_damaged_ranker_in_the_checkpoint_is_refused_offering_the_previous_one_fast(models, tmp_path):  # noqa: F811
    """Fast twin of the slow-tier job test: the checkpoint's online-updated ranker does not load,
    so the resume is one --resume error offering the previous checkpoint (real checkpoints;
    mutation review, s60: only the slow tier caught the check skipped)."""
    from controller.config import from_dict
    from controller.resume_check import checked_resume
    from test_resume import saved_checkpoints

    small, _, task = models
    root = tmp_path / "run" / "checkpoints"
    saved_checkpoints(root, small, task, (1, 2))
    (root / "iter_000002" / "ranker").mkdir()
    (root / "iter_000002" / "ranker" / "meta.json").write_text("{")  # damaged
    base = from_dict({"placement": {"generation": [1], "trainer": [2]}, "model": {"path": small},
                      "logging": {"logdir": str(tmp_path / "run")}})
    cfg = SimpleNamespace(trainer=base.trainer, ranker=SimpleNamespace(kind="lgbm"))
    with pytest.raises(ConfigError, match=r"ranker/meta.json: not valid JSON.*; the previous checkpoint, "
                                          r".*iter_000001, is complete"):
        checked_resume(str(root), cfg, small)
    found, _ = checked_resume(str(root), SimpleNamespace(trainer=base.trainer, ranker=SimpleNamespace(kind="none")),
                              small)
    assert found.name == "iter_000002"  # a run without a ranker does not read it
