"""Datasets from files: JSON Lines or a JSON array (and Parquet when pyarrow is installed) with a
prompt field and a reference answer, scored by a verifier named in the config (``verifiers.py``).
A malformed row raises ``ValueError`` naming file and line (a JSON array: file and index)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from workers.config_schema import expand_path
from workers.tasks.rows import row_item
from workers.tasks.verifiers import is_builtin, make_verifier
from workers.types import TaskPrompt


def _decode(path: Path) -> str:
    """The file's text: UTF-8, a byte-order mark at the start allowed (as ``datasets`` and pandas)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raw = e.object  # without the BOM: e.start counts from there
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(f"{path}:{line}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {column}, counted in "
                         "bytes); convert the file, e.g. iconv -f latin1 -t utf-8") from None


def read_json(path: Path, prompt_key: str, answer_key: str, task: str, text_answers: bool,
              answer_optional: bool = False) -> list[TaskPrompt]:
    """JSON Lines (one object per line, blank lines skipped), or one JSON array of objects
    (HF ``datasets``' json loader reads both, whatever the suffix)."""
    text = _decode(path)
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: malformed JSON array ({e.msg} at column {e.colno})") from None
        return [row_item(r, f"{path}[{i}]", prompt_key, answer_key, task, text_answers, answer_optional)
                for i, r in enumerate(rows)]
    items = []
    for lineno, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 may sit inside a string
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
        items.append(row_item(row, f"{path}:{lineno}", prompt_key, answer_key, task, text_answers, answer_optional))
    return items


def read_parquet(path: Path, prompt_key: str, answer_key: str, task: str, text_answers: bool,
                 answer_optional: bool = False) -> list[TaskPrompt]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    rows = pq.read_table(path).to_pylist()
    return [row_item(r, f"{path}:row {i}", prompt_key, answer_key, task, text_answers, answer_optional)
            for i, r in enumerate(rows)]


READERS = {".jsonl": read_json, ".json": read_json, ".parquet": read_parquet}


def _files_hint(files) -> str:
    """Why a ``files`` mapping is malformed, in the two ways it happens."""
    if isinstance(files, dict) and any(v is None and ":" in str(k) for k, v in files.items()):
        return (" (YAML reads {train:a.jsonl} as a key 'train:a.jsonl' without a value: write a space "
                "after each ':', {train: a.jsonl, test: b.jsonl})")
    if isinstance(files, dict) and any(isinstance(v, (list, tuple)) for v in files.values()):
        return " (several files per split: concatenate them)"
    if isinstance(files, (list, tuple)):  # verl's data.train_files: [a, b] shape
        if len(files) > 1:
            return " (several files per split: concatenate them; name the splits, {train: a.jsonl, test: b.jsonl})"
        return " (a path, not a list; or name the splits, {train: a.jsonl, test: b.jsonl})"
    return ""


SPLITS = ("train", "test")
TEST_ALIASES = ("val", "validation")  # verl's val_files, HF's validation split


def _splits(files: dict) -> dict:
    """split -> path, ``val`` / ``validation`` renamed ``test``. Refused: a split the run never
    reads (silently unused, as a ``val`` beside a ``test`` was) and two names for the test split."""
    given = [k for k in ("test", *TEST_ALIASES) if k in files]
    if len(given) > 1:
        raise ValueError(f"task.kwargs.files: {' and '.join(given)} both name the test split (val and validation "
                         f"stand for test, the one evaluations read); keep one")
    unknown = [k for k in files if k not in (*SPLITS, *TEST_ALIASES)]
    if unknown:
        raise ValueError(f"task.kwargs.files.{unknown[0]}: not a split; a run reads train and test (val or "
                         "validation stand for test)")
    return {("test" if k in TEST_ALIASES else k): p for k, p in files.items()}


