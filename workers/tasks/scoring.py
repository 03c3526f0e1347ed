"""A task's reward where a bug in it must cost one sample, not the run (trainer and eval)."""
from __future__ import annotations

import asyncio
import inspect
import math
from concurrent.futures import ThreadPoolExecutor

from workers.types import Task, TaskPrompt


def resolve(out):
    """``out``, or what it gives when awaited (an ``async def`` reward). Scoring threads run no
    event loop, so each call gets its own (``asyncio.run``); called from inside a running loop,
    the awaitable runs on a fresh loop in a helper thread instead (``asyncio.run`` refuses a
    nested loop)."""
    if not inspect.isawaitable(out):
        return out

    async def wait():
        return await out

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, wait()).result()


def safe_score(task: Task, prompt: TaskPrompt, completion: str) -> tuple[float, str]:
    """-> (the task's score, "") or (NaN, why): it raised, or gave no finite number."""
    try:
        score = float(resolve(task.score(prompt, completion)))
    except Exception as e:  # noqa: BLE001 - a user's verifier: anything can happen
        return float("nan"), f"the task's score raised {e!r}"
    if not math.isfinite(score):
        return float("nan"), f"the task's score is {score}"
    return score, ""
