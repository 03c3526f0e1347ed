"""Prompts checked once, before the first iteration: the task's prompts and demonstrations
well-formed, its ``score`` callable as the trainer calls it, and every prompt fitting the
generation context (``prompt_fit``).

A prompt whose tokens (after the chat or prompt template) leave no room for one output token
in the engines' context (``max_model_len``) is refused by every engine. Found mid-run, that
is a crash in iteration N after hours of work; found here it is one error naming the split and
the prompt's index (``train.overlong_prompts: error``, the default), or the prompt is dropped
with a count (``skip``), or cut to ``train.max_prompt_tokens`` (``truncate_*``). ``check_task``
also returns what a generation instance joining later must hold (``prompt_fit.ContextNeed``).
"""
from __future__ import annotations

import sys
from typing import Callable, Sequence

from controller.prompt_fit import KEPT, ContextNeed, PromptTooLong, fitting_prompts
from workers.types import TaskPrompt, prompt_text


def task_prompts(task, split: str) -> list[TaskPrompt]:
    """``task.prompts(split)`` as a list, each item checked: a ``TaskPrompt`` whose ``prompt`` is a
    string with some text (or whose ``messages`` hold the chat) and whose ``answer`` is a string.
    Whatever the task's own code raises, and what it returns that is not that, is a ValueError
    naming the split and the item's index (a user's task: a dict, a generator, an empty prompt
    were tracebacks or silent)."""
    try:
        got = task.prompts(split)
        if got is None:
            raise ValueError(f"prompts({split!r}) returned None; it must return a list of workers.types.TaskPrompt")
        items = list(got)
    except (ValueError, OSError, ImportError):
        raise
    except Exception as e:  # noqa: BLE001 - the user's prompts(): one line naming it, not a traceback
        raise ValueError(f"prompts({split!r}) raised {type(e).__name__}: {e}") from e
    if isinstance(got, (str, bytes, dict)) or hasattr(got, "columns"):  # a DataFrame iterates its column names
        raise ValueError(f"prompts({split!r}) returned a {type(got).__name__}; it must return a list of "
                         "workers.types.TaskPrompt")
    for i, item in enumerate(items):
        if not isinstance(item, TaskPrompt):
            raise ValueError(f"task.prompts({split!r})[{i}] is a {type(item).__name__}, not a workers.types.TaskPrompt "
                             f"(TaskPrompt(prompt=..., answer=..., task=...)): {item!r:.60}")
        _check_prompt_text(item, f"task.prompts({split!r})[{i}]")
        if not isinstance(item.answer, str):
            raise ValueError(f"task.prompts({split!r})[{i}] ({item.prompt[:40]!r}...): answer must be a string "
                             f"(raw_answer holds any other form), got {type(item.answer).__name__}")
        if not isinstance(item.task, str) or not item.task.strip():
            raise ValueError(f"task.prompts({split!r})[{i}] ({item.prompt[:40]!r}...): task must be a non-empty "
                             f"string (the eval group, eval/<task>), got {item.task!r:.40}")
        _check_messages(item, f"task.prompts({split!r})[{i}]")
    _check_picklable(items, split)
    return items


def _check_prompt_text(item: TaskPrompt, where: str) -> None:
    """``prompt``: a string with some text, or the chat in ``messages``."""
    if not isinstance(item.prompt, str) or not (item.prompt.strip() or item.messages):
        raise ValueError(f"{where}: prompt must be a string with some text, got {item.prompt!r:.40}")


def _check_messages(item: TaskPrompt, where: str) -> None:
    """``messages``: chat turns, each a dict with a string ``role`` (a tuple of strings passed the
    checks and failed in the model bootstrap with an AttributeError, or as "the template cannot
    render it")."""
    msgs = item.messages
    if msgs is None:
        return
    if isinstance(msgs, (str, bytes, dict)) or not hasattr(msgs, "__iter__"):
        raise ValueError(f"{where}: messages must be a sequence of chat turns ({{'role': ..., 'content': ...}}), "
                         f"got a {type(msgs).__name__}")
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"{where}: messages[{j}] must be a chat turn, a dict with a string 'role' (and its "
                             f"'content'), got {m!r:.60}")
    if not item.prompt.strip() and not prompt_text(item).strip():
        # the ranker reads this text (prompt_text): a chat of empty turns passed here and stopped a
        # run with a ranker at the first iteration that drew it (review, s54)
        raise ValueError(f"{where}: prompt is empty and no turn of its messages has any text")