def _check_file(key: str, p: Path) -> None:
    """A data file the readers take, there now (said at start, naming ``key``)."""
    if p.is_dir():
        raise ValueError(f"{key}: {p} is a folder; give one data file ({', '.join(sorted(READERS))}) per split "
                         "(several files: concatenate them)")
    if p.suffix not in READERS:
        raise ValueError(f"{key}: {p}: a {p.suffix or 'suffixless'} file; the readers take {sorted(READERS)}")
    if not p.exists():
        where = "" if p.is_absolute() else f" (a relative path resolves from the working directory, {Path.cwd()})"
        raise FileNotFoundError(f"{key}: {p} does not exist{where}")


class FileTask:
    """``files``: split -> path (``{"train": "a.jsonl", "test": "b.jsonl"}``; ``val`` or
    ``validation`` stand for ``test``, refused beside it) or one path for every split; ``~`` is
    expanded (in a ``file.py:fn`` verifier too); a relative path resolves from the working directory.
    ``prompt_key`` / ``answer_key`` may be dotted (nested fields). ``verifier``: see
    ``verifiers.make_verifier``; ``verifier_kwargs``: keyword arguments for it (verl's
    ``custom_reward_function.reward_kwargs``), checked against it here."""

    def __init__(self, files: dict[str, str] | str, verifier: str = "exact", prompt_key: str = "prompt",
                 answer_key: str = "answer", name: str = "jsonl", verifier_kwargs: dict | None = None):
        one = isinstance(files, (str, Path))
        if one:
            files = {"train": files, "test": files}
        if not isinstance(files, dict) or not all(isinstance(p, (str, Path)) for p in files.values()):
            raise ValueError(f"task.kwargs.files: one path, or split -> one path ({{train: a.jsonl, test: "
                             f"b.jsonl}}), got {files!r}{_files_hint(files)}")
        paths = {key: Path(expand_path(str(p))) for key, p in files.items()}  # ~, $HOME (verl's scripts)
        splits = _splits(paths)
        for key in ["train"] if one else paths:  # named as the config has them (val, not the test it stands for)
            _check_file("task.kwargs.files" + ("" if one else f".{key}"), paths[key])
        self.files = {split: str(p) for split, p in splits.items()}
        if not isinstance(verifier, str):
            raise ValueError(f"task.kwargs.verifier: a name or 'file.py:fn', got {verifier!r}")
        verifier = expand_path(verifier)  # ~/r.py:fn, $HOME/r.py:fn
        if not isinstance(verifier_kwargs or {}, dict) or not all(isinstance(k, str) for k in verifier_kwargs or {}):
            raise ValueError(f"task.kwargs.verifier_kwargs: a mapping of keyword -> value, got {verifier_kwargs!r}")
        self.verify = make_verifier(verifier, verifier_kwargs)
        if callable(getattr(self.verify, "batch", None)):  # verl's batch compute_score: many samples a call
            self.score_batch = self._score_batch
        self.text_answers = is_builtin(verifier)
        self.answer_optional = verifier == "reward_model"  # it scores the completion: rows may have no answer
        for key, value, what in (("prompt_key", prompt_key, "a row's field, dotted for a nested one"),
                                 ("answer_key", answer_key, "a row's field, dotted for a nested one"),
                                 ("name", name, "the eval group of rows without task or data_source")):
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"task.kwargs.{key}: a non-empty string ({what}), got {value!r}")
        self.prompt_key, self.answer_key, self.name = prompt_key, answer_key, name
        self._cache: dict[str, list[TaskPrompt]] = {}

    def prompts(self, split: str) -> Sequence[TaskPrompt]:
        if split not in self.files:
            raise ValueError(f"task.kwargs.files: no {split!r} file (have {sorted(self.files)})")
        if split not in self._cache:
            p = Path(self.files[split])
            items = READERS[p.suffix](p, self.prompt_key, self.answer_key, self.name, self.text_answers,
                                      self.answer_optional)
            if not items:  # said here, where the file is known (the start check's error could not name it)
                raise ValueError(f"{p}: no rows (task.kwargs.files.{split})")
            self._cache[split] = items
        return self._cache[split]

    def score(self, prompt: TaskPrompt, completion: str) -> float:
        return self.verify(prompt, completion)

    def _score_batch(self, prompts: list[TaskPrompt], completions: list[str]):
        return self.verify.batch(prompts, completions)
