"""The resolved config a run records (``config.yaml``, wandb) and every rank publishes at start
(``lifecycle.agree_on_config``): the ``topology`` and ``weight_sync`` sections as their keys,
the same in every process, loading back to the same config."""
import os
import subprocess
import sys
import types
from pathlib import Path

import yaml

from controller.config import from_dict, load_config
from controller.run_record import plain, recorded, save_run_config

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGY = {"datacenters": {"east": [0, 1], "west": [2]}, "nodes": {"n0": [0, 1]},
            "bandwidth_gbps": {"inter_dc": 10}, "shaped_links": ["inter_dc", "intra_dc", "intra_node"]}


def test_the_record_holds_the_sections_as_written_and_loads_back(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump({"weight_sync": {"bucket_mb": 8}, "topology": TOPOLOGY,
                                        "logging": {"logdir": str(tmp_path / "run")}}))
    cfg = load_config(cfg_file, 3)
    args = types.SimpleNamespace(resume="", config=str(cfg_file), set=[])
    rec = yaml.safe_load(save_run_config(tmp_path, cfg, args).read_text())["config"]
    assert rec["weight_sync"] == {"bucket_mb": 8.0, "tree_shape": cfg.weight_sync.tree_shape, "naive": False}
    assert rec["topology"] == {"datacenters": {"east": [0, 1], "west": [2]}, "nodes": {"n0": [0, 1]},
                               "bandwidth_gbps": {"intra_node": 1600.0, "intra_dc": 200.0, "inter_dc": 10.0},
                               "shaped_links": ["inter_dc", "intra_dc", "intra_node"], "default_datacenter": "east"}
    again = from_dict(rec, 3)
    assert again.topology == cfg.topology and again.weight_sync == cfg.weight_sync and recorded(again) == rec
    assert again == cfg


def test_the_record_loads_back_to_the_same_config_and_the_trainer_follows_it_again(tmp_path):
    """The record wrote the trainer keys that follow the train section as if set (a --set of
    train.iterations on it left total_steps behind), and with train.epochs both the epochs and
    the iterations it derived (refused as both setting the length; review, s53)."""
    from controller.epochs import with_epochs

    cfg = load_config(ROOT / "configs" / "quickstart.yaml")
    rec = yaml.safe_load(yaml.safe_dump(recorded(cfg)))
    assert from_dict(rec) == cfg and "total_steps" not in rec["trainer"] and "seed" not in rec["trainer"]
    longer = from_dict({**rec, "train": {**rec["train"], "iterations": 200, "seed": 7}})
    assert (longer.trainer.total_steps, longer.trainer.seed) == (200, 7)
    run_cfg, _ = with_epochs(from_dict({"train": {"epochs": 2, "batch_prompts": 4}}), prompts=40)
    args = types.SimpleNamespace(resume="", config="c.yaml", set=[])
    saved = yaml.safe_load(save_run_config(tmp_path, run_cfg, args).read_text())
    assert saved["derived"] == {"train.iterations": 20}
    assert with_epochs(from_dict(saved["config"]), prompts=40)[0] == run_cfg


def test_every_process_resolves_the_same_record():
    """shaped_links was recorded as str(frozenset(...)), in the order of the process's string-hash
    seed: with two or more classes the ranks' digests differed and the job was refused at start
    ("rank 1 resolved another config than rank 0")."""
    code = ("import json; from controller.config import from_dict; from controller.run_record import plain; "
            f"print(json.dumps(plain(from_dict({{'topology': {TOPOLOGY!r}}}, 3)), sort_keys=True))")
    outs = {subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in range(4)}
    assert len(outs) == 1


def test_a_text_that_reads_as_a_float_is_recorded_quoted(tmp_path):
    """``logging.experiment: "1e3"`` was written plain and loaded back as the float 1000.0 (a
    YAML 1.1 dumper beside a loader that reads 1e3 as a float): the record was refused (docs audit, s53)."""
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", 3, ["logging.experiment='1e3'", "task.kwargs.note='.5e3'"])
    args = types.SimpleNamespace(resume="", config="c.yaml", set=[])
    from controller.config_yaml import load_checked

    rec = load_checked(save_run_config(tmp_path, cfg, args).read_text(), "", "config.yaml")["config"]
    back = from_dict(rec, 3)
    assert back.logging.experiment == "1e3" and back.task.kwargs["note"] == ".5e3" and back == cfg


def test_a_users_file_named_like_the_record_is_never_overwritten(tmp_path):
    """A user who keeps the run's config beside its logs (``logging.logdir`` the config's own
    folder) lost it to the record, comments and all, even when the run was then refused at start
    (review, s55). A file of the record's name that the project did not write is refused,
    naming it; a record written earlier is written again (``train.epochs``' re-record)."""
    import pytest

    from controller.config import ConfigError

    mine = tmp_path / "config.yaml"
    mine.write_text("# my hand-tuned experiment\ntrain:\n  iterations: 5\n")
    cfg = load_config(mine, 3)
    args = types.SimpleNamespace(resume="", config=str(mine), set=[])
    with pytest.raises(ConfigError, match=r"logging.logdir: .* holds a config.yaml this project did not write "
                                          r"\(the run's config file\? it is --config\)"):
        save_run_config(tmp_path, cfg, args)
    assert mine.read_text() == "# my hand-tuned experiment\ntrain:\n  iterations: 5\n"
    run = tmp_path / "run"
    run.mkdir()
    first = save_run_config(run, cfg, args)
    assert save_run_config(run, cfg, args, name="config.yaml") == first  # its own record: written again


def test_each_resume_gets_a_record_of_its_own_with_its_overrides(tmp_path):
    """(A second --resume overwrote config.resume1.yaml, which numbers the attempts; the --set
    overrides were not recorded: mutation review, s58.)"""
    cfg = load_config(ROOT / "configs" / "quickstart.yaml")
    args = [types.SimpleNamespace(resume=r, config="c.yaml", set=[f"train.seed={i}"])
            for i, r in enumerate(("", str(tmp_path), str(tmp_path)))]
    names = [save_run_config(tmp_path, cfg, a).name for a in args]
    assert names == ["config.yaml", "config.resume1.yaml", "config.resume2.yaml"]
    recs = [yaml.safe_load((tmp_path / n).read_text()) for n in names]
    assert [r["overrides"] for r in recs] == [["train.seed=0"], ["train.seed=1"], ["train.seed=2"]]
