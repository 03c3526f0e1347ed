"""``make_task(name, **kwargs) -> Task``: a small registry of task builders, or the user's own
task class / factory named ``"package.module:Name"`` or ``"path/to/file.py:Name"``
(``workers/tasks/plugins.py``)."""
from __future__ import annotations

from typing import Callable

from workers.tasks.plugins import is_plugin, load_plugin
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


def task_factory(name: str) -> Callable[..., Task]:
    """The builder ``task.name`` selects: a registered name or a plugin spec."""
    if name in TASKS:
        return TASKS[name]
    if is_plugin(name):
        return load_plugin(name, "task.name")
    raise ValueError(f"task.name: {name!r} is not one of {sorted(TASKS)} or 'package.module:Name' / 'file.py:Name'")


def make_task(name: str, **kwargs) -> Task:
    factory = task_factory(name)
    try:
        task = factory(**kwargs)
    except TypeError as e:  # unknown keyword: name the config key
        raise ValueError(f"task {name!r}: bad arguments {sorted(kwargs)}: {e}") from None
    missing = [m for m in ("prompts", "score") if not callable(getattr(task, m, None))]
    if missing:
        raise ValueError(f"task.name: {name!r} built a {type(task).__name__} without {missing}: a task needs "
                         "prompts(split) -> [TaskPrompt] and score(prompt, completion) -> float")
    return task
