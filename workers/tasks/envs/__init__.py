"""Environments of multi-turn rollouts (``multi_turn.env``; workers/generation/multi_turn.py).

An environment is a callable ``env(task, messages) -> str | dict | None``, or an ``async def``
one (awaited on its pool thread: ``scoring.resolve``): ``task`` the dataset item (a
``TaskPrompt``), ``messages`` the conversation so far in OpenAI format (the prompt's chat, then
the assistant turns and the earlier observations). It returns the next observation: a str
is a ``{"role": "tool", "content": str}`` message, a dict with ``role`` and ``content`` is used as
is (``role: user`` for a user simulator), None ends the trajectory. It runs on a thread pool
(``multi_turn.workers`` calls at once per generation instance): it must be thread-safe.

``multi_turn.env`` names a built-in one (``ENVS``) or your own, ``module:fn`` / ``file.py:fn``;
a class is built once per generation instance (no arguments) and its instances are called
(``make_env``). Per-trajectory state (verl's tool create / release): an environment object may
have ``start(trajectory, task)`` and ``end(trajectory)``, and its call may take a ``trajectory``
keyword (``MultiTurnEngine``; docs/multi_turn.md). A ``TOOLS`` attribute (a list of OpenAI tool schemas) is what the policy's
prompts show when ``multi_turn.tools`` is empty (``tools.py``).
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

from workers.tasks.envs.calculator import calculator_env
from workers.tasks.plugins import builtin_or_plugin

ENVS: dict[str, Callable] = {"calculator": calculator_env}


def load_env(spec: str) -> Callable:
    """The environment ``multi_turn.env: spec`` names (a ValueError naming the key)."""
    env = builtin_or_plugin(spec, ENVS, "multi_turn.env", ", nor module:fn / file.py:fn of your own environment")
    if inspect.isclass(env) and not any("__call__" in vars(k) for k in env.__mro__[:-1]):
        raise ValueError(f"multi_turn.env: {spec!r} is a class without __call__; an environment class's instances "
                         "are called as env(task, messages)")
    _check_call(env, spec)
    return env


def _check_call(env, spec: str) -> None:
    """Refuse at start an environment that cannot be called as ``env(task, messages)`` (with
    ``trajectory=`` when its signature names one, as ``MultiTurnEngine`` calls it): it failed
    every tool call of the run, each sample skipped, and the run ended with exit 0 (review,
    s55). A decorator's wrapper that takes its own arguments (one that supplies a client) is
    read as it is called; one that passes ``*args, **kwargs`` on, by what it wraps."""
    fn, lead = _called(env)
    try:
        followed = inspect.signature(fn)
        own = inspect.signature(fn, follow_wrapped=False)
    except (TypeError, ValueError):  # a builtin: trust it
        return
    extra = {"trajectory": ""} if _takes_trajectory(followed) else {}
    passes_on = any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in own.parameters.values())
    problems = []
    for sig in (followed,) if passes_on or own == followed else (followed, own):
        try:
            sig.bind(*lead, None, [], **extra)
            return
        except TypeError as e:
            problems.append(e)
    takes = ", ".join(list(followed.parameters)[len(lead):])
    raise ValueError(f"multi_turn.env: {spec!r} takes ({takes}): {problems[0]}; an environment is called as "
                     "env(task, messages), and may take a trajectory keyword") from None


def _called(env) -> tuple:
    """(the function a call of ``env`` runs, the arguments Python puts before the caller's): a
    class's instances are called (``__call__``: self first, none for a staticmethod), an object
    through its class's ``__call__``."""
    owner = env if inspect.isclass(env) else type(env)
    if not inspect.isclass(env) and (inspect.isroutine(env) or not hasattr(owner, "__call__")
                                     or isinstance(env, functools.partial)):
        return env, ()
    static = inspect.getattr_static(owner, "__call__", None)
    if isinstance(static, staticmethod):
        return static.__func__, ()
    if inspect.isclass(env):
        return env.__call__, (() if isinstance(static, classmethod) else (None,))
    return env, ()


def takes_trajectory(env) -> bool:
    """Whether ``env`` (a function, or an object's ``__call__``) takes a ``trajectory`` keyword:
    then each call gets the trajectory's id, as its ``start`` and ``end`` do (``MultiTurnEngine``)."""
    try:
        return _takes_trajectory(inspect.signature(env))
    except (TypeError, ValueError):
        return False


def _takes_trajectory(sig: inspect.Signature) -> bool:
    return "trajectory" in sig.parameters or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())


def make_env(spec: str) -> Callable:
    """The environment to call: ``load_env(spec)``, a class instantiated (no arguments; one per
    generation instance, so it may hold a client or a cache its calls share, thread-safely)."""
    env = load_env(spec)
    if not inspect.isclass(env):
        return env
    try:
        return env()
    except Exception as e:  # noqa: BLE001 - your class's constructor: named, with the key
        raise ValueError(f"multi_turn.env: building {spec!r} (a class, called with no arguments) failed "
                         f"({type(e).__name__}: {e})") from e
