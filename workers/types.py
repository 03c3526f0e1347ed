"""Typed payloads that cross process boundaries, and the Protocols of the pluggable parts.

Everything sent between the controller, generation instances and trainer ranks is one of
these dataclasses. Token ids and log-probs travel as tensors (TensorPipe moves tensors
natively; never pickled Python lists).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Protocol, Sequence, runtime_checkable

import torch


SAMPLE_STRIDE = 1_000_000  # the controller's ids: sample_id = iteration * SAMPLE_STRIDE + index in it


def iteration_id(iteration: int, index: int) -> int:
    """The id of the ``index``-th sample (or group: prompt) of ``iteration``; ``id_parts`` reads it."""
    return iteration * SAMPLE_STRIDE + index


def id_parts(any_id: int) -> tuple[int, int]:
    """(iteration, index in it) of an ``iteration_id``."""
    return divmod(any_id, SAMPLE_STRIDE)


# below this a temperature is greedy (argmax; vLLM's _SAMPLING_EPS): logits / 1e-45 overflow
# to inf in fp32 and the draw returns NaN log-probs
GREEDY_BELOW = 1e-5
# Sampling temperatures both backends serve: T < GREEDY_BELOW is greedy (vLLM reads it as 0);
# otherwise MIN_SAMPLED_TEMPERATURE <= T <= MAX_TEMPERATURE. vLLM (0.32) refuses T > 2 and
# silently raises 0 < T < 0.01 to 0.01 - its samples and log-probs would then be of T = 0.01
# while the trainer takes its log-probs at the requested T - so both are refused.
MIN_SAMPLED_TEMPERATURE = 0.01
MAX_TEMPERATURE = 2.0
SERVED_TEMPERATURES = f"below {GREEDY_BELOW:g} (greedy) or in [{MIN_SAMPLED_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]"


def temperature_served(t: float) -> bool:
    """Whether both engines serve temperature ``t`` (``SERVED_TEMPERATURES``): the one rule the
    engines' request check and the run config's check share."""
    return t < GREEDY_BELOW or MIN_SAMPLED_TEMPERATURE <= t <= MAX_TEMPERATURE


@dataclass
class SamplingParams:
    """Per-request sampling. ``top_k`` 0 or -1 (vLLM's) and ``top_p == 1`` disable those filters;
    ``temperature`` below ``GREEDY_BELOW`` is greedy (log-probs at T = 1); engines sample at
    0.01 <= T <= 2 (vLLM's range) and refuse the rest. ``seed`` makes a request's draws
    reproducible."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class Request:
    """One generation request (one sample: GRPO's n samples of a prompt are n requests
    sharing ``group_id``; the engine shares their prompt KV blocks).

    prompt_ids: int64 [P]. ``min_tokens`` ignores EOS until reached (length-forced mode:
    ``min_tokens == max_tokens`` forces an exact length). ``est_len`` is the ranker's
    estimate, used by the admission policy (LPT)."""

    sample_id: int
    prompt_ids: torch.Tensor
    max_tokens: int
    min_tokens: int = 0
    est_len: float = 0.0
    group_id: int = -1
    sampling: SamplingParams = field(default_factory=SamplingParams)
    baseline: bool = False  # ReMax's greedy sample of the group: scored for the baseline, not trained
    # the dataset item (multi-turn runs only): what the environment (``multi_turn.env``) is handed
    task: "TaskPrompt | None" = None
    # the trainer DP rank its sample streams to (``pipeline.balance_batch``); -1: ``outbox.route``
    trainer_rank: int = -1


@dataclass
class Sample:
    """A finished generation. output_ids: int64 [L]; logprobs: float32 [L], the sampling
    policy's log-prob of each output token. ``weight_version`` is the version of the weights
    that produced every token (an engine never mixes versions inside one sample).
    ``finish_reason`` is ``"stop"`` (EOS), ``"length"`` (max_tokens) or ``"error"``
    (refused; ``error`` says why, output empty). ``timings`` holds wall-clock seconds
    (``queued``, ``admitted``, ``first_token``, ``finished``). ``min_tokens``: the request's; EOS
    could not be sampled before that many outputs, so ``logprobs`` there are of the
    distribution without EOS (the trainer takes its log-probs the same way). ``instance``: set
    by the generation instance that sends it (the trainer counts what each instance gave)."""

    sample_id: int
    prompt_ids: torch.Tensor
    output_ids: torch.Tensor
    logprobs: torch.Tensor
    weight_version: int
    finish_reason: str
    group_id: int = -1
    error: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    min_tokens: int = 0
    instance: int = -1  # the generation instance (its global rank) that streamed it; -1: none
    baseline: bool = False  # the request's (Request.baseline): ReMax's greedy baseline, not trained
    # multi-turn (workers/generation/multi_turn.py): bool [L], True where the policy sampled the
    # token, False on the environment's observation tokens (logprobs 0 there), which the trainer
    # leaves out of every loss term and count (verl's response_mask); None: all sampled
    loss_mask: torch.Tensor | None = None
    turns: int = 1  # assistant turns in ``output_ids``
    # multi-turn: the reward the environment gave with each answer that carried one (verl's tool
    # rewards), in call order; the trainer adds their sum to the task's score of the sample
    env_rewards: tuple[float, ...] = ()

    @property
    def env_reward(self) -> float:
        """The sum of ``env_rewards``: what the trainer adds to the task's score."""
        return float(sum(self.env_rewards))

    @classmethod
    def of(cls, req: "Request", output_ids, logprobs, weight_version: int, finish_reason: str,
           timings: dict[str, float], **extra) -> "Sample":
        """The sample of ``req``: what it carries over from the request (id, prompt, group,
        ``min_tokens``, ``baseline``) said once for every engine; ``extra``: other fields."""
        return cls(sample_id=req.sample_id, prompt_ids=req.prompt_ids,
                   output_ids=torch.as_tensor(output_ids, dtype=torch.int64),
                   logprobs=torch.as_tensor(logprobs, dtype=torch.float32), weight_version=weight_version,
                   finish_reason=finish_reason, group_id=req.group_id, timings=dict(timings),
                   min_tokens=int(req.min_tokens), baseline=req.baseline, **extra)


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    tokens_per_s: float
    max_batch_size: int
    weight_version: int
    preemptions: int = 0  # since the engine started
    # the most KV blocks in use at once since the engine last became busy (an ``add`` to an
    # idle engine starts a new busy period): how close a round came to preempting
    kv_blocks_peak: int = 0
    # prompt tokens (and a preempted sequence's tokens) found in the prefix cache by hash and
    # not computed again, since the engine started (native engine's prefix caching)
    prefix_cache_hit_tokens: int = 0


@runtime_checkable
class Engine(Protocol):
    """A generation backend (native or vLLM). ``step`` runs one scheduling + model step and
    returns the samples that finished in it (streaming: callers forward them at once).
    ``max_model_len``: the longest prompt + output a request may have (tokens). Optional:
    ``weight_dtype``, the dtype its weights are kept in (weight sync sends them in it: a bf16
    engine is sent half the bytes of the trainer's fp32 masters; absent: the trainer's dtype)."""

    max_model_len: int

    def add(self, requests: Sequence[Request]) -> list[Sample]:
        """Queue requests. Invalid ones are refused at once: returned as ``finish_reason
        == "error"`` samples naming what is wrong; the others are queued."""

    def step(self) -> list[Sample]: ...

    def has_work(self) -> bool: ...

    def abort(self, sample_ids: Iterable[int]) -> list[int]:
        """Cancel requests wherever they are (queued, running, preempted): their KV blocks are
        freed and no Sample of them comes out of a later ``step()``; their ids may be reused.
        Returns the ids actually aborted; unknown or finished ids are ignored (vLLM's
        ``abort_request``), so a caller can pass every id it has not seen finish."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                     version: int) -> None:
        """Replace weights in place (HF parameter names); samples in flight restart on the new
        version. Everything is checked first: a version that is not an int >= 0, a wrong name
        or shape, a meta, non-floating or non-finite tensor raises ValueError naming it, with
        the old weights, version and samples in flight untouched."""

    def set_max_batch_size(self, n: int) -> None: ...

    def stats(self) -> EngineStats: ...

    def close(self) -> None:
        """Release what outlives the engine object (vLLM's engine core process). Idempotent;
        the engine is not used after it."""


@runtime_checkable
class Ranker(Protocol):
    """Predicts output length from the prompt text alone (only the order matters): the
    rankers of ``ranker/`` (``ranker.base.LogLengthRanker``). ``fit`` trains from scratch,
    ``update`` goes on from the fitted model with new rows (online); both return the ranker.
    ``save(path)`` writes a folder that ``ranker.load(path)`` reads back as a ranker of the
    same ``kind``."""

    kind: str

    def fit(self, prompts: Sequence[str], lengths: Sequence[float]) -> Ranker: ...

    def update(self, prompts: Sequence[str], lengths: Sequence[float]) -> Ranker: ...

    def predict(self, prompts: Sequence[str]) -> list[float]: ...

    def save(self, path: str) -> None: ...


@dataclass(frozen=True)
class TaskPrompt:
    """A dataset item: the prompt text, the reference answer, the task it belongs to (for
    per-task accuracy) and free metadata the verifier may need. ``messages``: the chat, when
    the dataset gives one (``[{"role": ..., "content": ...}]``, verl's format): the policy sees
    it through the chat template, and ``prompt`` is its last user turn (logs, the ranker).
    ``raw_answer``: the answer as the dataset gives it (a list of accepted answers, a dict, a
    number), for verifiers that take it so (verl's ``ground_truth``); ``answer`` is its text."""

    prompt: str
    answer: str
    task: str
    meta: dict = field(default_factory=dict, hash=False, compare=False)
    messages: tuple = field(default=(), hash=False, compare=False)
    raw_answer: object = field(default=None, hash=False, compare=False)


def prompt_text(item: TaskPrompt) -> str:
    """The item's text as a ranker reads it: ``prompt``, or when a chat item leaves it empty, its
    last user turn (else every turn's text, joined)."""
    if item.prompt.strip() or not item.messages:
        return item.prompt
    turns = [m for m in item.messages if isinstance(m, dict)]
    texts = [t for t in (content_text(m.get("content")) for m in turns) if t.strip()]
    users = [content_text(m.get("content")) for m in turns if m.get("role") == "user"]
    return users[-1] if users and users[-1].strip() else "\n\n".join(texts)


def content_text(content) -> str:
    """A chat turn's text: its ``content`` string, or the ``text`` of its parts (OpenAI's
    ``[{"type": "text", "text": ...}]``)."""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


@runtime_checkable
class Task(Protocol):
    def prompts(self, split: str) -> Sequence[TaskPrompt]: ...

    def score(self, prompt: TaskPrompt, completion: str) -> float | dict:
        """Rule-based reward in [0, 1]; never raises on a malformed completion (scores 0). Or
        verl's ``{"score": number, ...}``: its other numbers and texts (``acc``, ``pred``) are
        evaluation's (``scoring.reward_info``)."""
