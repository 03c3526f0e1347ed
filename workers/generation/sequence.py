"""Sequence: the engine-side state of one request (tokens so far, block table, sampling state)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from workers.types import Request, Sample


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(eq=False)
class Sequence:
    """``tokens`` = prompt followed by the output so far (Python ints: one append per step).
    ``num_cached`` tokens have their K/V in the paged cache (blocks ``block_table``); after
    every step ``num_cached == len(tokens) - 1`` for a running sequence (the last sampled
    token is fed to the next step). ``block_hashes``: the chained hashes of its full blocks
    of tokens computed so far (prefix caching, ``block_manager.block_hashes``); its first
    ``num_hashed`` blocks are registered in the cache by hash (or were found there). Waiting
    sequences are admitted by ``admission`` (the policy's key, ``admission.py``), then
    ``arrival``; ``preempted`` puts one first."""

    request: Request
    arrival: int
    tokens: list[int]
    prompt_len: int
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    logprobs: list[float] = field(default_factory=list)
    status: Status = Status.WAITING
    preempted: bool = False
    generator: torch.Generator | None = None
    timings: dict[str, float] = field(default_factory=dict)
    admission: float = 0.0
    block_hashes: list[bytes] = field(default_factory=list)
    num_hashed: int = 0

    @classmethod
    def from_request(cls, req: Request, arrival: int, admission: float = 0.0) -> "Sequence":
        ids = req.prompt_ids.tolist()
        return cls(request=req, arrival=arrival, tokens=ids, prompt_len=len(ids),
                   timings={"queued": time.time()}, admission=admission)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def group_id(self) -> int:
        return self.request.group_id

    def reset_output(self) -> None:
        """Forget every generated token (new weights: the sample restarts from the prompt)."""
        del self.tokens[self.prompt_len:]
        self.block_hashes.clear()  # those of output blocks would be stale
        self.logprobs.clear()
        self.generator = None
        self.timings.pop("first_token", None)

    def to_sample(self, finish_reason: str, weight_version: int) -> Sample:
        return Sample.of(self.request, self.tokens[self.prompt_len:], self.logprobs, weight_version,
                         finish_reason, self.timings)


def error_sample(req: Request, why: str, weight_version: int) -> Sample:
    """A refused request: empty output, ``finish_reason == "error"``, ``error`` says why."""
    prompt = req.prompt_ids if isinstance(req.prompt_ids, torch.Tensor) else torch.empty(0, dtype=torch.int64)
    return Sample(sample_id=req.sample_id, prompt_ids=prompt,
                  output_ids=torch.empty(0, dtype=torch.int64),
                  logprobs=torch.empty(0, dtype=torch.float32), weight_version=weight_version,
                  finish_reason="error", group_id=req.group_id, error=why,
                  timings={"queued": time.time(), "finished": time.time()}, baseline=req.baseline)
