"""Atomic run checkpoints: trainer state (B's format) + controller state, and resume.

Layout under ``<logdir>/checkpoints/``::

    iter_000010/trainer/        TrainerWorker.save_checkpoint (model HF format, optimizer, RNG, version)
    iter_000010/controller.json iteration, weight version, prompt-stream position, mode, rewards,
                                the ranker's rows awaiting its next online update (the RNG states
                                are the trainer's, in trainer/; ``rng`` is always empty)
    iter_000010/ranker/         the length ranker, when it is updated online (ranker.update_every)
    latest                      text file naming the newest complete checkpoint

A checkpoint is written into a temporary folder, fsynced (every file and folder) and renamed
into place (the parent fsynced: the rename is the commit point); ``latest`` is replaced the same
way afterwards, so a crash, even a power loss, leaves the previous checkpoint intact and
``latest`` never names one whose data is not on the disk (a failed save removes its temporary
folder). ``latest`` naming no complete checkpoint (deleted by hand,
damaged) falls back to the newest complete ``iter_*``; a folder with checkpoint files but none
complete is refused, never taken for an empty one. The trainer ranks write to the same
filesystem path (shared storage on several nodes). ``prune`` (``train.ckpt_keep``) deletes
old checkpoints after a save.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from controller.config import ConfigError
from controller.data import StreamState
from workers.atomic import atomic_dir, remove_stale_temps, restore_moved_aside, write_text


class CheckpointError(ConfigError):
    """``--resume`` names a file, or a checkpoint folder holding no complete checkpoint."""


@dataclass
class ControllerState:
    iteration: int  # next iteration to run
    version: int  # weight version the instances hold
    stream: dict  # PromptStream.state_dict()
    mode: str
    rewards: list
    rng: dict  # always {}: no controller RNG state is saved (kept: the runner passes it, old files have it)
    # (prompt, length) rows gathered for the ranker's next online update (ranker.update_every):
    # a resume between two updates keeps them (checkpoints before session 12 have none)
    ranker_rows: list = field(default_factory=list)


def save(ckpt_root: str | Path, state: ControllerState, trainer_save, ranker=None) -> Path:
    """``trainer_save(folder)`` makes trainer rank 0 write its state into ``folder``; ``ranker``
    (one updated online) is saved beside it."""
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(root, r"\.iter_.*\.tmp.*")  # a save killed before it could clean up (kill -9), a failed prune
    restore_moved_aside(root)  # a save killed between the renames of a replacement (no atomic exchange)
    final = root / f"iter_{state.iteration:06d}"
    with atomic_dir(final) as tmp:  # a full disk, a trainer lost mid-save: the temp folder is removed
        trainer_save(str(tmp / "trainer"))
        if ranker is not None:
            ranker.save(tmp / "ranker")
        (tmp / "controller.json").write_text(json.dumps(state.__dict__, indent=1))
    write_text(root / "latest", final.name)
    return final


def iteration_of(ckpt: Path) -> int:
    """``iter_N``'s N (-1 for a name that is not one): checkpoints order by it, not by name
    (``iter_1000000`` sorts before ``iter_999999`` as a string)."""
    tail = Path(ckpt).name[len("iter_"):]
    return int(tail) if Path(ckpt).name.startswith("iter_") and tail.isdigit() else -1


def complete(ckpt_root: str | Path) -> list[Path]:
    """The complete checkpoints under ``ckpt_root``, oldest first (a temporary folder of a save
    that did not finish is ``.iter_*``, never listed)."""
    return sorted((p for p in Path(ckpt_root).glob("iter_*")
                   if iteration_of(p) >= 0 and (p / "controller.json").exists()), key=iteration_of)


def point_latest(ckpt: Path) -> None:
    """Make ``latest`` of ``ckpt``'s folder name it. A run resumed from an older checkpoint of
    its own folder continues that lineage: until its first save ``latest`` would still name the
    abandoned newest one, which a stop's hint and a plain ``--resume RUN`` would then pick."""
    latest = Path(ckpt).parent / "latest"
    if not latest.exists() or latest.read_text().strip() != Path(ckpt).name:
        write_text(latest, Path(ckpt).name)


