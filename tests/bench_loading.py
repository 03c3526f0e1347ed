"""Load a bench script as a module (its argument parser, its helpers) and check a refused
command line, for the bench argument tests."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str, monkeypatch):
    """``bench/<name>.py`` as module ``bench_<name>`` (registered: dataclasses look their
    module up in sys.modules); the bench folder on the path for its jsonline / argcheck."""
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)
    return mod


def refused(parse, argv, capsys) -> str:
    """``parse(argv)`` exits 2 (argparse's error) with nothing on stdout; returns stderr's last line."""
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    last = err.strip().splitlines()[-1]
    assert "error:" in last
    return last
