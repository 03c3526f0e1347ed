"""Every JSON line a bench prints is valid JSON (docs/benchmarks.md): an undefined number is
null, and every bench prints through the one helper that makes it so."""
import importlib.util
import json
import math
import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _helper():
    spec = importlib.util.spec_from_file_location("bench_jsonline", BENCH / "jsonline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def test_undefined_numbers_are_null_at_any_depth():
    line = _helper().json_line({"summary": {"fraction_of_oracle": math.nan, "speedup": 1.5,
                                            "xs": [math.inf, 2, (-math.inf, "a")], "ok": True, "n": None}})
    assert "\n" not in line
    assert _strict(line) == {"summary": {"fraction_of_oracle": None, "speedup": 1.5, "xs": [None, 2, [None, "a"]],
                                         "ok": True, "n": None}}


def test_every_bench_prints_json_through_the_helper():
    # a bare json.dumps writes NaN for an undefined ratio (bench/skew_dispatch.py did)
    for f in sorted(BENCH.glob("*.py")):
        if f.name == "jsonline.py":
            continue
        text = f.read_text()
        assert not re.search(r"print\(\s*json\.dumps\(", text), f"{f.name} prints json.dumps: use json_line"
        if "print(json_line(" in text:
            assert re.search(r"^from (bench\.)?jsonline import json_line", text, re.M), f.name
