"""Checkpoint retention (``train.ckpt_keep``: the run deletes old checkpoints after each save,
never the one ``latest`` names, the one just written or the one resumed from) and durable
saves (workers/atomic.py fsyncs what it renames into place, and the folder after the rename)."""
import contextlib
import errno
import json
import os
import shutil
import stat
from types import SimpleNamespace

import pytest
import torch

from controller import checkpoint as ckpt
from controller.config import ConfigError, from_dict
from workers import atomic


def _state(it):
    return ckpt.ControllerState(it, it, {"seed": 0, "epoch": 0, "pos": it}, "stream", [0.0] * it, {})


def _trainer_save(folder):
    os.makedirs(f"{folder}/model")
    with open(f"{folder}/model/weights", "w") as f:
        f.write("w")
    with open(f"{folder}/state", "w") as f:
        f.write("s")


def _names(root):
    return sorted(p.name for p in root.glob("iter_*"))


# ---- the config key ----------------------------------------------------------------------------------


def _cfg(train):
    return from_dict({"placement": {"generation": [1], "trainer": [2]}, "train": train}, world_size=3)


def test_ckpt_keep_defaults_to_keeping_every_checkpoint_as_verl():
    assert _cfg({}).train.ckpt_keep is None
    assert _cfg({"ckpt_keep": None}).train.ckpt_keep is None
    assert _cfg({"ckpt_keep": 1}).train.ckpt_keep == 1 and _cfg({"ckpt_keep": 5}).train.ckpt_keep == 5


@pytest.mark.parametrize("bad", [0, -1, "3", 2.5, True])
def test_a_bad_ckpt_keep_is_one_error_naming_the_key(bad):
    with pytest.raises(ConfigError, match=r"^train\.ckpt_keep(: expected int, got| must be an int >= 1)"):
        _cfg({"ckpt_keep": bad})


@pytest.mark.parametrize("key", ["max_actor_ckpt_to_keep", "max_critic_ckpt_to_keep"])
def test_verls_keep_keys_name_ckpt_keep(key):
    with pytest.raises(ConfigError, match=rf"trainer.{key}: unknown key; verl's '{key}' is train.ckpt_keep"):
        from_dict({"trainer": {key: 2}})


# ---- the runner's save (Session.save_checkpoint, no processes) ----------------------------------------


class _Trainer:  # a trainer handle: ``call("save_checkpoint", folder)`` is a call whose wait writes the folder
    def call(self, name, folder):
        assert name == "save_checkpoint"
        done = torch.futures.Future()
        done.set_result(None)
        return SimpleNamespace(wait=lambda cancelled=None: _trainer_save(folder), future=done, method=name,
                               handle=SimpleNamespace(rank=2, role="trainer", name="trainer2"))


def _session(tmp_path, keep, resumed_from=None):
    from controller import session

    s = session.Session.__new__(session.Session)
    s.cfg = SimpleNamespace(train=SimpleNamespace(ckpt_keep=keep), ranker=SimpleNamespace(update_every=0),
                            trainer=SimpleNamespace(shard_optimizer=False))
    s.logdir, s.resumed_from, s.ranker = tmp_path / "run", resumed_from, None
    s.metrics = SimpleNamespace(rewards=[], timed=lambda name, step: contextlib.nullcontext())
    from controller.program import Program

    s.world = SimpleNamespace(trainers=[_Trainer()])
    s.program = Program.__new__(Program)  # its save_trainers (no push in flight), with the state the save reads
    s.program.version, s.program.mode, s.program.ranker_rows, s.program.world = 0, SimpleNamespace(name="stream"), [], \
        s.world
    s.program.stream_state_at = lambda i: {"seed": 0, "pos": i}
    return s


def test_the_run_keeps_the_newest_ckpt_keep_checkpoints(tmp_path):
    s = _session(tmp_path, keep=2)
    root = tmp_path / "run" / "checkpoints"
    for it in (1, 2, 3, 4, 5):
        assert s.save_checkpoint(it) == root / f"iter_{it:06d}"
    assert _names(root) == ["iter_000004", "iter_000005"]
    assert ckpt.find(tmp_path / "run") == root / "iter_000005"
    assert not list(root.glob(".*tmp*"))  # nothing left half-deleted
    s = _session(tmp_path / "all", keep=None)  # the default: every checkpoint is kept
    for it in (1, 2, 3):
        s.save_checkpoint(it)
    assert _names(tmp_path / "all" / "run" / "checkpoints") == ["iter_000001", "iter_000002", "iter_000003"]


