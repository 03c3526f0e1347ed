"""Any reasoning-gym dataset as a Task: its questions as prompts, its ``score_answer`` as reward."""
from __future__ import annotations

import math
from typing import Sequence

from workers.tasks.answers import extract_answer
from workers.types import TaskPrompt

SPLIT_OFFSETS = {"train": 0, "test": 1_000_003, "eval": 1_000_003}
ANSWER_HINT = " Put the final answer after 'answer='."
EXAMPLE = "example_answer"  # the metadata key of one valid answer, where a dataset has no reference


def _answer_text(entry: dict) -> str:
    if entry["answer"] is not None:
        return str(entry["answer"])
    return str(entry.get("metadata", {}).get(EXAMPLE, ""))


class ReasoningGymTask:
    """``dataset``: a reasoning-gym dataset name (e.g. ``basic_arithmetic``); ``config``: its
    keyword config (e.g. ``{"min_terms": 2}``). The completion's answer is extracted as in
    ``verifiers.extract_answer`` and scored by reasoning-gym's own verifier."""

    def __init__(self, dataset: str = "basic_arithmetic", size: int = 512, seed: int = 0,
                 config: dict | None = None, answer_hint: bool = True):
        import reasoning_gym

        if dataset not in reasoning_gym.factory.DATASETS:
            raise ValueError(f"reasoning_gym task: dataset {dataset!r} is not registered "
                             f"(e.g. {sorted(reasoning_gym.factory.DATASETS)[:5]})")
        if size < 1:
            raise ValueError(f"reasoning_gym task: size must be >= 1, got {size}")
        self.name, self.size, self.seed, self.config = dataset, size, seed, dict(config or {})
        self.answer_hint = answer_hint
        self._datasets: dict[str, object] = {}

    def _dataset(self, split: str):
        if split not in SPLIT_OFFSETS:
            raise ValueError(f"task split {split!r} is not one of {sorted(SPLIT_OFFSETS)}")
        if split not in self._datasets:
            import reasoning_gym

            self._datasets[split] = reasoning_gym.create_dataset(
                self.name, size=self.size, seed=self.seed + SPLIT_OFFSETS[split], **self.config)
        return self._datasets[split]

    def prompts(self, split: str) -> Sequence[TaskPrompt]:
        """``answer`` is the entry's answer as text; where a dataset has none (``None``: its
        ``score_answer`` checks an answer's validity, e.g. propositional_logic, graph_color) it is
        ``metadata['example_answer']`` when the dataset gives one, else empty. ``meta['answer']``
        keeps the entry's own, for ``score_answer``."""
        ds = self._dataset(split)
        hint = ANSWER_HINT if self.answer_hint else ""
        return [TaskPrompt(prompt=e["question"] + hint, answer=_answer_text(e), task=f"reasoning_gym/{self.name}",
                           meta={"metadata": e.get("metadata", {}), "question": e["question"], "answer": e["answer"]})
                for e in (ds[i] for i in range(len(ds)))]

    def demonstrations(self, split: str = "train") -> list[tuple[TaskPrompt, str]]:
        """SFT demonstrations in the format the hint asks for: ``answer=<reference>`` (the example
        answer where the dataset has no reference); a dataset with neither has none: ValueError."""
        items = self.prompts(split)
        if any(item.meta["answer"] is None and EXAMPLE not in item.meta["metadata"] for item in items):
            raise ValueError(f"reasoning_gym task: dataset {self.name!r} gives no reference answer (its score_answer "
                             f"checks an answer's validity) and no metadata[{EXAMPLE!r}], so it has no SFT "
                             "demonstrations: set train.sft_steps: 0, or start from a trained model (model.path)")
        return [(item, f"answer={item.answer}" if self.answer_hint else item.answer) for item in items]

    def score(self, prompt: TaskPrompt, completion: str) -> float:
        try:
            entry = {"question": prompt.meta.get("question", prompt.prompt),
                     "answer": prompt.meta.get("answer", prompt.answer), "metadata": prompt.meta.get("metadata", {})}
            r = float(self._dataset("train").score_answer(answer=extract_answer(completion), entry=entry))
            return r if math.isfinite(r) else 0.0
        except Exception:  # a verifier never crashes
            return 0.0
