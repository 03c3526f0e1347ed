"""Checks before a run does any work, each one config error naming what is wrong: the run
folder (a fresh start never writes over another run; ``--resume`` continues a run in its own
folder or forks it into an unused one; the folder can be written) and the model folder."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from controller import checkpoint as ckpt
from controller.attempt import is_restart
from controller.config import ConfigError


def check_model_folder(path: Path, init: dict | None = None) -> None:
    """``model.path`` must be a folder this code loads (architecture, config) with a tokenizer,
    or one ``model.init`` (valid ModelConfig fields) builds: said here in one line, before the
    workers build anything, not as tracebacks from the worker ranks loading it."""
    from dataclasses import asdict

    from workers.model import ModelConfig
    from workers.model_check import check_weights
    from workers.tokenizer_folders import _read_json

    cfg = path / "config.json"
    if path.exists() and not path.is_dir():
        raise ConfigError(f"model.path: {path} is a file, not a model folder")
    if not cfg.exists() and init is not None:  # the bootstrap builds the model there
        from workers.config_schema import build_section
        from workers.tokenizer import min_bpe_vocab
        from workers.trainer.bootstrap import TINY

        built = build_section(ModelConfig, "model.init", {**asdict(TINY), **init})  # keys, types, shapes
        if built.vocab_size < min_bpe_vocab():
            raise ConfigError(f"model.init.vocab_size: {built.vocab_size} is below {min_bpe_vocab()}, the least "
                              "the bootstrap's byte-level BPE takes (256 byte symbols + EOS and PAD)")
        # the folder it will be written to: found only when saving, after the whole SFT (review, s51)
        there = next(p for p in (path, *path.parents) if p.exists())
        if not there.is_dir() or not os.access(there, os.W_OK | os.X_OK):
            why = "is a file" if not there.is_dir() else "cannot be written"
            raise ConfigError(f"model.path: {path}: {there} {why}, and model.init builds the model there")
        return
    if not cfg.exists():
        where = "does not exist" if not path.exists() else "holds no config.json"
        raise ConfigError(f"model.path: {path} {where} and model.init is not set (give a Hugging Face model "
                          "folder: config.json, *.safetensors, tokenizer.json; or model.init to build a tiny "
                          "model there)")
    try:
        model_cfg = ModelConfig.from_hf(_read_json(cfg), cfg)
    except (ValueError, KeyError, TypeError) as e:  # (each names config.json)
        raise ConfigError(f"model.path: {e}") from None
    tok = path / "tokenizer.json"
    if not tok.exists():
        raise ConfigError(f"model.path: {path} has no tokenizer.json (a model folder carries its tokenizer, "
                          "as on the Hugging Face hub)")
    try:  # the weights' headers (no tensor read) and the tokenizer, as the workers will load them
        check_weights(path, model_cfg)
    except (ValueError, OSError) as e:
        raise ConfigError(f"model.path: {e}") from None
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(tok))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception naming no file
        raise ConfigError(f"model.path: {tok}: not a tokenizer the tokenizers library reads ({e})") from None


def _holds_run(logdir: Path) -> bool:
    if logdir.is_file():  # (ckpt.find would say it as a --resume problem)
        raise ConfigError(f"logging.logdir: {logdir} is a file; a run writes its logs and checkpoints into a "
                          "folder: give a folder's path (it is created if missing)")
    # (eval.jsonl alone: train.eval_before_train's row of a run that stopped in its first iteration;
    # not the rows of train.eval_only runs, which trained nothing: a run may start there)
    return (ckpt.find(logdir) is not None or (logdir / "iterations.jsonl").exists()
            or any(row.get("source") != "eval_only" for row in _eval_rows(logdir)))


def _other_run(logdir: Path, resume: str) -> Path | None:
    """The run folder holding the checkpoint ``--resume`` names, when it is not ``logdir``."""
    found = ckpt.find(resume) if resume else None
    run = found.parent.parent if found is not None and found.parent.name == "checkpoints" else None
    return None if run is None or run.resolve() == logdir.resolve() else run


def _fork_of(logdir: Path, resume: str) -> bool:
    """``logdir`` was started as a fork of the checkpoint ``resume`` names: its first record is
    a ``--resume`` of that same checkpoint (a fork that stopped before it saved, started again)."""
    import yaml

    first = logdir / "config.resume1.yaml"
    if (logdir / "config.yaml").exists() or not first.exists():
        return False
    try:
        typed = (yaml.safe_load(first.read_text()) or {}).get("resume")
        a, b = ckpt.find(typed) if typed else None, ckpt.find(resume)
    except (OSError, yaml.YAMLError, ckpt.CheckpointError, AttributeError):
        return False
    return a is not None and b is not None and a.resolve() == b.resolve()


def run_logdir(logdir: Path, resume: str) -> Path:
    """Where a run writes. ``--resume`` of a checkpoint of run folder R continues in R when
    ``logging.logdir`` is R, or is another folder already holding a run (writing there would
    interleave two runs' rows, steps and checkpoints); into an unused ``logging.logdir`` it
    forks: R is left as it was. A fork's own folder stays the fork's when the same command is
    run again (it stopped early: its rows are there, no checkpoint yet)."""
    run = _other_run(logdir, resume)
    return run if run is not None and _holds_run(logdir) and not _fork_of(logdir, resume) else logdir


def resumed_logdir(logdir: Path, resume: str) -> Path:
    """``run_logdir``, saying where it writes when that is not the plain case."""
    out, run = run_logdir(logdir, resume), _other_run(logdir, resume)
    if out != logdir:
        print(f"[controller] --resume {resume}: continuing that run in its folder {out} (logging.logdir "
              f"{logdir} holds another run)", file=sys.stderr, flush=True)
    elif run is not None:
        print(f"[controller] --resume {resume}: continuing from {ckpt.find(resume)} in the new folder {logdir} "
              f"({run} is left as it is)", file=sys.stderr, flush=True)
    return out


def refuse_previous_run(logdir: Path, why: str = "") -> None:
    """A new run must not write into a folder holding another run's logs and checkpoints (its
    iterations.jsonl rows, TensorBoard steps and ``latest`` would interleave with this one's)."""
    if not _holds_run(logdir):
        return
    found = ckpt.find(logdir)
    what = f"checkpoints up to {found.name}" if found else "rows in iterations.jsonl / eval.jsonl"
    if is_restart():  # torchrun --max-restarts restarted the job: the folder is this job's own
        raise ConfigError(f"{why}logging.logdir: {logdir} already holds a run ({what}) and this is torchrun's "
                          f"restart of the job, launched without --resume: launch with --resume {logdir} "
                          "so that a restart continues from the last checkpoint (the first start, with no "
                          "checkpoint yet, starts fresh)")
    if found is None:  # rows, no checkpoint: --resume would be refused (nothing to continue from)
        n = _rows(logdir)
        raise ConfigError(f"{why}logging.logdir: {logdir} already holds a run that saved no checkpoint "
                          f"({n} row{'' if n == 1 else 's'} in iterations.jsonl and eval.jsonl), so there is nothing to resume: "
                          "start a new one elsewhere with --set logging.logdir=NEW_DIR (or delete the folder)")
    raise ConfigError(f"{why}logging.logdir: {logdir} already holds a run ({what}); continue it with "
                      f"--resume {logdir}, or start a new one elsewhere with --set logging.logdir=NEW_DIR "
                      f"(or delete the folder)")


WRITE_TEST_BYTES = 1 << 20  # written and synced: an empty file fits even on a full disk


def check_writable(logdir: Path) -> None:
    """Logs and checkpoints go to ``logdir``: one that cannot be written (read-only, no
    permission, full) is said before any work, not as a traceback once the workers are up."""
    import tempfile

    try:
        logdir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=logdir, prefix=".write_test") as f:
            f.write(b"\0" * WRITE_TEST_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise ConfigError(f"logging.logdir: {logdir}: cannot write there ({e.strerror or e})") from None


def lock_run_folder(logdir: Path) -> int:
    """Hold ``logdir/.lock`` (an flock, released when this process ends, however it ends) for
    the run: a second job writing into the same folder (a resume started while the first still
    runs, an orphaned job) would interleave checkpoints, ``latest`` and log rows. Returns the
    lock's file descriptor, to keep open."""
    import fcntl
    import socket

    fd = os.open(logdir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise ConfigError(f"logging.logdir: {logdir} is in use by a running job ({holder}); wait for it to end, "
                          "or stop it, before resuming or writing there") from None
    except OSError:  # a file system without flock (some network mounts): run without the lock
        return fd
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
    return fd


def refuse_fresh_start_over_a_run(logdir: Path, resume: str) -> None:
    """``--resume`` of a path with no checkpoint starts fresh only where that path is
    ``logdir`` and holds no rows yet (the first start of a ``torchrun --max-restarts`` job
    resumes its own, still empty, ``logging.logdir``; a restart of that job may start over its
    own rows), or where it does not exist yet and is no checkpoint's path, and then never over a
    run ``logdir`` holds (its rows, TensorBoard steps, ``iter_*`` folders and ``latest`` would be
    overwritten). An existing folder with no checkpoint (``iter_N/trainer``, a run that never
    saved) or a mistyped checkpoint path (``checkpoints/iter_5``) is refused, naming what is
    there, rather than silently training from scratch."""
    p = Path(resume)
    if ckpt.find(resume) is not None:
        return
    if p.resolve() == logdir.resolve():
        _refuse_restart_over_rows(logdir, resume)
        return
    if p.exists():
        inside = _checkpoint_above(p)
        hint = (f"it is inside the checkpoint {inside}: --resume {inside}" if inside else
                "give a run folder (logging.logdir) or a checkpoint folder (<logdir>/checkpoints/iter_N)")
        raise ConfigError(f"--resume {resume}: no checkpoint there (none in it: no controller.json, "
                          f"checkpoints/ or latest); {hint}")
    hint = _missing_checkpoint_hint(p)
    if hint:
        raise ConfigError(f"--resume {resume}: no checkpoint there (the path does not exist); {hint}")
    refuse_previous_run(logdir, f"--resume {resume}: no checkpoint there (the path does not exist); ")


def _eval_rows(logdir: Path) -> list[dict]:
    """eval.jsonl's rows (a torn or foreign line: a row of unknown source)."""
    try:
        lines = (logdir / "eval.jsonl").read_text(errors="replace").splitlines()
    except OSError:
        return []
    rows = []
    for line in filter(str.strip, lines):
        try:
            row = json.loads(line)
        except ValueError:
            row = {}
        rows.append(row if isinstance(row, dict) else {})
    return rows


def _rows(logdir: Path) -> int:
    """Rows ``logdir``'s iterations.jsonl and eval.jsonl hold (a resume from iteration 0 drops them
    all; not train.eval_only's, which stay)."""
    try:
        n = sum(1 for line in (logdir / "iterations.jsonl").read_text(errors="replace").splitlines() if line.strip())
    except OSError:
        n = 0
    return n + sum(row.get("source") != "eval_only" for row in _eval_rows(logdir))


def _refuse_restart_over_rows(logdir: Path, resume: str) -> None:
    """``--resume`` of a run folder holding rows but no checkpoint (a run stopped before its
    first save) would start at iteration 0 and drop every row: refused, unless this is
    torchrun's restart of the job that wrote them (``--max-restarts``, documented to start over)."""
    rows = _rows(logdir)
    if not rows or is_restart():
        return
    raise ConfigError(f"--resume {resume}: the run folder {logdir} holds no checkpoint to resume from, only {rows} "
                      "logged row(s) (iterations.jsonl, eval.jsonl) of a run that stopped before its first save; "
                      "resuming would start at iteration 0 and drop them. Start a new run elsewhere with --set "
                      "logging.logdir=NEW_DIR and no --resume (train.ckpt_every saves along the way), or delete "
                      "the folder to start over there")


def _checkpoint_above(p: Path) -> Path | None:
    return next((q for q in p.resolve().parents if (q / "controller.json").exists()), None)


def _missing_checkpoint_hint(p: Path) -> str:
    """What a ``--resume`` path that does not exist was likely meant to be, when it is a
    checkpoint's path (a mistyped ``iter_N``, a path inside a checkpoint or run folder); ''
    for a path that names no run (the first start of a ``--max-restarts`` job, a fork's
    folder)."""
    here = next((q for q in p.absolute().parents if q.is_dir()), None)
    if here is None:
        return ""
    inside = (here if (here / "controller.json").exists() else None) or _checkpoint_above(here)
    if inside is not None:
        return f"it is inside the checkpoint {inside}: --resume {inside}"
    try:
        found = ckpt.find(here)
    except ckpt.CheckpointError as e:
        return str(e)
    if found is not None:
        names = [c.name for c in ckpt.complete(found.parent)]
        listed = ", ".join(names[-4:]) + (f" (and {len(names) - 4} older)" if len(names) > 4 else "")
        return (f"{found.parent} holds the checkpoints {listed}: --resume {found} (the latest), or another "
                f"{found.parent}/iter_N of those")
    if (here / "iterations.jsonl").exists():
        return f"{here} holds a run that saved no checkpoint: nothing to resume there"
    if p.name.startswith("iter_") or "checkpoints" in p.parts:
        return ("expected a checkpoint folder (<logdir>/checkpoints/iter_N, holding controller.json) or a run "
                "folder (logging.logdir); give one that exists")
    return ""
