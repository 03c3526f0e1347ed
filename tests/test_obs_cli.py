"""--help of the planner, two benches and the setup / test scripts: defaults shown, each
tool's own description, and the scripts answer --help instead of installing."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _help(fn, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        fn()
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines at the terminal width


def _bench(name: str, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_planner_help_shows_the_defaults(capsys):
    from controller.planner.__main__ import main

    plan = _help(lambda: main(["plan", "--help"]), capsys)
    for shown in ("samples per iteration (default: 1024)", "(default: 4)", "output length cap (tokens) (default: 20000)",
                  "(default: skew_paper)", "trainer.algorithm simulated (default: ppo)"):
        assert shown in plan, shown
    assert "--cluster CLUSTER planner cluster file" in plan
    assert "(default: None)" not in plan  # required flags have none
    report = _help(lambda: main(["report", "--help"]), capsys)
    assert "(default: 128)" in report and "the cross-datacenter link (Gbit/s) (default: 80.0)" in report


def test_bench_help_describes_each_bench(monkeypatch, capsys):
    probe = _help(lambda: _bench("colocated_probe", monkeypatch).parse_args(["--help"]), capsys)
    assert "Where generation time goes inside the runtime" in probe and "six pipeline modes" not in probe
    tt = _bench("trainer_throughput", monkeypatch)
    monkeypatch.setattr(sys, "argv", ["trainer_throughput.py", "--help"])
    text = _help(tt.main, capsys)
    assert text.count("Trainer micro-batch throughput: packed causal attention") == 1
    assert "--quick batches of 16 and 64 sequences" in text and "(default: 2)" in text


@pytest.mark.parametrize("script, usage", [("setup.sh", "usage: scripts/setup.sh"),
                                           ("test.sh", "usage: scripts/test.sh [PYTEST_ARGS ...]")])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_scripts_answer_help_without_installing(tmp_path, script, usage, flag):
    # was: setup.sh --help ran the pip installs; test.sh --help ran them, then pytest --help
    marker = tmp_path / "ran"
    for tool in ("pip", "python"):
        fake = tmp_path / tool
        fake.write_text(f"#!/bin/sh\necho {tool} \"$@\" >> {marker}\n")
        fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    p = subprocess.run(["bash", str(ROOT / "scripts" / script), flag], env=env, capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.startswith(usage), p.stdout + p.stderr
    assert not marker.exists()
