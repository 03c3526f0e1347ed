"""One data-file row as a ``TaskPrompt``: the prompt (a string, or verl's list of chat messages)
and the reference answer, each error naming the row (``file:line``) and the key to set."""
from __future__ import annotations

import math
import numbers

from workers.text_check import surrogate_at
from workers.types import TaskPrompt

WHERE = "_where"  # TaskPrompt.meta key: the data file and line a prompt came from

NULL_CONTENT_ROLES = ("assistant", "tool")  # a tool-call turn may have no text (transformers passes None on)


def _field(row: dict, key: str, where: str, setting: str):
    """``row[key]``; a dotted key reads nested objects (verl's ``reward_model.ground_truth``), or
    a column of that very name (``datasets``' ``flatten()`` makes one)."""
    if key in row:
        return row[key]
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ValueError(f"{where}: missing field {key!r} (have {sorted(row)}; set task.kwargs.{setting})")
        value = value[part]
    return value


def _message(m, where: str) -> dict:
    """A chat message ``{"role": str, "content": str}``; OpenAI-style content parts
    (``[{"type": "text", "text": ...}]``) are joined; an assistant or tool turn's content may
    be null (a tool call), and stays so for the chat template."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError(f"{where}: a message must be {{\"role\": str, \"content\": str}}, got {m!r:.80}")
    content = m.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if content is None and m["role"] in NULL_CONTENT_ROLES:
        return {**m, "content": None}
    if not isinstance(content, str):
        raise ValueError(f"{where}: content must be a string or a list of text parts (null only in an "
                         f"{' or '.join(NULL_CONTENT_ROLES)} turn), got {content!r:.80}")
    return {**m, "content": content}


def _answer_text(answer, where: str, key: str, text_answers: bool) -> str:
    """The reference as text: a string as it is, a number as Python writes it (``72``, ``2.0``;
    the built-in verifiers compare it by value). A null is refused; so is an empty text, a list or
    an object when the verifier is a built-in one, which compares one answer (the user's own function gets any
    value as it is: ``raw_answer``, verl's ``ground_truth``)."""
    if answer is None:
        raise ValueError(f"{where}: field {key!r} is null: every row needs a reference answer (drop the row, "
                         "or set task.kwargs.answer_key)")
    if isinstance(answer, str):
        if text_answers and not answer.strip():  # an empty completion would equal it: rewarded for saying nothing
            raise ValueError(f"{where}: field {key!r} is {answer!r}, an empty reference answer (a table's missing "
                             "value?): drop the row, or set task.kwargs.answer_key")
        return answer
    if text_answers and isinstance(answer, numbers.Real) and not math.isfinite(answer):
        raise ValueError(f"{where}: field {key!r} is {answer!r}, not a reference answer (JSON's NaN/Infinity, "
                         "or a table's missing value): drop the row, or set task.kwargs.answer_key")
    if text_answers and not isinstance(answer, (numbers.Real, bool)):
        raise ValueError(f"{where}: field {key!r} is a {type(answer).__name__} ({answer!r:.60}); the built-in "
                         "verifiers compare one answer, a string or a number: name your own function as "
                         "task.kwargs.verifier (it gets the value as it is: prompt.raw_answer, verl's ground_truth)")
    return str(answer)


def row_item(row, where: str, prompt_key: str, answer_key: str, task: str, text_answers: bool = True,
             answer_optional: bool = False) -> TaskPrompt:
    """One row. The prompt is a string with some non-space text, or a chat (verl's format): a
    list of ``{"role", "content"}`` messages, seen by the policy through the chat template (its
    last user turn is ``prompt``). ``meta``: the row's other fields, and ``source`` (``where``)
    unless the row has a field of that name. ``text_answers``: the verifier compares the answer
    as text or a number (a built-in one). ``answer_optional``: a row without the answer field has
    the answer "" (a reward model scores the completion alone)."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    prompt = _field(row, prompt_key, where, "prompt_key")
    try:
        answer = _field(row, answer_key, where, "answer_key")
    except ValueError:
        if not answer_optional:
            raise
        answer = ""
    if answer is None and answer_optional:  # a Parquet column null in this row
        answer = ""
    messages: tuple = ()
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            raise ValueError(f"{where}: field {prompt_key!r} is an empty list of messages")
        messages = tuple(_message(m, f"{where}: {prompt_key}[{i}]") for i, m in enumerate(prompt))
        users = [m["content"] for m in messages if m["role"] == "user"]
        prompt = users[-1] if users else messages[-1]["content"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: field {prompt_key!r} must be a string with some text (or a list of chat "
                         f"messages), got {prompt!r:.40}")
    texts = [(prompt_key, prompt)] if not messages else [
        (f"{prompt_key}[{i}].content", t) for i, m in enumerate(messages)
        for t in (m["content"] if isinstance(m["content"], list) else [m["content"]])]
    for field, text in texts:
        text = text.get("text") if isinstance(text, dict) else text  # (an OpenAI content part)
        bad = surrogate_at(text) if isinstance(text, str) else None
        if bad is not None:  # the tokenizer failed on it after the engines were built (review, s55)
            raise ValueError(f"{where}: field {field!r} has a lone surrogate {text[bad]!r} at char {bad} (not valid "
                             "Unicode: JSON can write it, UTF-8 cannot)")
    meta = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}  # a dotted key's parent stays
    meta[WHERE] = where  # file:line, for the start check's messages (a key no dataset column takes:
    # a row's own "source" column, common in datasets, used to replace the location)
    return TaskPrompt(prompt=prompt, answer=_answer_text(answer, where, answer_key, text_answers),
                      task=_group(row, where, task), meta=meta, messages=messages, raw_answer=answer)


def _group(row: dict, where: str, default: str) -> str:
    """The row's eval group: its ``task`` field, else verl's ``data_source``, else ``default``
    (the task's name). A field that is null, empty or not a string or number (a dataset's own
    ``task`` object) names no group and is passed over."""
    for key in ("task", "data_source"):
        value = row.get(key)
        if isinstance(value, bool) or not isinstance(value, (str, numbers.Number)):
            continue
        if str(value).strip():
            return str(value)
    return default
