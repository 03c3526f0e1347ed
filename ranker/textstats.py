"""Stateless text statistics of a prompt: what its surface says about the work it asks for.

``text_stats(prompts) -> float32 [N, F]`` with column names ``STAT_NAMES``. Sizes (lengths,
counts of numbers / list items / operators / grid rows, digit lengths, magnitudes) say how
big an instance is; keyword counts say what kind of task it is. No fitted state, so these
columns never leak labels.
"""
from __future__ import annotations

import math
import re
from typing import Sequence

import numpy as np

_NUM = re.compile(r"-?\d+(?:\.\d+)?")
_WORD = re.compile(r"[A-Za-z]+")
_QUOTED = re.compile(r"\"([^\"\n]{1,2000})\"|'([^'\n]{1,2000})'")
_UPPER = re.compile(r"[A-Z]")
_NON_ASCII = re.compile(r"[^\x00-\x7f]")
_OPS = "+-*/^%=<>"
_BRACKETS = "()[]{}"

# Task-like words (lower-case whole words). The ranker sees the prompt, so phrases that name
# the kind of problem are fair features; the trace's `task` field is never used.
KEYWORDS = (
    "sort", "matrix", "grid", "puzzle", "sudoku", "step", "steps", "rotate", "cipher", "decrypt",
    "maze", "path", "graph", "color", "game", "rule", "rules", "transform", "sequence", "pattern",
    "prime", "fraction", "integral", "equation", "solve", "count", "letter", "letters", "word",
    "words", "string", "binary", "queen", "knight", "move", "moves", "tower", "disk", "dice",
    "probability", "cube", "code", "program", "output", "input", "example", "examples",
    "calculate", "simplify", "list", "true", "false", "minimum", "shortest", "date", "family",
    "islands", "cell", "cells", "row", "rows", "column", "columns", "swap", "palindrome",
    "substring", "expression", "target", "board", "island", "circuit", "lock", "button",
)

_SIZE_NAMES = (
    "chars", "words", "lines", "nonblank_lines", "numbers", "distinct_numbers", "max_digits",
    "sum_digits", "log_max_abs_number", "log_sum_abs_number", "mean_log_number", "decimals",
    "commas", "operators", "brackets", "colons", "semicolons", "questions", "uppercase",
    "max_line_chars", "mean_line_chars", "distinct_words", "single_char_tokens",
    "mean_word_chars", "max_token_chars", "quoted_chars", "grid_lines", "grid_cells",
    "list_items", "non_ascii",
)
STAT_NAMES: tuple[str, ...] = _SIZE_NAMES + tuple(f"kw_{k}" for k in KEYWORDS)
_KW_INDEX = {k: i for i, k in enumerate(KEYWORDS)}


def _grid(lines: list[str]) -> tuple[int, int]:
    """Rows that look like a grid/matrix row (>= 3 short tokens, mostly 1-2 chars), and
    their total cell count."""
    rows = cells = 0
    for line in lines:
        toks = line.split()
        if len(toks) >= 3 and sum(len(t) <= 2 for t in toks) >= 0.8 * len(toks):
            rows += 1
            cells += len(toks)
    return rows, cells


def _one(text: str) -> list[float]:
    lines = text.split("\n")
    nonblank = [l for l in lines if l.strip()]
    toks = text.split()
    nums = _NUM.findall(text)
    mags = [min(abs(float(n)), 1e300) for n in nums]
    words = [w.lower() for w in _WORD.findall(text)]
    quoted = sum(len(a or b) for a, b in _QUOTED.findall(text))
    grid_rows, grid_cells = _grid(nonblank)
    list_items = sum(1 for l in nonblank if l.lstrip()[:2] in ("- ", "* ") or l.lstrip()[:1].isdigit())
    kw = [0.0] * len(KEYWORDS)
    for w in words:
        j = _KW_INDEX.get(w)
        if j is not None:
            kw[j] += 1.0
    size = [
        len(text), len(toks), len(lines), len(nonblank), len(nums), len(set(nums)),
        max((len(n.lstrip("-")) for n in nums), default=0), sum(len(n) for n in nums),
        math.log1p(max(mags, default=0.0)), math.log1p(sum(mags)),
        sum(math.log1p(m) for m in mags) / len(mags) if mags else 0.0,
        sum("." in n for n in nums), text.count(","), sum(text.count(c) for c in _OPS),
        sum(text.count(c) for c in _BRACKETS), text.count(":"), text.count(";"), text.count("?"),
        len(_UPPER.findall(text)), max(len(l) for l in lines),
        sum(len(l) for l in nonblank) / max(1, len(nonblank)), len(set(toks)),
        sum(len(t) == 1 for t in toks), sum(len(t) for t in toks) / max(1, len(toks)),
        max((len(t) for t in toks), default=0), quoted, grid_rows, grid_cells, list_items,
        len(_NON_ASCII.findall(text)),
    ]
    return size + kw


def text_stats(prompts: Sequence[str]) -> np.ndarray:
    """float32 [N, len(STAT_NAMES)]."""
    out = np.asarray([_one(p) for p in prompts], dtype=np.float32).reshape(len(prompts), len(STAT_NAMES))
    return out
