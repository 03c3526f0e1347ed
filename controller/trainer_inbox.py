"""An iteration's inbox on a trainer rank (``controller/trainer_rank.py``): its registered
samples, those received and not yet handed to the trainer, and the pipeline mode's release
(``controller.modes``: ``PipelineMode.release``), which says when they go:

* ``all``       -- the whole iteration at once, once its generation has ended on every
  instance (colocated, batch, async_batch): the controller's ``step(i)`` says so, as it is
  only called after generation of i ended. This rank's own share being complete is not
  enough: colocated, the instance in this process would still be generating the other
  ranks' samples while this one trains (generate all, then train all, in turn)
* ``minibatch`` -- fixed-size hand-overs of ``minibatch`` samples (strawman 1)
* ``stream``    -- as samples arrive, in chunks of at least one trainer micro-batch
  (``max_tokens_per_microbatch`` tokens), and the rest as soon as the iteration is complete
  (stream, async_stream). The trainer trains a micro-batch as soon as one has
  arrived; handing it single samples would only split its receive-time forwards (reward,
  reference log-probs) into many small ones (measured: up to 2x the trainer's CPU).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from workers.types import Sample, TaskPrompt


@dataclass
class IterationInbox:
    iteration: int
    prompts: dict[int, TaskPrompt]
    group_sizes: dict[int, int]
    policy: str
    minibatch: int
    max_staleness: int
    stream_tokens: int = 0  # ``stream``: release once this many tokens are pending (0: at once)
    pending: list[Sample] = field(default_factory=list)
    pending_tokens: int = 0
    lengths: dict[int, int] = field(default_factory=dict)  # sample_id -> output length, as first received
    failed: set = field(default_factory=set)  # those whose generation failed: received, no length to report
    by_instance: dict[int, int] = field(default_factory=dict)  # generation rank -> samples taken from it
    consumed: int = 0
    duplicates: int = 0
    staleness_max: int = 0
    generated: bool = False  # the controller called step(): generation of the iteration has ended
    colocated: bool = False  # generation shares these ranks: nothing is released before step()
    scores: dict = field(default_factory=dict)  # sample_id -> its score, in flight since it arrived
    # group id -> its members' (sample id, score in flight, output length) (kept after the consumer
    # takes them): the group filter's count (kept_groups) reads them without waiting for the
    # trainer to take the samples
    group_scores: dict = field(default_factory=dict)

    @property
    def expected(self) -> int:
        return len(self.prompts)

    def release(self) -> list[Sample]:
        """Samples the policy lets go now (empty: keep waiting)."""
        n = len(self.pending)
        complete = self.consumed + n == self.expected
        if self.policy == "stream" and n and (complete or self.pending_tokens >= self.stream_tokens):
            k = n
        elif self.policy == "minibatch" and (n >= self.minibatch or (complete and n)):
            k = min(n, self.minibatch)
        elif self.policy == "all" and complete and n and self.generated:
            k = n  # every sample, in sample-id order: the arrival order is RPC timing's (runs
            self.pending.sort(key=lambda s: s.sample_id)  # and resumes trained them otherwise)
        else:
            return []
        out, self.pending = self.pending[:k], self.pending[k:]
        self.pending_tokens -= sum(sample_tokens(s) for s in out)
        return out


def sample_tokens(s: Sample) -> int:
    return int(s.prompt_ids.numel() + s.output_ids.numel())
