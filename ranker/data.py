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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

PROMPT_KEY = "question"
LENGTHS_KEY = "resp_words"


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
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            for i, raw in enumerate(f, start=1):
                yield i, raw
    except (OSError, EOFError) as e:
        raise TraceError(f"{path}: cannot read ({e})") from e


def _parse(path: Path, i: int, raw: bytes, need_lengths: bool) -> TraceRow:
    where = f"{path}:{i}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceError(f"{where}: line is not valid UTF-8 ({e.reason} at byte {e.start})") from e
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not a JSON object ({e.msg})") from e
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if PROMPT_KEY not in obj:
        raise TraceError(f"{where}: missing field '{PROMPT_KEY}' (the prompt)")
    prompt = obj[PROMPT_KEY]
    if not isinstance(prompt, str):
        raise TraceError(f"{where}: field '{PROMPT_KEY}' must be a string")
    if not prompt.strip():
        raise TraceError(f"{where}: empty prompt in field '{PROMPT_KEY}'")
    lengths: tuple[float, ...] = ()
    if need_lengths:
        if LENGTHS_KEY not in obj:
            raise TraceError(f"{where}: missing field '{LENGTHS_KEY}' (answer lengths in words)")
        vals = obj[LENGTHS_KEY]
        ok = isinstance(vals, list) and len(vals) > 0 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in vals)
        if not ok:
            raise TraceError(f"{where}: field '{LENGTHS_KEY}' must be a non-empty list of "
                             f"non-negative numbers, got {vals!r:.80}")
        lengths = tuple(float(v) for v in vals)
    task = obj.get("task", "")
    return TraceRow(i, prompt, lengths, task if isinstance(task, str) else "")


def read_traces(path: str | Path, need_lengths: bool = True) -> list[TraceRow]:
    """All rows of a trace file (``.gz`` or plain JSON lines). Blank lines are errors too,
    since ``predict`` promises one output line per input line."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path}: no such file")
    rows = [_parse(path, i, raw, need_lengths) for i, raw in _lines(path)]
    if not rows:
        raise TraceError(f"{path}: no lines")
    return rows


def check_prompts(prompts: list[str] | tuple[str, ...]) -> None:
    """Refuse non-string or empty prompts, naming the index."""
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise ValueError(f"prompt {i} is {type(p).__name__}, expected str")
        if not p.strip():
            raise ValueError(f"prompt {i} is empty")


def check_lengths(prompts, lengths) -> None:
    """Refuse mismatched, negative or non-finite lengths, naming the index."""
    if len(prompts) != len(lengths):
        raise ValueError(f"{len(prompts)} prompts but {len(lengths)} lengths")
    for i, v in enumerate(lengths):
        try:
            ok = not isinstance(v, (bool, str)) and math.isfinite(float(v)) and float(v) >= 0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"length {i} is {v!r}; expected a finite number >= 0")
