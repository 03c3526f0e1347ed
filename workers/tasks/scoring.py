"""A task's reward where a bug in it must cost one sample, not the run (trainer and eval)."""
from __future__ import annotations

import math

from workers.types import Task, TaskPrompt


def safe_score(task: Task, prompt: TaskPrompt, completion: str) -> tuple[float, str]:
    """-> (the task's score, "") or (NaN, why): it raised, or gave no finite number."""
    try:
        score = float(task.score(prompt, completion))
    except Exception as e:  # noqa: BLE001 - a user's verifier: anything can happen
        return float("nan"), f"the task's score raised {e!r}"
    if not math.isfinite(score):
        return float("nan"), f"the task's score is {score}"
    return score, ""
