"""``make_task(name, **kwargs) -> Task``: a small registry of task builders."""
from __future__ import annotations

from typing import Callable

from workers.types import Task


def _synthetic(**kw) -> Task:
    from workers.tasks.synthetic import SyntheticTask
    return SyntheticTask(**kw)


def _reasoning_gym(**kw) -> Task:
    from workers.tasks.reasoning_gym_task import ReasoningGymTask
    return ReasoningGymTask(**kw)


def _files(**kw) -> Task:
    from workers.tasks.files import FileTask
    return FileTask(**kw)


TASKS: dict[str, Callable[..., Task]] = {
    "synthetic": _synthetic,
    "reasoning_gym": _reasoning_gym,
    "jsonl": _files,
    "parquet": _files,
}


def make_task(name: str, **kwargs) -> Task:
    if name not in TASKS:
        raise ValueError(f"task.name {name!r} is not one of {sorted(TASKS)}")
    try:
        return TASKS[name](**kwargs)
    except TypeError as e:  # unknown keyword: name the config key
        raise ValueError(f"task {name!r}: bad arguments {sorted(kwargs)}: {e}") from None
