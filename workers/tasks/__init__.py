"""Tasks (datasets + rule-based verifiers): ``make_task(name, **kwargs)``."""
from workers.tasks.registry import TASKS, make_task

__all__ = ["TASKS", "make_task"]
