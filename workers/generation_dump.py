"""Generations written out for people to read (verl's ``trainer.rollout_data_dir``,
``validation_data_dir`` and ``log_val_generations``): a batch's rows as a JSON lines file in a
folder, and the first few as TensorBoard markdown. The trainer ranks write their scored samples,
the controller its evaluations' generations (docs/controller.md, "Generations")."""
from __future__ import annotations

import json
import re
from pathlib import Path

from workers.atomic import atomic_file

ROLLOUT_NAME = re.compile(r"(\d+)(?:\.rank(\d+))?\.jsonl")  # <iteration>.jsonl, <iteration>.rank<k>.jsonl


def write_rows(folder: str | Path, name: str, rows: list[dict]) -> Path:
    """``rows`` as ``<folder>/<name>.jsonl``, one JSON object a line (UTF-8, as written), written
    atomically: a run that resumes and writes the same name again replaces it whole."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.jsonl"
    with atomic_file(path) as tmp:  # (UTF-8 whatever the locale)
        tmp.write_bytes("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8"))
    return path


def stale_rows(folder: str | Path, step: int, ranks: int) -> None:
    """Delete ``step``'s rollout files that ``ranks`` trainer ranks do not write (``<step>.jsonl``
    with several, ``<step>.rank<k>.jsonl`` with one or from a rank past the last): a resumed
    run on another number of ranks replaces that run's files of the iterations it runs again."""
    folder = Path(folder)
    stale = [folder / f"{step}.jsonl"] if ranks > 1 else []
    for path in folder.glob(f"{step}.rank*.jsonl"):
        m = ROLLOUT_NAME.fullmatch(path.name)
        if m and m[2] is not None and (ranks == 1 or int(m[2]) >= ranks):
            stale.append(path)
    for path in stale:
        path.unlink(missing_ok=True)


def rows_from(folder: str | Path, first: int) -> list[Path]:
    """Delete the rollout files of iteration ``first`` and later (``<n>.jsonl``,
    ``<n>.rank<k>.jsonl``; other names stay) -> the paths deleted: those of a lineage abandoned by
    resuming a run folder from an older checkpoint (``TrainerRank.drop_rollouts_from``)."""
    later = [path for path in Path(folder).glob("*.jsonl")
             if (m := ROLLOUT_NAME.fullmatch(path.name)) and int(m[1]) >= first]
    for path in later:
        path.unlink(missing_ok=True)
    return later


def markdown(rows: list[dict], n: int) -> str:
    """The first ``n`` rows for TensorBoard's text panel: each its score and reference answer,
    then its input and output in a code block (markdown would eat the model's own markup)."""
    parts = []
    for r in rows[:n]:
        body = f"{r.get('input', '')}\n----\n{r.get('output', '')}".replace("```", "'''")
        parts.append(f"**score** {r.get('score')} · **gts** {r.get('gts')!s:.200}\n\n```\n{body}\n```")
    return "\n\n---\n\n".join(parts)
