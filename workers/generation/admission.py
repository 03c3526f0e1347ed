"""The order in which an engine admits waiting requests (``engine.admission``): a key per
request, the smallest admitted first, ties in arrival order (a preempted sequence always goes
back first, whatever its key).

* ``fcfs``: every key 0, so arrival order;
* ``lpt``: ``-est_len``, the longest estimated output first (the paper's LPT, with the
  ranker's estimates);
* your own, ``module:fn`` or ``file.py:fn`` (as ``task.name``): ``fn(request: Request) ->
  number``, e.g. the shortest prompt first, ``lambda r: r.prompt_ids.numel()``. Loaded and tried
  on a probe request when the config loads (each error one ``config error`` naming the key);
  a key that raises, or is no finite number, for a request admits that request last (the
  order is a policy: a sample is not lost to it), said once per engine.

The vLLM backend queues requests by the same key before handing them to vLLM (as many as its
batch cap), so the order is the same there.
"""
from __future__ import annotations

import logging
import math
from typing import Callable

import torch

from workers.finite import finite_number
from workers.types import Request

log = logging.getLogger("streamrl.engine")

AdmissionKey = Callable[[Request], float]

_BUILTIN: dict[str, AdmissionKey] = {
    "fcfs": lambda r: 0.0,
    "lpt": lambda r: -float(r.est_len),
}
ADMISSION_POLICIES = tuple(_BUILTIN)


def valid_name(name: str) -> bool:
    """A built-in policy, or the form of your own (``module:fn`` / ``file.py:fn``)."""
    from workers.tasks.plugins import is_plugin

    return name in _BUILTIN or (isinstance(name, str) and is_plugin(name))


def admission_key(name: str) -> AdmissionKey:
    """The key of ``name`` as an engine uses it: for your own, loaded (a ValueError naming
    ``engine.admission``), and a request it fails for goes last (``_Lenient``)."""
    if name in _BUILTIN:
        return _BUILTIN[name]
    return _Lenient(_checked(name))


def _checked(name: str) -> "_Checked":
    from workers.tasks.plugins import load_plugin

    return _Checked(load_plugin(name, "engine.admission"), name)


class _Checked:
    """Your key, its value checked: a finite real number (a bool or a string would sort, wrongly
    or not at all, against the others)."""

    def __init__(self, fn: Callable, name: str):
        self.fn, self.name = fn, name

    def __call__(self, req: Request) -> float:
        try:
            out = self.fn(req)
        except Exception as e:  # noqa: BLE001 - your code: it costs this request, said
            raise ValueError(f"engine.admission {self.name!r} raised {type(e).__name__}: {e}") from None
        value = finite_number(out)  # numpy's scalars and one-element tensors too
        if value is None:
            raise ValueError(f"engine.admission {self.name!r} returned {_short(out)}, not a finite number "
                             "(smaller is admitted first)")
        return value


def _short(x) -> str:
    """``repr(x)``, cut to 60 characters (marked)."""
    try:
        text = repr(x)
    except ValueError:  # an int past Python's 4,300-digit limit on str()
        return f"an {type(x).__name__} too long to print"
    return text if len(text) <= 60 else text[:57] + "..."


class _Lenient:
    """Your key; where it fails for a request, that request is admitted last, said once."""

    def __init__(self, key: _Checked):
        self.key, self.said = key, False

    def __call__(self, req: Request) -> float:
        try:
            return self.key(req)
        except ValueError as e:
            if not self.said:
                self.said = True
                log.warning("%s for sample %d; it and any other request the key fails for are admitted last "
                            "(said once)", e, req.sample_id)
            return math.inf


def check_admission(name: str) -> None:
    """Load ``name`` and try it on a probe request: a ValueError naming ``engine.admission``."""
    key = _checked(name) if name not in _BUILTIN else _BUILTIN[name]
    key(Request(sample_id=0, prompt_ids=torch.tensor([1, 2, 3]), max_tokens=8, est_len=8.0, group_id=0))
