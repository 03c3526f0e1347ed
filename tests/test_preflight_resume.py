"""``--resume`` paths that hold no checkpoint (controller/preflight.py): a run folder with rows
but no checkpoint, and a mistyped or deeper checkpoint path, are refused naming what is there,
never started from iteration 0 over the rows or silently trained from scratch elsewhere."""
import os

import pytest

from controller import checkpoint as ckpt
from controller.config import ConfigError
from controller.preflight import refuse_fresh_start_over_a_run, resumed_logdir


def _state(it):
    return ckpt.ControllerState(it, it, {"seed": 0, "epoch": 0, "pos": it}, "stream", [0.0] * it, {})


def _trainer_save(folder):
    os.makedirs(folder)
    with open(f"{folder}/weights", "w") as f:
        f.write("w")


def _run(folder, *its, rows=0):
    """A run folder with checkpoints ``its`` and ``rows`` rows of iterations.jsonl."""
    folder.mkdir(parents=True, exist_ok=True)
    for it in its:
        ckpt.save(folder / "checkpoints", _state(it), _trainer_save)
    (folder / "iterations.jsonl").write_text("".join(f'{{"iteration": {i}}}\n' for i in range(rows)))
    return folder


def _resume(logdir, resume):
    """What the session does first with ``--resume`` (controller/session.py)."""
    out = resumed_logdir(logdir, str(resume))
    refuse_fresh_start_over_a_run(out, str(resume))
    return out


def test_resuming_a_run_folder_with_rows_but_no_checkpoint_is_refused(tmp_path, monkeypatch):
    """``--resume runs/quickstart`` of a run stopped before its first save started at iteration
    0 and dropped its iterations.jsonl rows (Metrics drops rows from the first step on)."""
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    run = _run(tmp_path / "quickstart", rows=7)
    (run / "eval.jsonl").write_text('{"iteration": 5}\n')
    with pytest.raises(ConfigError, match=rf"^--resume {run}: the run folder {run} holds no checkpoint to resume "
                                          r"from, only 8 logged row\(s\).*drop them. Start a new run elsewhere with "
                                          r"--set logging.logdir=NEW_DIR and no --resume"):
        _resume(run, run)
    assert len((run / "iterations.jsonl").read_text().splitlines()) == 7
    # the first start of a torchrun --max-restarts job: its folder is empty, or has no rows yet
    _resume(_run(tmp_path / "first"), tmp_path / "first")
    _resume(tmp_path / "not_yet", tmp_path / "not_yet")
    # a restart of that job starts over its own rows (README: it starts fresh while DIR holds no checkpoint)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    _resume(run, run)


def test_a_run_folder_with_a_checkpoint_resumes(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    run = _run(tmp_path / "run", 2, rows=3)
    assert _resume(run, run) == run


@pytest.mark.parametrize("typo", ["checkpoints/iter_5", "checkpoints/iter_000009", "chekpoints/iter_000002",
                                  "checkpoints/latest/x"])
def test_a_mistyped_checkpoint_path_is_refused_not_trained_from_scratch_elsewhere(tmp_path, typo):
    """``--resume RUN/checkpoints/iter_5`` (the folder is iter_000005) with an unused
    logging.logdir printed 'starting fresh' and trained from scratch into that new folder."""
    run = _run(tmp_path / "run", 2, 4, rows=4)
    fresh = tmp_path / "fresh"
    with pytest.raises(ConfigError, match=rf"^--resume {run}/{typo}: no checkpoint there \(the path does not "
                                          rf"exist\); {run}/checkpoints holds the checkpoints iter_000002, "
                                          rf"iter_000004: --resume {run}/checkpoints/iter_000004 \(the latest\)"):
        _resume(fresh, run / typo)
    assert not fresh.exists()


def test_a_path_inside_a_checkpoint_or_a_checkpoint_shaped_path_is_refused(tmp_path):
    run = _run(tmp_path / "run", 2)
    c = run / "checkpoints" / "iter_000002"
    with pytest.raises(ConfigError, match=rf"the path does not exist\); it is inside the checkpoint {c}: --resume {c}$"):
        _resume(tmp_path / "fresh", c / "trainer" / "wieghts")
    with pytest.raises(ConfigError, match=r"the path does not exist\); expected a checkpoint folder "
                                          r"\(<logdir>/checkpoints/iter_N, holding controller.json\)"):
        _resume(tmp_path / "fresh", tmp_path / "elsewhere" / "checkpoints" / "iter_000002")
    saved_nothing = _run(tmp_path / "nosave", rows=2)
    with pytest.raises(ConfigError, match=rf"{saved_nothing} holds a run that saved no checkpoint"):
        _resume(tmp_path / "fresh", saved_nothing / "checkpoints" / "iter_000001")
    _resume(tmp_path / "fresh", tmp_path / "fresh_typo")  # names no run: a first start, as before


def test_a_logdir_that_is_a_file_is_said_as_logging_logdir(tmp_path):
    from controller.preflight import refuse_previous_run

    f = tmp_path / "run.sh"
    f.write_text("#!/bin/sh\n")
    with pytest.raises(ConfigError, match=rf"^logging.logdir: {f} is a file; a run writes its logs and checkpoints "
                                          r"into a folder"):
        refuse_previous_run(f)  # was "--resume ...: is a file", with no --resume given


def test_a_folder_with_rows_and_no_checkpoint_is_not_told_to_resume(tmp_path):
    # the hint said "continue it with --resume", which is then refused (nothing to resume)
    from controller.preflight import refuse_previous_run

    run = _run(tmp_path / "r", rows=1)
    with pytest.raises(ConfigError) as e:
        refuse_previous_run(run)
    assert str(e.value) == (f"logging.logdir: {run} already holds a run that saved no checkpoint (1 row in "
                            "iterations.jsonl and eval.jsonl), so there is nothing to resume: start a new one "
                            "elsewhere with --set logging.logdir=NEW_DIR (or delete the folder)")
    with pytest.raises(ConfigError, match=r"already holds a run \(checkpoints up to iter_000002\); continue it "
                                          r"with --resume"):
        refuse_previous_run(_run(tmp_path / "s", 2, rows=2))
    # train.eval_before_train's row alone (a run that stopped in its first iteration) is a run too
    only_eval = tmp_path / "e"
    only_eval.mkdir()
    (only_eval / "eval.jsonl").write_text('{"iteration": -1, "eval/mean": 0.5}\n')
    with pytest.raises(ConfigError, match=r"already holds a run that saved no checkpoint \(1 row in"):
        refuse_previous_run(only_eval)
