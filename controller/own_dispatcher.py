"""A dispatcher of the user's own, named in the config (``dispatch.name: module:Name`` or
``file.py:Name``, as ``task.name``): built with ``dispatch.options`` as its keyword arguments,
and each plan it makes checked before the SGS acts on it (``checked_plan``)."""
from __future__ import annotations

import collections
import numbers
import os
import traceback

from controller.scheduling import DispatchPlan, Dispatcher
from controller.stops import RunStopped


def own_dispatcher(name: str, **kwargs) -> Dispatcher:
    """The user's dispatcher ``name`` built with ``kwargs``, its plans checked; a ValueError
    naming it when it cannot be built or has no ``plan``."""
    from workers.tasks.plugins import load_plugin

    factory = load_plugin(name, "dispatch.name")
    try:
        d = factory(**kwargs)
    except TypeError as e:  # options it does not take, or required ones missing
        raise ValueError(f"dispatcher {name!r}: {e}") from None
    if not callable(getattr(d, "plan", None)):
        raise ValueError(f"dispatcher {name!r} built a {type(d).__name__} with no plan() method (the "
                         "Dispatcher Protocol: plan(est_lens, profiles, true_lens=None, seed=0, prompt_lens=None) "
                         "-> DispatchPlan)")
    return _Checked(d, name)


class _Checked:
    """A user's dispatcher whose plans are checked (``checked_plan``) before the SGS acts on them.
    A plan() that raises, or a plan the SGS cannot run, stops the run with one line naming the
    dispatcher (``RunStopped``: every worker is fine, so the job leaves quietly), not with the
    controller's traceback; the REPL's ``dispatch`` tries a plan first (``switches.trial_plan``)."""

    def __init__(self, inner, name: str):
        self.inner, self.name = inner, name

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    def plan(self, est_lens, profiles, true_lens=None, seed=0, prompt_lens=None) -> DispatchPlan:
        try:
            out = self.inner.plan(est_lens, profiles, true_lens=true_lens, seed=seed, prompt_lens=prompt_lens)
        except Exception as e:  # noqa: BLE001 - the user's code: one line naming it
            raise RunStopped(f"dispatcher {self.name!r}: plan() raised {type(e).__name__}: "
                             f"{' '.join(str(e).split())}{_where(e)}") from e
        try:
            return checked_plan(out, len(est_lens), len(profiles), self.name)
        except ValueError as e:
            raise RunStopped(str(e)) from None


def _where(e: BaseException) -> str:
    """`` (at my_rl/dispatch.py:12 in plan)``: where it was raised (relative to the working
    directory when under it)."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return ""
    f = frames[-1]
    rel = os.path.relpath(f.filename)
    return f" (at {f.filename if rel.startswith('..') else rel}:{f.lineno} in {f.name})"


def checked_plan(plan, requests: int, instances: int, name: str) -> DispatchPlan:
    """``plan`` if it is one the SGS can run: a DispatchPlan with one request list (a list of
    int indices) and one batch cap (an int >= 1) per instance, every request index exactly once. Otherwise a ValueError
    naming the dispatcher and what is wrong (a lost or doubled request would hang or skew the
    iteration, not fail it)."""
    if not isinstance(plan, DispatchPlan):
        raise ValueError(f"dispatcher {name!r}: plan() returned a {type(plan).__name__}, not a "
                         "controller.scheduling.DispatchPlan")
    for field_name in ("per_instance", "batch_caps"):  # (len() of None raised a TypeError: the traceback)
        if hasattr(getattr(plan, field_name), "tolist"):  # a numpy array (of caps, or of index lists)
            setattr(plan, field_name, getattr(plan, field_name).tolist())
        if not isinstance(getattr(plan, field_name), (list, tuple)):
            raise ValueError(f"dispatcher {name!r}: the plan's {field_name} is a "
                             f"{type(getattr(plan, field_name)).__name__}, not a list (one entry per instance)")
    if len(plan.per_instance) != instances or len(plan.batch_caps) != instances:
        raise ValueError(f"dispatcher {name!r}: the plan has {len(plan.per_instance)} request lists and "
                         f"{len(plan.batch_caps)} batch caps for {instances} instances")
    bad_caps = [c for c in plan.batch_caps if isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 1]
    if bad_caps:
        raise ValueError(f"dispatcher {name!r}: batch caps must be ints >= 1, got {bad_caps[:4]}")
    plan.batch_caps = [int(c) for c in plan.batch_caps]  # numpy's too (the indices are taken so)
    # (numpy's arrays, np.array_split's list of them, index as lists do)
    plan.per_instance = [idx.tolist() if hasattr(idx, "tolist") else idx for idx in plan.per_instance]
    for j, idx in enumerate(plan.per_instance):
        # checked here, as the count below would take 1.0 for 1 and the SGS indexes with them
        if not isinstance(idx, (list, tuple)):
            raise ValueError(f"dispatcher {name!r}: the plan's request list for instance {j} is a "
                             f"{type(idx).__name__}, not a list of request indices")
        bad = [i for i in idx if isinstance(i, bool) or not isinstance(i, numbers.Integral)]
        if bad:
            raise ValueError(f"dispatcher {name!r}: request indices must be ints; instance {j}'s list "
                             f"has {', '.join(f'{i!r} ({type(i).__name__})' for i in bad[:4])}")
    counts = collections.Counter(i for idx in plan.per_instance for i in idx)
    if sorted(counts.elements()) != list(range(requests)):
        missing = sorted(set(range(requests)) - set(counts))
        twice = sorted(i for i, n in counts.items() if n > 1)
        other = sorted(i for i in counts if not 0 <= i < requests)
        raise ValueError(f"dispatcher {name!r}: the plan must place each of the {requests} requests once; "
                         f"missing {missing[:6]}, twice {twice[:6]}, not a request index {other[:6]}")
    return plan
