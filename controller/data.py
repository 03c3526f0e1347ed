"""Prompt stream of the controller: the task's train split, shuffled per epoch, resumable."""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from workers.types import TaskPrompt


@dataclass
class StreamState:
    seed: int
    epoch: int = 0
    pos: int = 0


class PromptStream:
    """``next(n)`` returns the next n items; the order depends only on (seed, epoch), so a
    resumed run (``state`` restored) continues the same sequence."""

    def __init__(self, items: list[TaskPrompt], seed: int = 0, state: dict | None = None):
        if not items:
            raise ValueError("task has no train prompts")
        self.items = list(items)
        self.state = StreamState(**state) if state else StreamState(seed)
        self._order = self._shuffle(self.state.epoch)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        random.Random(self.state.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self, n: int) -> list[TaskPrompt]:
        out = []
        while len(out) < n:
            if self.state.pos >= len(self._order):
                self.state.epoch += 1
                self.state.pos = 0
                self._order = self._shuffle(self.state.epoch)
            out.append(self.items[self._order[self.state.pos]])
            self.state.pos += 1
        return out

    def state_dict(self) -> dict:
        return asdict(self.state)
