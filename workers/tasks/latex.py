"""Is a LaTeX answer the reference? The ``math`` verifier's comparison, after the rules of verl's
``math_reward.is_equiv`` / ``strip_string`` (from the Hendrycks MATH evaluation): both sides
normalised, then compared as text, or as exact values when both are numbers."""
from __future__ import annotations

import re

from workers.tasks.answers import value

# (pattern, replacement), applied in order; spaces go late, because a unit is found by its space
_REWRITES: tuple[tuple[str, str], ...] = (
    (r"\n", ""),
    (r"\\!", ""),                              # thin negative space
    (r"\\\\", r"\\"),                          # a doubly escaped backslash
    (r"[dt]frac", "frac"),                     # \dfrac, \tfrac
    (r"\\left|\\right", ""),
    (r"\^\{?\\circ\}?", ""),                   # degrees
    (r"\\\$", ""),                             # an escaped dollar
    (r"^\s*\$+|(?<!\$)\$+\s*$", ""),           # math-mode dollars around the answer (a run: one pass)
    # a unit at the end, with its power and a final period: after a value (a digit or a bracket:
    # 5\text{cm}, 12\mbox{cm}^2.), or, as verl's remove_right_units, marked by a space ("a
    # \text{ units}"); not x = \text{(B)} (the answer's text), nor 5 \text{ and } 6
    (r"(?:(?<=[\d)\]}])\s*\\(?:text|mbox)\{|(?<=\S)\s*\\text\{ )[^{}]*\}(?:\^\{?\w+\}?)?\.?\s*$", ""),
    (r"\\(?:text|mbox)\{([^{}]*)\}", r"\1"),   # other text: its content
    (r"\\%", ""),
    (r"(?<!\.)\.+\s*$", ""),                   # a final period (from a run's first: linear in it)
    (r"(^|[\s{])\.(\d)", r"\g<1>0.\2"),        # .5 -> 0.5
    (r"\\sqrt\s*([^{\s\\])", r"\\sqrt{\1}"),  # \sqrt3 -> \sqrt{3}
)
# after the "x =" rule (normalise), once spaces are gone
_SPELLING: tuple[tuple[str, str], ...] = (
    (r"\s+", ""),
    (r"\\frac([^{\\])([^{\\])", r"\\frac{\1}{\2}"),  # \frac12 -> \frac{1}{2}
    (r"\\frac([^{\\])\{", r"\\frac{\1}{"),            # \frac1{72}
    (r"\\frac\{([^{}]*)\}([^{\\])", r"\\frac{\1}{\2}"),  # \frac{1}2
)
# a comma and a space: a list (MATH's "separated by commas"), never a thousands separator
_LIST = re.compile(r",\s")
_COMPILED = tuple((re.compile(p), r) for p, r in _REWRITES)
_COMPILED_SPELLING = tuple((re.compile(p), r) for p, r in _SPELLING)


def normalise(text: str) -> str:
    """``text`` in one spelling: the rewrites above, and a short left side of one ``=``
    dropped (``x = 5`` -> ``5``, as verl's ``k = `` rule)."""
    for pattern, replacement in _COMPILED:
        text = pattern.sub(replacement, text)
    left, eq, right = text.partition("=")
    if eq and "=" not in right and len(left.strip()) <= 2:
        text = right
    for pattern, replacement in _COMPILED_SPELLING:
        text = pattern.sub(replacement, text)
    return text


def equivalent(answer: str, reference: str) -> bool:
    """Whether ``answer`` is ``reference`` once both are normalised: the same text, or two
    numbers of the same exact value (``0.5`` and ``\\frac{1}{2}``, ``3/4`` and ``\\frac34``; not
    where either is written as a list, ``3, 125``)."""
    a, b = normalise(answer), normalise(reference)
    if a == b:
        return True
    if _LIST.search(answer) or _LIST.search(reference):  # "3, 125" lost its space: no 3,125
        return False
    va, vb = value(a), value(b)
    return va is not None and va == vb
