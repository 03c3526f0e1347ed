"""A generation instance's sample stream to its trainer ranks: ``route`` (the data-parallel
rank that owns a group: the program registers the iteration's prompts with it, the instance
sends the group's samples there) and ``Outbox`` (the samples in time-windowed chunks, one RPC
per trainer per window)."""
from __future__ import annotations

import heapq
import math
import queue
import threading
import time

from controller.length_estimates import within_run_bounds
from workers.types import Request, Sample, id_parts


def route(group_id: int, num_trainers: int) -> int:
    """Trainer DP index that trains ``group_id`` (a GRPO group never splits across ranks): its
    index in the iteration, rotated by the iteration (``SAMPLE_STRIDE`` is a multiple of most
    rank counts: with ``batch_prompts`` not one, the same low ranks took the extra groups at
    every step)."""
    iteration, index = id_parts(group_id)
    return (index + iteration) % num_trainers


def balance(requests: list[Request], num_trainers: int, iteration: int, loads: list[float] | None = None,
            bounds: tuple[int, float] = (0, math.inf)) -> None:
    """``pipeline.balance_batch`` (verl's ``trainer.balance_batch``): set each request's
    ``trainer_rank`` so the ranks get about the same number of tokens to train, not the same
    number of groups. A group's tokens are its samples' prompt tokens plus their expected
    output (the ranker's estimate where a ranker runs, within ``bounds``, the run's
    ``(train.min_tokens, train.max_tokens)``: ``length_estimates.within_run_bounds``; without
    one, ``train.max_tokens``; never a request's forced length under ``train.length_trace``).
    Longest group first to the rank with the fewest tokens so far (LPT); ties go as ``route``
    rotates them, so no rank takes the odd group every step.
    ``loads``: each rank's tokens placed so far in the iteration (a refill's batch goes on from
    them, not from zero: each refill put its longest groups on the same ranks), updated. verl
    balances after generation, by the lengths it got; here a group streams to its rank as it
    finishes, so the rank is chosen at dispatch, by the estimate."""
    tokens: dict[int, float] = {}
    outs = within_run_bounds([r.est_len for r in requests], *bounds)  # a NaN estimate: the floor
    for r, out in zip(requests, outs):
        tokens[r.group_id] = tokens.get(r.group_id, 0.0) + len(r.prompt_ids) + out
    loads = [0.0] * num_trainers if loads is None else loads
    heap = [(loads[t], (t - iteration) % num_trainers, t) for t in range(num_trainers)]
    heapq.heapify(heap)
    owner: dict[int, int] = {}
    for g in sorted(tokens, key=lambda g: (-tokens[g], g)):
        load, order, t = heapq.heappop(heap)
        owner[g] = t
        loads[t] = load + tokens[g]
        heapq.heappush(heap, (loads[t], order, t))
    for r in requests:
        r.trainer_rank = owner[r.group_id]


def owner(request: Request, num_trainers: int) -> int:
    """The trainer DP rank ``request``'s sample streams to."""
    return request.trainer_rank if request.trainer_rank >= 0 else route(request.group_id, num_trainers)


class Outbox:
    """Sends finished samples to trainer RRefs from a background thread in time-windowed
    chunks: the samples that finish within ``window_s`` of the first unsent one travel in one
    RPC per trainer (fewer round trips, and the trainer prepares them in one forward instead
    of one per sample). ``close()`` sends what is left at once (no window wait at the end).
    ``owners``: group id -> trainer rank, for groups not sent by ``route`` (``balance``)."""

    def __init__(self, trainers: list, window_s: float, owners: dict[int, int] | None = None):
        self.trainers, self.window_s = trainers, window_s
        self.owners = owners or {}
        self.q: queue.Queue = queue.Queue()
        self.futures: list = []
        self._last: dict[int, object] = {}  # trainer -> its send in flight
        self.sends = 0  # RPCs issued
        self.error: BaseException | None = None  # what stopped the sending thread (raised by close)
        self.thread = threading.Thread(target=self._run, daemon=True, name="outbox")
        self.thread.start()

    def put(self, sample: Sample) -> None:
        if self.error is not None:  # the sending thread is gone: say so now, not at close()
            raise RuntimeError(f"sending samples to the trainers failed: {self.error!r}") from self.error
        if sample.output_ids.is_cuda:  # RPC moves CPU tensors without device maps
            sample.prompt_ids, sample.output_ids = sample.prompt_ids.cpu(), sample.output_ids.cpu()
            sample.logprobs = sample.logprobs.cpu()
        if sample.loss_mask is not None and sample.loss_mask.is_cuda:
            sample.loss_mask = sample.loss_mask.cpu()
        self.q.put(sample)

    def _run(self) -> None:
        try:
            self._send_windows()
        except BaseException as e:  # noqa: BLE001 - a failed send (a sample RPC cannot carry, RPC
            self.error = e  # shut down) must fail the generate call, not lose its samples quietly

    def _send_windows(self) -> None:
        done = False
        while not done:
            first = self.q.get()
            if first is None:
                return
            batch, deadline = [first], time.monotonic() + self.window_s
            while True:  # collect until the window closes or close() is called
                left = deadline - time.monotonic()
                try:
                    s = self.q.get(timeout=left) if left > 0 else self.q.get_nowait()
                except queue.Empty:
                    break
                if s is None:
                    done = True
                    break
                batch.append(s)
            self._send(batch)

    def _send(self, batch: list[Sample]) -> None:
        by_trainer: dict[int, list[Sample]] = {}
        for s in batch:
            t = self.owners.get(s.group_id)
            by_trainer.setdefault(route(s.group_id, len(self.trainers)) if t is None else t, []).append(s)
        for t, samples in by_trainer.items():
            # one send at a time to each trainer: the trainer serves RPCs on a pool of threads, so
            # two in flight could be taken in either order (the training order, then the weights,
            # was RPC timing's; a resume was not bit-identical to the run it continued)
            prev = self._last.get(t)
            if prev is not None:
                prev.wait()
            self._last[t] = self.trainers[t].rpc_async().receive(samples)
            self.futures.append(self._last[t])
            self.sends += 1

    def close(self) -> None:
        """Flush and wait until every trainer has accepted its samples (raises on failure)."""
        self.q.put(None)
        self.thread.join()
        for f in self.futures:
            f.wait()
        if self.error is not None:
            raise RuntimeError(f"sending samples to the trainers failed: {self.error!r}") from self.error
