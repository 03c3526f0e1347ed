"""Datasets from files: JSONL (and Parquet when pyarrow is installed) with a prompt field and a
reference answer, scored by a verifier named in the config (``exact``, ``numeric``,
``reasoning_gym:<dataset>``). A malformed line raises ``ValueError`` naming file and line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from workers.tasks.verifiers import make_verifier
from workers.types import TaskPrompt


def read_jsonl(path: Path, prompt_key: str, answer_key: str, task: str) -> list[TaskPrompt]:
    items = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
            items.append(_item(row, f"{path}:{lineno}", prompt_key, answer_key, task))
    return items


def read_parquet(path: Path, prompt_key: str, answer_key: str, task: str) -> list[TaskPrompt]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    rows = pq.read_table(path).to_pylist()
    return [_item(r, f"{path}:row {i}", prompt_key, answer_key, task) for i, r in enumerate(rows)]


def _field(row: dict, key: str, where: str, setting: str):
    """``row[key]``; a dotted key reads nested objects (verl's ``reward_model.ground_truth``)."""
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ValueError(f"{where}: missing field {key!r} (have {sorted(row)}; set task.kwargs.{setting})")
        value = value[part]
    return value


def _message(m, where: str) -> dict:
    """A chat message ``{"role": str, "content": str}``; OpenAI-style content parts
    (``[{"type": "text", "text": ...}]``) are joined."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError(f"{where}: a message must be {{\"role\": str, \"content\": str}}, got {m!r:.80}")
    content = m.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ValueError(f"{where}: content must be a string or a list of text parts, got {content!r:.80}")
    return {**m, "content": content}


def _item(row, where: str, prompt_key: str, answer_key: str, task: str) -> TaskPrompt:
    """One row. The prompt is a non-empty string, or a chat (verl's format): a list of
    ``{"role", "content"}`` messages, seen by the policy through the chat template."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    prompt, answer = _field(row, prompt_key, where, "prompt_key"), _field(row, answer_key, where, "answer_key")
    messages: tuple = ()
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            raise ValueError(f"{where}: field {prompt_key!r} is an empty list of messages")
        messages = tuple(_message(m, f"{where}: {prompt_key}[{i}]") for i, m in enumerate(prompt))
        users = [m["content"] for m in messages if m["role"] == "user"]
        prompt = users[-1] if users else messages[-1]["content"]
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: field {prompt_key!r} must be a non-empty string (or a list of chat messages)")
    meta = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}  # a dotted key's parent stays
    return TaskPrompt(prompt=prompt, answer=str(answer), task=str(row.get("task", row.get("data_source", task))),
                      meta=meta, messages=messages, raw_answer=answer)


READERS = {".jsonl": read_jsonl, ".json": read_jsonl, ".parquet": read_parquet}


def _files_hint(files) -> str:
    """Why a ``files`` mapping is malformed, in the two ways it happens."""
    if isinstance(files, dict) and any(v is None and ":" in str(k) for k, v in files.items()):
        return (" (YAML reads {train:a.jsonl} as a key 'train:a.jsonl' without a value: write a space "
                "after each ':', {train: a.jsonl, test: b.jsonl})")
    if isinstance(files, dict) and any(isinstance(v, (list, tuple)) for v in files.values()):
        return " (several files per split: concatenate them)"
    return ""


class FileTask:
    """``files``: split -> path (``{"train": "a.jsonl", "test": "b.jsonl"}``; ``val`` or
    ``validation`` stand for ``test``) or one path for every split; ``~`` is expanded.
    ``prompt_key`` / ``answer_key`` may be dotted (nested fields). ``verifier``: see
    ``verifiers.make_verifier``."""

    def __init__(self, files: dict[str, str] | str, verifier: str = "exact", prompt_key: str = "prompt",
                 answer_key: str = "answer", name: str = "jsonl"):
        if isinstance(files, (str, Path)):
            files = {"train": files, "test": files}
        if not isinstance(files, dict) or not all(isinstance(p, (str, Path)) for p in files.values()):
            raise ValueError(f"task.kwargs.files: one path, or split -> one path ({{train: a.jsonl, test: "
                             f"b.jsonl}}), got {files!r}{_files_hint(files)}")
        files = dict(files)
        for alias in ("val", "validation"):
            if alias in files and "test" not in files:
                files["test"] = files.pop(alias)
        self.files = {split: str(Path(p).expanduser()) for split, p in files.items()}
        for split, p in self.files.items():
            if Path(p).suffix not in READERS:
                raise ValueError(f"task.files[{split!r}]: {p} is not one of {sorted(READERS)}")
            if not Path(p).exists():
                raise FileNotFoundError(f"task.files[{split!r}]: {p} does not exist")
        self.verify = make_verifier(verifier)
        self.prompt_key, self.answer_key, self.name = prompt_key, answer_key, name
        self._cache: dict[str, list[TaskPrompt]] = {}

    def prompts(self, split: str) -> Sequence[TaskPrompt]:
        if split not in self.files:
            raise ValueError(f"task.kwargs.files: no {split!r} file (have {sorted(self.files)})")
        if split not in self._cache:
            p = Path(self.files[split])
            self._cache[split] = READERS[p.suffix](p, self.prompt_key, self.answer_key, self.name)
        return self._cache[split]

    def score(self, prompt: TaskPrompt, completion: str) -> float:
        return self.verify(prompt, completion)
