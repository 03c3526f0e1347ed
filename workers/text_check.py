"""Text that JSON can carry but UTF-8 cannot: a lone surrogate (``"\\ud800"``). Read files refuse
it at the row that holds it (the tokenizer fails on it much later, naming no file)."""
from __future__ import annotations


def surrogate_at(text: str) -> int | None:
    """Index of the first lone surrogate in ``text``, or None."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return e.start
