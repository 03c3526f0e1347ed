"""The user's reward function (``task.kwargs.verifier: file.py:fn``) as a verifier.

Three signatures, told apart by parameter names and checked when the task is built (a mismatch
used to raise on every sample, so every sample was skipped, silently; a function with some of
verl's names but not ``solution_str`` is refused: called as ``fn(prompt, completion)`` its
``ground_truth`` would get the completion):

* StreamRL's ``fn(prompt: TaskPrompt, completion: str) -> float``;
* verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``, any subset
  of those names (verl's own gsm8k / math scorers lack ``data_source``); ``data_source`` and
  ``extra_info`` are the row's fields of those names, ``ground_truth`` the answer as the data
  gives it (``prompt.raw_answer``);
* verl's batch reward manager's ``compute_score(data_sources, solution_strs, ground_truths,
  extra_infos)`` (the plural names, any subset with ``solution_strs``): lists in, one score per
  sample out. The verifier then has ``batch(prompts, completions)``, and its task a
  ``score_batch``: the reward pool hands it many samples per call (``reward_pool.py``).

``options`` (``task.kwargs.verifier_kwargs``, verl's ``custom_reward_function.reward_kwargs``)
are passed to every call as keyword arguments; each must be a parameter of the function (or it
takes ``**kwargs``) and not one of the arguments above. The result is a number, or verl's
``{"score": number, ...}``, returned as it is: the reward pool reads the score (``scoring.as_score``)
and the dict's other numbers and texts (``scoring.reward_info``: evaluation's ``acc`` headline and
``maj@N`` of ``pred``). An ``async def`` function is run to completion on each call
(``scoring.resolve``).
"""
from __future__ import annotations

import inspect
from typing import Callable

from workers.tasks.scoring import resolve
from workers.types import TaskPrompt

VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
VERL_BATCH_ARGS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")
STREAMRL_ARGS = ("prompt", "completion")


def user_verifier(fn: Callable, spec: str, options: dict) -> Callable[[TaskPrompt, str], object]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: trust it
        return lambda prompt, completion: resolve(fn(prompt, completion, **options))
    params = sig.parameters
    streamrl = list(params)[:2] == list(STREAMRL_ARGS)  # fn(prompt, completion, ...): whatever else it takes
    if "solution_strs" in params and not streamrl:  # verl's batch reward manager's names
        return BatchVerifier(fn, _verl_wanted(sig, options, spec, VERL_BATCH_ARGS), options)
    if "solution_str" in params and not streamrl:  # verl's names
        wanted = _verl_wanted(sig, options, spec, VERL_ARGS)

        def verl_style(prompt: TaskPrompt, completion: str):
            values = _verl_values(prompt, completion)
            return resolve(fn(**{n: values[n] for n in wanted}, **options))
        return verl_style
    verl_named = [n for n in VERL_ARGS + VERL_BATCH_ARGS if n in params]
    if verl_named and not streamrl:  # verl's names without solution_str (e.g. prime_math's (model_output, ground_truth)):
        # called as fn(prompt, completion), its ground_truth would get the completion, silently
        batch = any(n in VERL_BATCH_ARGS for n in verl_named)
        one = "solution_strs" if batch else "solution_str"
        sig_text = ("compute_score(data_sources, solution_strs, ground_truths, extra_infos), any subset, for a "
                    "batch" if batch else "compute_score(data_source, solution_str, ground_truth, extra_info=None), "
                    "any subset")
        raise ValueError(f"task.kwargs.verifier: {spec!r} takes ({', '.join(params)}): {verl_named} are verl's "
                         f"names, but the completion's, {one}, is not among them; name the completion "
                         f"parameter {one} (verl's {sig_text}), or write fn(prompt, completion)")
    positional = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
    _check_options(sig, options, spec, tuple(positional))
    try:
        sig.bind(None, "", **options)
    except TypeError:
        raise ValueError(f"task.kwargs.verifier: {spec!r} takes ({', '.join(params)}); a verifier is "
                         "fn(prompt, completion) -> float, or verl's compute_score(data_source, solution_str, "
                         "ground_truth, extra_info=None)") from None
    return lambda prompt, completion: resolve(fn(prompt, completion, **options))


def _verl_wanted(sig: inspect.Signature, options: dict, spec: str, names: tuple[str, ...]) -> list[str]:
    """Which of verl's ``names`` the function is given: those it names, or all of them when it
    takes ``**kwargs`` (verl passes all four by keyword); a ValueError when it needs others."""
    params = sig.parameters
    _check_options(sig, options, spec, names)
    by_position = [n for n in names if n in params and params[n].kind is params[n].POSITIONAL_ONLY]
    if by_position:  # verl passes them by keyword: every call raised, every sample was skipped
        raise ValueError(f"task.kwargs.verifier: {spec!r} takes {by_position} positional-only (before '/'); "
                         "verl passes its arguments by keyword: drop the '/'")
    required = [n for n, p in params.items() if p.default is p.empty and n not in options
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in names]
    if required:
        raise ValueError(f"task.kwargs.verifier: {spec!r} needs {required}, which a verl-style scorer is not "
                         f"given (it gets {list(names)}; others can be set in task.kwargs.verifier_kwargs)")
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return list(names)
    return [n for n in names if n in params]


def _verl_values(prompt: TaskPrompt, completion: str) -> dict:
    """verl's arguments for one sample. ``extra_info`` is the row's (a copy: a scorer that writes
    to it changes no other sample's), or ``{}`` when it has none, as verl's dataset gives it."""
    extra = prompt.meta.get("extra_info")
    return {"data_source": prompt.meta.get("data_source", prompt.task), "solution_str": completion,
            "ground_truth": prompt.answer if prompt.raw_answer is None else prompt.raw_answer,
            "extra_info": {} if extra is None else dict(extra) if isinstance(extra, dict) else extra}


class BatchVerifier:
    """verl's batch ``compute_score(data_sources, solution_strs, ground_truths, extra_infos)``:
    ``batch`` calls it once for many samples (its results are checked per sample by the caller,
    ``scoring.safe_score_batch``); called for one sample, it is a batch of one."""

    def __init__(self, fn: Callable, wanted: list[str], options: dict):
        self.fn, self.wanted, self.options = fn, wanted, options

    def batch(self, prompts: list[TaskPrompt], completions: list[str]):
        import numpy as np

        rows = [_verl_values(p, c) for p, c in zip(prompts, completions)]
        given = {n: [r[n[:-1]] for r in rows] for n in self.wanted}
        for n in ("data_sources", "extra_infos"):  # verl's come from non_tensor_batch: numpy object arrays
            if n in given:  # (so `data_sources == "gsm8k"` is a mask there, and here)
                arr = np.empty(len(rows), dtype=object)
                arr[:] = given[n]
                given[n] = arr
        return self.fn(**given, **self.options)

    def __call__(self, prompt: TaskPrompt, completion: str):
        out = list(resolve(self.batch([prompt], [completion])))
        if len(out) != 1:
            raise ValueError(f"the batch reward returned {len(out)} scores for 1 sample")
        return resolve(out[0])


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
