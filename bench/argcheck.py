"""Argument types the benches' command lines share: a bad value is refused by argparse itself,
before any work or process starts, with one line on stderr naming the flag and the value
(``error: argument --repeats: must be an integer >= 1, got '0'``) and exit code 2; stdout,
which holds the benches' JSON lines, stays empty."""
from __future__ import annotations

import argparse
import math
from typing import Callable, Iterable


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type=``: an integer >= ``low`` (a count: repeats, threads, prompts)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = None
        if n is None or n < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return n
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def positive_float(text: str) -> float:
    """An argparse ``type=``: a finite number > 0 (a scale, a rate)."""
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return x


def folder(text: str) -> str:
    """An argparse ``type=``: a folder to write into, existing or to be made: not a file, and its
    nearest existing parent a folder this process may write (``/dev/null/x`` failed after the
    work, with a traceback)."""
    import os
    from pathlib import Path

    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder")
    there = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    if not there.is_dir() or not os.access(there, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be made or written: {there} is "
                                         f"{'a file' if not there.is_dir() else 'not writable'}")
    return text


def names_from(known: Iterable[str]) -> Callable[[str], list[str]]:
    """An argparse ``type=``: a comma-separated list of one or more of ``known``, each once, in
    the given order (blanks around the commas ignored)."""
    known = tuple(known)

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in known]
        twice = sorted({n for n in names if names.count(n) > 1})
        if bad or twice or not names:
            what = (f"unknown {', '.join(map(repr, bad))}" if bad else
                    f"{', '.join(map(repr, twice))} given twice" if twice else "no names")
            raise argparse.ArgumentTypeError(f"{what} in {text!r} (known: {', '.join(known)})")
        return names
    return parse


def fill_defaults(args: argparse.Namespace, quick: dict, full: dict) -> argparse.Namespace:
    """The flags left unset (None) take ``quick``'s value under ``--quick``, else ``full``'s: a
    flag given on the command line wins over ``--quick``."""
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args
