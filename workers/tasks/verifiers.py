"""Answer verifiers for file datasets: ``(prompt: TaskPrompt, completion: str) -> float``.

The completion's answer is the last ``<answer>...</answer>``, else the text after the last
``answer:`` / ``answer=``, else the whole stripped completion. A verifier never raises.
"""
from __future__ import annotations

import inspect
import math
import re
from typing import Callable

from workers.tasks.plugins import is_plugin, load_plugin
from workers.types import TaskPrompt

Verifier = Callable[[TaskPrompt, str], float]
_TAGGED = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
_MARKED = re.compile(r"answer\s*[:=]\s*(.*)$", re.IGNORECASE | re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def extract_answer(completion: str) -> str:
    tagged = _TAGGED.findall(completion)
    if tagged:
        return tagged[-1].strip()
    parts = re.split(r"answer\s*[:=]", completion, flags=re.IGNORECASE)
    if len(parts) > 1:
        return parts[-1].strip()
    return completion.strip()


def exact(prompt: TaskPrompt, completion: str) -> float:
    try:
        return float(extract_answer(completion) == prompt.answer.strip())
    except Exception:
        return 0.0


def _to_float(text: str) -> float | None:
    text = text.replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        nums = _NUMBER.findall(text)
        return float(nums[-1]) if nums else None


def numeric(prompt: TaskPrompt, completion: str, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> float:
    try:
        got, want = _to_float(extract_answer(completion)), _to_float(prompt.answer)
        if got is None or want is None or not math.isfinite(got):
            return 0.0
        return float(math.isclose(got, want, rel_tol=rel_tol, abs_tol=abs_tol))
    except Exception:
        return 0.0


def reasoning_gym_verifier(dataset_name: str) -> Verifier:
    """reasoning-gym's own ``score_answer`` for ``dataset_name`` (entry metadata from meta)."""
    import reasoning_gym

    fn = reasoning_gym.get_score_answer_fn(dataset_name)

    def verify(prompt: TaskPrompt, completion: str) -> float:
        try:
            entry = {"question": prompt.prompt, "answer": prompt.answer,
                     "metadata": dict(prompt.meta.get("metadata", prompt.meta))}
            r = float(fn(answer=extract_answer(completion), entry=entry))
            return r if math.isfinite(r) else 0.0
        except Exception:
            return 0.0

    return verify


VERIFIERS: dict[str, Callable[[], Verifier]] = {"exact": lambda: exact, "numeric": lambda: numeric}


def make_verifier(spec: str) -> Verifier:
    """``"exact"``, ``"numeric"``, ``"reasoning_gym:<dataset>"``, or the user's own function
    named ``"package.module:fn"`` or ``"path/to/file.py:fn"``, either
    ``fn(prompt: TaskPrompt, completion: str) -> float`` or verl's
    ``compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | {"score": ...}``
    (recognised by its parameter names; ``data_source`` / ``extra_info`` come from the row's
    fields of those names). A user function that raises or returns a non-number makes that
    sample's reward unusable: the trainer skips the sample and logs why (``skipped_samples``)."""
    if spec.startswith("reasoning_gym:"):
        return reasoning_gym_verifier(spec.split(":", 1)[1])
    if spec in VERIFIERS:
        return VERIFIERS[spec]()
    if is_plugin(spec):
        return _user_verifier(load_plugin(spec, "task.kwargs.verifier"), spec)
    raise ValueError(f"task.kwargs.verifier: {spec!r} is not one of {sorted(VERIFIERS)}, "
                     "'reasoning_gym:<dataset>' or 'package.module:fn' / 'file.py:fn'")


VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


def _user_verifier(fn, spec: str) -> Verifier:
    """The user's function as a Verifier, checked against the two signatures at load (a
    mismatch used to raise on every sample, so every sample was skipped, silently)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: trust it
        return lambda prompt, completion: _as_score(fn(prompt, completion))
    params = sig.parameters
    if "solution_str" in params:  # verl's names (its own gsm8k/math scorers lack data_source)
        required = [n for n, p in params.items() if p.default is p.empty
                    and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in VERL_ARGS]
        if required:
            raise ValueError(f"task.kwargs.verifier: {spec!r} needs {required}, which a verl-style scorer "
                             f"is not given (it gets {list(VERL_ARGS)})")
        wanted = [n for n in VERL_ARGS if n in params]

        def verl_style(prompt: TaskPrompt, completion: str) -> float:
            values = {"data_source": prompt.meta.get("data_source", prompt.task), "solution_str": completion,
                      "ground_truth": prompt.answer if prompt.raw_answer is None else prompt.raw_answer,
                      "extra_info": prompt.meta.get("extra_info")}
            return _as_score(fn(**{n: values[n] for n in wanted}))
        return verl_style
    try:
        sig.bind(None, "")
    except TypeError:
        raise ValueError(f"task.kwargs.verifier: {spec!r} takes ({', '.join(params)}); a verifier is "
                         "fn(prompt, completion) -> float, or verl's compute_score(data_source, solution_str, "
                         "ground_truth, extra_info=None)") from None
    return lambda prompt, completion: _as_score(fn(prompt, completion))


def _as_score(out) -> float:
    """A number, or verl's {"score": number, ...}; anything else says what it was."""
    if isinstance(out, dict):
        if "score" not in out:
            raise ValueError(f"the reward returned a dict without 'score' (keys {sorted(map(str, out))})")
        out = out["score"]
    if out is None or isinstance(out, (str, bytes)) or not hasattr(out, "__float__"):
        raise ValueError(f"the reward returned {type(out).__name__} {out!r:.60}, not a number")
    return float(out)
