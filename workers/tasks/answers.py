"""Where a completion's answer is, and the value of a number written as text: shared by the
built-in verifiers (``workers/tasks/verifiers.py``).

The answer span: within the last ``<answer>...</answer>`` (the last closing tag and the
opening one nearest before it), else within the whole completion, the text after whichever of
these marks comes last: a ``\\boxed{...}`` / ``\\fbox{...}`` (its content, braces balanced, as
verl's ``last_boxed_only_string``), gsm8k's ``####`` before a number, ``answer:`` / ``answer=``. With no mark
the span is all of that text, stripped.
"""
from __future__ import annotations

import re
from fractions import Fraction

_OPEN, _CLOSE = "<answer>", "</answer>"
# gsm8k's "####" only before a number that ends its line (verl's "#### (\-?[0-9\.\,]+)"): a
# markdown heading, "#### Step 2" or "#### 2. Verification", is none (it took the 2 and overrode an
# earlier \boxed{}); linear: the digits give back one at a time to a test that fails at once
_MARK = re.compile(r"####(?=[ \t]*(?:[-+$\u2212][ \t]*)?\.?\d[\d,.]*[ \t]*(?:\n|$))|answer\s*[:=]",
                   re.IGNORECASE)
# a markdown list item opening a line: its "- " is a bullet, not a minus sign
_BULLET = re.compile(r"[ \t]*\n\s*[-+*\u2022][ \t]+")
_BOX = re.compile(r"\\(?:boxed|fbox)")

_DIGITS = r"(?:\d{1,3}(?:,\d{3})+|\d+)"  # 1,234,567 or 1234567
_DECIMAL = rf"(?:{_DIGITS}(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_SIGNED = rf"[-+]?{_DECIMAL}"
# one number as it may be written: a decimal, a ratio of two (3/4), a \frac of two (\frac{3}{4}, \frac34)
_FRAC = rf"\\[dt]?frac\s*(?:\{{\s*({_SIGNED})\s*\}}|(\d))\s*(?:\{{\s*({_SIGNED})\s*\}}|(\d))"
# whitespace only after a sign: "[-+]?\s*" was tried at every space of a run and scanned the rest of
# it (80k spaces of a degenerate output: 10 s of the GIL for one sample)
_VALUE = re.compile(rf"(?:([-+])\s*)?(?:{_FRAC}|({_SIGNED})(?:\s*/\s*({_SIGNED}))?)")
MAX_EXPONENT = 400  # "1e999999999" is text, not a value worth building
MINUS = "\u2212"  # the Unicode minus sign (typeset math, some models' output): read as "-"


def last_boxed(text: str) -> tuple[int, int, str] | None:
    """(start, end, content) of the last ``\\boxed{...}`` / ``\\fbox{...}``; verl's brace-less
    ``\\boxed 5`` reads up to a ``$`` or the end. None when there is none, or its braces do not close."""
    found = list(_BOX.finditer(text))
    if not found:
        return None
    start, rest_at = found[-1].start(), found[-1].end()
    rest = text[rest_at:]
    if rest[:1] == "{":
        depth = 0
        for i, c in enumerate(rest):
            depth += (c == "{") - (c == "}")
            if depth == 0:
                return start, rest_at + i + 1, rest[1:i]
        return None
    if rest[:1].isspace():
        content = rest.split("$")[0]
        return start, rest_at + len(content), content.strip()
    return None


def answer_span(completion: str) -> tuple[str, bool]:
    """(the answer's text, whether a tag or mark delimited it): see the module docstring."""
    end = completion.rfind(_CLOSE)
    start = completion.rfind(_OPEN, 0, end) if end >= 0 else -1  # rfind, not a regex: linear on any text
    tagged = start >= 0
    text = completion[start + len(_OPEN):end] if tagged else completion
    boxed, marks = last_boxed(text), list(_MARK.finditer(text))
    mark = marks[-1] if marks else None
    if boxed is not None and (mark is None or mark.start() < boxed[1]):
        return boxed[2].strip(), True
    if mark is not None:  # ("Answer:\n- 27": the bullet goes, not its 27's sign)
        span = text[mark.end():]
        bullet = _BULLET.match(span)
        return (span[bullet.end():] if bullet else span).strip(), True
    return text.strip(), tagged


def extract_answer(completion: str) -> str:
    """The completion's answer text (``answer_span``)."""
    return answer_span(completion)[0]


def _number(text: str) -> Fraction | None:
    """A decimal (thousands commas allowed) as an exact fraction; None for text that is not one."""
    text = text.replace(",", "")
    exponent = re.search(r"[eE]([-+]?\d+)$", text)
    if exponent and abs(int(exponent.group(1))) > MAX_EXPONENT:
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):  # also an int of more than 4300 digits
        return None


def _from_match(m: re.Match, signed: bool = True) -> Fraction | None:
    """The match's value; ``signed`` False: its sign (``- 5``'s) left off, a binary minus."""
    sign, num_braced, num_digit, den_braced, den_digit, plain, over = m.groups()
    if plain is not None:
        num, den = _number(plain), _number(over) if over is not None else Fraction(1)
    else:
        num, den = _number(num_braced or num_digit), _number(den_braced or den_digit)
    num = -num if (signed and sign == "-" and num is not None) else num
    if num is None or den is None or den == 0:
        return None
    return num / den


def _own_sign(text: str, m: re.Match) -> bool:
    """Whether the match's sign is the number's own within a longer text: written against it
    (``-5``, ``10-3`` as before), or a ``\\frac``'s, or with a space after it (``- 72``) opening
    the text (a marked span: ``Answer: - 5 degrees``; a bullet on the next line is gone already,
    ``answer_span``) or right after ``$`` or ``=`` (``$- 0.75$``, ``x = - 3``); not a markdown
    bullet after other text (``- 27``) nor a subtraction (``10 - 3``). Looks back over the spaces
    before the sign only (linear)."""
    at = m.start(1)
    if at < 0 or not m.group(0)[1:2].isspace() or m.group(2) is not None or m.group(3) is not None:
        return True
    while at > 0 and text[at - 1] in " \t":
        at -= 1
    return at == 0 or text[at - 1] in "$="


def value(text: str) -> Fraction | None:
    """The exact value of ``text`` when all of it is one number (``72``, ``-1,000.5``, ``1e3``,
    ``3/4``, ``\\frac{3}{4}``, ``\\dfrac34``; surrounding ``$`` and a final period allowed), else None."""
    text = text.replace(MINUS, "-").strip().strip("$").strip()
    text = text[:-1] if text.endswith(".") and not text.endswith("..") else text
    m = _VALUE.fullmatch(text)
    return _from_match(m) if m else None


def numbers_in(text: str) -> list[Fraction]:
    """Every number written in ``text``, in order (the forms ``value`` reads)."""
    text = text.replace(MINUS, "-")
    found = (_from_match(m, _own_sign(text, m)) for m in _VALUE.finditer(text))
    return [v for v in found if v is not None]


def close(got: Fraction, want: Fraction, rel_tol: float = 0.0, abs_tol: float = 0.0) -> bool:
    """``math.isclose`` on exact values (no overflow for huge numbers)."""
    return abs(got - want) <= max(Fraction(rel_tol) * max(abs(got), abs(want)), Fraction(abs_tol))
