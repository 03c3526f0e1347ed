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


def _item(row, where: str, prompt_key: str, answer_key: str, task: str) -> TaskPrompt:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in (prompt_key, answer_key):
        if key not in row:
            raise ValueError(f"{where}: missing field {key!r} (have {sorted(row)})")
    if not isinstance(row[prompt_key], str) or not row[prompt_key]:
        raise ValueError(f"{where}: field {prompt_key!r} must be a non-empty string")
    meta = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
    return TaskPrompt(prompt=row[prompt_key], answer=str(row[answer_key]), task=row.get("task", task), meta=meta)


READERS = {".jsonl": read_jsonl, ".json": read_jsonl, ".parquet": read_parquet}


class FileTask:
    """``files``: split -> path (``{"train": "a.jsonl", "test": "b.jsonl"}``) or one path for
    every split. ``verifier``: see ``verifiers.make_verifier``."""

    def __init__(self, files: dict[str, str] | str, verifier: str = "exact", prompt_key: str = "prompt",
                 answer_key: str = "answer", name: str = "jsonl"):
        self.files = {"train": files, "test": files} if isinstance(files, (str, Path)) else dict(files)
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
            raise ValueError(f"task split {split!r} has no file (have {sorted(self.files)})")
        if split not in self._cache:
            p = Path(self.files[split])
            self._cache[split] = READERS[p.suffix](p, self.prompt_key, self.answer_key, self.name)
        return self._cache[split]

    def score(self, prompt: TaskPrompt, completion: str) -> float:
        return self.verify(prompt, completion)
