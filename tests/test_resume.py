"""Checkpoints and ``--resume``: what was saved is never lost or written over, and a bad
checkpoint or path is refused with one line naming it (controller/checkpoint.py,
workers/trainer/checkpoint.py, the resume parts of controller/session.py)."""
import errno
import importlib.util
import json
import os
import shutil
import subprocess

import pytest
import torch

from controller import checkpoint as ckpt
from controller.config import ConfigError
from tests.runtime_helpers import iterations, tiny_model, torchrun, write_config  # noqa: F401
from tests.trainer_helpers import synthetic_task, tiny_config, tiny_model_dir
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer import checkpoint as tckpt

torch.set_num_threads(1)


def _state(it):
    return ckpt.ControllerState(it, it, {"seed": 0, "epoch": 0, "pos": it}, "stream", [0.0] * it, {})


def _trainer_save(folder):
    os.makedirs(folder)
    (open(f"{folder}/weights", "w")).write("w")


def _saved(root, *its):
    for it in its:
        ckpt.save(root, _state(it), _trainer_save)
    return root


def test_latest_naming_no_complete_checkpoint_falls_back_to_the_newest_complete(tmp_path):
    """A ``latest`` whose folder was deleted (a roll-back by hand) or is torn made ``find`` return
    None: ``--resume RUN`` then started a fresh run in RUN, dropping its rows and writing over its
    checkpoints."""
    root = _saved(tmp_path / "run" / "checkpoints", 2, 4, 6)
    shutil.rmtree(root / "iter_000006")
    assert ckpt.find(tmp_path / "run") == root / "iter_000004"
    (root / "latest").write_text("")  # torn
    assert ckpt.find(tmp_path / "run") == root / "iter_000004"
    (root / "latest").write_text("iter_000002")  # a valid latest wins over a newer name
    assert ckpt.find(tmp_path / "run") == root / "iter_000002"


def test_a_file_or_a_folder_of_incomplete_checkpoints_is_refused_not_started_fresh(tmp_path):
    (tmp_path / "cfg.yaml").write_text("x: 1")
    with pytest.raises(ConfigError, match="cfg.yaml: is a file"):
        ckpt.find(tmp_path / "cfg.yaml")
    root = _saved(tmp_path / "run" / "checkpoints", 2)
    (root / "iter_000002" / "controller.json").unlink()
    with pytest.raises(ConfigError, match="holds no complete checkpoint"):
        ckpt.find(tmp_path / "run")
    assert ckpt.find(tmp_path / "new") is None and ckpt.find(tmp_path) is None  # nothing there yet: fresh


def test_damaged_controller_json_is_named(tmp_path):
    root = _saved(tmp_path / "checkpoints", 2)
    (root / "iter_000002" / "controller.json").write_text('{"iteration": ')
    with pytest.raises(ConfigError, match=r"iter_000002/controller.json: unreadable"):
        ckpt.load_state(root / "iter_000002")
    state = {"iteration": 2, "version": 2, "stream": {"seed": 0, "epoch": 0, "posx": 2}, "mode": "stream",
             "rewards": [], "rng": {}}
    (root / "iter_000002" / "controller.json").write_text(json.dumps(state))  # the stream's keys: named too
    with pytest.raises(ConfigError, match=r"iter_000002/controller.json: unreadable.*posx"):
        ckpt.load_state(root / "iter_000002")


