"""Trackers beside TensorBoard (``logging.trackers``, controller/trackers.py): a real wandb run in
offline mode (no account, no network: the run stays on disk, as on a cluster without internet),
read back from its ``.wandb`` file; the config keys; a tracker that fails mid-run."""
import json
import re
import struct

import pytest

from controller.evaluation import EvalResult
from controller.metrics import Metrics
from controller.program import IterationResult
from controller.trackers import RUN_ID_FILE, Fanout, make_trackers

wandb = pytest.importorskip("wandb", reason="wandb is in the test extra; this environment lacks it")


def _res(i: int, reward: float) -> IterationResult:
    return IterationResult(iteration=i, version=i + 1, gen_version=i, metrics={"reward_mean": reward},
                           num_samples=8, num_tokens=48, gen_seconds=1.0, train_seconds=1.0,
                           iter_seconds=2.0, staleness_max=0, interval_s=1.0)


def _records(path):
    """The records of a ``.wandb`` file: a 7-byte header, then LevelDB's log format (32 KiB blocks
    of [crc32c, length, type] chunks; a record split over blocks is FIRST, MIDDLE..., LAST)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, parts, out = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(parts)
            out.append(rec)
            parts = b""
    return out


def _exits(logdir, runs: int) -> list[int]:
    """The exit codes of the folder's ``runs`` offline runs, in start order. wandb-core (a process
    of its own) may write a run's last records just after ``finish()`` returns: waited for."""
    import time

    for _ in range(600):
        exits = [r.exit.exit_code for f in sorted((logdir / "wandb").glob("offline-run-*/run-*.wandb"))
                 for r in _records(f) if r.WhichOneof("record_type") == "exit"]
        if len(exits) >= runs:
            return exits
        time.sleep(0.1)
    return exits


def _history(logdir):
    """step -> the scalars logged at it, over every offline run of the folder."""
    steps = {}
    for f in sorted((logdir / "wandb").glob("offline-run-*/run-*.wandb")):
        for rec in _records(f):
            if rec.WhichOneof("record_type") == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                steps.setdefault(row["_step"], {}).update({k: v for k, v in row.items() if not k.startswith("_")})
    return steps


