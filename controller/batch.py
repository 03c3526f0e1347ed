"""An iteration's batch on the controller: its prompts and requests, its generation rounds (the
first and the refills, ``Program._refill``), a weight push in flight, and what the iteration
reports (``IterationResult``: ``iterations.jsonl``, TensorBoard, the console)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from controller.rpc import Completions
from controller.sgs import Round
from workers.types import Request, TaskPrompt

if TYPE_CHECKING:
    from controller.program import Program


@dataclass
class IterationResult:
    iteration: int
    version: int
    gen_version: int
    metrics: dict[str, float]
    num_samples: int
    num_tokens: int
    gen_seconds: float  # from the batch's dispatch to its last instance report's arrival (each refill's added)
    train_seconds: float  # the controller's wait for the step
    iter_seconds: float  # from the batch's dispatch to the end of its step
    staleness_max: int
    weight_sync_seconds: float = 0.0
    redispatched: int = 0
    lost: list[int] = field(default_factory=list)
    # the samples trained on (the trainer ranks' reports: one copy of a re-generated request):
    # the output length of each, in sample id order, and generation rank -> samples it gave
    out_lens: list[int] = field(default_factory=list)
    gen_lens: list[int] = field(default_factory=list)  # every generated sample's (remax's greedy ones too)
    per_instance: dict[int, int] = field(default_factory=dict)
    # the engines in this batch's generation (``engine_stats``): preemptions (sum over
    # the instances), kv_peak_frac (the fullest instance's peak share of its KV blocks)
    engine: dict[str, float] = field(default_factory=dict)
    instances: int = 0
    ranker_rows: int = 0  # rows of the ranker's online update after this iteration (0: none)
    # with a ranker: how its estimates (est_len) ranked this batch's true output lengths
    # (ranker.metrics.ranking_report: recall@10/20/30, kendall_tau, spearman) and their means
    ranker_quality: dict[str, float | None] = field(default_factory=dict)
    # the batch's lengths in tokens (``Program._batch_stats``: response_len_max/min,
    # response_clip_ratio, prompt_len_mean/max) and the prompt stream's epoch
    batch: dict[str, float] = field(default_factory=dict)
    # time since the previous iteration was recorded (the first of a ``run`` call: since that
    # call began): the pipeline's throughput interval. The intervals add up to the run's time;
    # ``iter_seconds`` (the batch's dispatch to its step's end) overlap in the async modes.
    interval_s: float = 0.0
    # the pipeline mode it stepped in and the dispatcher its batch was dispatched with (the REPL's
    # ``mode`` / ``dispatch`` change them between iterations)
    mode: str = ""
    dispatch: str = ""

    # the trainer's metrics the controller reads (``metrics`` holds them all, logged as train/*;
    # a key a step did not report reads as none of it)
    @property
    def reward_mean(self) -> float:
        return float(self.metrics.get("reward_mean", 0.0))

    @property
    def trained(self) -> int:
        """The samples trained (``num_seqs``): with ``trainer.filter_groups`` fewer than
        ``num_samples``, which counts every sample received, the dropped groups' too."""
        return int(self.metrics.get("num_seqs", self.num_samples))

    @property
    def skipped_samples(self) -> int:
        return int(self.metrics.get("skipped_samples", 0))

    @property
    def groups_without_baseline(self) -> int:
        return int(self.metrics.get("groups_without_baseline", 0))

    @property
    def nothing_trainable(self) -> bool:
        """The step trained nothing for want of samples: every one skipped (a reward that raised,
        bad input), or remax groups without their greedy baseline. The run stops there, with a
        checkpoint that retries the step (``Session._stop_untrained``)."""
        return bool(self.skipped_samples and not self.num_samples or self.groups_without_baseline and not self.trained)

    @property
    def step_skipped(self) -> bool:
        """No update was applied (the version did not advance)."""
        return bool(self.metrics.get("step_skipped", 0))


@dataclass
class Batch:
    """An iteration's prompts and requests, and its generation rounds: the first, then the
    refills of a batch the group filter left short (``Program._refill``)."""

    iteration: int
    items: list[TaskPrompt]
    requests: list[Request]
    started: float
    round: Round | None = None  # the round in flight, or the last one
    rounds: list[Round] = field(default_factory=list)
    dispatched: float = 0.0
    gen_done: float = 0.0
    launched: float = 0.0  # the round in flight's dispatch
    gen_s: float = 0.0  # the ended rounds' generation: each from its dispatch to its last report
    dispatch: str = ""  # the dispatcher it was dispatched with (Program.dispatch_name)

    @property
    def reports(self) -> list:
        return [rep for r in self.rounds for rep in r.reports]

    @property
    def redispatched(self) -> int:
        return sum(len(r.redispatched) for r in self.rounds)

    @property
    def lost(self) -> list[int]:
        return [rank for r in self.rounds for rank in r.lost]


class Push:
    """A weight push in flight: its calls, waited for from the start (``rpc.Completions``), so
    its duration is the transfer's, however late the controller takes it."""

    def __init__(self, calls: list):
        self.t0, self.waiting = time.time(), Completions()
        for c in calls:
            self.waiting.add(c)

    def wait(self, program: "Program") -> float:
        """Wait for it (``Program._wait_push``: instances lost meanwhile leave the SGS); -> seconds."""
        program._wait_push(self.waiting)
        return self.waiting.last_end() - self.t0 if self.waiting.added else 0.0


def engine_stats(reports: list) -> dict[str, float]:
    """The engines in a batch's generation (its rounds' ``GenerateReport``s): preemptions
    (recomputations a full KV cache forced: raise ``engine.kv_cache_tokens`` or lower
    ``engine.max_batch_size``) and the fullest instance's peak KV share; {} for none."""
    if not reports:
        return {}
    return {"preemptions": float(sum(r.preemptions for r in reports)),
            "kv_peak_frac": max(r.kv_blocks_peak / max(r.kv_blocks_total, 1) for r in reports)}