def test_a_failed_save_keeps_the_previous_checkpoint_and_leaves_no_partial_copy(tmp_path):
    """A full disk mid-save left ``.iter_N.tmpXXX`` behind (with a full disk, each restart's
    failed save added one); a save killed outright (kill -9) leaves one that the next save removes."""
    root = _saved(tmp_path / "checkpoints", 2)

    def full_disk(folder):
        os.makedirs(folder)
        open(f"{folder}/weights", "w").write("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        ckpt.save(root, _state(4), full_disk)
    assert sorted(p.name for p in root.iterdir()) == ["iter_000002", "latest"]
    assert ckpt.find(root) == root / "iter_000002"
    (root / ".iter_000004.tmpdead" / "trainer").mkdir(parents=True)  # a save killed with SIGKILL
    _saved(root, 4)
    assert sorted(p.name for p in root.iterdir()) == ["iter_000002", "iter_000004", "latest"]


def test_prune_keeps_what_latest_names(tmp_path):
    """A checkpoint after the one ``latest`` names (of a run resumed from an older checkpoint into
    its own folder) is neither counted nor deleted: the run writes over it when it gets there.
    (Before, iter_000008 was kept as "the newest" and iter_000006 of the same abandoned run deleted.)"""
    root = _saved(tmp_path / "checkpoints", 2, 4, 6, 8)
    (root / "latest").write_text("iter_000004")  # resumed from an older one, not saved again yet
    ckpt.prune(root, keep=1)
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_000004", "iter_000006", "iter_000008"]
    ckpt.prune(root, keep=0)  # never none
    assert ckpt.find(root) == root / "iter_000004"


def test_the_ranker_is_saved_with_the_checkpoint(tmp_path):
    class Ranker:  # ranker.store.save's contract: a folder written at ``path``
        def save(self, path):
            path.mkdir()
            (path / "meta.json").write_text("{}")

    c = ckpt.save(tmp_path / "checkpoints", _state(2), _trainer_save, Ranker())
    assert (c / "ranker" / "meta.json").exists() and (c / "trainer" / "weights").exists()


def test_a_mistyped_resume_never_starts_fresh_over_the_run_in_logdir(tmp_path):
    """``--resume runs/qiuckstart`` (no such path) with logging.logdir runs/quickstart started a
    fresh run there: its iterations.jsonl rows and TensorBoard steps were dropped, iter_000001...
    and ``latest`` written over."""
    from controller.preflight import refuse_fresh_start_over_a_run

    logdir = tmp_path / "run"
    _saved(logdir / "checkpoints", 2)
    with pytest.raises(ConfigError, match=r"--resume .*typo: no checkpoint there \(the path does not exist\); "
                                          r"logging.logdir: .* already holds a run \(checkpoints up to iter_000002\)"):
        refuse_fresh_start_over_a_run(logdir, str(tmp_path / "typo"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="none in it"):
        refuse_fresh_start_over_a_run(logdir, str(tmp_path / "empty"))
    refuse_fresh_start_over_a_run(logdir, str(logdir))  # resumes it
    refuse_fresh_start_over_a_run(tmp_path / "unused", str(tmp_path / "typo"))  # a first start: fresh
    (tmp_path / "restarted").mkdir()
    (tmp_path / "restarted" / "iterations.jsonl").write_text("")  # crashed before its first checkpoint
    refuse_fresh_start_over_a_run(tmp_path / "restarted", str(tmp_path / "restarted"))


def test_an_existing_folder_with_no_checkpoint_is_refused_not_a_fresh_start(tmp_path):
    """``--resume RUN/checkpoints/iter_N/trainer`` (an easy slip) into an unused logdir printed
    'starting fresh' and trained from scratch."""
    from controller.preflight import refuse_fresh_start_over_a_run

    c = _saved(tmp_path / "run" / "checkpoints", 2) / "iter_000002"
    with pytest.raises(ConfigError, match=r"trainer: no checkpoint there \(none in it.*\); it is inside the "
                                          r"checkpoint .*iter_000002: --resume .*iter_000002$"):
        refuse_fresh_start_over_a_run(tmp_path / "fork", str(c / "trainer"))
    (tmp_path / "other").mkdir()
    with pytest.raises(ConfigError, match="give a run folder"):
        refuse_fresh_start_over_a_run(tmp_path / "fork", str(tmp_path / "other"))


def test_a_fork_started_again_writes_into_its_own_folder(tmp_path):
    """A fork (``--resume R/checkpoints/iter_N`` into an unused F) that stopped before its first
    checkpoint left rows in F; the same command again then went to R, writing over R's
    checkpoints and rows, which a fork promises to leave alone."""
    import yaml

    from controller.preflight import run_logdir

    c = _saved(tmp_path / "R" / "checkpoints", 2, 4) / "iter_000002"
    fork = tmp_path / "F"
    assert run_logdir(fork, str(c)) == fork  # unused: a fork
    fork.mkdir()
    (fork / "config.resume1.yaml").write_text(yaml.safe_dump({"resume": str(c)}))
    (fork / "iterations.jsonl").write_text('{"iteration": 2}\n')
    assert run_logdir(fork, str(c)) == fork  # its own folder, started again (was R)
    assert run_logdir(fork, str(c.parent / "iter_000004")) == tmp_path / "R"  # another checkpoint: R's run
    other = tmp_path / "G"  # a folder holding another run: R continues in R, as before
    other.mkdir()
    (other / "config.yaml").write_text("{}")
    (other / "iterations.jsonl").write_text("")
    assert run_logdir(other, str(c)) == tmp_path / "R"


def test_checkpoints_order_by_iteration_not_by_name(tmp_path):
    root = _saved(tmp_path / "checkpoints", 10, 999999, 1000000)
    assert [p.name for p in ckpt.complete(root)] == ["iter_000010", "iter_999999", "iter_1000000"]
    assert ckpt.previous(root / "iter_1000000") == root / "iter_999999"  # was iter_000010
    (root / "latest").write_text("iter_torn")
    assert ckpt.find(root) == root / "iter_1000000"  # the newest complete one (was iter_999999)
    (root / "iter_notanumber").mkdir()
    assert len(ckpt.complete(root)) == 3


def test_resuming_an_older_checkpoint_points_latest_at_it(tmp_path):
    """Until the resumed run's first save ``latest`` named the abandoned newest checkpoint: a
    stop's hint and ``--resume RUN`` went back to it, across the rows already cut."""
    root = _saved(tmp_path / "checkpoints", 2, 4)
    ckpt.point_latest(root / "iter_000002")
    assert ckpt.find(tmp_path) == root / "iter_000002"
    assert ckpt.resume_hint(tmp_path).endswith(f"--resume {root / 'iter_000002'}")
    assert ckpt.prune(root, keep=1) == []  # the abandoned iter_000004 is not counted or deleted


# ---- the trainer's part -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return (tiny_model_dir(tmp_path_factory), tiny_model_dir(tmp_path_factory, tiny_config(hidden=48)),
            synthetic_task())


@pytest.fixture(scope="module")
def saved(models, tmp_path_factory):
    small, _, task = models
    path = tmp_path_factory.mktemp("ck") / "trainer"
    TrainerWorker(TrainerConfig(lr=1e-3), small, task, device="cpu").save_checkpoint(str(path))
    return path


def test_resume_with_another_lr_or_optimizer_setting_uses_it(models, saved):
    """The optimizer's state_dict carries the saved run's lr, betas, eps and weight decay: a run
    resumed with a lower trainer.lr (or another warmup/critic_lr) kept the old ones, silently."""
    small, _, task = models
    cfg = TrainerConfig(lr=1e-5, betas=(0.8, 0.9), weight_decay=0.1, adam_eps=1e-6, warmup_steps=4, total_steps=8)
    w = TrainerWorker(cfg, small, task, device="cpu")
    w.load_checkpoint(str(saved))
    g = w.optimizer.param_groups[0]
    assert (g["betas"], g["weight_decay"], g["eps"]) == ((0.8, 0.9), 0.1, 1e-6)
    assert w.scheduler.base_lrs == [1e-5] and g["lr"] == pytest.approx(1e-5 / 4)  # warmup step 0 of 4
    assert w.scheduler.get_last_lr() == [g["lr"]]


@pytest.mark.parametrize("damage,msg", [
    ("trainer_state.pt", r"trainer_state.pt: unreadable, the checkpoint is damaged"),
    ("model/model.safetensors", r"model/model.safetensors: unreadable, the checkpoint is damaged"),
    ("model/config.json", r"model/config.json: unreadable, the checkpoint is damaged"),
])
def test_a_truncated_file_is_named(models, saved, tmp_path, damage, msg):
    small, _, task = models
    copy = tmp_path / "trainer"
    shutil.copytree(saved, copy)
    data = (copy / damage).read_bytes()
    (copy / damage).write_bytes(data[:len(data) // 2])
    w = TrainerWorker(TrainerConfig(lr=1e-3), small, task, device="cpu")
    with pytest.raises(ValueError, match=msg):
        w.load_checkpoint(str(copy))


@pytest.mark.parametrize("damage", ["trainer_state.pt", "model/model.safetensors"])
def test_bytes_changed_inside_a_file_are_found(models, saved, tmp_path, damage):
    # a flipped byte in the middle keeps the file's structure: torch.load and safetensors' header
    # take it without a word (one weight silently differed); the CRC-32 written at save does not
    small, _, _ = models
    copy = tmp_path / "trainer"
    shutil.copytree(saved, copy)
    data = bytearray((copy / damage).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / damage).write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{damage}: unreadable, the checkpoint is damaged \(CRC-32 [0-9a-f]{{8}}, "
                                         r"written as [0-9a-f]{8}: its bytes changed since the save\)"):
        tckpt.check(copy, small, "grpo", False)
    tckpt.check(saved, small, "grpo", False)


def test_another_model_or_algorithm_is_named(models, saved):
    small, wide, task = models
    with pytest.raises(ValueError, match=r"another model than this run's model.path .*hidden_size 32 \(this run: 48\)"):
        tckpt.check(saved, wide, "grpo", False)
    with pytest.raises(ValueError, match="checkpoint is for trainer.algorithm 'grpo', this run's is 'ppo'"):
        tckpt.check(saved, small, "ppo", True)
    tckpt.check(saved, small, "grpo", False)
    assert json.loads((saved / "trainer.json").read_text())["algorithm"] == "grpo"


# ---- end to end (torchrun) -----------------------------------------------------------------------------


@pytest.mark.slow
def test_refused_resumes_leave_the_run_as_it_was(tmp_path, tiny_model, monkeypatch):  # noqa: F811
    """A mistyped --resume, a damaged checkpoint and another algorithm each stop with one
    ``config error`` line (rank 0 exits 2); the run's rows and checkpoints are as they were, and
    its wandb run too (the refused start resumed it and left it unfinished: review, s53)."""
    wandb = importlib.util.find_spec("wandb") is not None
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = write_config(tmp_path, tiny_model, train__iterations=2, train__eval_every=0, train__ckpt_every=1,
                       train__ckpt_keep=1, logging__trackers=["wandb"] if wandb else [])
    assert torchrun(cfg).returncode == 0
    run = tmp_path / "run"
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert before == ["iter_000002", "latest"]  # train.ckpt_keep 1: iter_000001 deleted after iter_000002's save
    p = torchrun(cfg, extra=["--resume", str(tmp_path / "rnu")])
    assert p.returncode != 0 and "config error: --resume" in p.stderr and "already holds a run" in p.stderr, \
        p.stderr[-3000:]
    state = run / "checkpoints" / "iter_000002" / "trainer" / "trainer_state.pt"
    good = state.read_bytes()
    state.write_bytes(good[:100])
    p = torchrun(cfg, extra=["--resume", str(run)])
    assert p.returncode != 0 and f"{state}: unreadable, the checkpoint is damaged" in p.stderr, p.stderr[-3000:]
    state.write_bytes(good)
    ppo = write_config(tmp_path, tiny_model, train__iterations=4, train__eval_every=0, trainer__algorithm="ppo")
    p = torchrun(ppo, extra=["--resume", str(run)])
    assert p.returncode != 0 and "checkpoint is for trainer.algorithm 'grpo'" in p.stderr, p.stderr[-3000:]
    assert [r["iteration"] for r in iterations(run)] == [0, 1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    assert subprocess.run(["pgrep", "-f", str(cfg)], capture_output=True).returncode == 1
    if wandb:  # the first run's wandb run only: no refused start began one
        assert len(list((run / "wandb").glob("offline-run-*"))) == 1


def test_an_unwritable_logdir_is_said_before_any_work(tmp_path):
    """A read-only logging.logdir failed with a traceback from Metrics once every worker was up."""
    from controller.preflight import check_writable

    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"logging.logdir: .*file/run: cannot write there"):
        check_writable(tmp_path / "file" / "run")
    check_writable(tmp_path / "new" / "run")
    assert list((tmp_path / "new" / "run").iterdir()) == []


def test_a_torchrun_restart_without_resume_says_to_launch_with_resume(tmp_path, monkeypatch):
    """torchrun --max-restarts restarts the job with its first command line: without --resume
    the restart found its own run folder and was refused like a second job would be."""
    from controller.preflight import refuse_previous_run

    logdir = tmp_path / "run"
    _saved(logdir / "checkpoints", 2)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(ConfigError, match=r"already holds a run \(checkpoints up to iter_000002\) and this is "
                                          r"torchrun's restart of the job, launched without --resume: launch with "
                                          rf"--resume {logdir} so that"):
        refuse_previous_run(logdir)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with pytest.raises(ConfigError, match=r"continue it with --resume"):
        refuse_previous_run(logdir)


def _session(cfg, resume, model_dir, logdir):
    """A Session far enough for ``_resume``: its config, --resume, and one trainer rank in this
    process that loads nothing (the controller's part is under test)."""
    from types import SimpleNamespace

    from controller.rpc import WorkerHandle
    from controller.session import Session
    from runtime_helpers import LocalRRef

    class Trainer:
        def __init__(self):
            self.dropped = []

        def load_checkpoint(self, folder):
            return 7

        def drop_rollouts_from(self, iteration):  # the lineage goes on from `iteration`
            self.dropped.append(iteration)
            return 0

    s = Session.__new__(Session)
    s.cfg, s.model_dir, s.logdir = cfg, model_dir, logdir
    s.args = SimpleNamespace(resume=str(resume), repl=False)
    s.world = SimpleNamespace(trainers=[WorkerHandle(2, "trainer", LocalRRef(Trainer()))], push_weights=lambda v: [])
    return s


def saved_checkpoints(root, model_dir, task, iterations) -> None:
    """Real checkpoints of a grpo trainer under ``root``, one per iteration in ``iterations``."""
    w = TrainerWorker(TrainerConfig(algorithm="grpo"), model_dir, task, device="cpu")
    for it in iterations:
        ckpt.save(root, ckpt.ControllerState(it, it, {"seed": 0, "epoch": 0, "pos": it}, "batch", [0.0] * it, {}),
                  lambda folder: w.save_checkpoint(folder))

def test_a_config_mismatch_offers_no_previous_checkpoint_and_a_no_op_resume_leaves_latest(models, tmp_path):
    """(1) Another trainer.algorithm was refused with "the previous checkpoint ... is complete:
    --resume it", which every checkpoint of the run refuses the same way; a damaged one still
    gets the hint. (2) A resume of an older checkpoint that trains nothing (train.iterations
    reached) pointed latest at it: the next plain --resume went back there and wrote over the
    newer one (review, session 52)."""
    from controller.config import from_dict

    small, _, task = models
    root = tmp_path / "run" / "checkpoints"
    saved_checkpoints(root, small, task, (2, 4))
    base = {"placement": {"generation": [1], "trainer": [2]}, "model": {"path": small},
            "logging": {"logdir": str(tmp_path / "run")}}

    def cfg(**over):
        return from_dict({**base, "train": {"iterations": over.pop("iterations", 8)}, "trainer": over})

    with pytest.raises(ConfigError) as e:
        _session(cfg(algorithm="rloo"), tmp_path / "run", small, tmp_path / "run")._resume()
    assert "checkpoint is for trainer.algorithm 'grpo', this run's is 'rloo'" in str(e.value)
    assert "the previous checkpoint" not in str(e.value)
    state = root / "iter_000004" / "trainer" / "trainer_state.pt"
    good = state.read_bytes()
    state.write_bytes(good[:100])
    with pytest.raises(ConfigError, match=r"unreadable, the checkpoint is damaged .*; the previous checkpoint, "
                                          r".*iter_000002, is complete: --resume .*iter_000002"):
        _session(cfg(), tmp_path / "run", small, tmp_path / "run")._resume()
    state.write_bytes(good)
    assert (root / "latest").read_text().strip() == "iter_000004"
    done = _session(cfg(iterations=2), root / "iter_000002", small, tmp_path / "run")._resume()
    assert done.iteration == 2 and (root / "latest").read_text().strip() == "iter_000004"  # nothing trained
    console = _session(cfg(iterations=6), root / "iter_000002", small, tmp_path / "run")
    console.args.repl = True
    console._resume()  # a console that only inspects (status, eval) leaves the lineage as it was (review, s57)
    assert (root / "latest").read_text().strip() == "iter_000004"
    console.continue_lineage()  # its first `run`: the trainers drop the rollout files from iteration 2 on
    assert (root / "latest").read_text().strip() == "iter_000002"
    assert console.world.trainers[0].rref.obj.dropped == [2]
    ckpt.point_latest(root / "iter_000004")
    _session(cfg(iterations=6), root / "iter_000002", small, tmp_path / "run")._resume()
    assert (root / "latest").read_text().strip() == "iter_000002"  # this run continues from there
