"""Experiment trackers beside TensorBoard (``logging.trackers``, verl's ``trainer.logger``): every
scalar the controller writes to TensorBoard (``train/*``, ``perf/*``, ``time/*``, ``eval/*``, ...)
goes to each tracker too, at the same step (the iteration).

* ``wandb``: one Weights & Biases run per run folder, ``logging.project`` / ``logging.experiment``
  (verl's ``project_name`` / ``experiment_name``; the experiment defaults to the folder's name),
  the resolved config as the run's config. Its id is kept in ``<logdir>/wandb_run_id``, so a
  ``--resume`` (or a torchrun restart) continues the same run; steps logged again after a restart
  from an older checkpoint are dropped by wandb (its steps only increase), where TensorBoard
  replaces them; ``train.eval_before_train``'s evaluation (TensorBoard's step -1) is in step 0's
  row, where the one after iteration 0 (``train.eval_every: 1``) replaces it. A run that stops on
  an error ends failed (exit code 1). wandb's files go under
  ``<logdir>/wandb``. ``WANDB_MODE=offline`` keeps the run on disk: clusters without internet;
  each attempt writes an ``offline-run-*`` folder of its own with the same id, and one ``wandb
  sync <logdir>/wandb/offline-run-*`` uploads them as one run, in order of start time.
  ``pip install wandb`` (the ``wandb`` extra).

``tensorboard`` and ``console`` are accepted as verl spells them: TensorBoard and the console
lines are always on. A tracker that fails while the run goes on is said once and dropped.
"""
from __future__ import annotations

import importlib.util
import secrets
import sys
from pathlib import Path
from typing import Literal, Protocol

from workers.atomic import write_text
from workers.config_schema import ConfigError

TrackerName = Literal["tensorboard", "console", "wandb"]  # logging.trackers' names
RUN_ID_FILE = "wandb_run_id"


class Tracker(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self, exit_code: int = 0) -> None: ...


def missing(names) -> str | None:
    """Why ``names`` cannot be tracked here (a tracker's package is not installed), or None."""
    if "wandb" in names and importlib.util.find_spec("wandb") is None:
        return "wandb is not installed (pip install wandb, or the project's wandb extra: pip install -e '.[wandb]')"
    return None


class WandbTracker:
    def __init__(self, logdir: Path, project: str, experiment: str, config: dict):
        import wandb

        id_file = logdir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        write_text(id_file, run_id + "\n")
        try:  # console "off": wandb leaves stdout/stderr alone (the REPL, the progress bar)
            self.run = wandb.init(project=project, name=experiment or logdir.resolve().name, id=run_id,
                                  resume="allow", dir=str(logdir), config=config,
                                  settings=wandb.Settings(console="off"))
        except Exception as e:  # noqa: BLE001 - no API key, no network, a bad project name: one line
            raise ConfigError(f"logging.trackers: wandb could not start a run ({type(e).__name__}: {e}); "
                              "`wandb login` first (or check that this machine reaches the wandb server), or set "
                              "WANDB_MODE=offline to keep the run on disk (`wandb sync` uploads it later)") from None

    def log(self, scalars: dict[str, float], step: int) -> None:
        # wandb's steps start at 0: train.eval_before_train's step -1 goes in step 0's row
        self.run.log(scalars, step=max(step, 0))

    def close(self, exit_code: int = 0) -> None:
        self.run.finish(exit_code=exit_code)  # non-zero: the run shows as failed, not finished


def make_trackers(names, logdir: Path, project: str, experiment: str, config: dict) -> list[Tracker]:
    return [WandbTracker(Path(logdir), project, experiment, config)] if "wandb" in names else []


class Fanout:
    """The trackers, each dropped (said once) at its first failure: a tracker is not worth the run."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = list(trackers)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for t in list(self.trackers):
            try:
                t.log(scalars, step)
            except Exception as e:  # noqa: BLE001 - a tracker's own failure (network, disk): the run goes on
                self.trackers.remove(t)
                print(f"[controller] {type(t).__name__} failed ({e!r}); it logs nothing more, the run goes on",
                      file=sys.stderr, flush=True)

    def close(self, exit_code: int = 0) -> None:
        for t in self.trackers:
            try:
                t.close(exit_code)
            except Exception as e:  # noqa: BLE001 - on the way out: say it, keep the run's own exit
                print(f"[controller] {type(t).__name__} did not close: {e!r}", file=sys.stderr, flush=True)
        self.trackers = []
