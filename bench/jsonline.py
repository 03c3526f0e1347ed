"""The JSON lines every bench prints: valid JSON (RFC 8259, what ``jq`` and a strict
``json.loads`` read), so an undefined number (a ratio over a zero gap: nan, inf) is written
as ``null``, never as the ``NaN``/``Infinity`` that ``json.dumps`` writes by default."""
from __future__ import annotations

import json
import math


def finite(x):
    """``x`` with every non-finite float (nan, inf, -inf), at any depth of dicts, lists and
    tuples, replaced by None."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def json_line(obj, **kw) -> str:
    """``obj`` as one line of valid JSON, undefined numbers as null (``kw``: json.dumps's)."""
    return json.dumps(finite(obj), allow_nan=False, **kw)
