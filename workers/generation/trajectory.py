"""Trajectory: one multi-turn request's conversation so far (``MultiTurnEngine``'s record of
it: the policy's tokens and the observations spliced between them, their loss mask, the
environment's rewards), and ``turn_sampling``, each turn's seed."""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
from dataclasses import dataclass, field

import torch

from workers.types import Request, Sample, SamplingParams


def turn_sampling(sampling: SamplingParams, turn: int) -> SamplingParams:
    """The sampling of the turn after ``turn`` (>= 1) turns: a request's seed, if any, mixed with
    the turn, so each turn draws fresh noise (the same seed would replay the first turn's
    draws), reproducibly."""
    if sampling.seed is None:
        return sampling
    mixed = int.from_bytes(hashlib.blake2b(f"{sampling.seed}:{turn}".encode(), digest_size=8).digest(), "little")
    return dataclasses.replace(sampling, seed=mixed >> 1)  # in [0, 2**63)


@dataclass
class Trajectory:
    """One request's conversation so far: ``output`` is every turn and observation after the
    original prompt, ``mask`` True on the policy's tokens."""

    request: Request  # the original
    messages: list[dict]  # the prompt's chat, then the turns and observations (OpenAI format)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    turns: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    weight_version: int = 0
    env_call: cf.Future | None = None  # the environment's answer being computed
    serial: int = 0  # the engine's count of trajectories (a restart, a re-added id: a new one)
    opened: bool = False  # the environment's ``start`` returned (set on the pool thread): it gets ``end``
    env_rewards: list[float] = field(default_factory=list)  # the rewards the environment gave, in call order

    @property
    def tid(self) -> str:
        """The id the environment sees: the sample id and the trajectory's serial ("12000003-7"),
        never the id of another trajectory of this engine (an aborted one's ``end`` may still come)."""
        return f"{self.request.sample_id}-{self.serial}"

    def absorb(self, s: Sample) -> None:
        """A finished turn: its tokens (the policy's) go on the output."""
        self.output += s.output_ids.tolist()
        self.logprobs += s.logprobs.tolist()
        self.mask += [True] * len(s.output_ids)
        self.turns += 1
        self.weight_version = s.weight_version
        if self.turns == 1:
            self.timings = {k: v for k, v in s.timings.items() if k in ("queued", "admitted", "first_token")}
        self.timings["finished"] = s.timings.get("finished", 0.0)

    def sample(self, finish_reason: str) -> Sample:
        return Sample.of(self.request, self.output, self.logprobs, self.weight_version, finish_reason,
                         self.timings, loss_mask=torch.tensor(self.mask, dtype=torch.bool), turns=self.turns,
                         env_rewards=tuple(self.env_rewards))
