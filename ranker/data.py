"""Reading length traces: JSON lines (gzip or plain), one prompt per line.

A trace line holds at least ``question`` (the prompt) and, for training/eval, ``resp_words``
(the word counts of the prompt's sampled answers). The ranker's target is each prompt's
mean answer length in whitespace words (see docs/ranker.md for why words and why the mean).
Every malformed line raises ``TraceError`` naming the file and the 1-based line number.
"""
from __future__ import annotations

import gzip
import json
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from workers.text_check import surrogate_at

PROMPT_KEY = "question"
LENGTHS_KEY = "resp_words"
# Longest answer length (words) accepted: far above any real answer, and well inside float32
# (the feature code's dtype) even after log1p/expm1 round trips.
MAX_WORDS = 1e9


class TraceError(ValueError):
    """A malformed trace line; the message names the file and line."""


@dataclass(frozen=True)
class TraceRow:
    """One trace line: the prompt, its answers' lengths (words; may be empty when only
    predicting) and the line number (1-based) it came from."""

    line: int
    prompt: str
    lengths: tuple[float, ...] = ()
    task: str = ""
    extra: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def target(self) -> float:
        """Mean answer length in words (the ranker's regression target)."""
        return sum(self.lengths) / len(self.lengths)


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    opener = gzip.open if path.suffix.lower() == ".gz" else open
    i = 0
    try:
        with opener(path, "rb") as f:
            for i, raw in enumerate(f, start=1):
                yield i, raw
    except (OSError, EOFError, zlib.error) as e:
        # A corrupt gzip stream fails while reading line i + 1 (the first read: no line yet).
        where = f"{path}:{i + 1}" if i else f"{path}"
        raise TraceError(f"{where}: cannot read ({e})") from e


def length_ok(v) -> bool:
    """A finite number in [0, MAX_WORDS] (not a bool, not a string; huge ints are refused too)."""
    if isinstance(v, (bool, str, bytes)):
        return False
    try:
        f = float(v)
    except (TypeError, ValueError, OverflowError):
        return False
    return math.isfinite(f) and 0 <= f <= MAX_WORDS


_BOM, _GZIP_MAGIC = b"\xef\xbb\xbf", b"\x1f\x8b"


def _parse(path: Path, i: int, raw: bytes, need_lengths: bool) -> TraceRow:
    where = f"{path}:{i}"
    if i == 1 and raw.startswith(_BOM):  # a UTF-8 byte-order mark, as some editors write
        raw = raw[len(_BOM):]
    if i == 1 and raw.startswith(_GZIP_MAGIC):
        raise TraceError(f"{where}: gzip data (starts with bytes 1f 8b) in a file whose name does not end in "
                         f".gz; rename it to end in .gz")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceError(f"{where}: line is not valid UTF-8 ({e.reason} at byte {e.start})") from e
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not a JSON object ({e.msg})") from e
    except RecursionError as e:
        raise TraceError(f"{where}: not a JSON object (nested too deeply)") from e
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if PROMPT_KEY not in obj:
        raise TraceError(f"{where}: missing field '{PROMPT_KEY}' (the prompt)")
    prompt = obj[PROMPT_KEY]
    if not isinstance(prompt, str):
        raise TraceError(f"{where}: field '{PROMPT_KEY}' must be a string")
    if not prompt.strip():
        raise TraceError(f"{where}: empty prompt in field '{PROMPT_KEY}'")
    bad = surrogate_at(prompt)
    if bad is not None:
        raise TraceError(f"{where}: field '{PROMPT_KEY}' has a lone surrogate {prompt[bad]!r} at char {bad} "
                         f"(not valid Unicode)")
    lengths: tuple[float, ...] = ()
    if need_lengths:
        if LENGTHS_KEY not in obj:
            raise TraceError(f"{where}: missing field '{LENGTHS_KEY}' (answer lengths in words)")
        vals = obj[LENGTHS_KEY]
        ok = isinstance(vals, list) and len(vals) > 0 and all(
            isinstance(v, (int, float)) and length_ok(v) for v in vals)
        if not ok:
            raise TraceError(f"{where}: field '{LENGTHS_KEY}' must be a non-empty list of "
                             f"numbers in [0, {MAX_WORDS:.0e}] (words), got {vals!r:.80}")
        lengths = tuple(float(v) for v in vals)
    task = obj.get("task", "")
    return TraceRow(i, prompt, lengths, task if isinstance(task, str) else "")


def read_traces(path: str | Path, need_lengths: bool = True) -> list[TraceRow]:
    """All rows of a trace file (``.gz`` or plain JSON lines). Blank lines at the end of the
    file are ignored; one before a row is an error (a lost or spliced row, most likely)."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path}: no such file")
    rows, blank = [], 0
    for i, raw in _lines(path):
        if not raw.strip():
            blank = blank or i
            continue
        if blank:
            raise TraceError(f"{path}:{blank}: blank line (only the end of the file may have blank lines)")
        rows.append(_parse(path, i, raw, need_lengths))
    if not rows:
        raise TraceError(f"{path}: no rows (the file is empty or holds only blank lines)")
    return rows


def check_prompts(prompts: list[str] | tuple[str, ...]) -> None:
    """Refuse non-string, empty or not-valid-Unicode prompts, naming the index."""
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise ValueError(f"prompt {i} is {type(p).__name__}, expected str")
        if not p.strip():
            raise ValueError(f"prompt {i} is empty")
        bad = surrogate_at(p)
        if bad is not None:
            raise ValueError(f"prompt {i} has a lone surrogate {p[bad]!r} at char {bad} (not valid Unicode)")


def as_prompts(prompts) -> list[str]:
    """``prompts`` as a checked list; a single string is refused (it would be read as a list of
    one-character prompts)."""
    if isinstance(prompts, (str, bytes)):
        raise ValueError(f"prompts must be a list of strings, got one {type(prompts).__name__} "
                         f"({prompts!r:.40}); wrap it in a list")
    prompts = list(prompts)
    check_prompts(prompts)
    return prompts


def check_lengths(prompts, lengths) -> None:
    """Refuse mismatched, negative, non-finite or absurdly large lengths, naming the index."""
    if len(prompts) != len(lengths):
        raise ValueError(f"{len(prompts)} prompts but {len(lengths)} lengths")
    for i, v in enumerate(lengths):
        if not length_ok(v):
            raise ValueError(f"length {i} is {v!r:.40}; expected a number in [0, {MAX_WORDS:.0e}] (words)")
