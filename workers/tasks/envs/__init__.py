"""Environments of multi-turn rollouts (``multi_turn.env``; workers/generation/multi_turn.py).

An environment is a callable ``env(task, messages) -> str | dict | None``: ``task`` the dataset
item (a ``TaskPrompt``), ``messages`` the conversation so far in OpenAI format (the prompt's chat,
then the assistant turns and the earlier observations). It returns the next observation: a str
is a ``{"role": "tool", "content": str}`` message, a dict with ``role`` and ``content`` is used as
is (``role: user`` for a user simulator), None ends the trajectory. It runs on a thread pool
(``multi_turn.workers`` calls at once per generation instance): it must be thread-safe.

``multi_turn.env`` names a built-in one (``ENVS``) or your own, ``module:fn`` / ``file.py:fn``.
"""
from __future__ import annotations

from typing import Callable

from workers.tasks.envs.calculator import calculator_env
from workers.tasks.plugins import is_plugin, load_plugin

ENVS: dict[str, Callable] = {"calculator": calculator_env}


def load_env(spec: str) -> Callable:
    """The environment ``multi_turn.env: spec`` names (a ValueError naming the key)."""
    if spec in ENVS:
        return ENVS[spec]
    if not is_plugin(spec):
        raise ValueError(f"multi_turn.env: {spec!r} is not one of {sorted(ENVS)}, nor module:fn / file.py:fn of "
                         "your own environment")
    return load_plugin(spec, "multi_turn.env")
