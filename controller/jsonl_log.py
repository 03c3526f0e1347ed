"""The run's JSON-lines logs (``iterations.jsonl``, ``eval.jsonl``, ``spans.jsonl``): rows
appended whole, read back with a torn last line (a crash, a power loss) dropped from the file,
and cut at a resume to the iterations before it."""
from __future__ import annotations

import json
import os
from pathlib import Path

from controller.timeline import Span
from workers.atomic import write_text


def load_spans(path: Path) -> list[Span]:
    """The spans of ``spans.jsonl`` (a torn last line, after a crash, is dropped from the file)."""
    if not path.exists():
        return []
    text = path.read_text()
    out, kept = [], []
    for line in text.splitlines(keepends=True):
        try:
            if line.endswith("\n"):
                out.append(Span(**json.loads(line)))
                kept.append(line)
        except (ValueError, TypeError):
            pass
    if "".join(kept) != text:
        write_text(path, "".join(kept))
    return out


def append_line(path: Path, line: str) -> None:
    """Append one row (or several, joined by newlines) with a single write() on an O_APPEND
    descriptor: a crash leaves the rows whole or absent (a torn last line, after a power loss,
    is dropped at the next resume)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        data = (line + "\n").encode()
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


def drop_rows_from(path: Path, first: int) -> list[dict]:
    """Keep the rows of iterations before ``first`` (a resumed run writes the rest again), and
    train.eval_only's (no run writes them again), and drop a torn last line; replaced atomically,
    untouched when nothing changes. -> the other rows of ``first`` or later, dropped."""
    if not path.exists():
        return []
    text = path.read_text()
    kept, again = [], []
    for line in text.splitlines(keepends=True):
        try:
            if not line.endswith("\n"):
                continue  # torn
            row = json.loads(line)
            if row["iteration"] < first or row.get("source") == "eval_only":
                kept.append(line)
            else:
                again.append(row)
        except (ValueError, KeyError, TypeError):
            pass
    if "".join(kept) != text:
        write_text(path, "".join(kept))
    return again