def test_resuming_an_older_checkpoint_into_its_run_keeps_it_with_keep_1(tmp_path):
    """A run saved 10..50; it is resumed from iter_30 into the same folder with keep=1. The
    checkpoint resumed from stays for the whole run (another try from it stays possible), the
    one just written (which ``latest`` names) stays, and 40/50 of the abandoned run are neither
    counted nor deleted: the run writes over each when it gets there."""
    root = tmp_path / "run" / "checkpoints"
    for it in (10, 20, 30, 40, 50):
        ckpt.save(root, _state(it), _trainer_save)
    s = _session(tmp_path, keep=1, resumed_from=ckpt.find(root / "iter_000030"))
    s.save_checkpoint(40)
    assert _names(root) == ["iter_000030", "iter_000040", "iter_000050"]
    assert ckpt.find(tmp_path / "run") == root / "iter_000040"
    s.save_checkpoint(50)
    s.save_checkpoint(60)
    assert _names(root) == ["iter_000030", "iter_000060"]
    # the resumed-from checkpoint named through a symlink to the run folder is still that one
    (tmp_path / "link").symlink_to(tmp_path / "run")
    s.resumed_from = tmp_path / "link" / "checkpoints" / "iter_000060"
    s.save_checkpoint(70)
    assert _names(root) == ["iter_000060", "iter_000070"]


def test_the_end_of_a_run_writes_no_second_copy_of_a_checkpoint(tmp_path, monkeypatch):
    """ckpt_every saved iteration 4 and the run ends there, or a finished run is resumed with
    nothing to train: the end of the run names that checkpoint instead of writing it again."""
    s = _session(tmp_path, keep=None)
    s._saved = None
    root = tmp_path / "run" / "checkpoints"
    s.program.iteration = 4
    first = s.save_checkpoint(4)
    writes = []
    monkeypatch.setattr(ckpt, "save", lambda *a, **k: writes.append(a) or first)
    assert s.final_checkpoint() == first and writes == []
    s.program.mode = SimpleNamespace(name="batch")  # a REPL `mode` switch since: the mode it
    assert s.final_checkpoint() == first and writes == []  # records is not read on resume
    # resumed from this run's iter_000004 with nothing to train: no rewrite; from another
    # run's folder (a fork into a new logdir): the new folder gets its own checkpoint
    t = _session(tmp_path, keep=None, resumed_from=first)
    t._saved, t.program.iteration = (4, first), 4
    assert t.final_checkpoint() == first and writes == []
    u = _session(tmp_path / "fork", keep=None, resumed_from=first)
    u._saved, u.program.iteration = (4, first), 4
    u.final_checkpoint()
    assert len(writes) == 1 and root.is_dir()


def test_a_failed_deletion_is_one_line_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    s = _session(tmp_path, keep=1)
    root = tmp_path / "run" / "checkpoints"
    s.save_checkpoint(1)
    real_rmtree = shutil.rmtree

    def busy(path, *a, **k):  # an NFS .nfsXXXX file, a read-only folder: the delete fails half-way
        if ".iter_000001.tmp-pruned" in str(path) and not k.get("ignore_errors"):
            os.unlink(os.path.join(path, "trainer", "state"))  # controller.json still there
            raise OSError(errno.EBUSY, "Device or resource busy", str(path))
        return real_rmtree(path, *a, **k)

    monkeypatch.setattr(shutil, "rmtree", busy)
    assert s.save_checkpoint(2) == root / "iter_000002"
    err = [ln for ln in capsys.readouterr().err.splitlines() if "could not delete" in ln]
    assert len(err) == 1 and "iter_000001" in err[0] and "Device or resource busy" in err[0], err
    assert _names(root) == ["iter_000002"]  # renamed out of the listing first: never taken for a complete one
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    s.save_checkpoint(3)  # the next save sweeps the leftover
    assert sorted(p.name for p in root.iterdir()) == ["iter_000003", "latest"]

    real_rename = os.rename

    def refused(a, b):  # the rename out of the listing refused: the checkpoint stays whole, retried later
        if str(b).endswith(".tmp-pruned"):
            raise PermissionError(errno.EACCES, "Permission denied", str(a))
        return real_rename(a, b)

    monkeypatch.setattr(os, "rename", refused)
    s.save_checkpoint(4)
    err = [ln for ln in capsys.readouterr().err.splitlines() if "could not delete" in ln]
    assert len(err) == 1 and "iter_000003" in err[0] and "Permission denied" in err[0], err
    assert _names(root) == ["iter_000003", "iter_000004"]
    monkeypatch.setattr(os, "rename", real_rename)
    s.save_checkpoint(5)
    assert _names(root) == ["iter_000005"]


