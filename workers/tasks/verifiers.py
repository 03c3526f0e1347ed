"""Answer verifiers for file datasets: ``(prompt: TaskPrompt, completion: str) -> float``.

Built in (``VERIFIERS``; their options come from ``task.kwargs.verifier_kwargs``):

* ``exact``: the completion's answer (``answers.answer_span``: the last ``<answer>`` tag,
  ``\\boxed{}``, ``####`` or ``answer:`` / ``answer=``) is the reference text. A reference that
  is a number in the data (JSON ``72``, not ``"72"``) is compared by value, as ``numeric`` does.
* ``numeric(rel_tol, abs_tol)``: a reference that is one number (``72``, ``1,000``, ``3/4``,
  ``\\frac{1}{2}``) is compared by value with the answer: all of the answer when it is one
  number, else the first number after the tag or mark (the one it marks), else the
  completion's last number; within ``rel_tol`` (default 1e-6) / ``abs_tol`` (1e-9), except
  that without either option two integers must be equal (``2000001`` is not ``2000000``); a
  Unicode minus (U+2212) is a sign. Any other reference (a ratio ``2:30``, a tuple, an equation) must
  equal the answer's text, spaces and surrounding ``$`` aside.
* ``gsm8k(method, format_score, score)``: verl's GSM8K rule. ``strict``: the number after the
  last ``#### ``; ``flexible``: the completion's last number. Commas and ``$`` are removed;
  ``score`` when it equals the reference (as text or as a number), ``format_score`` when it does
  not, 0 when there is none.
* ``math``: verl's MATH rule: the content of the last ``\\boxed{}`` / ``\\fbox{}`` equals the
  reference after ``latex.normalise`` (or has its exact value); 0 without one.
* ``reasoning_gym:<dataset>``: reasoning-gym's own ``score_answer``.
* ``reward_model(path, max_length, batch_size)``: a sequence-classification reward model's
  logit (``reward_model.py``); it scores the completion, not an answer, and raises on a text it
  cannot score (that sample is skipped, named).

The rule-based verifiers never raise: a malformed completion scores 0.
"""
from __future__ import annotations

import inspect
import math
import numbers
import re
from functools import partial
from typing import Callable

from workers.tasks.answers import answer_span, close, extract_answer, last_boxed, numbers_in, value
from workers.tasks.latex import equivalent
from workers.tasks.plugins import is_plugin, load_plugin
from workers.tasks.user_verifier import user_verifier
from workers.types import TaskPrompt

Verifier = Callable[[TaskPrompt, str], float]
GSM8K_METHODS = ("strict", "flexible")
_GSM8K = {"strict": re.compile(r"#### (-?[0-9.,]+)"), "flexible": re.compile(r"-?[0-9.,]+")}


def _never_raises(verify: Verifier) -> Verifier:
    def safe(prompt: TaskPrompt, completion: str) -> float:
        try:
            return verify(prompt, completion)
        except Exception:  # noqa: BLE001 - a malformed completion scores 0
            return 0.0
    return safe


def _squash(text: str) -> str:
    """Text compared as text: no spaces, no surrounding ``$``, no final period."""
    return "".join(text.split()).strip("$").rstrip(".")


def is_number(answer) -> bool:
    """Whether a reference as the data gives it is a number (JSON ``2.0``; ``true`` is not)."""
    return isinstance(answer, numbers.Real) and not isinstance(answer, bool)


def exact(prompt: TaskPrompt, completion: str) -> float:
    if is_number(prompt.raw_answer):
        return numeric(prompt, completion)
    try:
        return float(extract_answer(completion) == prompt.answer.strip())
    except Exception:  # noqa: BLE001
        return 0.0


REL_TOL, ABS_TOL = 1e-6, 1e-9  # numeric's tolerances when not given (not between two integers)


def numeric(prompt: TaskPrompt, completion: str, rel_tol: float | None = None, abs_tol: float | None = None) -> float:
    try:
        span, marked = answer_span(completion)
        want = value(prompt.answer)
        if want is None:  # not one number: no number in it stands for it
            return float(_squash(span) == _squash(prompt.answer))
        got = value(span)
        if got is None:
            found = numbers_in(span)
            got = (found[0] if marked else found[-1]) if found else None
        if got is None:
            return 0.0
        if rel_tol is None and abs_tol is None and got.denominator == want.denominator == 1:
            return float(got == want)  # a default relative tolerance made 2000000 and 2000001 one answer
        return float(close(got, want, REL_TOL if rel_tol is None else rel_tol, ABS_TOL if abs_tol is None else abs_tol))
    except Exception:  # noqa: BLE001
        return 0.0


def _same_number(got: str, want: str) -> bool:
    if got == want:
        return True
    a, b = value(got), value(want)
    return a is not None and a == b


