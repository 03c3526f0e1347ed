"""TrainerRank: one trainer data-parallel rank behind an RRef, wrapping B's ``TrainerWorker``.

Generation instances call ``receive(samples)`` directly (the sample stream, by plain RPC:
``controller/trainer_address.py``); the rank keeps a
per-iteration inbox and a consumer thread that hands samples to ``TrainerWorker.receive`` as
the pipeline mode's release (``controller/trainer_inbox.py``) lets go.

Iterations are consumed strictly in order: samples of iteration i+1 (async modes) wait in
their inbox until ``step(i)`` has produced the new version. Every sample's staleness
(trainer version - sample.weight_version) is checked against the mode's bound. A sample id
seen twice is dropped (re-dispatch after an instance loss never trains a sample twice).
"""
from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch

from controller.modes import get_mode
from controller.process_state import COLLECTIVE_TIMEOUT_S, LOCAL, subgroup
from controller.timeline import SpanRecorder
from controller.trainer_inbox import IterationInbox, sample_tokens
from workers import heap
from workers.generation_dump import rows_from, stale_rows, write_rows
from workers.trainer.rollout_dump import take_rows
from workers.trainer.sample_checks import check_new_ids
from workers.types import Sample, TaskPrompt


@dataclass
class StepReport:
    rank: int
    iteration: int
    version: int
    metrics: dict[str, float]
    num_samples: int
    num_tokens: int
    staleness_max: int
    duplicates: int
    rss_mb: float = 0.0  # this process's resident memory after the step (0 where unknown)
    # the samples this rank trained on, each once whatever copies arrived (a lost instance's
    # requests are generated again; not those whose generation failed): sample_id -> output
    # length, and generation rank -> count
    lengths: dict[int, int] = field(default_factory=dict)
    per_instance: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainerStats:
    """Where a trainer rank stands (the REPL's ``trainer``): its weight version, the iteration
    its worker is in (None between iterations), the iterations registered and not yet stepped,
    and per iteration the samples waiting to be trained on and those trained on so far."""

    rank: int
    version: int
    current_iteration: int | None
    queued_iterations: list[int]
    pending: dict[int, int]
    consumed: dict[int, int]


