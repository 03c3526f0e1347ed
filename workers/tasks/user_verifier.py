"""The user's reward function (``task.kwargs.verifier: file.py:fn``) as a verifier.

Two signatures, told apart by parameter names and checked when the task is built (a mismatch
used to raise on every sample, so every sample was skipped, silently; a function with some of
verl's names but not ``solution_str`` is refused: called as ``fn(prompt, completion)`` its
``ground_truth`` would get the completion):

* StreamRL's ``fn(prompt: TaskPrompt, completion: str) -> float``;
* verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``, any subset
  of those names (verl's own gsm8k / math scorers lack ``data_source``); ``data_source`` and
  ``extra_info`` are the row's fields of those names, ``ground_truth`` the answer as the data
  gives it (``prompt.raw_answer``).

``options`` (``task.kwargs.verifier_kwargs``, verl's ``custom_reward_function.reward_kwargs``)
are passed to every call as keyword arguments; each must be a parameter of the function (or it
takes ``**kwargs``) and not one of the arguments above. The result is a number, or verl's
``{"score": number, ...}`` (the other keys are ignored). An ``async def`` function is run to
completion on each call (``scoring.resolve``).
"""
from __future__ import annotations

import inspect
from typing import Callable

from workers.tasks.scoring import as_score
from workers.types import TaskPrompt

VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
STREAMRL_ARGS = ("prompt", "completion")


def user_verifier(fn: Callable, spec: str, options: dict) -> Callable[[TaskPrompt, str], float]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: trust it
        return lambda prompt, completion: as_score(fn(prompt, completion, **options))
    params = sig.parameters
    if "solution_str" in params:  # verl's names
        _check_options(sig, options, spec, VERL_ARGS)
        required = [n for n, p in params.items() if p.default is p.empty and n not in options
                    and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in VERL_ARGS]
        if required:
            raise ValueError(f"task.kwargs.verifier: {spec!r} needs {required}, which a verl-style scorer is not "
                             f"given (it gets {list(VERL_ARGS)}; others can be set in task.kwargs.verifier_kwargs)")
        wanted = [n for n in VERL_ARGS if n in params]

        def verl_style(prompt: TaskPrompt, completion: str) -> float:
            values = {"data_source": prompt.meta.get("data_source", prompt.task), "solution_str": completion,
                      "ground_truth": prompt.answer if prompt.raw_answer is None else prompt.raw_answer,
                      "extra_info": prompt.meta.get("extra_info")}
            return as_score(fn(**{n: values[n] for n in wanted}, **options))
        return verl_style
    verl_named = [n for n in VERL_ARGS if n in params]
    if verl_named:  # verl's names without solution_str (e.g. prime_math's (model_output, ground_truth)):
        # called as fn(prompt, completion), its ground_truth would get the completion, silently
        raise ValueError(f"task.kwargs.verifier: {spec!r} takes ({', '.join(params)}): {verl_named} are verl's "
                         "names, but the completion's, solution_str, is not among them; name the completion "
                         "parameter solution_str (verl's compute_score(data_source, solution_str, ground_truth, "
                         "extra_info=None), any subset), or write fn(prompt, completion)")
    positional = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
    _check_options(sig, options, spec, tuple(positional))
    try:
        sig.bind(None, "", **options)
    except TypeError:
        raise ValueError(f"task.kwargs.verifier: {spec!r} takes ({', '.join(params)}); a verifier is "
                         "fn(prompt, completion) -> float, or verl's compute_score(data_source, solution_str, "
                         "ground_truth, extra_info=None)") from None
    return lambda prompt, completion: as_score(fn(prompt, completion, **options))


def _check_options(sig: inspect.Signature, options: dict, spec: str, given: tuple[str, ...]) -> None:
    """Each option a keyword the function takes, and not one it is already given."""
    params = sig.parameters
    clash = sorted(set(options) & set(given))
    if clash:
        raise ValueError(f"task.kwargs.verifier_kwargs: {clash} are the arguments every call gets "
                         f"({', '.join(given)}), not options of {spec!r}")
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(k for k in options if k not in params or params[k].kind is params[k].POSITIONAL_ONLY)
    if unknown:
        raise ValueError(f"task.kwargs.verifier_kwargs: {spec!r} takes no keyword argument {unknown} "
                         f"(it takes {', '.join(params)})")