def find(path: str | Path, say_newer: bool = False) -> Path | None:
    """A checkpoint folder from ``path``: the folder itself, a ``checkpoints/`` root, or a
    run logdir (its ``checkpoints/latest``; when that names no complete checkpoint, the newest
    complete one). None when nothing is there yet; CheckpointError for a file, or for a folder
    whose checkpoints are all incomplete (starting fresh there would write over that run).
    ``say_newer`` (the resume itself): say so when a complete checkpoint newer than the one
    ``latest`` names is there (taken only when asked for by its path)."""
    p = Path(path)
    if p.is_file():
        raise CheckpointError(f"--resume {path}: is a file; give a run folder (logging.logdir) or a checkpoint "
                              "folder (<logdir>/checkpoints/iter_N)")
    if (p / "controller.json").exists():
        return p
    for root in (p, p / "checkpoints"):
        restore_moved_aside(root)  # a checkpoint a killed replacement had moved aside is found again
        latest, done = root / "latest", complete(root)
        if latest.exists():
            c = root / latest.read_text().strip()
            if c != root and (c / "controller.json").exists():
                newer = [d for d in done if iteration_of(d) > iteration_of(c)]
                if newer and say_newer:
                    print(f"[controller] {latest} names {c.name}; {newer[-1].name} is newer and complete (a save "
                          f"stopped between its commit and latest's update, or a lineage abandoned by resuming an "
                          f"older checkpoint); resuming {c.name}: give --resume {newer[-1]} to continue from there",
                          file=sys.stderr, flush=True)
                return c
            if done and (root, c.name) not in _SAID:  # said once per process: find() is asked often
                _SAID.add((root, c.name))
                print(f"[controller] {latest} names {c.name}, which is {'incomplete' if c.exists() else 'missing'}; "
                      f"taking the newest complete checkpoint, {done[-1].name}", file=sys.stderr, flush=True)
        if done:
            return done[-1]
        if latest.exists() or list(root.glob("iter_*")):
            said = f"latest names {latest.read_text().strip()!r}; " if latest.exists() else ""
            raise CheckpointError(f"--resume {path}: {root} holds no complete checkpoint ({said}no "
                                  "iter_*/controller.json there); give one with --resume DIR/checkpoints/iter_N")
    return None


_SAID: set = set()


def previous(ckpt: Path) -> Path | None:
    """The newest complete checkpoint before ``ckpt`` in its folder (to try when it is damaged)."""
    older = [c for c in complete(Path(ckpt).parent) if iteration_of(c) < iteration_of(ckpt)]
    return older[-1] if older else None


def resume_hint(run_folder: str | Path, resume: str = "") -> str:
    """What a stopped run keeps: its last checkpoint (in ``run_folder``, where the run wrote,
    else the one it resumed from) and the ``--resume`` that continues it."""
    try:
        found = find(run_folder) or (find(resume) if resume else None)
    except CheckpointError:  # --resume names a file (refused at start, unless this came first)
        found = None
    return (f"the last checkpoint is {found}: continue with --resume {found}" if found
            else "no checkpoint was written yet (train.ckpt_every)")


def load_state(ckpt: Path) -> ControllerState:
    f = Path(ckpt) / "controller.json"
    try:
        state = ControllerState(**json.loads(f.read_text()))
        state.ranker_rows = [(str(t), float(n)) for t, n in state.ranker_rows]  # JSON gives lists
        StreamState(**state.stream)  # the prompt stream's position: its keys, read when the stream is built
        return state
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{f}: unreadable, the checkpoint is damaged ({e})") from None


def prune(ckpt_root: str | Path, keep: int = 2, protect=()) -> list[Path]:
    """Delete old complete checkpoints; returns those deleted. Kept: the newest ``keep`` (at
    least 1) up to the one ``latest`` names, that one, and any in ``protect`` (the checkpoint a
    ``--resume`` read from). Checkpoints newer than ``latest``'s (a run resumed from an older
    checkpoint into its own folder: the abandoned ones) are neither counted nor deleted; the run
    writes over each when it gets there. A checkpoint is renamed out of the listing first, so a
    deletion that fails half-way leaves no torn ``iter_*``; a failure is one line on stderr and
    the rest goes on (the next save sweeps the leftover)."""
    root = Path(ckpt_root)
    try:
        named = find(root)
    except (CheckpointError, OSError):
        return []
    if named is None or named.parent != root:
        return []
    kept = {p.resolve() for p in protect} | {named.resolve()}
    older = [p for p in complete(root) if iteration_of(p) <= iteration_of(named)]
    deleted = []
    for p in older[:-max(1, keep)]:
        if p.resolve() in kept:
            continue
        gone = root / f".{p.name}.tmp-pruned"  # swept by save's stale-folder clean-up if left
        try:
            os.rename(p, gone)
            shutil.rmtree(gone)
            deleted.append(p)
        except OSError as e:
            print(f"[controller] checkpoint retention: could not delete {p} ({type(e).__name__}: {e}); "
                  "the run goes on", file=sys.stderr, flush=True)
    return deleted
