"""Atomic run checkpoints: trainer state (B's format) + controller state, and resume.

Layout under ``<logdir>/checkpoints/``::

    iter_000010/trainer/        TrainerWorker.save_checkpoint (model HF format, optimizer, RNG, version)
    iter_000010/controller.json iteration, weight version, prompt-stream position, RNG, mode
    latest                      text file naming the newest complete checkpoint

A checkpoint is written into a temporary folder and renamed into place; ``latest`` is
replaced atomically afterwards, so a crash leaves the previous checkpoint intact. The
trainer ranks write to the same filesystem path (shared storage on several nodes).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from workers.model import replace_dir


@dataclass
class ControllerState:
    iteration: int  # next iteration to run
    version: int  # weight version the instances hold
    stream: dict  # PromptStream.state_dict()
    mode: str
    rewards: list
    rng: dict


def _rng_state() -> dict:
    return {"python": repr(random.getstate()), "numpy": np.random.get_state()[1].tolist()[:4],
            "torch_seed": int(torch.initial_seed())}


def save(ckpt_root: str | Path, state: ControllerState, trainer_save) -> Path:
    """``trainer_save(folder)`` makes trainer rank 0 write its state into ``folder``."""
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"iter_{state.iteration:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp", dir=root))
    trainer_save(str(tmp / "trainer"))
    (tmp / "controller.json").write_text(json.dumps(state.__dict__, indent=1))
    replace_dir(tmp, final)
    latest_tmp = root / ".latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    return final


def find(path: str | Path) -> Path | None:
    """A checkpoint folder from ``path``: the folder itself, a ``checkpoints/`` root, or a
    run logdir (its ``checkpoints/latest``). None when nothing is there yet."""
    p = Path(path)
    if (p / "controller.json").exists():
        return p
    for root in (p, p / "checkpoints"):
        if (root / "latest").exists():
            c = root / (root / "latest").read_text().strip()
            if (c / "controller.json").exists():
                return c
    return None


def load_state(ckpt: Path) -> ControllerState:
    d = json.loads((Path(ckpt) / "controller.json").read_text())
    return ControllerState(**d)


def prune(ckpt_root: str | Path, keep: int = 2) -> None:
    root = Path(ckpt_root)
    done = sorted(p for p in root.glob("iter_*") if (p / "controller.json").exists())
    for p in done[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
