"""What a run folder records about how each attempt was started: ``config.yaml`` (the first
start) and ``config.resume<N>.yaml`` (the N-th ``--resume``), each the command line, the YAML
file and ``--set`` overrides as typed, and the config as resolved (every default filled in),
as verl's Hydra writes ``.hydra/config.yaml``. Written atomically before any work."""
from __future__ import annotations

import dataclasses
import shlex
import sys
from pathlib import Path
from typing import Any

from controller.config_yaml import dump

from workers.atomic import write_text
from workers.config_schema import ConfigError, key_fields

HEADER = "# how this attempt was started (controller/run_record.py)\n"


def plain(value: Any) -> Any:
    """``value`` as YAML-safe data: what has a ``to_config`` (the sections built into objects:
    ``topology``, ``weight_sync``) as its section's keys, dataclasses as mappings, tuples as
    lists, anything else that YAML cannot hold as its ``str``."""
    if hasattr(value, "to_config") and not isinstance(value, type):
        return plain(value.to_config())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: plain(getattr(value, name)) for name in key_fields(value)}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def recorded(cfg) -> dict:
    """``plain(cfg)`` as it loads back to ``cfg``: the trainer keys that followed the train
    section (``cfg.follows``) left to follow it again, and with ``train.epochs`` the iterations
    it derived left out (a file may not set both). The record held them, and loaded they were
    refused, or set where the file had not (review, s53)."""
    config = plain(cfg)
    for key in cfg.follows:
        config["trainer"].pop(key, None)
    if cfg.train.epochs is not None:
        config["train"]["iterations"] = None
    return config


def save_run_config(logdir: Path, cfg, args, name: str = "") -> Path:
    """Write this attempt's record into ``logdir``; returns its path. ``name``: the record to
    write again (the config resolved further at start: ``train.epochs``' derived length)."""
    if not name:
        name = "config.yaml"
        if args.resume:
            n = 1
            while (logdir / f"config.resume{n}.yaml").exists():
                n += 1
            name = f"config.resume{n}.yaml"
    path = logdir / name
    if path.exists() and not _is_record(path):
        raise ConfigError(f"logging.logdir: {logdir} holds a {name} this project did not write (the run's "
                          f"config file?{' it is --config' if args.config and _same(path, args.config) else ''}); "
                          f"a run records how it was started in {path}: give another logging.logdir or "
                          "move the file")
    record = {"command": shlex.join(sys.argv), "config_file": args.config, "overrides": list(args.set),
              "resume": args.resume or None, "config": recorded(cfg)}
    if cfg.train.epochs is not None and cfg.train.iterations is not None:  # derived at start: said apart
        record["derived"] = {"train.iterations": cfg.train.iterations}
    return write_text(path, HEADER + dump(record, sort_keys=False))


def _is_record(path: Path) -> bool:
    """``path`` is a record this module wrote (its first line), not a user's file of that name."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline() == HEADER
    except OSError:
        return False


def _same(path: Path, other: str) -> bool:
    try:
        return path.resolve() == Path(other).resolve()
    except OSError:
        return False
