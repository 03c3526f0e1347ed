"""workers/atomic.py: what was saved is the old folder or the new one, never none."""
import os
import shutil

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


def test_write_text_replaces_a_file(tmp_path):
    p = atomic.write_text(tmp_path / "d" / "x.txt", "one")
    atomic.write_text(p, "two")
    assert p.read_text() == "two" and sorted(q.name for q in p.parent.iterdir()) == ["x.txt"]


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