def _check_picklable(items: list[TaskPrompt], split: str) -> None:
    """Prompts travel to the trainer ranks by RPC (pickled): a lambda or an open file in
    ``meta`` failed there, after the model bootstrap, with the RPC layer's traceback."""
    import pickle

    try:
        pickle.dumps(items)
    except Exception:  # noqa: BLE001 - PicklingError, TypeError, AttributeError: which item says
        for i, item in enumerate(items):
            try:
                pickle.dumps(item)
            except Exception as e:  # noqa: BLE001
                raise ValueError(f"task.prompts({split!r})[{i}] ({item.prompt[:40]!r}...) cannot be pickled, which "
                                 f"sending it to the trainer ranks needs (TaskPrompt.meta holds data, not functions "
                                 f"or open files): {type(e).__name__}: {e}") from None


def check_demonstrations(task, task_name: str) -> None:
    """A task's own SFT demonstrations (``demonstrations(split) -> [(TaskPrompt, completion)]``,
    used when ``model.init`` builds the model), checked on the controller before the trainer rank
    trains on them: a wrong type was that rank's traceback, printed twice."""
    from controller.config_types import ConfigError

    if not callable(getattr(task, "demonstrations", None)):
        return
    try:
        pairs = list(task.demonstrations("train"))
    except Exception as e:  # noqa: BLE001 - the user's code: one line naming it
        raise ConfigError(f"task ({task_name}): demonstrations('train') raised {type(e).__name__}: {e}") from None
    if not pairs:
        raise ConfigError(f"task ({task_name}): demonstrations('train') is empty: nothing for model.init's SFT")
    for i, pair in enumerate(pairs):
        ok = isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], TaskPrompt) and \
            isinstance(pair[1], str)
        if not ok:
            raise ConfigError(f"task ({task_name}): demonstrations('train')[{i}] must be a (TaskPrompt, completion "
                              f"text) pair, got {pair!r:.80}")
        where = f"task ({task_name}): demonstrations('train')[{i}]"
        try:
            _check_prompt_text(pair[0], where)
            _check_messages(pair[0], where)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def check_score_signature(task, item: TaskPrompt, task_name: str) -> None:
    """``task.score`` must take ``(prompt, completion)``: a wrong signature raised on every sample,
    after the bootstrap and the first generation."""
    import inspect

    try:
        sig = inspect.signature(task.score)
    except (TypeError, ValueError, AttributeError):  # a builtin, or no score (the task's own check says so)
        return
    try:
        sig.bind(item, "")
    except TypeError:
        from controller.config_types import ConfigError

        raise ConfigError(f"task ({task_name}): score takes ({', '.join(sig.parameters)}); it is called as "
                          "score(prompt: TaskPrompt, completion: str) -> float") from None


def checked_task(task, task_name: str, splits: Sequence[str]) -> "FittingTask":
    """``task`` seen through its ``splits``' prompts, each read once and checked
    (``task_prompts``) when the controller builds the task, before the model bootstrap: a
    bad split is a ``ConfigError`` naming it. The start check (``check_task``) reads these
    lists, not the task's ``prompts()`` again."""
    from controller.config_types import ConfigError

    checked = {}
    for split in splits:
        try:
            checked[split] = task_prompts(task, split)
        except (ValueError, OSError, ImportError) as e:
            raise ConfigError(f"task ({task_name}) {split} prompts: {e}") from None
    if checked.get(splits[0]):
        check_score_signature(task, checked[splits[0]][0], task_name)
    return FittingTask(task, checked)


class RefusedSplit:
    """A split the start check refused where reading it was optional (a REPL run's test split,
    which an ``eval`` may never read): reading it says why (it fell back to the unchecked split)."""

    def __init__(self, why: str):
        self.why = why


class FittingTask:
    """A task seen through the checked prompt lists (split -> prompts); scoring and anything
    else (``demonstrations``, ``name``) are the task's own."""

    def __init__(self, task, prompts: dict[str, list[TaskPrompt] | RefusedSplit]):
        self.task, self._prompts = task, prompts

    def prompts(self, split: str) -> Sequence[TaskPrompt]:
        got = self._prompts.get(split)
        if isinstance(got, RefusedSplit):
            raise ValueError(got.why)
        return got if got is not None else self.task.prompts(split)

    def score(self, prompt: TaskPrompt, completion: str) -> float:
        return self.task.score(prompt, completion)

    def __getattr__(self, name: str):
        if name == "task":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.task, name)


def chat_without_template_note(prompts: Sequence[TaskPrompt], has_chat_template: bool) -> str | None:
    """The one-line notice for chat prompts (``messages``) on a tokenizer with no chat template:
    they are flattened (roles dropped), where transformers' ``apply_chat_template`` refuses."""
    if has_chat_template:
        return None
    chats = sum(1 for p in prompts if p.messages)
    if not chats:
        return None
    return (f"{chats} of {len(prompts)} train prompts are chat messages, but the model folder's tokenizer has "
            "no chat template (tokenizer_config.json chat_template): each is its turns' contents, roles "
            "dropped, joined by blank lines, in tokenizer.prompt_template; give the folder a chat template "
            "to keep the roles")


