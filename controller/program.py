"""The RL program on the controller (DESIGN.md section 3), one loop for the six pipeline modes.

Per iteration i: take a batch of prompts, estimate lengths (ranker), register the iteration
with the trainer ranks, dispatch generation over the SGS (samples stream to the trainers),
step the trainers (new weight version), push weights to the instances.

* lag 0 (colocated, batch, minibatch, stream): G(i) uses the version after step(i-1); the
  push completes before G(i+1). Staleness 0.
* lag 1 (async_batch, async_stream): G(i) starts as soon as G(i-1) finished and the weights
  of step(i-2) are staged (and, with trainer.train_groups, G(i-1)'s refills have ended:
  ``_refill``); step(i-1) and the push of its weights overlap G(i). Staleness <= 1.

``run(k)`` runs k iterations and drains the pipeline, so the REPL can change the mode or the
dispatcher between calls.
"""
from __future__ import annotations

import sys
import time
from collections import deque

import torch

from controller.data import PromptStream
from controller.outbox import balance, owner
from controller.modes import PipelineMode, get_mode
from controller.prompt_fit import fit_prompt_ids
from controller.ranker_feedback import ranking_quality, update_rows
from controller.batch import Batch, IterationResult, Push, engine_stats
from controller.config_checks import requests_per_prompt
from controller.rpc import Completions, wait_all
from controller.sgs import Round
from controller.timeline import SpanRecorder
from controller.world import World
from workers.types import SAMPLE_STRIDE, Request, SamplingParams, TaskPrompt, id_parts, iteration_id, prompt_text



HISTORY = 64  # iteration results kept in memory (a run's every one, with its per-sample lengths,
# grew with it: ~22 KB an iteration at a tiny batch, ~400 KB at verl's 512 x 16; review, s51)


