"""A prompt's length against the generation context: the fit check, truncation, and the context
a joiner must hold.

``fitting_prompts`` keeps a split's prompts that leave room for one output token in the
engines' context (``max_model_len``), and raises ``PromptTooLong`` naming the first that does
not (``train.overlong_prompts: error``, the default), drops them with a count (``skip``, as
verl's ``filter_overlong_prompts``) or, with ``truncate_left`` / ``_right`` / ``_middle``
(verl's ``data.truncation``), keeps a prompt longer than ``train.max_prompt_tokens`` as cut to
it (``fit_prompt_ids``, applied where the controller encodes every prompt). ``ContextNeed``
records what a generation instance joining later (scale-out) must hold: the SGS refuses a
joiner with less context (``ContextTooSmall``) instead of letting it refuse a kept prompt
mid-iteration. ``prompt_check`` runs it for every split once, before the first iteration.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from workers.types import TaskPrompt


class PromptTooLong(ValueError):
    pass


# ``train.overlong_prompts: truncate_*`` (verl's data.truncation left / right / middle): a prompt's
# token ids (with the template) cut to n, as verl's RLHFDataset cuts its raw_prompt_ids
TRUNCATIONS: dict[str, Callable[[Sequence[int], int], Sequence[int]]] = {
    "truncate_left": lambda ids, n: ids[len(ids) - n:],  # the end: the question, the template's answer cue
    "truncate_right": lambda ids, n: ids[:n],  # the start
    "truncate_middle": lambda ids, n: [*ids[:n // 2], *ids[len(ids) - (n - n // 2):]],  # both ends
}
KEPT = {"truncate_left": "last", "truncate_right": "first", "truncate_middle": "first and last"}


def fit_prompt_ids(ids: Sequence[int], policy: str, max_prompt_tokens: int) -> Sequence[int]:
    """A prompt's token ids as the engines generate from them and the trainer trains on (the
    controller encodes every prompt: ``Program.prompt_ids``): cut to ``max_prompt_tokens`` when
    ``policy`` truncates and they are longer, else as they are."""
    cut = TRUNCATIONS.get(policy)
    if cut is None or len(ids) <= max_prompt_tokens:
        return ids
    return cut(ids, max_prompt_tokens)


class ContextTooSmall(ValueError):
    """A generation instance (a joiner) has less context than the run's kept prompts need."""


@dataclass
class ContextNeed:
    """The context (max_model_len) every generation instance of the run must hold: the longest
    kept prompt (``where``, ``longest`` tokens) + ``train.max_tokens``, capped at ``context``
    (the starting instances' smallest max_model_len, which the prompts were checked against).
    With less, an instance would refuse a kept prompt (its round fails: the run stops) or cut
    outputs shorter than the starting instances do (verl's rule: max_model_len >= prompt +
    response length)."""

    context: int
    max_tokens: int
    longest: int = 0
    where: str = ""

    @property
    def tokens(self) -> int:
        return min(self.context, self.longest + self.max_tokens)

    def check(self, rank: int, max_model_len: int) -> None:
        if max_model_len < self.tokens:
            raise ContextTooSmall(
                f"generation instance rank {rank} has max_model_len {max_model_len}, less than the {self.tokens} "
                f"tokens this run needs: its longest prompt, {self.where}, is {self.longest} tokens with the "
                f"template, + train.max_tokens {self.max_tokens}, within the starting instances' context of "
                f"{self.context}; not added. A joiner must serve every kept prompt as the starting instances do: join "
                "from a host whose engine resolves at least that context (their device and KV memory)")


def where(item: TaskPrompt, split: str, i: int) -> str:
    """``task.prompts('train')[3]``, with the data file's line when the task records it
    (``meta[rows.WHERE]``), and the prompt's start."""
    from workers.tasks.rows import WHERE

    src = item.meta.get(WHERE) if isinstance(item.meta, dict) else None
    return f"task.prompts({split!r})[{i}]{f' ({src})' if src else ''} ({item.prompt[:40]!r}...)"