class TrainerRank:
    def __init__(self, rank: int, dp_ranks: list[int], trainer_cfg, model_dir: str, task_name: str,
                 task_kwargs: dict, collective_timeout_s: float = COLLECTIVE_TIMEOUT_S, rollout_data_dir: str = ""):
        from workers.tasks.registry import make_task
        from workers.trainer.worker import TrainerWorker

        self.rank = rank
        self.dp_ranks = sorted(dp_ranks)
        group = subgroup(self.dp_ranks, collective_timeout_s)
        self.worker = TrainerWorker(trainer_cfg, model_dir, make_task(task_name, **task_kwargs),
                                    rank=self.dp_ranks.index(rank), world_size=len(self.dp_ranks),
                                    group=group, device=LOCAL.device,
                                    build_task=functools.partial(make_task, task_name, **task_kwargs))
        self.spans = SpanRecorder(f"train{rank}")
        self.rollout_data_dir = rollout_data_dir  # logging.rollout_data_dir: each step's scored samples there
        if rollout_data_dir:
            self.worker.rollout_rows = []
        self._iters: dict[int, IterationInbox] = {}
        self._owner: dict[int, int] = {}  # sample_id -> iteration
        self._current: int | None = None  # iteration the worker is in (begin_iteration called)
        self._ready: set[int] = set()  # iterations fully consumed, waiting for step()
        self._error: str | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._consume_loop, daemon=True, name="consumer")
        self._thread.start()
        LOCAL.roles["trainer"] = self

    # ---- control -------------------------------------------------------------------------
    def set_total_steps(self, total_steps: int) -> None:
        """The LR schedule's length (``trainer.total_steps``) derived at start from ``train.epochs``,
        before any iteration (and before a resumed run's checkpoint is loaded)."""
        from workers.trainer.schedule import set_total_steps

        with self._cond:
            set_total_steps(self.worker, total_steps)

    def begin_iteration(self, iteration: int, prompts: dict[int, TaskPrompt], group_sizes: dict[int, int],
                        mode: str, minibatch: int) -> bool:
        """Register an iteration's samples, released to the trainer as pipeline ``mode``
        (``controller.modes``) says, with its staleness bound; ``minibatch``: the hand-over size
        of the ``minibatch`` release."""
        m = get_mode(mode)
        with self._cond:
            self._raise_if_failed()
            if iteration in self._iters:
                raise RuntimeError(f"train{self.rank}: iteration {iteration} begun twice")
            self._iters[iteration] = IterationInbox(iteration, dict(prompts), dict(group_sizes), m.release, minibatch,
                                                m.max_staleness, self.worker.cfg.max_tokens_per_microbatch,
                                                colocated=m.colocated)
            for sid in prompts:
                self._owner[sid] = iteration
            self._cond.notify_all()
        return True

    def extend_iteration(self, iteration: int, prompts: dict[int, TaskPrompt], group_sizes: dict[int, int]) -> bool:
        """More samples for a registered iteration not yet stepped (the controller's refill of a
        batch the group filter left short): its release waits for them, and for the end of
        their generation (``kept_groups``) where the mode releases all at once."""
        with self._cond:
            self._raise_if_failed()
            rec = self._iters.get(iteration)
            if rec is None:
                raise RuntimeError(f"train{self.rank}: iteration {iteration} extended but not begun (or stepped)")
            check_new_ids(f"train{self.rank}: extend_iteration({iteration})", prompts, group_sizes, rec.prompts,
                          rec.group_sizes)
            if self._current == iteration:
                self.worker.extend_iteration(prompts, group_sizes)
            rec.prompts.update(prompts)
            rec.group_sizes.update(group_sizes)
            rec.generated = False
            for sid in prompts:
                self._owner[sid] = iteration
            if prompts:
                self._ready.discard(iteration)
            self._cond.notify_all()
        return True

    def kept_groups(self, iteration: int) -> int:
        """Once every sample registered for ``iteration`` has been received (its generation has
        ended: the ``all`` release may go, but for colocated, where it waits for ``step``), how
        many of this rank's groups the filter keeps, from their task scores: it waits for the
        rewards, not for the trainer to take the samples (reference log-probs, values), which in
        the lag-1 modes may still be busy with the previous iteration."""
        with self._cond:
            rec = self._iters[iteration]
            # the samples may go to the trainer while a refill generates, on other ranks only:
            # colocated, these ranks generate it (generate all, then train all, in turn)
            rec.generated = not rec.colocated
            self._cond.notify_all()
            while len(rec.lengths) < rec.expected and iteration not in self._ready and self._error is None:
                self._cond.wait(timeout=1.0)
            self._raise_if_failed()
            pending = {g: list(members) for g, members in rec.group_scores.items()}
        return self.worker.passing_groups(pending)

    def receive(self, samples: list[Sample]) -> int:
        """The sample stream (called by generation instances). Returns how many were new."""
        new = 0
        arrived: dict[int, list[Sample]] = {}
        with self._cond:
            for s in samples:
                it = self._owner.get(s.sample_id)
                if it is None or it not in self._iters:
                    continue  # a late duplicate of an iteration already trained
                rec = self._iters[it]
                if s.sample_id in rec.lengths:
                    rec.duplicates += 1
                    continue
                rec.lengths[s.sample_id] = int(s.output_ids.numel())
                if s.finish_reason == "error":  # (its length would read as a 0-token answer in the stats)
                    rec.failed.add(s.sample_id)
                rec.by_instance[s.instance] = rec.by_instance.get(s.instance, 0) + 1
                rec.pending.append(s)
                rec.pending_tokens += sample_tokens(s)
                arrived.setdefault(it, []).append(s)
                new += 1
            # each reward in flight as its sample arrives (trainer.reward_workers at once): it
            # runs while earlier samples train and generation goes on, not when the consumer
            # reaches the sample (a streamed iteration's many small hand-overs each waited out
            # their rewards in turn)
            for it, group in arrived.items():
                rec = self._iters[it]
                scored = self.worker.score_ahead(group, rec.prompts, it)
                rec.scores.update(scored)
                for s in group:
                    if s.sample_id in scored and not s.baseline:  # the filter reads the sampled members
                        rec.group_scores.setdefault(s.group_id, []).append(
                            (s.sample_id, scored[s.sample_id], int(s.output_ids.numel())))
            self._cond.notify_all()
        return new

    def received_ids(self, iteration: int) -> list[int]:
        with self._cond:
            rec = self._iters.get(iteration)
            return sorted(rec.lengths) if rec else []

    def step(self, iteration: int) -> StepReport:
        """Wait until ``iteration`` is fully consumed, then flush + all-reduce + optimizer step.
        Called once generation of ``iteration`` has ended: the ``all`` release waits for it."""
        with self._cond:
            if iteration in self._iters:
                self._iters[iteration].generated = True
                self._cond.notify_all()
            while iteration not in self._ready and self._error is None:
                self._cond.wait(timeout=1.0)
            self._raise_if_failed()
            rec = self._iters[iteration]
        if os.environ.get("STREAMRL_TEST_TRAINER_DIE_AT") == str(iteration) and \
                os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)  # test hook: trainer death on the first attempt
        t0 = time.time()
        result = self.worker.step()
        heap.trim()  # the step's freed activations back to the kernel (workers/heap.py)
        t1 = time.time()
        self.spans.add("train", t0, t1, iteration)
        if self.rollout_data_dir:  # verl's rollout_data_dir (its own span: not the training's time)
            self._dump_rollouts(iteration)
        with self._cond:
            self._ready.discard(iteration)
            del self._iters[iteration]
            for sid in rec.prompts:
                self._owner.pop(sid, None)
            self._current = None
            self._cond.notify_all()
        return StepReport(self.rank, iteration, result.version, dict(result.metrics), result.num_samples,
                          result.num_tokens, rec.staleness_max, rec.duplicates, heap.rss_mb(),
                          {sid: n for sid, n in rec.lengths.items() if sid not in rec.failed},
                          dict(rec.by_instance))

    def _dump_rollouts(self, iteration: int) -> None:
        """This iteration's scored samples as ``<rollout_data_dir>/<iteration>.jsonl`` (a rank's own
        ``.rank<k>`` with several ranks); a failed write is said, not raised: the step is done."""
        with self.spans.span("rollout_dump", iteration):
            ranks, k = len(self.dp_ranks), self.dp_ranks.index(self.rank)
            name = str(iteration) if ranks == 1 else f"{iteration}.rank{k}"
            rows = [{**r, "step": iteration} for r in take_rows(self.worker)]
            try:
                write_rows(self.rollout_data_dir, name, rows)
                if k == 0:  # a resumed run on another number of ranks: that run's files of this iteration go
                    stale_rows(self.rollout_data_dir, iteration, ranks)
            except OSError as e:
                logging.getLogger("streamrl.trainer").warning(
                    "logging.rollout_data_dir: iteration %d's samples not written (%s); training goes on", iteration, e)

    # ---- the consumer thread -------------------------------------------------------------
    def _consume_loop(self) -> None:
        try:
            while True:
                with self._cond:
                    batch, rec = self._next_batch()
                    if rec is None:
                        return
                if batch:
                    self._train(rec, batch)
        except Exception:  # noqa: BLE001 - reported to the controller by step()
            with self._cond:
                self._error = traceback.format_exc()
                self._cond.notify_all()

    def _next_batch(self) -> tuple[list[Sample], IterationInbox | None]:
        """Under the lock: wait for the next releasable batch of the current iteration. Time
        spent waiting (for samples, or for the next iteration) is recorded as "idle"; time
        while ``step()`` runs is not."""
        idle_from = None
        while not self._closed:
            if self._current is None and self._iters:
                nxt = min(self._iters)
                if nxt not in self._ready:
                    rec = self._iters[nxt]
                    self.worker.begin_iteration(nxt, rec.prompts, rec.group_sizes)
                    self._current = nxt
                    if rec.expected == 0:  # no group came to this rank: step() all-reduces zeros
                        self._ready.add(nxt)
                        self._cond.notify_all()
            stepping = self._current is not None and self._current in self._ready
            if self._current is not None and not stepping:
                rec = self._iters[self._current]
                batch = rec.release()
                if batch:
                    if idle_from is not None:
                        self.spans.add("idle", idle_from, time.time(), rec.iteration)
                    return batch, rec
            if stepping and idle_from is not None:
                self.spans.add("idle", idle_from, time.time(), self._current)
                idle_from = None
            elif not stepping and idle_from is None:
                idle_from = time.time()
            self._cond.wait(timeout=0.5)
        return [], None

    def _train(self, rec: IterationInbox, batch: list[Sample]) -> None:
        version = self.worker.version
        for s in batch:
            stale = version - s.weight_version
            if not 0 <= stale <= rec.max_staleness:
                raise RuntimeError(f"train{self.rank}: sample {s.sample_id} of iteration {rec.iteration} has "
                                   f"weight version {s.weight_version}, trainer is at {version}: staleness "
                                   f"{stale} outside [0, {rec.max_staleness}]")
            rec.staleness_max = max(rec.staleness_max, stale)
        with self._cond:
            scores = {s.sample_id: rec.scores.pop(s.sample_id) for s in batch if s.sample_id in rec.scores}
        with self.spans.span("train", rec.iteration):
            self.worker.receive(batch, scores)
        with self._cond:
            rec.consumed += len(batch)
            if rec.consumed == rec.expected:
                self._ready.add(rec.iteration)
                self._cond.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"train{self.rank}: consumer failed:\n{self._error}")

    # ---- weights, checkpoints, stats -----------------------------------------------------
    def weights_for(self, version: int, dtype: str | None = None) -> dict[str, torch.Tensor]:
        """The current weights as CPU named tensors, for an instance that pulls them (joined
        instances), in its engine's ``dtype`` when it says one of ``WIRE_DTYPES`` (a bf16 joiner
        is sent half the bytes). The instance asks and the trainer only answers, so an instance
        that dies meanwhile costs one failed reply."""
        from workers.weight_sync import sent_dtype, wire_dtype

        if version != self.worker.version:
            raise RuntimeError(f"train{self.rank}: weights of version {version} asked for, "
                               f"the trainer holds version {self.worker.version}")
        t0 = time.time()
        wire = wire_dtype([dtype])
        named = {k: v.detach().to("cpu", dtype=sent_dtype(v, wire), copy=True) for k, v in self.worker.named_weights()}
        self.spans.add("weight_sync", t0, time.time(), version)
        return named

    def push_weights(self, plan, version: int) -> float:
        """Weight-sync tree sender side (workers.weight_sync), concurrent with the receivers."""
        from workers.weight_sync import WeightSyncSender

        t0 = time.time()
        if self.worker.version != version:  # every root must send the same weights
            raise RuntimeError(f"trainer rank {self.rank}: asked to send weights version {version}, "
                               f"holds version {self.worker.version}")
        wire = {s.name: s.dtype for s in plan.slots}  # the engines' dtype (tensor_spec): bf16 halves the bytes
        named = [(k, v.detach().to(LOCAL.comm_device, dtype=wire.get(k, v.dtype), copy=True))
                 for k, v in self.worker.named_weights()]
        WeightSyncSender(plan, self.rank, timeout_s=LOCAL.rpc_timeout_s).push(named, version)
        self.spans.add("weight_sync", t0, time.time(), version)
        return time.time() - t0

    def tensor_spec(self, dtype: str | None = None) -> list:
        """The weights' names, shapes and dtypes as weight sync sends them: floating tensors in
        ``dtype`` ("torch.bfloat16": the engines'), when given, else the trainer's own."""
        from workers.weight_sync import sent_dtype, tensor_spec

        return tensor_spec((k, v.to("meta", dtype=sent_dtype(v, dtype))) for k, v in self.worker.named_weights())

    def save_checkpoint(self, folder: str) -> str:
        self.worker.save_checkpoint(folder)
        return folder

    def load_checkpoint(self, folder: str) -> int:
        self.worker.load_checkpoint(folder)
        return self.worker.version

    def drop_rollouts_from(self, iteration: int) -> int:
        """The rollout files of ``iteration`` and later in this rank's logging.rollout_data_dir:
        the controller's call when its run folder's lineage goes on from an older checkpoint
        (``Session.continue_lineage``; those iterations' rows leave iterations.jsonl then) ->
        how many were deleted. A failure is said, not raised (as a failed dump: the run goes on)."""
        try:
            return len(rows_from(self.rollout_data_dir, iteration)) if self.rollout_data_dir else 0
        except OSError as e:
            logging.getLogger("streamrl.trainer").warning(
                "logging.rollout_data_dir: the files of iterations from %d on (a lineage this resume abandons) "
                "were not deleted (%s)", iteration, e)
            return 0

    def version(self) -> int:
        return self.worker.version

    def stats(self) -> TrainerStats:
        with self._cond:
            return TrainerStats(self.rank, self.worker.version, self._current, sorted(self._iters),
                                {i: len(r.pending) for i, r in self._iters.items()},
                                {i: r.consumed for i, r in self._iters.items()})

    def drain_spans(self) -> list:
        return self.spans.drain()

    def close(self) -> bool:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.worker.rewards.close()
        if LOCAL.roles.get("trainer") is self:
            del LOCAL.roles["trainer"]
        return True

