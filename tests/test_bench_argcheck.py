"""bench/argcheck.py's argument types (mutation review, s59): bounds taken, 0 refused, an empty names list refused."""
import argparse
from pathlib import Path
import pytest


BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_the_bench_argument_types_take_their_bounds_and_refuse_an_empty_list(monkeypatch):
    """bench/argcheck.py: ``int_at_least(low)`` takes ``low`` itself (``--repeats 1``,
    ``--seed 0``), ``positive_float`` refuses 0 (its contract: > 0), and
    a names list with no name (``--workloads ,``) is refused, not run as no work."""
    monkeypatch.syspath_prepend(str(BENCH))
    import argcheck

    assert argcheck.positive_int("1") == 1 and argcheck.non_negative_int("0") == 0
    assert argcheck.int_at_least(2)("2") == 2
    assert argcheck.positive_float("0.001") == 0.001
    for bad in ("0", "-0.0", "nan"):
        with pytest.raises(argparse.ArgumentTypeError, match="must be a finite number > 0"):
            argcheck.positive_float(bad)
    with pytest.raises(argparse.ArgumentTypeError, match=r"no names in ' , ' \(known: a, b\)"):
        argcheck.names_from(["a", "b"])(" , ")
    assert argcheck.names_from(["a", "b"])("b, a") == ["b", "a"]