def test_prune_never_deletes_latest_nor_what_it_is_told_to_keep(tmp_path):
    root = tmp_path / "checkpoints"
    for it in (2, 4, 6, 8):
        ckpt.save(root, _state(it), _trainer_save)
    atomic.write_text(root / "latest", "iter_000006")  # resumed from 6, not saved again yet
    assert ckpt.prune(root, keep=1, protect=[root / "iter_000002"]) == [root / "iter_000004"]
    assert _names(root) == ["iter_000002", "iter_000006", "iter_000008"]  # 8: after latest, not counted
    ckpt.prune(root, keep=0)  # never none
    assert _names(root) == ["iter_000006", "iter_000008"]


# ---- durability: fsync before the rename, the folder after it -----------------------------------------


@pytest.fixture
def events(monkeypatch):
    """Records ("fsync", path) for every os.fsync, ("rename", src, dst) for every rename."""
    out = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd):
        out.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", lambda a, b: (out.append(("rename", str(a), str(b))), real_rename(a, b))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (out.append(("rename", str(a), str(b))), real_replace(a, b))[1])
    return out


def _index(events, ev):
    assert ev in events, (ev, events)
    return events.index(ev)


def test_a_checkpoint_is_fsynced_before_its_rename_and_its_folder_after(tmp_path, events, monkeypatch):
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc to name the fsynced descriptors")
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)  # every rename is recorded
    root = (tmp_path / "checkpoints").resolve()
    final = ckpt.save(root, _state(2), _trainer_save)
    [(_, tmp, _)] = [e for e in events if e[0] == "rename" and e[2] == str(final)]
    commit = _index(events, ("rename", tmp, str(final)))
    synced = [e[1] for e in events[:commit] if e[0] == "fsync"]
    for rel in ("trainer/model/weights", "trainer/state", "controller.json", "trainer/model", "trainer", ""):
        assert os.path.join(tmp, rel).rstrip("/") in synced, (rel, synced)  # every file and folder
    assert synced.index(f"{tmp}/trainer/model/weights") < synced.index(f"{tmp}/trainer/model") < \
        synced.index(f"{tmp}/trainer") < synced.index(tmp)  # bottom-up
    [(_, latest_tmp, _)] = [e for e in events if e[0] == "rename" and e[2] == str(root / "latest")]
    pointer = _index(events, ("rename", latest_tmp, str(root / "latest")))
    assert commit < events.index(("fsync", str(root)), commit) < _index(events, ("fsync", latest_tmp)) < pointer
    assert ("fsync", str(root)) in events[pointer:]  # latest's rename made durable too
    assert (root / "latest").read_text() == "iter_000002"


@pytest.mark.parametrize("exchange", [True, False])
def test_replace_dir_over_a_folder_syncs_the_parent_before_deleting_the_old_one(tmp_path, events, monkeypatch,
                                                                                exchange):
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    elif not atomic._renameat2():
        pytest.skip("no renameat2 here")
    real_rmtree = shutil.rmtree
    monkeypatch.setattr(shutil, "rmtree", lambda p, **k: (events.append(("rmtree", str(p))), real_rmtree(p, **k)))
    parent = tmp_path.resolve()
    for name, text in (("m", "old"), (".m.tmp", "new")):
        (parent / name).mkdir()
        (parent / name / "f").write_text(text)
    atomic.replace_dir(parent / ".m.tmp", parent / "m")
    assert (parent / "m" / "f").read_text() == "new" and sorted(p.name for p in parent.iterdir()) == ["m"]
    assert _index(events, ("fsync", f"{parent}/.m.tmp/f")) < _index(events, ("fsync", f"{parent}/.m.tmp"))
    [rm] = [i for i, e in enumerate(events) if e[0] == "rmtree"]
    assert ("fsync", str(parent)) in events[:rm]  # the new one is durable before the old one goes


def test_write_text_fsyncs_the_file_then_the_folder(tmp_path, events):
    p = atomic.write_text(tmp_path.resolve() / "d" / "x.txt", "one")
    tmp = f"{p.parent}/.x.txt.tmp{os.getpid()}"
    assert events == [("fsync", tmp), ("rename", tmp, str(p)), ("fsync", str(p.parent))]
    assert p.read_text() == "one"


