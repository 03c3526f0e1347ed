"""Outgoing links of one rank: one send thread per child, so a bucket paced on a slow
(shaped) link never holds up the fast local children, and byte counters per link class.

Each child gets its buckets in plan order (so per-pair message order is the same on both
ends, which NCCL needs; gloo also matches on the tag). Every bucket is two messages:
header int64 [4] = (version, bucket index, checksum s1, s2) with tag 2*i, payload uint8 [n]
with tag 2*i+1.
"""
from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from workers.weight_sync.shaper import LinkShaper
from workers.weight_sync.topology import LinkClass, Topology

HEADER_WORDS = 4
_FLUSH = object()  # a child's queue item: finish the sends posted so far (Links.flush)


@dataclass
class Outgoing:
    """One bucket for one child. ``done`` is called once the send completed (or failed)."""

    bucket: int
    header: torch.Tensor     # int64 [4]
    payload: torch.Tensor    # uint8 [n]
    tensor_bytes: int        # bytes of real tensor data in payload (without padding)
    done: "Countdown"


class Countdown:
    """Counts a bucket's pending child sends; ``wait`` blocks until all finished."""

    def __init__(self, n: int) -> None:
        self._n = n
        self._cv = threading.Condition()

    def hit(self) -> None:
        with self._cv:
            self._n -= 1
            if self._n <= 0:
                self._cv.notify_all()

    def finished(self) -> bool:
        with self._cv:
            return self._n <= 0

    def wait(self, timeout_s: float | None = None) -> bool:
        """Whether every send finished (False: ``timeout_s`` passed first)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._n <= 0, timeout_s)


class Links:
    """Outgoing sends of ``rank`` towards ``children``; counts bytes per link class.

    Threaded (default): one send thread per child, fed by ``send``. ``inline=True``: ``send``
    posts at once on the caller's thread (shaping included), so the issue order of all this
    rank's sends and receives is the caller's order, which NCCL needs (see receiver.py).
    ``window``: sends in flight per child before waiting for the oldest (payloads are views
    of staging or pooled buffers, so this costs no memory; a window of 4 made a busy
    receiver stall the paced inter-DC thread, ~0.2 s lost per 100 MB)."""

    def __init__(self, topology: Topology, rank: int, children: list[int], group=None,
                 timeout_s: float = 600.0, window: int = 64, inline: bool = False) -> None:
        self.topology = topology
        self.rank = rank
        self.group = group
        self.timeout = timedelta(seconds=timeout_s)
        self.window = window
        self.inline = inline
        self.wire_bytes = {lc.value: 0 for lc in LinkClass}
        self.tensor_bytes = {lc.value: 0 for lc in LinkClass}
        self.busy: dict[str, list[float]] = {}   # link class -> [first post, last completion] (time.time())
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._shapers: dict[tuple, LinkShaper] = {}
        self._children = list(dict.fromkeys(children))
        self._shaper = {c: self._shaper_for(c) for c in self._children}
        self._outstanding = {c: collections.deque() for c in self._children}
        self._failed: set[int] = set()
        self._queues: dict[int, queue.Queue] = {}
        self._threads: list[threading.Thread] = []
        if not inline:
            for child in self._children:
                self._queues[child] = queue.Queue()
                t = threading.Thread(target=self._run, args=(child,), name=f"weight-sync-{rank}->{child}",
                                     daemon=True)
                self._threads.append(t)
                t.start()

    def _shaper_for(self, child: int) -> LinkShaper | None:
        """One shaper per shared link: the link into each remote DC for inter-DC children;
        this rank's NIC for all intra-DC (resp. intra-node) children."""
        lc = self.topology.link(self.rank, child)
        if lc not in self.topology.shaped:
            return None
        key = (lc, self.topology.dc(child)) if lc is LinkClass.INTER_DC else (lc,)
        if key not in self._shapers:
            self._shapers[key] = LinkShaper(self.topology.bandwidth[lc])
        return self._shapers[key]

    def send(self, child: int, item: Outgoing) -> None:
        if self.inline:
            self._post(child, item)
        else:
            self._queues[child].put(item)

    def flush(self) -> None:
        """Finish every send posted so far (each child's thread, after what is queued for it):
        a send is marked done only when the window fills or at a flush, and a producer waiting
        for one (the sender's pack buffers) posts nothing more that would fill it."""
        if self.inline:
            for child in self._children:
                self._drain(child)
            return
        for q in self._queues.values():
            q.put(_FLUSH)

    def close(self) -> None:
        """Flush every queue, wait for all sends, stop the threads."""
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join()
        if self.inline:
            for child in self._children:
                self._drain(child)

    def _run(self, child: int) -> None:
        q = self._queues[child]
        while (item := q.get()) is not None:
            if item is _FLUSH:
                self._drain(child)
            else:
                self._post(child, item)
        self._drain(child)

    def _post(self, child: int, item: Outgoing) -> None:
        """Shape, post header + payload, keep at most ``window`` in flight. After a failure
        on this child, items are only marked done (so producers never block)."""
        if child in self._failed:
            item.done.hit()
            return
        lc = self.topology.link(self.rank, child).value
        outstanding = self._outstanding[child]
        posted = False
        try:
            nbytes = item.header.numel() * 8 + item.payload.numel()
            if self._shaper[child] is not None:
                self._shaper[child].acquire(nbytes)
            tag = 2 * item.bucket
            works = (dist.isend(item.header, dst=child, group=self.group, tag=tag),
                     dist.isend(item.payload, dst=child, group=self.group, tag=tag + 1))
            outstanding.append((item, works))
            posted = True
            with self._lock:
                self.busy.setdefault(lc, [time.time(), 0.0])
                self.wire_bytes[lc] += nbytes
                self.tensor_bytes[lc] += item.tensor_bytes
            while len(outstanding) > self.window:
                self._finish(outstanding.popleft())
        except Exception as e:  # noqa: BLE001 - reported to the caller, never swallowed
            self._failed.add(child)
            with self._lock:
                self.errors.append(f"send {self.rank}->{child} bucket {item.bucket}: {e}")
            if not posted:
                item.done.hit()

    def _drain(self, child: int) -> None:
        outstanding = self._outstanding[child]
        while outstanding:
            try:
                self._finish(outstanding.popleft())
            except Exception as e:  # noqa: BLE001
                with self._lock:
                    self.errors.append(f"send {self.rank}->{child}: {e}")
        lc = self.topology.link(self.rank, child).value
        with self._lock:
            if lc in self.busy:
                self.busy[lc][1] = max(self.busy[lc][1], time.time())

    def _finish(self, entry) -> None:
        item, works = entry
        try:
            for w in works:
                w.wait(self.timeout)
        finally:
            item.done.hit()