def tools_without_template_note(tools: Sequence[dict], has_chat_template: bool) -> str | None:
    """The one-line notice for tool schemas (``multi_turn.tools``, or the env's ``TOOLS``) on a
    tokenizer with no chat template: only a chat template renders them into the prompt."""
    if has_chat_template or not tools:
        return None
    names = ", ".join(str(t["function"]["name"]) for t in tools[:8]) + (" ..." if len(tools) > 8 else "")
    return (f"multi_turn.tools: the model folder's tokenizer has no chat template (tokenizer_config.json "
            f"chat_template), so the {len(tools)} tool schema(s) ({names}) cannot be shown to the model; the run "
            "goes on without them: describe the tools in the prompts, or give the folder a chat template that "
            "renders tools")


def check_task(task, train, task_name: str, context: int, encode: Callable[[TaskPrompt], Sequence[int]],
               vocab_size: int = 0, repl: bool = False) -> tuple[FittingTask, ContextNeed]:
    """The run's start check: ``task``'s train split (and test split, when ``train.eval_every`` or
    ``eval_before_train`` evaluates, or the REPL may: ``repl``, where a test split the check
    refuses is left for an ``eval`` to say so; a REPL eval read the split unchecked, so
    ``overlong_prompts`` did not apply to it: review, session 51) against the engines' smallest
    ``context``, under ``train``'s ``overlong_prompts`` / ``max_prompt_tokens``. Returns the task
    seen through the kept prompts and what a joining instance must hold; an over-long prompt
    (``error``), a split left empty, the task's data (a file, a line, a field) raise
    ``ConfigError`` naming it; a context that cuts the longest kept prompt's answers is said."""
    from controller.config_types import ConfigError

    need = ContextNeed(context, train.max_tokens)
    kept = {}
    for split in ("train", "test") if train.evaluates or repl else ("train",):
        truncated: list[int] = []
        optional = split == "test" and not train.evaluates  # (the REPL's: a run that may never eval)
        try:
            kept[split], dropped = fitting_prompts(task_prompts(task, split), encode, context, split,
                                                   train.overlong_prompts, train.max_prompt_tokens,
                                                   ContextNeed(context, train.max_tokens) if optional else need,
                                                   vocab_size, truncated)
        except PromptTooLong as e:
            if optional:
                kept[split] = RefusedSplit(str(e))
                continue
            raise ConfigError(str(e)) from None
        except (ValueError, OSError, ImportError) as e:
            if optional:
                kept[split] = RefusedSplit(f"task ({task_name}) {split} prompts: {e}")
                continue
            raise ConfigError(f"task ({task_name}) {split} prompts: {e}") from None
        if dropped:
            print(f"[controller] train.overlong_prompts skip: dropped {len(dropped)} of "
                  f"{len(dropped) + len(kept[split])} {split} prompts longer than train.max_prompt_tokens "
                  f"or with no room for an output token in max_model_len {context} "
                  f"(indices {dropped[:10]}{' ...' if len(dropped) > 10 else ''})", file=sys.stderr, flush=True)
        if truncated:
            print(f"[controller] train.overlong_prompts {train.overlong_prompts}: cut {len(truncated)} of "
                  f"{len(kept[split])} {split} prompts longer than train.max_prompt_tokens {train.max_prompt_tokens} "
                  f"to their {KEPT[train.overlong_prompts]} {train.max_prompt_tokens} tokens (indices "
                  f"{truncated[:10]}{' ...' if len(truncated) > 10 else ''})", file=sys.stderr, flush=True)
        if not kept[split] and optional:
            kept[split] = RefusedSplit(f"train.overlong_prompts skip: every {split} prompt is over-long (longer "
                                       "than train.max_prompt_tokens, or no room for an output token in the "
                                       f"engines' context of {context} tokens)")
            continue
        if not kept[split]:
            key = "eval_every" if train.eval_every else "eval_before_train"
            raise ConfigError(f"train.overlong_prompts skip: every {split} prompt is over-long (longer than "
                              f"train.max_prompt_tokens, or no room for an output token in the engines' "
                              f"context of {context} tokens)" + (f": train.{key} would evaluate nothing"
                                                                 if split == "test" else ""))
    if need.longest + need.max_tokens > context:  # vLLM refuses to start here; verl asks prompt + response
        print(f"[controller] the engines' context (max_model_len) is {context} tokens: the longest kept prompt, "
              f"{need.where}, is {need.longest}, so its answers stop at {context - need.longest} of "
              f"train.max_tokens {need.max_tokens} (finish reason length); raise engine.kv_cache_tokens / "
              "engine.max_model_len, or lower train.max_prompt_tokens", file=sys.stderr, flush=True)
    return FittingTask(task, kept), need
