"""Prompt stream of the controller: the task's train split, shuffled per epoch, resumable."""
from __future__ import annotations

import hashlib
import json
import random
import sys
from dataclasses import asdict, dataclass, field

from workers.types import TaskPrompt


@dataclass
class StreamState:
    seed: int
    epoch: int = 0
    pos: int = 0
    # the prompts the position counts in: their number and a digest of their texts, in order
    # (empty in checkpoints written before they were recorded)
    items: int = 0
    digest: str = ""
    # the prompts (indices) this epoch's order puts last: those of the batch that ran into it
    # from the epoch before (``PromptStream.next``)
    deferred: list[int] = field(default_factory=list)


def digest(items: list[TaskPrompt]) -> str:
    """The prompts' texts and answers in order, and a chat's whole conversation (its system and
    earlier turns too: an edited one resumed without a word before)."""
    h = hashlib.blake2b(digest_size=8)
    for it in items:
        h.update(it.prompt.encode("utf-8", "surrogatepass") + b"\0" + str(it.answer).encode("utf-8", "surrogatepass")
                 + b"\1")
        if it.messages:  # (absent for plain prompts: their digests are what they were)
            h.update(json.dumps(it.messages, sort_keys=True, default=str).encode("utf-8", "surrogatepass") + b"\2")
    return h.hexdigest()


class PromptStream:
    """``next(n)`` returns the next n items; the order depends only on (seed, epoch) and the
    prompts put last (``StreamState.deferred``), so a resumed run (``state`` restored) continues
    the same sequence. A batch that runs past an epoch's end goes on into the next, reshuffled
    epoch, whose order puts the prompts the batch already has last: no prompt twice in a batch
    (verl's ``drop_last`` loader never makes such a batch) while there are enough prompts."""

    def __init__(self, items: list[TaskPrompt], seed: int = 0, state: dict | None = None):
        if not items:
            raise ValueError("task has no train prompts")
        self.items = list(items)
        self.state = StreamState(**state) if state else StreamState(seed)
        if self.state.seed != seed:
            print(f"[controller] train.seed {seed}: the prompt order keeps the checkpoint's seed "
                  f"{self.state.seed} (its position counts in that shuffle); sampling takes the new one",
                  file=sys.stderr, flush=True)
        now = digest(self.items)
        if self.state.digest and self.state.digest != now:
            print(f"[controller] the train prompts differ from those the checkpoint's position counts in "
                  f"({self.state.items} then, {len(self.items)} now: another task.name or task.kwargs, an edited "
                  "data file, or another train.max_prompt_tokens / max_model_len dropping others): its position (epoch "
                  f"{self.state.epoch}, prompt {self.state.pos}) now falls in another shuffle, so prompts of this "
                  "epoch may repeat or be skipped", file=sys.stderr, flush=True)
        self.state.items, self.state.digest = len(self.items), now
        self._order = self._shuffle(self.state.epoch)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        random.Random(self.state.seed * 1_000_003 + epoch).shuffle(order)
        last = set(self.state.deferred)
        return [i for i in order if i not in last] + [i for i in self.state.deferred if i < len(order)]

    def next(self, n: int) -> list[TaskPrompt]:
        taken: list[int] = []
        while len(taken) < n:
            if self.state.pos >= len(self._order):
                self.state.epoch += 1
                self.state.pos = 0
                self.state.deferred = list(dict.fromkeys(taken))
                self._order = self._shuffle(self.state.epoch)
            taken.append(self._order[self.state.pos])
            self.state.pos += 1
        return [self.items[i] for i in taken]

    def state_dict(self) -> dict:
        return asdict(self.state)
