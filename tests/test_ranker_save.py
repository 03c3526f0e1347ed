"""Where a ranker is saved and predictions are written: nothing but a ranker is ever replaced,
targets that cannot be written are refused before any work, writes are atomic and leave no
temp files, I/O errors are one `error:` line with exit 2."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

import ranker
from ranker import store
from ranker.cli import main
from test_ranker_synth import SMALL_LGBM, synth, write_trace
from workers import atomic

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model():
    return ranker.build("lgbm", **SMALL_LGBM).fit(*synth(200, seed=0))


@pytest.fixture(scope="module")
def other_model():
    return ranker.build("lgbm", **{**SMALL_LGBM, "rounds": 20}).fit(*synth(200, seed=1))


def _probe():
    return synth(20, seed=7)[0]


def _plain_trace(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"question": p}) + "\n" for p in synth(n, seed=0)[0]))
    return path


def _train_args(tmp_path, out) -> list[str]:
    train = write_trace(tmp_path / "s.train.jsonl.gz", 60, seed=0)
    return ["train", "--train", str(train), "--out", str(out), "--config", json.dumps(SMALL_LGBM)]


def test_save_refuses_a_ranker_folder_holding_other_files(model, tmp_path, capsys):
    d = tmp_path / "m"
    model.save(d)
    (d / "notes.txt").write_text("mine")
    (d / "preds").mkdir()
    (d / "preds" / "p.jsonl").write_text("{}")
    with pytest.raises(ValueError, match=r"holds things its saved ranker does not list \(notes.txt, preds/\)"):
        model.save(d)
    # the CLI refuses before reading any data (--train does not exist)
    assert main(["train", "--train", str(tmp_path / "none.jsonl"), "--out", str(d)]) == 2
    assert f"--out {d}: holds things its saved ranker does not list (notes.txt, preds/)" in capsys.readouterr().err
    assert (d / "notes.txt").read_text() == "mine" and (d / "preds" / "p.jsonl").read_text() == "{}"
    # a folder saved without a file list cannot be told apart from the user's files
    (d / "notes.txt").unlink()
    (d / "preds" / "p.jsonl").unlink()
    (d / "preds").rmdir()
    meta = json.loads((d / "meta.json").read_text())
    del meta["files"]
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="saved without a file list"):
        model.save(d)
    assert sorted(os.listdir(tmp_path)) == ["m"]


def test_save_error_is_one_line_exit_2_and_keeps_the_old_model(model, tmp_path):
    """A file size limit (ulimit -f) makes the save fail half-way: the earlier model and nothing
    else stays, and the CLI prints one error line (was: a traceback and rc 1)."""
    out = tmp_path / "o"
    model.save(out)
    before = model.predict(_probe())
    args = _train_args(tmp_path, out)

    def limit():  # 64 kB: lgbm_state.npz is larger
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
    res = subprocess.run([sys.executable, "-m", "ranker", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, preexec_fn=limit, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"error: {out}: cannot save the ranker (File too large)" in res.stderr
    assert "Traceback" not in res.stderr
    assert ranker.load(out).predict(_probe()) == before
    assert sorted(os.listdir(tmp_path)) == ["o", "s.train.jsonl.gz"]


def test_out_that_is_or_holds_the_current_folder_is_refused(tmp_path, monkeypatch, capsys):
    (tmp_path / "e").mkdir()
    monkeypatch.chdir(tmp_path / "e")
    for out in (".", "..", str(tmp_path / "e")):
        assert main(["train", "--train", "none.jsonl", "--out", out]) == 2
        assert f"--out {out}: is the current folder or holds it" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["e"] and not os.listdir(tmp_path / "e")


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs /proc")
def test_out_that_cannot_be_written_is_refused_before_training(tmp_path, capsys):
    # --train does not exist: the --out check must come first
    assert main(["train", "--train", str(tmp_path / "none.jsonl"), "--out", "/proc/ranker_out"]) == 2
    assert "--out /proc/ranker_out: cannot write in /proc" in capsys.readouterr().err
    with pytest.raises(ValueError, match="cannot write in /proc"):
        store.check_target(Path("/proc/a/b"))


def test_save_through_a_symlink_writes_into_its_target(model, other_model, tmp_path):
    tgt, link = tmp_path / "tgt", tmp_path / "lnk"
    model.save(tgt)
    link.symlink_to(tgt)
    other_model.save(link)
    assert link.is_symlink() and os.readlink(link) == str(tgt)
    assert ranker.load(tgt).predict(_probe()) == other_model.predict(_probe())
    assert sorted(os.listdir(tmp_path)) == ["lnk", "tgt"]  # no stray .lnk.tmp* link


def test_interrupted_save_leaves_no_temp_and_stale_temps_are_removed(model, other_model, tmp_path, monkeypatch):
    d = tmp_path / "m"
    model.save(d)

    def interrupted(tmp, folder):
        raise KeyboardInterrupt
    monkeypatch.setattr(atomic, "replace_dir", interrupted)
    with pytest.raises(KeyboardInterrupt):
        other_model.save(d)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["m"]
    assert ranker.load(d).predict(_probe()) == model.predict(_probe())
    # what a killed save (kill -9) leaves: removed by the next save; other names are left alone
    for name in (".m.tmpab_cd123", ".m.tmpzz9", ".mm.tmpabcd1234"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "lgbm.txt").write_text("partial")
    other_model.save(d)
    assert sorted(os.listdir(tmp_path)) == [".m.tmpzz9", ".mm.tmpabcd1234", "m"]
    assert ranker.load(d).predict(_probe()) == other_model.predict(_probe())


# --- predict --output ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(model, tmp_path_factory):
    d = tmp_path_factory.mktemp("model") / "m"
    model.save(d)
    return d


def test_predict_refuses_output_that_is_the_input(model_dir, tmp_path, capsys):
    data = _plain_trace(tmp_path / "t.jsonl", 20)
    before = data.read_bytes()
    (tmp_path / "link.jsonl").symlink_to(data)
    for out in (data, tmp_path / "link.jsonl", tmp_path / "." / "t.jsonl"):
        assert main(["predict", "--model", str(model_dir), "--input", str(data), "--output", str(out)]) == 2
        assert f"--output {out}: is the --input file" in capsys.readouterr().err
    assert data.read_bytes() == before


def test_predict_refuses_output_inside_the_model_folder(model_dir, tmp_path, capsys):
    # predictions written over the model's meta.json: exit 0, and the ranker no longer loaded (review, s54)
    import ranker

    data = _plain_trace(tmp_path / "t.jsonl", 20)
    before = {p.name: p.read_bytes() for p in model_dir.iterdir()}
    for out in (model_dir / "meta.json", model_dir / "preds.jsonl"):
        assert main(["predict", "--model", str(model_dir), "--input", str(data), "--output", str(out)]) == 2
        assert f"--output {out}: is inside the --model folder" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in model_dir.iterdir()} == before
    ranker.load(model_dir)


def test_predict_output_is_replaced_atomically(model_dir, tmp_path):
    """A write that fails half-way (a file size limit) leaves the earlier output as it was, and
    no temp file (was: a truncated file in its place)."""
    data = _plain_trace(tmp_path / "t.jsonl", 200)
    out = tmp_path / "pred.jsonl"
    out.write_text('{"idx": 1, "pred_len": 3.0}\n')

    def limit():  # 4 kB: 200 predictions take ~8 kB
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 10, 4 << 10))
    res = subprocess.run([sys.executable, "-m", "ranker", "predict", "--model", str(model_dir), "--input", str(data),
                          "--output", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         preexec_fn=limit, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"error: --output {out}: cannot write (File too large)" in res.stderr
    assert out.read_text() == '{"idx": 1, "pred_len": 3.0}\n'
    assert sorted(os.listdir(tmp_path)) == ["pred.jsonl", "t.jsonl"]


def test_predict_creates_output_folders_only_when_writing(model_dir, tmp_path, capsys):
    data = _plain_trace(tmp_path / "t.jsonl", 20)
    assert main(["predict", "--model", str(tmp_path / "nope"), "--input", str(data),
                 "--output", str(tmp_path / "side" / "p.jsonl")]) == 2
    assert f"{tmp_path / 'nope'}: does not exist" in capsys.readouterr().err
    assert not (tmp_path / "side").exists()
    assert main(["predict", "--model", str(model_dir), "--input", str(data),
                 "--output", str(tmp_path / "side" / "p.jsonl")]) == 0
    assert len((tmp_path / "side" / "p.jsonl").read_text().splitlines()) == 20
    # a parent that is a file: the message train gives for --out
    out = data / "p.jsonl"
    assert main(["predict", "--model", str(model_dir), "--input", str(data), "--output", str(out)]) == 2
    assert f"--output {out}: cannot create it, {data} is not a folder" in capsys.readouterr().err
    # .gz would promise gzip: refused, nothing written
    assert main(["predict", "--model", str(model_dir), "--input", str(data),
                 "--output", str(tmp_path / "p.jsonl.gz")]) == 2
    assert "not gzip; use a name without .gz" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["side", "t.jsonl"]
