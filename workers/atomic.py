"""Atomic writes (no torch import, so every part of the project can use them): what was saved
is either the old file/folder or the new one, never a half-written mix."""
from __future__ import annotations

import os
import shutil
from pathlib import Path


def replace_dir(tmp: str | os.PathLike, folder: str | os.PathLike) -> None:
    """Put directory ``tmp`` at ``folder`` by renames (the old one is removed only after)."""
    tmp, folder = Path(tmp), Path(folder)
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old{os.getpid()}")
        os.rename(folder, old)
        os.rename(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, folder)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to a temp file beside ``path``, then rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
