"""``finite_number``: a value a user's code returned (an admission key, an environment's reward,
a sample's rewards over RPC) as a finite float, or None where it is none."""
from __future__ import annotations

import math
import numbers


def finite_number(x) -> float | None:
    """``x`` as a float when it is a finite real number: an int or float, numpy's scalars, a
    one-element tensor; not a bool (True would count as 1), a string, NaN, an infinity or an int
    too large for a float. Else None."""
    if hasattr(x, "numel") and hasattr(x, "item") and x.numel() == 1:  # a one-element tensor
        x = x.item()
    if not isinstance(x, numbers.Real) or isinstance(x, bool):
        return None
    try:
        value = float(x)
    except (OverflowError, TypeError, ValueError):  # an int 10**400
        return None
    return value if math.isfinite(value) else None