def gsm8k(prompt: TaskPrompt, completion: str, method: str = "strict", format_score: float = 0.0,
          score: float = 1.0) -> float:
    found = [s for s in _GSM8K[method].findall(completion) if any(c.isdigit() for c in s)]  # not "." or ","
    if not found:
        return 0.0
    got = found[-1].replace(",", "").replace("$", "")
    return float(score if _same_number(got, prompt.answer.replace(",", "").strip()) else format_score)


def math_boxed(prompt: TaskPrompt, completion: str) -> float:
    boxed = last_boxed(completion)
    return float(boxed is not None and equivalent(boxed[2], prompt.answer))


def _option(name: str, x, low: float = -math.inf) -> float:
    """A real-valued option, checked once, at load."""
    if not is_number(x) or not low <= x < math.inf:
        raise ValueError(f"task.kwargs.verifier_kwargs.{name}: a number >= {low}, got {x!r}")
    return float(x)


def _numeric_verifier(rel_tol: float | None = None, abs_tol: float | None = None) -> Verifier:
    return partial(numeric, rel_tol=None if rel_tol is None else _option("rel_tol", rel_tol, 0),
                   abs_tol=None if abs_tol is None else _option("abs_tol", abs_tol, 0))


def _gsm8k_verifier(method: str = "strict", format_score: float = 0.0, score: float = 1.0) -> Verifier:
    if method not in GSM8K_METHODS:
        raise ValueError(f"task.kwargs.verifier_kwargs.method: {method!r} is not one of {GSM8K_METHODS} (gsm8k)")
    return _never_raises(partial(gsm8k, method=method, format_score=_option("format_score", format_score),
                                 score=_option("score", score)))


def reasoning_gym_verifier(dataset_name: str) -> Verifier:
    """reasoning-gym's own ``score_answer`` for ``dataset_name`` (entry metadata from meta)."""
    import reasoning_gym

    if dataset_name not in reasoning_gym.factory.DATASETS:
        raise ValueError(f"task.kwargs.verifier: 'reasoning_gym:{dataset_name}': {dataset_name!r} is not a "
                         f"registered reasoning-gym dataset (e.g. {sorted(reasoning_gym.factory.DATASETS)[:5]})")
    fn = reasoning_gym.get_score_answer_fn(dataset_name)

    def verify(prompt: TaskPrompt, completion: str) -> float:
        try:
            entry = {"question": prompt.prompt, "answer": prompt.answer,
                     "metadata": dict(prompt.meta.get("metadata", prompt.meta))}
            r = float(fn(answer=extract_answer(completion), entry=entry))
            return r if math.isfinite(r) else 0.0
        except Exception:  # noqa: BLE001
            return 0.0

    return verify


# name -> builder: its keyword arguments are the verifier's options (task.kwargs.verifier_kwargs)
VERIFIERS: dict[str, Callable[..., Verifier]] = {
    "exact": lambda: exact,
    "numeric": _numeric_verifier,
    "gsm8k": _gsm8k_verifier,
    "math": lambda: _never_raises(math_boxed),
    "reward_model": lambda path, max_length=None, batch_size=16: _reward_model(path, max_length, batch_size),
}


def _reward_model(path: str, max_length: int | None, batch_size: int) -> Verifier:
    from workers.tasks.reward_model import RewardModelVerifier

    return RewardModelVerifier(path, max_length, batch_size)


def is_builtin(spec: str) -> bool:
    """Whether ``spec`` names a built-in verifier that compares the answer as text or a number."""
    return (spec in VERIFIERS and spec != "reward_model") or spec.startswith("reasoning_gym:")


def make_verifier(spec: str, options: dict | None = None) -> Verifier:
    """``spec``: a name in ``VERIFIERS``, ``"reasoning_gym:<dataset>"``, or the user's own function
    ``"package.module:fn"`` / ``"path/to/file.py:fn"`` (``user_verifier.user_verifier``).
    ``options`` (``task.kwargs.verifier_kwargs``): keyword arguments for it, checked here."""
    options = dict(options or {})
    if spec.startswith("reasoning_gym:"):
        return _built(lambda: reasoning_gym_verifier(spec.split(":", 1)[1]), spec, options)
    if spec in VERIFIERS:
        return _built(VERIFIERS[spec], spec, options)
    if is_plugin(spec):
        return user_verifier(load_plugin(spec, "task.kwargs.verifier"), spec, options)
    raise ValueError(f"task.kwargs.verifier: {spec!r} is not one of {sorted(VERIFIERS)}, "
                     "'reasoning_gym:<dataset>' or 'package.module:fn' / 'file.py:fn'")


def _built(builder: Callable[..., Verifier], spec: str, options: dict) -> Verifier:
    signature = inspect.signature(builder)
    try:
        signature.bind(**options)
    except TypeError:
        takes = list(signature.parameters)
        raise ValueError(f"task.kwargs.verifier_kwargs: {sorted(options)} are not options of the verifier "
                         f"{spec!r} (it takes {takes or 'none'})") from None
    return builder(**options)