class Program:
    def __init__(self, cfg, world: World, tokenizer, task, ranker=None, on_iteration=None,
                 stream_state: dict | None = None, start_iteration: int = 0, version: int = 0):
        self.cfg = cfg
        self.world = world
        self.tok = tokenizer
        self.task = task
        self.ranker = ranker
        self.mode: PipelineMode = get_mode(cfg.pipeline.mode)
        self.minibatch = cfg.pipeline.minibatch_size
        world.sgs.stream_window_s = cfg.pipeline.stream_window_s
        world.sgs.est_bounds = (cfg.train.min_tokens, cfg.train.max_tokens)  # the lengths dispatch plans with
        self.stream = PromptStream(list(task.prompts("train")), cfg.train.seed, stream_state)
        self.iteration = start_iteration
        self.version = version  # weights the instances hold
        self.in_flight: Round | None = None  # the round generating now (async modes: during a step)
        self.on_iteration = on_iteration  # callback(IterationResult, spans)
        self.history: deque[IterationResult] = deque(maxlen=HISTORY)  # the latest (each one is logged)
        self._drained_sync_s = 0.0  # the last push of a lag-1 run, reported by the next run's first row
        self.ranker_rows: list[tuple[str, float]] = []  # awaiting the next online update
        self.length_of = None  # benchmarks: prompt text -> forced output length
        self.before_iteration = None  # hook(iteration) -> None (scale-out decisions)
        self.spans = SpanRecorder("controller")  # what the controller waits on, for the timeline
        self._stream_at: dict[int, dict] = {}  # iteration -> prompt-stream state before its batch
        self.eval_pool = None  # evaluation.eval_rewards: the task's scores of eval samples
        # requests per prompt: train.group_size samples, and remax's greedy baseline (verl's gen_max)
        self.per_prompt = requests_per_prompt(cfg)
        self.dispatch_name = cfg.dispatch.name  # the dispatcher in use (the REPL's dispatch sets it)
        self._rank_tokens: dict[int, list[float]] = {}  # pipeline.balance_batch: iteration -> tokens per rank

    # ---- requests ------------------------------------------------------------------------
    def make_batch(self, iteration: int) -> Batch:
        t = self.cfg.train
        self._stream_at[iteration] = self.stream.state_dict()
        for old in [i for i in self._stream_at if i < iteration - 2]:  # a checkpoint reads the next one's
            del self._stream_at[old]
        items = self.stream.next(t.batch_prompts)
        return Batch(iteration, items, self._requests(iteration, items, 0), time.time())

    def _requests(self, iteration: int, items: list[TaskPrompt], first: int) -> list[Request]:
        """The ``train.group_size`` requests of each of ``items`` (remax: and a greedy one, the
        group's baseline), the ``first``-th prompt of the iteration onwards (their sample and group
        ids follow from it)."""
        t = self.cfg.train
        texts = [prompt_text(it) for it in items]
        est = self.ranker.predict(texts) if self.ranker is not None else [float(t.max_tokens)] * len(items)
        reqs, per = [], self.per_prompt
        multi_turn = self.cfg.multi_turn.on  # the environment is handed the item (single-turn: not sent)
        for j, item in enumerate(items, start=first):
            ids = self.prompt_ids(item)
            max_tokens, min_tokens = self.token_bounds(item)
            for k in range(per):
                sid = iteration_id(iteration, j * per + k)
                greedy = k == t.group_size  # remax: the group's greedy baseline, after its samples
                reqs.append(Request(sid, ids, max_tokens, min_tokens, float(est[j - first]),
                                    group_id=iteration_id(iteration, j), baseline=greedy,
                                    sampling=self.sampling(0.0 if greedy else t.temperature, t.seed * 7919 + sid),
                                    task=item if multi_turn else None))
        if self.cfg.pipeline.balance_batch:  # refills go on from the loads placed in the iteration
            loads = self._rank_tokens.setdefault(iteration, [0.0] * len(self.world.trainers))
            balance(reqs, len(self.world.trainers), iteration, loads, bounds=(t.min_tokens, t.max_tokens))
            for old in [i for i in self._rank_tokens if i < iteration - 1]:
                del self._rank_tokens[old]
        return reqs

    def _register(self, b: Batch, requests: list[Request], method: str, *extra) -> None:
        """Tell each trainer DP rank which of ``requests`` (samples and groups of ``b``) it will
        receive: ``begin_iteration`` or, for a refill, ``extend_iteration``."""
        n = len(self.world.trainers)
        g = self.per_prompt
        per: list[tuple[dict, dict]] = [({}, {}) for _ in range(n)]
        for r in requests:
            prompts, groups = per[owner(r, n)]
            prompts[r.sample_id] = b.items[id_parts(r.group_id)[1]]
            groups[r.group_id] = g
        wait_all([t.call(method, b.iteration, prompts, groups, *extra)
                  for t, (prompts, groups) in zip(self.world.trainers, per)])

    def _generate(self, b: Batch, version: int) -> None:
        b.dispatched = b.launched = time.time()
        b.dispatch = self.dispatch_name
        with self.spans.span("dispatch", b.iteration):
            self._register(b, b.requests, "begin_iteration", self.mode.name, self.minibatch)
            self._launch(b, b.requests, version)

    def _launch(self, b: Batch, requests: list[Request], version: int) -> None:
        b.round = self.in_flight = self.world.sgs.generate(b.iteration, requests, version,
                                                           staged_ok=self.mode.lag == 0)
        b.rounds.append(b.round)
        b.gen_done = 0.0

    def _finish_generation(self, b: Batch) -> None:
        """Wait for ``b``'s generation. It ended when the last instance's report arrived, noted
        by the round as it arrived (in the lag-1 modes the controller waits only after the
        previous step), re-dispatched requests' reports included."""
        if b.round is not None and not b.gen_done:
            with self.spans.span("wait_generate", b.iteration):
                b.round.wait()
            b.gen_done = b.round.ended_at
            b.gen_s += b.gen_done - b.launched
            if self.in_flight is b.round:
                self.in_flight = None

    def _refill(self, b: Batch, version: int) -> None:
        """DAPO's refill (verl's ``max_num_gen_batches``): with ``trainer.filter_groups`` and
        ``train_groups`` > 0, once ``b``'s generation ended, generate another ``train.batch_prompts``
        prompts for the same iteration (weights ``version``) while fewer than ``train_groups`` of its
        groups pass the filter, at most ``trainer.max_gen_batches`` batches in all. Short after the
        last, the iteration trains what passed (said)."""
        tr, t = self.cfg.trainer, self.cfg.train
        if not self._refills():
            return
        most = tr.max_gen_batches or (SAMPLE_STRIDE - 1) // (t.batch_prompts * self.per_prompt)
        while True:
            with self.spans.span("wait_filter", b.iteration):
                kept = sum(wait_all([r.call("kept_groups", b.iteration) for r in self.world.trainers]))
            if kept >= tr.train_groups:
                return
            if len(b.rounds) >= most:
                bound = (f"trainer.max_gen_batches {tr.max_gen_batches}" if tr.max_gen_batches else
                         f"trainer.max_gen_batches 0: no limit but the {SAMPLE_STRIDE} sample ids of an iteration")
                print(f"[controller] step {b.iteration}: {kept} of trainer.train_groups {tr.train_groups} groups "
                      f"passed the filter after {len(b.rounds)} generation batches ({bound}); training on those",
                      file=sys.stderr, flush=True)
                return
            items = self.stream.next(t.batch_prompts)
            reqs = self._requests(b.iteration, items, len(b.items))
            b.items += items
            b.requests += reqs
            b.launched = time.time()
            with self.spans.span("dispatch", b.iteration):
                self._register(b, reqs, "extend_iteration")
                self._launch(b, reqs, version)
            self._finish_generation(b)

    def _refills(self) -> bool:
        """``_refill`` may generate more prompts for an iteration (filter_groups and train_groups)."""
        tr = self.cfg.trainer
        return bool(getattr(tr, "filter_groups", False) and getattr(tr, "train_groups", 0))

    def drain_spans(self) -> list:
        """Every worker's spans plus the controller's own."""
        return self.world.drain_spans() + self.spans.drain()

    def _step(self, b: Batch, gen_version: int, sync_s: float) -> IterationResult:
        t0 = time.time()
        reports = wait_all([t.call("step", b.iteration) for t in self.world.trainers])
        t1 = time.time()
        self.spans.add("wait_step", t0, t1, b.iteration)
        version = reports[0].version
        metrics = dict(reports[0].metrics)  # all-reduced: every DP rank reports the same totals
        metrics["staleness_max"] = float(max(r.staleness_max for r in reports))
        metrics["rss_mb_max"] = max(r.rss_mb for r in reports)  # the trainer ranks' memory (workers/heap.py)
        # re-sent samples are dropped by each rank's TrainerRank before its worker sees them
        metrics["duplicates"] = metrics.get("duplicates", 0.0) + float(sum(r.duplicates for r in reports))
        res = IterationResult(b.iteration, version, gen_version, metrics,
                              int(metrics["num_samples"]), int(metrics["num_tokens"]),
                              b.gen_s, t1 - t0, t1 - b.dispatched,
                              max(r.staleness_max for r in reports), sync_s,
                              b.redispatched, b.lost)
        generated = {sid: n for r in reports for sid, n in r.lengths.items()}  # each DP rank its own groups
        baselines = {r.sample_id for r in b.requests if r.baseline}  # remax's greedy samples: not trained
        lengths = {sid: n for sid, n in generated.items() if sid not in baselines}
        res.out_lens = [lengths[sid] for sid in sorted(lengths)]
        res.gen_lens = [generated[sid] for sid in sorted(generated)]  # what generation's time was spent on
        for r in reports:
            for rank, n in r.per_instance.items():
                res.per_instance[rank] = res.per_instance.get(rank, 0) + n
        # the instances the batch was dispatched to (one added later, while an async step
        # waited, served the next batch)
        res.instances = b.rounds[0].instances if b.rounds else len(self.world.sgs.slots)
        res.mode, res.dispatch = self.mode.name, b.dispatch
        res.batch = self._batch_stats(b, res.out_lens)
        if getattr(self.cfg.trainer, "filter_groups", False):
            res.metrics["gen_batches"] = float(len(b.rounds))  # verl's train/num_gen_batches
        res.engine = engine_stats(b.reports)
        if self.ranker is not None and b.round is not None:
            res.ranker_quality = ranking_quality(b, lengths)
        every = self.cfg.ranker.update_every
        # (a step that trained nothing is retried from its checkpoint: its lengths come then)
        if self.ranker is not None and every > 0 and b.round is not None and not res.nothing_trainable:
            self.ranker_rows += update_rows(b, lengths, self.per_prompt)
            if (b.iteration + 1) % every == 0 and self.ranker_rows:
                texts, lens = zip(*self.ranker_rows)
                self.ranker.update(list(texts), list(lens))
                res.ranker_rows, self.ranker_rows = len(texts), []
        return res

    def _batch_stats(self, b: Batch, out_lens: list[int]) -> dict[str, float]:
        """The batch's lengths in tokens (verl's response_length/*, prompt_length/*): output
        max / min, the share of samples cut at ``train.max_tokens`` (verl's clip_ratio), prompt
        mean / max (with the template, per sample); and the prompt stream's epoch."""
        cap = self.cfg.train.max_tokens
        prompts = [len(r.prompt_ids) for r in b.requests]
        return {"response_len_max": max(out_lens, default=0), "response_len_min": min(out_lens, default=0),
                "response_clip_ratio": sum(n >= cap for n in out_lens) / max(len(out_lens), 1),
                "prompt_len_mean": sum(prompts) / max(len(prompts), 1), "prompt_len_max": max(prompts, default=0),
                "epoch": self._batch_epoch(b.iteration)}

    def _batch_epoch(self, iteration: int) -> int:
        """The epoch of the iteration's first prompt: the stream's before its batch, or the next
        one when that had ended at the epoch's last prompt (the stream turns over when drawn)."""
        st = self._stream_at.get(iteration, self.stream.state_dict())
        return st["epoch"] + (st["pos"] >= st["items"])

    def _wait_push(self, waiting: Completions) -> None:
        """Wait for a weight push's calls, in the order they end (a receiver's error is said at
        once, not once a sender waiting on it gives up); an instance lost meanwhile leaves the
        SGS (its next prompts go to the others), any other failure stops the run. Its span
        carries ``self.iteration``: in every mode the next iteration to dispatch, the one that
        generates with those weights."""
        t0 = time.time()
        try:
            while waiting.pending:
                err = waiting.next()[3]
                if err is not None:
                    self.world.sgs.remove_lost(err, "weight push")
        finally:
            waiting.cancel()
        self.spans.add("wait_push", t0, time.time(), self.iteration)

    def _push(self, version: int) -> "Push":
        self._last_push = Push(self.world.push_weights(version))
        return self._last_push

    def settle_push(self) -> None:
        """Wait for the last weight push if it is still in flight (the lag-1 modes record, and
        save, an iteration while it runs); one waited for already (or failed) is done. Its
        failure is the push's, raised here (the session waits before it saves, so a failed push
        is not reported as a checkpoint that could not be written: diff review, s55)."""
        push = getattr(self, "_last_push", None)
        if push is not None and not push.waiting.cancelled.is_set():
            push.wait(self)

    def save_trainers(self, folder: str) -> str:
        """Every trainer rank saves its part into ``folder`` (rank 0 writes; a sharded optimizer's
        shares reach it); -> rank 0's folder. The push in flight is waited for first: a save
        gathers over the trainers' group (the RNG states always, a sharded optimizer's shares),
        which must not run beside the push's sends (NCCL: two communicators from two threads).
        A wait on each rank alone could deadlock: one rank's save in the gather, another's
        behind its push, whose buckets the receivers take in order (review, s55)."""
        self.settle_push()
        return wait_all([t.call("save_checkpoint", folder) for t in self.world.trainers])[0]

    # ---- the loop ------------------------------------------------------------------------
    def run(self, k: int, keep: bool = True) -> list[IterationResult]:
        """Run ``k`` iterations in the current mode; returns their results (pipeline drained; with
        ``keep`` False none: a whole run's, each logged as it ends, were held to its end).
        When it fails, a round still in flight is abandoned (``Round.abandon``): its calls,
        failing as the workers exit, are not losses to re-dispatch."""
        try:
            return self._run(k, keep)
        except BaseException:
            if self.in_flight is not None:
                self.in_flight.abandon()
            raise

    def _run(self, k: int, keep: bool) -> list[IterationResult]:
        out: list[IterationResult] | None = [] if keep else None
        self._recorded_at = time.time()  # pauses between calls (the REPL's prompt) are nobody's time
        lag = self.mode.lag
        prev: Batch | None = None
        prev_gen_version = self.version
        # weight_sync_seconds of a row: the last push that completed before it was recorded,
        # timed from its start to its last call's completion (the transfer, not the waits
        # around it). lag 0: the push of the row's own weights. lag 1: the push of the
        # previous row's weights (the weights the next generation uses); a run's last push
        # (drained) is reported by the next run's first row if that run is lag-1 too.
        push: Push | None = None
        sync_s, self._drained_sync_s = self._drained_sync_s, 0.0
        for _ in range(k):
            i = self.iteration
            if self.before_iteration is not None:
                self.before_iteration(i)
            # lag 1 with refills: the batch is drawn after the previous one's refill, so the prompt
            # stream runs iteration after iteration (a checkpoint's stream_state_at resumes it)
            b = self.make_batch(i) if lag == 0 or not self._refills() else None
            if lag == 0:
                self._generate(b, self.version)
                self._finish_generation(b)
                self._refill(b, self.version)
                res = self._step(b, self.version, 0.0)
                self.iteration += 1  # before the push: its weights are the next iteration's (as lag 1)
                res.weight_sync_seconds = self._push(res.version).wait(self)
                self.version = res.version
                self._record(res, out)
            else:
                if prev is not None:
                    self._finish_generation(prev)
                if push is not None:
                    sync_s, push = push.wait(self), None
                if prev is not None:  # on the weights just staged, before the next batch's generation
                    self._refill(prev, self.version)
                if b is None:
                    b = self.make_batch(i)
                gen_version = self.version
                self._generate(b, gen_version)
                if prev is not None:
                    res = self._step(prev, prev_gen_version, sync_s)
                    push = self._push(res.version)
                    self.version = res.version  # staged on the instances once `push` completes
                    self._record(res, out)
                prev, prev_gen_version = b, gen_version
                self.iteration += 1
        if prev is not None:  # drain
            self._finish_generation(prev)
            if push is not None:
                sync_s = push.wait(self)
            self._refill(prev, self.version)
            res = self._step(prev, prev_gen_version, sync_s)
            self._drained_sync_s = self._push(res.version).wait(self)
            self.version = res.version
            self._record(res, out)
        return [] if out is None else out

    def _record(self, res: IterationResult, out: list[IterationResult] | None) -> None:
        now = time.time()
        res.interval_s, self._recorded_at = now - self._recorded_at, now
        if out is not None:
            out.append(res)
        self.history.append(res)
        if self.on_iteration is not None:
            self.on_iteration(res)

    def stream_state_at(self, iteration: int) -> dict:
        """Prompt-stream state to resume at ``iteration`` (in async modes the next batch may
        already be drawn when a checkpoint is written)."""
        return self._stream_at.get(iteration, self.stream.state_dict())

    def prompt_ids(self, item: TaskPrompt | str) -> torch.Tensor:
        """A prompt (a dataset item, whose chat is used when it has one, or a text) as the policy
        sees it (chat template or prompt template), tokenized, and cut to ``train.max_prompt_tokens``
        under ``train.overlong_prompts: truncate_*``. The one place prompts are encoded for the
        engines: the samples carry these ids to the trainer, which trains on them."""
        ids = self.tok.encode_prompt(item) if isinstance(item, str) else \
            self.tok.encode_prompt(item.prompt, item.messages)
        t = self.cfg.train
        return torch.tensor(list(fit_prompt_ids(ids, t.overlong_prompts, t.max_prompt_tokens)), dtype=torch.long)

    def token_bounds(self, item: TaskPrompt | str) -> tuple[int, int]:
        """A training request's (max_tokens, min_tokens): ``train.max_tokens`` / ``min_tokens``, or
        both the item's forced length under ``train.length_trace``."""
        t = self.cfg.train
        if self.length_of is not None and not isinstance(item, str):
            forced = max(1, int(self.length_of(item)))
            return forced, forced
        return t.max_tokens, t.min_tokens

    def sampling(self, temperature: float, seed: int) -> SamplingParams:
        """The rollout's sampling (``train.top_k`` / ``top_p``; a top_k of -1 is off, as 0)."""
        t = self.cfg.train
        return SamplingParams(temperature=temperature, top_k=max(t.top_k, 0), top_p=t.top_p, seed=seed)