def test_every_scalar_reaches_a_wandb_run_and_a_resume_continues_it(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = {"trainer": {"lr": 0.0003}, "logging": {"trackers": ["wandb"]}}
    m = Metrics(tmp_path, timeline_every=0,
                trackers=make_trackers(("wandb",), tmp_path, "streamrl-test", "", config))
    # train.eval_before_train's evaluation (step -1) goes in step 0's row (wandb's first);
    # the one after iteration 0 replaces what both have (eval/mean), not what it lacks (best@2)
    m.log_eval(EvalResult({"eval/mean": 0.1, "eval/best@2": 0.3}, prompts=4, requested=4, split=16,
                          samples=2, seconds=0.1, started=0.0), -1)
    m.log_iteration(_res(0, 0.25), [])
    m.log_eval(EvalResult({"eval/mean": 0.5, "eval/sum": 0.5}, prompts=4, requested=4, split=16,
                          samples=1, seconds=0.2, started=0.0), 0)
    m.log_iteration(_res(1, 0.75), [])
    m.close()
    assert _exits(tmp_path, 1) == [0]
    run_id = (tmp_path / RUN_ID_FILE).read_text().strip()
    steps = _history(tmp_path)
    assert steps[0]["train/reward_mean"] == 0.25 and steps[1]["train/reward_mean"] == 0.75
    assert steps[0]["eval/mean"] == 0.5 and steps[0]["time/eval_s"] == 0.2  # the eval, merged into its step
    assert steps[0]["eval/best@2"] == 0.3 and -1 not in steps
    assert steps[1]["perf/samples_per_s"] == 8.0  # the derived scalars too, as TensorBoard's
    run = next(r.run for f in (tmp_path / "wandb").glob("offline-run-*/run-*.wandb") for r in _records(f)
               if r.WhichOneof("record_type") == "run")
    assert (run.run_id, run.project, run.display_name) == (run_id, "streamrl-test", tmp_path.name)
    assert json.loads({u.key: u.value_json for u in run.config.update}["trainer"]) == {"lr": 0.0003}
    # --resume: the same run id, its steps go on; this attempt stops on an error: the run ends failed.
    # (wandb names an offline folder by the second it started and the id: a second attempt in the
    # same second would write into the first's folder; a resume takes longer than that)
    import time

    time.sleep(1.1)
    m = Metrics(tmp_path, timeline_every=0, trackers=make_trackers(("wandb",), tmp_path, "streamrl-test", "", config))
    m.log_iteration(_res(2, 1.0), [])
    m.close(exit_code=1)
    assert _exits(tmp_path, 2) == [0, 1]
    assert (tmp_path / RUN_ID_FILE).read_text().strip() == run_id
    assert all(f.name == f"run-{run_id}.wandb" for f in (tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert _history(tmp_path)[2]["train/reward_mean"] == 1.0


def test_a_tracker_that_fails_is_said_once_and_dropped(capsys):
    class Broken:
        def __init__(self):
            self.calls = 0

        def log(self, scalars, step):
            self.calls += 1
            raise OSError("disk full")

        def close(self, exit_code=0):
            raise AssertionError("a dropped tracker is not closed")

    broken, kept = Broken(), []

    class Kept:
        def log(self, scalars, step):
            kept.append((step, scalars))

        def close(self, exit_code=0):
            kept.append(("closed", exit_code))

    fan = Fanout([broken, Kept()])
    fan.log({"a": 1.0}, 0)
    fan.log({"a": 2.0}, 1)
    fan.close(exit_code=1)
    assert broken.calls == 1 and kept == [(0, {"a": 1.0}), (1, {"a": 2.0}), ("closed", 1)]
    assert capsys.readouterr().err.count("Broken failed (OSError('disk full'))") == 1


def test_logging_trackers_config(tmp_path, monkeypatch):
    from controller.config import ConfigError, LoggingSection
    import controller.trackers as trackers

    assert LoggingSection(trackers=("console", "wandb")).trackers == ("console", "wandb")
    with pytest.raises(ConfigError, match="logging.project: empty; wandb needs a project name"):
        LoggingSection(trackers=("wandb",), project=" ")
    # wandb not installed (find_spec answering None stands in for an environment without it)
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"logging.trackers: wandb is not installed \(pip install wandb"):
        LoggingSection(trackers=("wandb",))


def test_a_wandb_run_that_cannot_start_is_one_config_error(tmp_path):
    # online, and no API key anywhere: wandb refuses at once. A process of its own: wandb keeps
    # the settings of its first run in a process (the offline test's)
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="online", WANDB_CONFIG_DIR=str(tmp_path / "cfg"), NETRC=str(tmp_path / "netrc"),
               HOME=str(tmp_path), PYTHONPATH=os.getcwd())
    code = ("from pathlib import Path\nfrom controller.trackers import make_trackers\n"
            f"make_trackers(('wandb',), Path({str(tmp_path)!r}), 'p', '', {{}})\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "ConfigError: logging.trackers: wandb could not start a run (UsageError: No API key configured" in out.stderr
    assert "`wandb login` first (or check that this machine reaches the wandb server), or set WANDB_MODE=offline" \
        in out.stderr


@pytest.mark.parametrize("value, said", [
    ("wandb", ("wandb",)), (["console", "wandb"], ("console", "wandb")),
    ("mlflow", "logging.trackers: 'mlflow' is not one of ('tensorboard', 'console', 'wandb')"),
    (["mlflow"], "logging.trackers[0]: 'mlflow' is not one of"),
    (3, "logging.trackers: expected a list or one of ('tensorboard', 'console', 'wandb'), got int 3"),
])
def test_trackers_take_one_name_or_a_list(value, said):
    # verl's trainer.logger takes either; a wrong name is said as the choice it is, not as a type
    from controller.config import ConfigError, from_dict

    if isinstance(said, tuple):
        assert from_dict({"logging": {"trackers": value}}, world_size=3).logging.trackers == said
    else:
        with pytest.raises(ConfigError, match=re.escape(said)):
            from_dict({"logging": {"trackers": value}}, world_size=3)
