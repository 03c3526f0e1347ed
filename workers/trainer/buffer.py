"""Per-iteration sample bookkeeping: prepared samples, group completion, micro-batch formation."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence, TypeVar

import torch

T = TypeVar("T")


@dataclass
class Prepared:
    """A received sample after its receive-time work (reward, reference log-probs, values).

    Tensors are [L] over the L response tokens, on CPU. ``adv``/``returns`` are filled when the
    sample's advantage is known (at once for PPO, when its group completes for GRPO/RLOO)."""

    sample_id: int
    group_id: int
    prompt_ids: torch.Tensor
    output_ids: torch.Tensor
    old_logp: torch.Tensor
    ref_logp: torch.Tensor | None  # None: no reference (trainer.kl_coef 0)
    score: float  # the task's reward (multi-turn: plus the environment's rewards, ``env_reward``)
    reward: float  # score plus the overlong penalty, minus the KL penalty in kl_mode "reward" (grouped algorithms)
    token_rewards: torch.Tensor | None = None  # [L] for GAE
    values: torch.Tensor | None = None
    adv: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    weight_version: int = 0
    min_tokens: int = 0  # EOS was not allowed before this many outputs (Sample.min_tokens)
    # rollout correction (workers/trainer/rollout_correction.py; TrainerConfig.rollout_is / tis_cap, rollout_rs):
    tis_weight: torch.Tensor | None = None  # [L] truncated importance weight of pi_old / pi_sampler (normalised)
    # [L] bool: the tokens every loss term and count is over (None: all): the policy's own tokens
    # (``sampled``) less those rollout_rs rejects (verl's response_mask after rejection)
    keep: torch.Tensor | None = None
    # multi-turn (Sample.loss_mask): [L] bool, True where the policy sampled the token, False on the
    # environment's observation tokens (None: all sampled, every single-turn sample)
    sampled: torch.Tensor | None = None
    turns: int = 1  # assistant turns in output_ids (Sample.turns)
    env_reward: float = 0.0  # the sum of the environment's rewards (Sample.env_rewards), in ``score``
    correction: dict[str, float] = field(default_factory=dict)  # its rollout_corr/* metric terms
    overlong: float = 0.0  # the overlong penalty added to the reward (<= 0; TrainerConfig.overlong_buffer)
    reward_kl: float = 0.0  # mean per-token KL(old || ref) over its sampled tokens, what kl_mode reward penalises
    info: dict = field(default_factory=dict)  # a dict reward's numbers and texts (Scored.info: acc, pred)

    @property
    def num_tokens(self) -> int:
        return int(self.output_ids.numel())

    @property
    def observation_tokens(self) -> int:
        """Output tokens the environment wrote (multi-turn), not the policy."""
        return 0 if self.sampled is None else int((~self.sampled).sum())

    @property
    def packed_tokens(self) -> int:
        """What a micro-batch's forward processes for it: prompt and response."""
        return int(self.prompt_ids.numel() + self.output_ids.numel())


def microbatches(items: Sequence[T], max_tokens: int, tokens_of: Callable[[T], int] = lambda p: p.packed_tokens
                 ) -> list[list[T]]:
    """``items`` in order, cut into micro-batches of at most ``max_tokens`` packed tokens
    (``tokens_of`` an item; at least one item each)."""
    out, tokens = [], 0
    for p in items:
        n = tokens_of(p)
        if out and tokens + n <= max_tokens:
            out[-1].append(p)
            tokens += n
        else:
            out.append([p])
            tokens = n
    return out


@dataclass
class GroupState:
    expected: int
    members: list[Prepared] = field(default_factory=list)
    dropped: int = 0
    baseline: float | None = None  # remax: the reward of the group's greedy sample, once scored
    baseline_score: float | None = None  # its task score (the reward less the overlong penalty)

    @property
    def complete(self) -> bool:
        return len(self.members) + self.dropped + (self.baseline is not None) >= self.expected


class SampleBuffer:
    """Holds pending groups and the queue of samples ready to train (advantages known)."""

    def __init__(self):
        self.groups: dict[int, GroupState] = {}
        self.ready: deque[Prepared] = deque()
        self.ready_tokens = 0

    def push_ready(self, items: list[Prepared]) -> None:
        self.ready.extend(items)
        self.ready_tokens += sum(p.packed_tokens for p in items)

    def pop_microbatch(self, max_tokens: int, flush: bool) -> list[Prepared]:
        """Samples in arrival order up to ``max_tokens`` packed (prompt + response) tokens, at
        least one. Without ``flush`` only when a full budget is there: ``[]`` otherwise."""
        if not self.ready or (not flush and self.ready_tokens < max_tokens):
            return []
        out, tokens = [], 0
        while self.ready and (not out or tokens + self.ready[0].packed_tokens <= max_tokens):
            p = self.ready.popleft()
            out.append(p)
            tokens += p.packed_tokens
        self.ready_tokens -= tokens
        return out

    def keep_ready(self, items: list[Prepared]) -> None:
        """Replace the ready queue with ``items`` (a subset of it, in its order)."""
        self.ready = deque(items)
        self.ready_tokens = sum(p.packed_tokens for p in items)

    def clear(self) -> None:
        self.groups.clear()
        self.ready.clear()
        self.ready_tokens = 0

    @property
    def pending(self) -> int:
        return len(self.ready) + sum(len(g.members) for g in self.groups.values())


def mini_batch_shares(items: Sequence[T], k: int, seed: int | None, group_of: Callable[[T], int] = lambda p: p.group_id
                      ) -> list[list[T]]:
    """``items`` cut into ``k`` shares, one optimizer update each. ``seed`` None: in the given
    (arrival) order, of (nearly) equal sample counts. Otherwise whole prompt groups in an order
    drawn from ``seed``, as verl's mini-batches hold a random set of prompts with their n
    samples (in arrival order the first update would train the groups that finished first, i.e.
    the shortest responses, and the last the longest); each cut falls on the group boundary
    nearest an equal split that leaves every share at least one group (a share is empty only
    when there are fewer groups than shares)."""
    items = list(items)
    n = len(items)
    if seed is None:
        return [items[i * n // k:(i + 1) * n // k] for i in range(k)]
    groups: dict[int, list[T]] = {}
    for p in sorted(items, key=lambda p: p.sample_id):  # not arrival order: the seed alone decides
        groups.setdefault(group_of(p), []).append(p)
    order = torch.randperm(len(groups), generator=torch.Generator().manual_seed(seed)).tolist()
    ids = sorted(groups)
    ordered = [groups[ids[i]] for i in order]
    bounds = [0]  # sample index after each group
    for g in ordered:
        bounds.append(bounds[-1] + len(g))
    g_count, at = len(ordered), [0]  # at: the cuts as indices into bounds
    for i in range(1, k):
        # at least one group per share while there are enough groups (the nearest boundaries of
        # unequal groups could coincide and leave a share empty), else non-decreasing
        lo, hi = (at[-1] + 1, g_count - (k - i)) if g_count >= k else (at[-1], g_count)
        at.append(min(range(lo, hi + 1), key=lambda j: (abs(bounds[j] - i * n / k), j)))
    cuts = [bounds[j] for j in at] + [n]
    items = [p for g in ordered for p in g]
    return [items[a:b] for a, b in zip(cuts, cuts[1:])]
