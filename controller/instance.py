"""GenerationInstance: one SGS data-parallel unit, living on a worker rank behind an RRef.

It owns an engine (``workers.generation.factory.make_engine``) and generates the requests the
controller's dispatch plan gives it. Each finished ``Sample`` goes straight to the trainer
rank that owns its group (``outbox.route(group_id)``) through RPC, tensors as tensors, in
time-windowed chunks (``outbox.Outbox``, ``stream_window_s``); the controller only gets a
``GenerateReport`` (metadata).
Weights arrive staged (versioned) and are swapped in only at an iteration boundary: at the
start of ``generate(..., weight_version)``.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import torch

from controller.config import PipelineSection
from controller.process_state import LOCAL
from controller.outbox import Outbox
from controller.timeline import SpanRecorder
from workers.types import EngineStats, Request


@dataclass
class GenerateReport:
    rank: int
    iteration: int
    sample_ids: list[int]
    num_tokens: int
    seconds: float
    weight_version: int
    lengths: list[int] = field(default_factory=list)  # output tokens per finished sample
    stopped: bool = False  # left early (scale-in); unfinished requests go back to the SGS
    unfinished: list[int] = field(default_factory=list)
    preemptions: int = 0  # sequences the engine preempted (recomputed later) in this call
    kv_blocks_peak: int = 0  # the most KV blocks in use at once during this call
    kv_blocks_total: int = 0  # the engine's KV blocks


@dataclass
class EvalOutput:
    """What ``GenerationInstance.evaluate`` generated, and with which weights."""

    weight_version: int
    outputs: list[tuple[int, list[int]]]  # (sample id, output token ids)
    cancelled: bool = False  # stopped by ``cancel``: outputs are what finished before
    # samples that failed (a multi-turn environment that raised): (sample id, why); not in outputs
    errors: list[tuple[int, str]] = field(default_factory=list)
    turns: list[tuple[int, int]] = field(default_factory=list)  # (sample id, its assistant turns: multi-turn)


@dataclass(frozen=True)
class InstanceStats:
    """What an instance holds now (the REPL's ``sgs``, the prompts' context check): its
    engine's ``EngineStats``, its context (``max_model_len``, tokens), the weight version it
    generates with and the one staged for the next round."""

    rank: int
    engine: EngineStats
    max_model_len: int
    weight_version: int
    staged_version: int | None

    def flat(self) -> dict:
        """One level of keys (the REPL's JSON): the engine's next to the instance's."""
        return {"rank": self.rank, **asdict(self.engine), "max_model_len": self.max_model_len,
                "weight_version": self.weight_version, "staged_version": self.staged_version}


def _test_die_after(rank: int, iteration: int) -> int:
    """Test hook ``STREAMRL_TEST_DIE_AFTER=rank:iteration:samples``: this process kills itself
    (SIGKILL) after streaming that many samples of that iteration. 0: never."""
    spec = os.environ.get("STREAMRL_TEST_DIE_AFTER", "")
    if spec:
        r, it, n = (int(x) for x in spec.split(":"))
        if r == rank and it == iteration:
            return n
    return 0


class GenerationInstance:
    """Engine + weight staging + sample streaming, on one rank."""

    def __init__(self, rank: int, engine_cfg, model_dir: str, eos_ids: list[int] | None = None,
                 multi_turn=None, tokenizer=None, stream_window_s: float = PipelineSection.stream_window_s):
        """``multi_turn``: the run's ``multi_turn`` section (with an ``env``, the engine runs
        multi-turn rollouts: ``workers/generation/multi_turn.py``, rendering observations with
        ``tokenizer``, the controller's; None: the folder's)."""
        from workers.generation.factory import make_engine

        self.rank = rank
        self.engine = make_engine(engine_cfg, model_dir, eos_ids, multi_turn, tokenizer)
        print(f"[generation {rank}] {self.engine!r}", file=sys.stderr, flush=True)
        self.version = 0
        self.trainers: list = []
        self.stream_window_s = stream_window_s  # Outbox window (``pipeline.stream_window_s``)
        self.spans = SpanRecorder(f"gen{rank}")
        self._staged: tuple[int, dict[str, torch.Tensor]] | None = None
        self._staging = threading.Lock()  # _staged: set by pushes (RPC threads) while generating
        self._receiver = None  # the weight-sync receiver of the current plan (receive_weights)
        self._lock = threading.Lock()  # one generate at a time
        self._stop = threading.Event()
        self._cancelled: dict[str, None] = {}  # evaluate tokens the controller gave up on (cancel)
        self._cancel_lock = threading.Lock()
        LOCAL.roles["generation"] = self

    # ---- control -------------------------------------------------------------------------
    def connect(self, trainers: list) -> bool:
        """``trainers``: RRefs (or ``TrainerAddress``es) of the TrainerRank objects, in DP order.
        Kept as addresses: samples and weight pulls go over plain RPC, no RRef (see
        controller/trainer_address.py)."""
        from controller.trainer_address import TrainerAddress

        self.trainers = [TrainerAddress.of(t) for t in trainers]
        return True

    def weight_dtype(self) -> str | None:
        """The dtype the engine keeps weights in ("torch.bfloat16"), None when it does not say."""
        dtype = getattr(self.engine, "weight_dtype", None)
        return None if dtype is None else str(dtype)

    def pull_weights(self, version: int, timeout: float) -> int:
        """Fetch the weights of ``version`` from trainer DP rank 0 and stage them (instances
        that joined later, outside the weight-sync group). The instance asks, the trainer only
        answers: if this process dies meanwhile, the trainer loses one reply, not its process."""
        t0 = time.time()
        named = self.trainers[0].rpc_async(timeout).weights_for(version, self.weight_dtype()).wait()
        self.spans.add("weight_sync", t0, time.time(), version)
        return self.stage_weights(named, version)

    def stage_weights(self, named: dict[str, torch.Tensor], version: int) -> int:
        """Keep weights of ``version``; they are loaded at the next iteration boundary."""
        t0 = time.time()
        with self._staging:
            if self._staged is None or version > self._staged[0]:
                self._staged = (version, named)
        self.spans.add("weight_stage", t0, time.time(), version)  # the transfer is the "weight_sync" span
        return version

    def receive_weights(self, plan) -> int:
        """Weight-sync tree receiver side (workers.weight_sync); runs while generating."""
        from workers.weight_sync import WeightSyncReceiver

        t0 = time.time()
        if self._receiver is None or self._receiver.plan != plan:
            # one per plan: its staging is allocated and touched once (page faults cost ~4 ms/MB,
            # more than the transfer). Two buffers, used in turn: the staged tensors (views of
            # one) are loaded at the next iteration boundary, before the push after next
            # (pushes follow steps, and a generate - which swaps - starts between two steps).
            self._receiver = WeightSyncReceiver(plan, self.rank, device=LOCAL.comm_device, staging_buffers=2,
                                                timeout_s=LOCAL.rpc_timeout_s)
        staged = self._receiver.receive()
        if not staged.ok:
            which = f"of version {staged.version} " if staged.version >= 0 else ""  # -1: no header arrived
            raise RuntimeError(f"gen{self.rank}: weight sync {which}failed: {staged.error}")
        self.spans.add("weight_sync", t0, time.time(), staged.version)
        return self.stage_weights(staged.tensors, staged.version)

    def load_local_trainer_weights(self, version: int) -> int:
        """Colocated: take the weights from the trainer object of this same process."""
        trainer = LOCAL.roles["trainer"]
        return self.stage_weights({k: v.detach().clone() for k, v in trainer.worker.named_weights()}, version)

    def _swap_weights(self, version: int, force: bool = False) -> None:
        if self.version == version and not force:
            return
        with self._staging:
            staged = self._staged
        if staged is None or staged[0] != version:
            have = None if staged is None else staged[0]
            raise RuntimeError(f"gen{self.rank}: asked to generate with weight version {version}, "
                               f"holds {self.version}, staged {have}")
        self.engine.load_weights(staged[1].items(), version)
        with self._staging:  # the next version may have been staged while this one loaded
            if self._staged is staged:  # (vLLM's reload takes ~1 s): keep it
                self._staged = None
        self.version = version

    def hold_weights(self, version: int) -> int:
        """Load staged ``version`` now (a joiner just added, with no round in flight: it would
        otherwise hold the model folder's weights until its first round, and an evaluation
        before that scored them). Loaded even at version 0: a joiner starts at 0 with its folder's
        weights, which are not the run's when the folder differs (a joiner added at 0 generated
        from it, and one of other shapes was admitted; review, s54). -> the version held."""
        with self._lock:
            self._swap_weights(version, force=True)
        return self.version

    def _swap_to_newest(self) -> None:
        """Load the staged weights, if any (between rounds only: a round in flight on another
        instance generates with the version it was dispatched with)."""
        with self._staging:
            staged = None if self._staged is None else self._staged[0]
        if staged is not None:
            self._swap_weights(staged)

    def stop(self) -> bool:
        """Scale-in: the running ``generate`` returns early, reporting its unfinished requests."""
        self._stop.set()
        return True

    def resume(self) -> bool:
        """Scale out again after ``stop`` (the REPL's ``rejoin`` of a torchrun rank): the next
        ``generate`` runs its requests."""
        self._stop.clear()
        return True

    # ---- data ----------------------------------------------------------------------------
    def generate(self, iteration: int, requests: list[Request], weight_version: int,
                 batch_cap: int = 0, window_s: float | None = None) -> GenerateReport:
        """Generate ``requests`` with weights ``weight_version``; finished samples stream to the
        trainers in ``window_s`` chunks (default: the instance's ``stream_window_s``)."""
        with self._lock:
            self._swap_weights(weight_version)
            t0 = time.time()
            die_after = _test_die_after(self.rank, iteration)
            if os.environ.get("STREAMRL_TEST_RAISE_IN_GENERATE") == str(self.rank):
                # test hook: an engine failure (a CUDA error, OOM) cannot be produced on demand here
                raise RuntimeError(f"gen{self.rank}: STREAMRL_TEST_RAISE_IN_GENERATE (test hook)")
            out = Outbox(self.trainers, self.stream_window_s if window_s is None else window_s,
                         {r.group_id: r.trainer_rank for r in requests if r.trainer_rank >= 0})
            before = self.engine.stats()
            preempted_before = before.preemptions
            done: list[int] = []
            lengths: list[int] = []
            configured = before.max_batch_size  # the round's cap is the round's alone: evaluations
            # and the next rounds ran at a re-dispatch's cap of 1 (review, session 51)
            try:
                if batch_cap > 0:  # within engine.max_batch_size (a dispatch.profile's cap may be larger)
                    self.engine.set_max_batch_size(min(batch_cap, configured))
                refused = self.engine.add(requests)
                if refused:
                    s = refused[0]
                    raise ValueError(f"gen{self.rank}: engine refused request {s.sample_id}: {s.error}")
                while self.engine.has_work() and not self._stop.is_set():
                    for s in self.engine.step():
                        # a sample that failed (its multi-turn environment raised) goes to the
                        # trainer like any: trainer.on_bad_sample skips it (counted) or stops the
                        # run; it failed the round, and the run with it (until session 53)
                        s.instance = self.rank
                        out.put(s)
                        done.append(s.sample_id)
                        if len(done) == die_after:  # test hook: a real, abrupt process death
                            out.close()
                            os.kill(os.getpid(), signal.SIGKILL)
                        lengths.append(len(s.output_ids))
                stopped = self._stop.is_set()
                unfinished = sorted({r.sample_id for r in requests} - set(done)) if stopped else []
                self.engine.abort(unfinished)  # scale-in: they go back to the SGS, not on in here
            except BaseException:
                self._abort_after_error(requests)  # the round fails: leave nothing behind
                raise
            finally:
                out.close()
                if batch_cap > 0:
                    self.engine.set_max_batch_size(configured)
            self.spans.add("generate", t0, time.time(), iteration)
            st = self.engine.stats()
            return GenerateReport(self.rank, iteration, done, sum(lengths), time.time() - t0,
                                  weight_version, lengths, stopped, unfinished, st.preemptions - preempted_before,
                                  st.kv_blocks_peak, st.kv_blocks_used + st.kv_blocks_free)

    def _abort_after_error(self, requests: list[Request]) -> None:
        """Cancel in the engine what a failing call queued (its refused ids are unknown there;
        nothing else is in the engine: calls run one at a time and leave it empty). A failure
        to abort (the engine itself broken) is printed, never raised over the error being
        handled."""
        try:
            self.engine.abort([r.sample_id for r in requests])
        except Exception as e:
            print(f"[generation {self.rank}] abort after an error failed: {e!r}", file=sys.stderr, flush=True)

    def evaluate(self, requests: list[Request], newest: bool = False, token: str | None = None,
                 stage: str = "eval", step: int | None = None) -> EvalOutput:
        """Generate ``requests`` (their own sampling: greedy for evaluation, sampled for the
        ranker's bootstrap); outputs come back to the controller, not to the trainers. Its span
        on this instance's timeline row is ``stage``: "eval", or "ranker" for the bootstrap. With
        ``newest`` (the controller has no round in flight) the staged weights are loaded first,
        so an evaluation after a push runs on the weights it is logged under; otherwise on the
        weights held now. The answer names the version used. ``token``: the call's name for
        ``cancel`` (then it stops at its next step, or does not start, answering
        ``cancelled``). ``step``: the iteration the span is labelled with, the one the controller
        logs the evaluation at (None: the weight version used)."""
        with self._lock:
            if self._take_cancel(token):
                return EvalOutput(self.version, [], cancelled=True)
            if newest:
                self._swap_to_newest()
            with self.spans.span(stage, self.version if step is None else step):
                out, errors, turns = [], [], []
                try:  # (the add too: vLLM's queues a request, then may raise; review, s53)
                    refused = self.engine.add(requests)
                    if refused:
                        s = refused[0]
                        raise ValueError(f"gen{self.rank}: engine refused {stage} request {s.sample_id}: {s.error}")
                    while self.engine.has_work():
                        if self._take_cancel(token):
                            self.engine.abort([r.sample_id for r in requests])
                            return EvalOutput(self.version, out, cancelled=True, errors=errors)
                        for s in self.engine.step():
                            if s.finish_reason == "error":  # (scored as an empty answer until session 48)
                                errors.append((s.sample_id, f"gen{self.rank}: {stage} sample {s.sample_id} failed: "
                                                            f"{s.error}"))
                            else:
                                out.append((s.sample_id, s.output_ids.tolist()))
                                turns.append((s.sample_id, s.turns))
                except BaseException:
                    # the accepted requests of this call must not stay queued and run inside the
                    # next generate() as training samples
                    self._abort_after_error(requests)
                    raise
                return EvalOutput(self.version, out, errors=errors, turns=turns)

    def cancel(self, token: str) -> bool:
        """The controller gave up on the ``evaluate`` call named ``token`` (another instance's
        share failed, so the evaluation did): it stops at its next step, aborting what it
        queued, or, still queued behind another call, does not start. Without this the
        instance kept generating the dead evaluation, and the next command (a REPL ``run``)
        waited for it."""
        with self._cancel_lock:
            self._cancelled[token] = None
            while len(self._cancelled) > 64:  # a cancel that came after its call had ended
                del self._cancelled[next(iter(self._cancelled))]
        return True

    def _take_cancel(self, token: str | None) -> bool:
        if token is None:
            return False
        with self._cancel_lock:
            if token not in self._cancelled:
                return False
            del self._cancelled[token]
            return True

    def stats(self) -> InstanceStats:
        with self._staging:
            staged = self._staged
        return InstanceStats(self.rank, self.engine.stats(), self.engine.max_model_len, self.version,
                             None if staged is None else staged[0])

    def drain_spans(self) -> list:
        return self.spans.drain()

    def close(self) -> bool:
        """Leave the process's roles and stop the engine's own processes (vLLM's engine core),
        which would otherwise outlive this one."""
        if LOCAL.roles.get("generation") is self:
            del LOCAL.roles["generation"]
        self.engine.close()
        return True
