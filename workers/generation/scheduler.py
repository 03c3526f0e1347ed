"""Scheduler: continuous batching over the paged KV cache.

Each step is either a *prefill* (admit waiting sequences, in the order of their admission keys
(``admission.py``, computed by the engine when a request is added),
while the batch cap, the prefill token budget and free blocks allow) or a *decode* (one
token for every running sequence, all in one forward). With ``mixed`` (vLLM V1's steps; the
engine sets it where the attention takes ragged batches, the "cpu" kernel) one step does both:
every running sequence's next token, and the next prefill chunk and new admissions within the
budget, so an admission never stalls the running batch for a step of its own. When a decode step lacks blocks,
idle prefix pins are dropped first, then the most recently admitted sequences are preempted
(their blocks freed; they are recomputed later from their tokens) - never another
sequence's blocks are touched. Sequences that were preempted go back to the queue's front.
With prefix caching, an admitted sequence not on its group's prefix starts on the leading
full blocks of its tokens found in the cache by hash (``BlockManager.match``).
``abort`` takes a sequence out wherever it is (waiting, preempted or running) and frees its
blocks.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from workers.generation.block_manager import BlockManager
from workers.generation.prefix_cache import PrefixCache
from workers.generation.sequence import Sequence, Status

@dataclass
class ScheduledBatch:
    """``seqs`` to run this step; a prefill computes tokens ``[num_cached, ends[i])`` of each
    (``ends`` None: to ``num_tokens``), a decode the last token of each. ``copies`` are
    (src, dst) block copies (copy-on-write) to do in the cache before the forward.
    ``sampling``: the sequences that get a new token this step (a prefill chunk that stops
    before a sequence's last token gets none)."""

    seqs: list[Sequence]
    is_prefill: bool
    copies: list[tuple[int, int]] = field(default_factory=list)
    ends: list[int] | None = None
    sampling: list[Sequence] = field(init=False)

    def __post_init__(self):
        if self.ends is None:
            self.ends = [s.num_tokens for s in self.seqs]
        self.sampling = [s for s, e in zip(self.seqs, self.ends) if e == s.num_tokens]


class Scheduler:
    def __init__(self, blocks: BlockManager, prefix: PrefixCache | None, max_batch_size: int,
                 max_prefill_tokens: int, chunked_prefill: bool = True, mixed: bool = False):
        self.bm, self.prefix = blocks, prefix
        self.max_batch_size, self.max_prefill_tokens = max_batch_size, max_prefill_tokens
        self.chunked_prefill, self.mixed = chunked_prefill, mixed
        self._after_chunk = False  # the last step left a prefill unfinished: decode next
        self.waiting: list[Sequence] = []  # sorted by _key
        self._keys: list[tuple] = []
        self.running: list[Sequence] = []  # in admission order (last = first preempted)
        self.preemptions = 0
        self.prefix_hit_tokens = 0  # prompt tokens admitted from the prefix cache (by hash)
        self.watermark = max(1, blocks.num_blocks // 100)
        self._tie = itertools.count()

    # ---- queue -------------------------------------------------------------------------------
    def _key(self, seq: Sequence) -> tuple:
        return (0 if seq.preempted else 1, seq.admission, seq.arrival, next(self._tie))

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        key = self._key(seq)
        i = bisect.bisect(self._keys, key)
        self._keys.insert(i, key)
        self.waiting.insert(i, seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def preempt(self, seq: Sequence, count: bool = True) -> None:
        self.running.remove(seq)
        if self.prefix is not None and seq.group_id >= 0:
            self.prefix.release_unready(seq.group_id, seq)  # its prompt was still being prefilled
        self.bm.free(seq)
        seq.preempted = True
        self.preemptions += int(count)
        self.add(seq)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = Status.FINISHED

    def abort(self, seq: Sequence) -> None:
        """Cancel ``seq`` wherever it is: out of the queue (waiting or preempted: its key goes
        with it) or out of the batch; its blocks are freed (shared prefix blocks lose one
        reference, the pin keeps them for the group's other samples)."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        else:
            i = self.waiting.index(seq)  # identity: Sequence has eq=False
            del self.waiting[i], self._keys[i]
        self.bm.free(seq)
        seq.status = Status.FINISHED

    def set_max_batch_size(self, n: int) -> None:
        """Takes effect at once: running sequences beyond ``n`` are preempted."""
        self.max_batch_size = n
        while len(self.running) > n:
            self.preempt(self.running[-1])

    # ---- one step ----------------------------------------------------------------------------
    @staticmethod
    def prefilling(seq: Sequence) -> bool:
        """A running sequence whose prompt (or recomputation) is not yet all in the cache: it
        takes more prefill chunks before it decodes."""
        return seq.num_cached < seq.num_tokens - 1

    def partial(self) -> Sequence | None:
        """The running sequence whose prefill is unfinished, if any. There is at most one, the
        last admitted: a step cuts only its last admission, continues that prefill first in the
        next prefill step and admits nothing new before it is done (so no scan of the batch)."""
        last = self.running[-1] if self.running else None
        return last if last is not None and self.prefilling(last) else None

    def _decodable(self) -> bool:
        return len(self.running) > (self.partial() is not None)

    def schedule(self) -> ScheduledBatch | None:
        """A prefill when something can be admitted or a prefill is unfinished, else a decode.
        After a prefill chunk that leaves a prompt unfinished the next step decodes (when any
        sequence can): a long prompt delays the running batch by one chunk at a time, not by
        its whole prefill. ``mixed``: both in one step (``_mixed``)."""
        if self.mixed:
            return self._mixed()
        if self._after_chunk and self._decodable():
            self._after_chunk = False
            return self._decode()
        batch = self._admit()
        if batch is not None:
            self._after_chunk = len(batch.sampling) < len(batch.seqs)
            return batch
        return self._decode() if self._decodable() else None

    def _mixed(self) -> ScheduledBatch | None:
        """The running batch's decode (its blocks first), then, unless it had to preempt (memory
        is short), the prefill work the budget allows, in one batch: the decoding sequences
        compute their last token as a one-token prefill would."""
        preemptions = self.preemptions
        decode = self._decode() if self._decodable() else None
        if decode is not None and self.preemptions != preemptions:
            return decode
        admit = self._admit()
        if admit is None or decode is None:
            return admit or decode
        return ScheduledBatch(decode.seqs + admit.seqs, True, decode.copies + admit.copies,
                              decode.ends + admit.ends)

    def _running_groups(self) -> set[int]:
        return {s.group_id for s in self.running}

    def _admit(self) -> ScheduledBatch | None:
        admitted: list[Sequence] = []
        ends: list[int] = []
        copies: list[tuple[int, int]] = []
        budget = self.max_prefill_tokens
        seq = self.partial()
        if seq is not None:  # an unfinished prefill first: its blocks are allocated
            n = min(seq.num_tokens - seq.num_cached, budget)
            admitted.append(seq)
            ends.append(seq.num_cached + n)
            budget -= n
        continuing = len(admitted)
        deferred = 0  # skipped until their group's prompt is computed: their slots are kept for them
        i = 0
        while (i < len(self.waiting) and len(self.running) + len(admitted) - continuing + deferred < self.max_batch_size
               and (budget > 0 or not self.chunked_prefill)):
            seq = self.waiting[i]
            g = self.prefix.lookup(seq) if self.prefix is not None and seq.group_id >= 0 else None
            if g is not None and not g.ready:
                # its group's prompt is being computed in this very step: it is admitted at the next,
                # in the slot it holds in the admission order (requests behind it took the slots of
                # a long group's samples: LPT admitted short requests first; flows review, s59)
                i += 1
                deferred += 1
                continue
            hit = 0
            if g is not None:
                self.prefix.attach(seq, g)
            else:  # prefix caching: the leading full blocks already in the cache, by hash
                hit = self.bm.match(seq)
            new_tokens = seq.num_tokens - seq.num_cached
            need = self.bm.new_blocks_needed(seq, seq.num_tokens)
            if need + self.watermark > self.bm.num_free and self.prefix is not None:
                while need + self.watermark > self.bm.num_free and self.prefix.evict_idle(
                        self._running_groups() | {s.group_id for s in admitted} | {seq.group_id}):
                    pass
            # keep a small watermark free while others run, so admission does not
            # immediately cause preemptions in the next decode steps
            reserve = self.watermark if (self.running or admitted) else 0
            if (admitted and new_tokens > budget and not self.chunked_prefill) or need + reserve > self.bm.num_free:
                if seq.block_table:
                    self.bm.free(seq)  # undo attach / match
                break
            copy = self.bm.prepare_write(seq, seq.num_tokens)
            if copy is not None:
                copies.append(copy)
            if g is None and self.prefix is not None:
                self.prefix.pin(seq)
            self.prefix_hit_tokens += hit
            n = min(new_tokens, budget) if self.chunked_prefill else new_tokens
            budget -= n
            del self.waiting[i], self._keys[i]
            seq.status = Status.RUNNING
            admitted.append(seq)
            ends.append(seq.num_cached + n)
        if not admitted:
            return None
        self.running.extend(admitted[continuing:])
        return ScheduledBatch(admitted, True, copies, ends)

    def _decode(self) -> ScheduledBatch:
        copies: list[tuple[int, int]] = []
        bs, ref = self.bm.block_size, self.bm.ref
        partial = self.partial()  # it waits for its next chunk (a victim like any other)
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            table = seq.block_table
            if seq is partial or (seq.num_tokens <= len(table) * bs and ref[table[seq.num_cached // bs]] == 1):
                i += 1  # fast path: the token's slot is in a private block already
                continue
            while self.bm.new_blocks_needed(seq, seq.num_tokens) > self.bm.num_free:
                if self.prefix is not None and self.prefix.evict_idle(self._running_groups()):
                    continue
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break  # seq itself was the last one: everything after it is gone too
            copy = self.bm.prepare_write(seq, seq.num_tokens)
            if copy is not None:
                copies.append(copy)
            i += 1
        return ScheduledBatch(self.running[:-1] if self.partial() is not None else list(self.running), False, copies)
