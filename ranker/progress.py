"""Progress display for training (rich), switched on by the CLI and off in tests."""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

_enabled = False
console = Console(stderr=True)


def set_enabled(on: bool) -> None:
    global _enabled
    _enabled = on


def log(msg: str) -> None:
    if _enabled:
        console.log(msg)


class _Bar:
    def __init__(self, progress: Progress | None, task):
        self._p, self._t = progress, task

    def advance(self, n: int = 1, **fields) -> None:
        if self._p is not None:
            self._p.update(self._t, advance=n, **fields)


@contextlib.contextmanager
def bar(desc: str, total: int) -> Iterator[_Bar]:
    """``with bar("lgbm", 400) as b: b.advance()``; a no-op when disabled."""
    if not _enabled:
        yield _Bar(None, None)
        return
    cols = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[info]}")]
    with Progress(*cols, console=console, transient=not sys.stderr.isatty()) as p:
        t = p.add_task(desc, total=total, info="")
        yield _Bar(p, t)
    console.log(f"{desc}: done ({total} steps)")