def test_directory_fsync_refused_by_the_file_system_is_ignored_other_errors_are_not(tmp_path, monkeypatch):
    real_fsync = os.fsync

    def fsync_refusing(code, dirs_only=True):
        def fsync(fd):
            if not dirs_only or stat.S_ISDIR(os.fstat(fd).st_mode):
                raise OSError(code, os.strerror(code))
            real_fsync(fd)
        return fsync

    (tmp_path / ".a.tmp").mkdir()
    (tmp_path / ".a.tmp" / "f").write_text("1")
    for code in (errno.EINVAL, errno.ENOTSUP):  # some network / FUSE file systems
        monkeypatch.setattr(os, "fsync", fsync_refusing(code))
        atomic.write_text(tmp_path / "x.txt", "ok")
        atomic.replace_dir(tmp_path / ".a.tmp", tmp_path / "a")
        (tmp_path / "a").rename(tmp_path / ".a.tmp")
    monkeypatch.setattr(os, "fsync", fsync_refusing(errno.EIO))  # a failing disk is said
    with pytest.raises(OSError, match="Input/output error"):
        atomic.replace_dir(tmp_path / ".a.tmp", tmp_path / "a")
    monkeypatch.setattr(os, "fsync", fsync_refusing(errno.EINVAL, dirs_only=False))  # a file's, never ignored
    with pytest.raises(OSError):
        atomic.write_text(tmp_path / "x.txt", "ok")
    assert (tmp_path / "x.txt").read_text() == "ok" and not list(tmp_path.glob(".x.txt.tmp*"))


def test_the_rows_awaiting_the_rankers_next_update_are_saved(tmp_path):
    """ranker.update_every K: rows gathered since the last online update are in the checkpoint
    (before, a resume between two updates lost them); a checkpoint without them loads as none."""
    s = _session(tmp_path, keep=None)
    s.program.ranker_rows = [("1 + 2 =", 6.0), ("3 + 4 + 5 =", 9.0)]
    saved = s.save_checkpoint(3)
    assert ckpt.load_state(saved).ranker_rows == [("1 + 2 =", 6.0), ("3 + 4 + 5 =", 9.0)]
    old = json.loads((saved / "controller.json").read_text())
    del old["ranker_rows"]
    (saved / "controller.json").write_text(json.dumps(old))
    assert ckpt.load_state(saved).ranker_rows == []


def test_a_newer_complete_checkpoint_than_latest_is_named_not_taken(tmp_path, capsys):
    """A save killed between its rename (the commit) and latest's update leaves iter_3 complete
    and latest on iter_2; the resume takes iter_2 (latest may name an older lineage on purpose:
    point_latest) and says iter_3 is there, with the flag that takes it. Only the resume says
    it: the finds of a run's saves (prune) on a lineage resumed on purpose stay quiet."""
    root = tmp_path / "run" / "checkpoints"
    for it in (1, 2, 3):
        ckpt.save(root, _state(it), _trainer_save)
    (root / "latest").write_text("iter_000002")
    assert ckpt.find(tmp_path / "run", say_newer=True) == root / "iter_000002"
    err = capsys.readouterr().err
    assert "iter_000003 is newer and complete" in err and "resuming iter_000002" in err
    assert f"--resume {root / 'iter_000003'}" in err
    assert ckpt.find(tmp_path / "run") == root / "iter_000002"
    assert capsys.readouterr().err == ""  # not the resume: nothing said
    (root / "latest").write_text("iter_000003")
    assert ckpt.find(tmp_path / "run", say_newer=True) == root / "iter_000003"
    assert capsys.readouterr().err == ""  # nothing newer: nothing said


def test_a_lineage_resumed_on_purpose_is_not_told_of_the_abandoned_one_at_each_save(tmp_path, capsys):
    s = _session(tmp_path, keep=2)
    root = tmp_path / "run" / "checkpoints"
    for it in range(1, 11):
        s.save_checkpoint(it)
    capsys.readouterr()
    ckpt.point_latest(root / "iter_000009")  # --resume RUN/checkpoints/iter_000009 into its own folder
    s = _session(tmp_path, keep=2, resumed_from=root / "iter_000009")
    for it in (9, 10):
        s.save_checkpoint(it)
    assert "newer and complete" not in capsys.readouterr().err


def test_a_failed_push_waited_for_by_the_save_is_the_pushs_failure(tmp_path):
    """The lag-1 modes save while the push runs; the save waits for it first. A push that failed
    was reported as "the checkpoint ... could not be written (N MiB free there)", and the runner
    then skipped naming the gone worker (diff review, s55): it is raised as the push's."""
    import threading

    import pytest

    from controller.rpc import WorkerFailed

    s = _session(tmp_path, keep=None)
    failed = WorkerFailed(3, "generation", "receive_weights", "send 1->3 failed", lost=False)

    def wait(prog):
        raise failed
    s.program._last_push = SimpleNamespace(waiting=SimpleNamespace(cancelled=threading.Event()), wait=wait)
    with pytest.raises(WorkerFailed) as e:
        s.save_checkpoint(4)
    assert e.value is failed
    assert not (tmp_path / "run" / "checkpoints").exists() or not _names(tmp_path / "run" / "checkpoints")
