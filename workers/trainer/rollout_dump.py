"""The scored samples of an iteration, kept for people to read (``logging.rollout_data_dir``,
verl's ``trainer.rollout_data_dir``): ``rollout_row`` as each is scored (its ids), ``take_rows``
at the step (decoded), written by the trainer rank (controller/trainer_rank.py) as
``<dir>/<iteration>.jsonl`` through workers/generation_dump.py."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.trainer.worker import TrainerWorker
    from workers.types import Sample


def rollout_row(w: "TrainerWorker", s: "Sample", score: float) -> dict:
    """What is kept of a scored sample: its ids (decoded in ``take_rows``), the reference answer
    (verl's ``gts``), the reward (the task's score plus the environment's rewards) and the rest."""
    task = w._prompts.get(s.sample_id)
    return {"sample_id": s.sample_id, "group_id": s.group_id, "prompt_ids": s.prompt_ids, "output_ids": s.output_ids,
            "gts": task.answer if task is not None else None, "score": score, "env_reward": s.env_reward,
            "weight_version": s.weight_version, "finish_reason": s.finish_reason, "turns": s.turns,
            "baseline": s.baseline}


def take_rows(w: "TrainerWorker") -> list[dict]:
    """The rows kept since the last call, their ids decoded (``input``, ``output``), and a fresh
    list; with ``trainer.filter_groups``, each says whether the step's filter dropped its group
    (``filtered``: verl writes only the batch its filter kept)."""
    with w._lock:
        rows, w.rollout_rows = w.rollout_rows or [], []
    dec = w.tokenizer.decode
    marks = (lambda r: {"filtered": r["sample_id"] in w.filtered_ids}) if w.cfg.filter_groups else (lambda r: {})
    return [{"input": dec(r.pop("prompt_ids")), "output": dec(r.pop("output_ids")), **r, **marks(r)} for r in rows]
