"""``make_task(name, **kwargs) -> Task``: a small registry of task builders, or the user's own
task class / factory named ``"package.module:Name"`` or ``"path/to/file.py:Name"``
(``workers/tasks/plugins.py``)."""
from __future__ import annotations

import inspect
import os
import traceback
from typing import Callable

from workers.tasks.plugins import builtin_or_plugin
from workers.types import Task


def _synthetic_cls():
    from workers.tasks.synthetic import SyntheticTask
    return SyntheticTask


def _reasoning_gym_cls():
    from workers.tasks.reasoning_gym_task import ReasoningGymTask
    return ReasoningGymTask


def _files_cls():
    from workers.tasks.files import FileTask
    return FileTask


class _Builtin:
    """A registered task: its class, imported on first use (reasoning_gym is heavy)."""

    def __init__(self, load: Callable[[], type], **defaults):
        self.load = load
        self.defaults = defaults  # keyword arguments the name implies (parquet's eval group)

    def __call__(self, **kw) -> Task:
        return self.load()(**{**self.defaults, **kw})


TASKS: dict[str, Callable[..., Task]] = {
    "synthetic": _Builtin(_synthetic_cls),
    "reasoning_gym": _Builtin(_reasoning_gym_cls),
    "jsonl": _Builtin(_files_cls),
    "parquet": _Builtin(_files_cls, name="parquet"),  # rows with no task / data_source: eval/parquet
}


def task_factory(name: str) -> Callable[..., Task]:
    """The builder ``task.name`` selects: a registered name or a plugin spec."""
    return builtin_or_plugin(name, TASKS, "task.name", " or 'package.module:Name' / 'file.py:Name'")


def make_task(name: str, /, **kwargs) -> Task:
    """Build the task ``name`` with ``kwargs`` (``task.kwargs``; they may hold a ``name`` of
    their own, as the jsonl/parquet tasks' eval group). Kwargs its constructor does not
    take are a ValueError naming them; an exception the constructor itself raises is reported as
    the task's own error (type, message, where it was raised), not blamed on the kwargs."""
    factory = task_factory(name)
    given = sorted(kwargs)  # the config's (the name's defaults are not the user's to fix)
    if isinstance(factory, _Builtin):
        target, kwargs = factory.load(), {**factory.defaults, **kwargs}
    else:
        target = factory
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # no signature to check against (a builtin callable)
        signature = None
    if signature is not None:
        try:
            signature.bind(**kwargs)
        except TypeError as e:
            raise ValueError(f"task {name!r}: task.kwargs {given}: {_init_name(target)} "
                             f"{_bind_problem(signature, kwargs) or e} ({_takes(signature)})") from None
    try:
        task = target(**kwargs)
    except (ValueError, OSError, ImportError) as e:
        if isinstance(factory, _Builtin):  # this project's tasks: their messages name the key
            raise
        raise ValueError(_own_error(name, target, e)) from e
    except Exception as e:  # noqa: BLE001 (the user's code: one line naming it, not a traceback)
        raise ValueError(_own_error(name, target, e)) from e
    missing = [m for m in ("prompts", "score") if not callable(getattr(task, m, None))]
    if missing:
        raise ValueError(f"task.name: {name!r} built a {type(task).__name__} without {missing}: a task needs "
                         "prompts(split) -> [TaskPrompt] and score(prompt, completion) -> float")
    return task


def _init_name(target) -> str:
    """What Python names in a call's TypeError: ``FileTask.__init__()``, ``build()``."""
    return f"{_called(target)}.__init__()" if isinstance(target, type) else f"{_called(target)}()"


def _bind_problem(signature: inspect.Signature, kwargs: dict) -> str:
    """The unknown keywords first (a typo also leaves its key missing), then the missing ones."""
    import difflib

    params = signature.parameters
    named = [p.name for p in params.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    problems = []
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        for k in sorted(k for k in kwargs if k not in named):
            near = difflib.get_close_matches(k, named, n=1, cutoff=0.75)
            problems.append(f"got an unexpected keyword argument {k!r}"
                            + (f" (did you mean {near[0]!r}?)" if near else ""))
    missing = [p.name for p in params.values() if p.default is p.empty and p.name not in kwargs
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing:
        problems.append(f"missing required argument(s) {missing}")
    return "; ".join(problems)


def _takes(signature: inspect.Signature) -> str:
    named = [p.name for p in signature.parameters.values()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return f"it takes {', '.join(named)}" if named else "it takes no arguments"


def _called(target) -> str:
    return getattr(target, "__qualname__", None) or type(target).__name__


def _own_error(name: str, target, e: BaseException) -> str:
    """``task 'x': MathTask(...) raised TypeError: ... (at my_rl/tasks.py:12 in __init__)``: the
    innermost frame of the traceback, and the deepest one in the task's own file when that is
    another (the exception came out of a library the task called)."""
    frames = traceback.extract_tb(e.__traceback__)[1:]  # [0]: the call here
    where = ""
    if frames:
        last = frames[-1]
        where = f" (at {_short(last.filename)}:{last.lineno} in {last.name}"
        try:
            own = inspect.getsourcefile(target)
        except TypeError:
            own = None
        mine = [f for f in frames if own and f.filename == own]
        if mine and mine[-1] is not last:
            where += f", called from {_short(mine[-1].filename)}:{mine[-1].lineno} in {mine[-1].name}"
        where += ")"
    text = " ".join(str(e).split())  # one line
    return f"task {name!r}: {_called(target)}(...) raised {type(e).__name__}: {text}{where}"


def _short(filename: str) -> str:
    """A path relative to the current directory when under it (as the config names it)."""
    try:
        return os.path.relpath(filename) if not os.path.relpath(filename).startswith("..") else filename
    except ValueError:
        return filename