def fitting_prompts(items: Sequence[TaskPrompt], encode: Callable[[TaskPrompt], Sequence[int]], context_len: int,
                    split: str, policy: str, max_prompt_tokens: int = 0,
                    need: ContextNeed | None = None, vocab_size: int = 0,
                    truncated: list[int] | None = None) -> tuple[list[TaskPrompt], list[int]]:
    """The prompts of ``split`` that leave room for an output token (and are at most
    ``max_prompt_tokens`` long, when > 0), and the indices dropped (``policy`` "skip"); "error"
    raises ``PromptTooLong`` at the first one that does not. A ``truncate_*`` policy keeps a prompt
    over ``max_prompt_tokens`` as cut to it (its index appended to ``truncated``); one that still
    leaves no room for an output token (``max_prompt_tokens`` >= the context) raises as "error".
    ``encode``: a prompt's token ids with its template; a prompt it cannot render (a chat template
    raising on its turns) or with an id outside ``vocab_size`` (when > 0: a tokenizer that does not
    match the model) raises ValueError naming it, whatever the policy. ``need``: updated with the longest kept prompt.
    A split with no prompts at all raises ValueError (an empty data file: without this it read
    as "every prompt is over-long")."""
    if not len(items):
        raise ValueError(f"the {split} split is empty (an empty data file in task.kwargs.files, or a task "
                         "whose prompts() returns nothing)")
    limit = context_len - 1 if max_prompt_tokens <= 0 else min(context_len - 1, max_prompt_tokens)
    kept, dropped = [], []
    for i, item in enumerate(items):
        try:
            ids = encode(item)
        except Exception as e:  # noqa: BLE001 - jinja2's TemplateError and whatever a template raises
            raise ValueError(f"{where(item, split, i)}: the prompt template cannot render it: "
                             f"{type(e).__name__}: {e}") from None
        n = len(ids)
        if n == 0:  # kept, the engine refused it mid-run and the run stopped (review, s53)
            raise ValueError(f"{where(item, split, i)}: the template renders it to no tokens (a chat template "
                             "that renders none of its turns' roles?): nothing to generate from")
        if vocab_size and max(ids) >= vocab_size:
            bad = max(ids)
            raise ValueError(f"{where(item, split, i)}: token id {bad} is outside the model's vocabulary "
                             f"(vocab_size {vocab_size}): the tokenizer does not match the model (a token added "
                             "to the tokenizer, e.g. by a chat template's special tokens, needs the model's "
                             "embeddings resized)")
        cut = policy in TRUNCATIONS and n > max_prompt_tokens > 0
        if cut and max_prompt_tokens < context_len:
            n = max_prompt_tokens
            if truncated is not None:
                truncated.append(i)
        if n <= limit:
            kept.append(item)
            if need is not None and n > need.longest:
                need.longest, need.where = n, where(item, split, i)
        elif policy in TRUNCATIONS:  # only the max_prompt_tokens limit truncates: not the context
            cut_to = f", cut to train.max_prompt_tokens {max_prompt_tokens} ({policy})," if cut else ""
            raise PromptTooLong(
                f"{where(item, split, i)} is {n} tokens with the template{cut_to} which leaves no room for an output "
                f"token in the engines' context (max_model_len) of {context_len}. Lower train.max_prompt_tokens "
                f"below {context_len}, or raise engine.max_model_len / engine.kv_cache_tokens (within the model's "
                "max_position_embeddings)")
        elif policy == "error":
            whys = ([f"the engines' context (max_model_len) is {context_len}, which leaves no room for an output "
                     "token"] if n + 1 > context_len else [])
            whys += [f"train.max_prompt_tokens is {max_prompt_tokens}"] if 0 < max_prompt_tokens < n else []
            raise PromptTooLong(
                f"{where(item, split, i)} is {n} tokens with the template; {'; and '.join(whys)}. "
                "Shorten or drop it, raise engine.max_model_len / engine.kv_cache_tokens (within the model's "
                "max_position_embeddings) or train.max_prompt_tokens, or set train.overlong_prompts: skip to "
                "drop such prompts")
        else:
            dropped.append(i)
    return kept, dropped
