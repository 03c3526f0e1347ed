"""workers/atomic.py: what was saved is the old folder or the new one, never none."""
import os
import shutil
import zlib

import pytest

from workers import atomic


def _folder(path, text):
    path.mkdir()
    (path / "f").write_text(text)
    return path


def test_replace_dir_swaps_in_one_step_where_linux_allows(tmp_path, monkeypatch):
    if not atomic._renameat2():
        pytest.skip("no renameat2 here: the two-rename fallback is tested below")
    target, new = _folder(tmp_path / "t", "old"), _folder(tmp_path / ".t.tmp", "new")
    # no step may leave the target missing: fail the test if the fallback's renames run
    monkeypatch.setattr(os, "rename", lambda *a: pytest.fail(f"non-atomic rename {a}"))
    removed = []
    monkeypatch.setattr(shutil, "rmtree", lambda p, **kw: removed.append(str(p)))  # a crash before cleanup
    atomic.replace_dir(new, target)
    assert (target / "f").read_text() == "new"
    assert (new / "f").read_text() == "old" and removed == [str(new)]  # the old one, left to delete


def test_replace_dir_fallback_and_fresh_target(tmp_path, monkeypatch):
    atomic.replace_dir(_folder(tmp_path / "a.tmp", "1"), tmp_path / "a")  # no target yet
    assert (tmp_path / "a" / "f").read_text() == "1"
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)  # a platform without renameat2
    atomic.replace_dir(_folder(tmp_path / "a.tmp2", "2"), tmp_path / "a")
    assert (tmp_path / "a" / "f").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # old copy removed


def test_a_replacement_killed_between_its_renames_is_finished_on_the_next_look(tmp_path, monkeypatch):
    from controller import checkpoint

    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)  # the two-rename path
    root = tmp_path / "checkpoints"
    root.mkdir()
    for it, text in ((1, "one"), (2, "two")):
        _folder(root / f"iter_{it:06d}", text)
        (root / f"iter_{it:06d}" / "controller.json").write_text("{}")
    atomic.write_text(root / "latest", "iter_000002")
    renames = []

    def killed_after_one(a, b):  # kill -9 after moving the old copy aside
        if renames:
            raise KeyboardInterrupt
        renames.append((a, b))
        os.replace(a, b)

    monkeypatch.setattr(os, "rename", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        atomic.replace_dir(_folder(root / ".iter_000002.tmpX", "new"), root / "iter_000002")
    monkeypatch.undo()
    assert not (root / "iter_000002").exists()  # only the copy moved aside holds it now
    assert checkpoint.find(tmp_path) == root / "iter_000002"  # put back, found
    assert (root / "iter_000002" / "f").read_text() == "two" and not list(root.glob(".iter_000002.old*"))
    # and one left beside a replacement that did land is deleted
    aside = _folder(root / ".iter_000001.old123", "stale")
    atomic.restore_moved_aside(root)
    assert not aside.exists() and (root / "iter_000001" / "f").read_text() == "one"


def test_write_text_replaces_a_file(tmp_path):
    p = atomic.write_text(tmp_path / "d" / "x.txt", "one")
    atomic.write_text(p, "two")
    assert p.read_text() == "two" and sorted(q.name for q in p.parent.iterdir()) == ["x.txt"]


def test_atomic_dir_replaces_on_success_and_leaves_the_old_folder_on_failure(tmp_path):
    target = _folder(tmp_path / "t", "old")
    with pytest.raises(KeyboardInterrupt):
        with atomic.atomic_dir(target) as tmp:
            assert tmp.parent == tmp_path and tmp.name.startswith(".t.tmp")
            (tmp / "f").write_text("half")
            raise KeyboardInterrupt
    assert (target / "f").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["t"]
    with atomic.atomic_dir(tmp_path / "new" / "t") as tmp:  # the parent is created
        (tmp / "f").write_text("new")
    assert (tmp_path / "new" / "t" / "f").read_text() == "new"
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["t"]


def test_atomic_file_keeps_the_old_file_when_the_write_fails(tmp_path):
    p = atomic.write_text(tmp_path / "x.png", "old")
    with pytest.raises(OSError):
        with atomic.atomic_file(p) as tmp:
            tmp.write_text("half")
            raise OSError("disk full")
    assert p.read_text() == "old" and sorted(q.name for q in tmp_path.iterdir()) == ["x.png"]


def test_remove_stale_temps_removes_only_matching_names(tmp_path):
    for name in (".m.tmpabcd1234", ".m.tmpzz9", "m"):
        _folder(tmp_path / name, "x")
    (tmp_path / ".m.tmpfile0001").write_text("x")
    (tmp_path / ".m.tmplink0001").symlink_to(tmp_path / "m")
    atomic.remove_stale_temps(tmp_path, r"\.m\.tmp[a-z0-9_]{8}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.tmpzz9", "m"]
    assert (tmp_path / "m" / "f").read_text() == "x"  # a link's target is left alone
    atomic.remove_stale_temps(tmp_path / "none", r".*")  # no folder: nothing to do


def test_digests_keep_the_formats_saved_folders_hold(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_bytes(b"hello")
    (tmp_path / "b").write_bytes(b"")
    assert atomic.folder_digests(tmp_path, "crc32") == {"b": "00000000", "d/a": "3610a686"}
    assert atomic.file_digest(tmp_path / "d" / "a", "sha256") == \
        "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"


def test_saved_model_folders_are_readable_as_a_plain_mkdir_makes_them(tmp_path):
    """mkdtemp gives 0o700 and safetensors writes 0o600: a model or checkpoint saved on a shared
    cluster was unreadable to everyone else. Saved trees get the umask's modes."""
    import os
    import stat

    from workers.model import CausalLM, ModelConfig, init_weights, save_pretrained

    old = os.umask(0o022)
    try:
        cfg = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1)
        out = save_pretrained(init_weights(CausalLM(cfg), seed=0), tmp_path / "m", max_shard_bytes=4096)
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()} == {0o644}


def test_a_file_over_one_read_block_has_the_crc_of_all_its_bytes(tmp_path):
    """file_digest reads 16 MiB blocks: every block must feed the running CRC, or a byte changed
    anywhere but in the last block of a model.safetensors (every real model's is larger) passes
    checkpoint.check's CRC comparison."""
    data = bytearray(b"\x5a" * ((1 << 24) + 4096))
    f = tmp_path / "big.bin"
    f.write_bytes(data)
    before = atomic.file_digest(f, "crc32")
    assert before == f"{zlib.crc32(data):08x}"
    data[100] ^= 0xFF  # a flipped byte in the first block
    f.write_bytes(data)
    assert atomic.file_digest(f, "crc32") != before
