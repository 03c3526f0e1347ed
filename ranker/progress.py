"""Progress display for training: a live rich bar on a terminal, a log line every 10% when
stderr is a file or pipe. Switched on by the CLI, off by default (library use, tests)."""
from __future__ import annotations

import contextlib
import time
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
    def __init__(self, desc: str, total: int, progress: Progress | None, task):
        self.desc, self.total, self._p, self._t = desc, max(1, total), progress, task
        self.done, self._next_log, self._t0 = 0, 0.1, time.time()

    def advance(self, n: int = 1, info: str = "") -> None:
        if not _enabled:
            return
        self.done += n
        if self._p is not None:
            self._p.update(self._t, advance=n, info=info)
        elif self.done / self.total >= self._next_log - 1e-9:
            console.log(f"{self.desc}: {self.done}/{self.total} ({time.time() - self._t0:.0f}s) {info}")
            self._next_log = (int(self.done * 10 / self.total) + 1) / 10


@contextlib.contextmanager
def bar(desc: str, total: int) -> Iterator[_Bar]:
    """``with bar("lgbm", 400) as b: b.advance()``; a no-op when disabled."""
    if not _enabled or not console.is_terminal:
        yield _Bar(desc, total, None, None)
        return
    cols = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[info]}")]
    with Progress(*cols, console=console) as p:
        yield _Bar(desc, total, p, p.add_task(desc, total=total, info=""))
