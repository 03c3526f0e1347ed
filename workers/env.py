"""``env_var(name, value)``: an environment variable set for the length of a block, then put
back as it was (removed if it was unset). For what a spawned child reads at start
(``OMP_NUM_THREADS``), which only the parent's environment can give it."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator


@contextlib.contextmanager
def env_var(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
