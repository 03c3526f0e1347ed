"""Weight-sync executor: bucketed, pipelined broadcast over torch.distributed point-to-point
(gloo on CPU, NCCL on GPU), following a SyncPlan.

Every participant calls at the same time (the controller triggers them with rpc_async):
trainer ranks ``WeightSyncSender(plan, rank).push(named_tensors, version)``, generation
instances ``WeightSyncReceiver(plan, rank).receive()``. Ranks are global ranks of the
default group (or of ``group``: torch's p2p calls take global ranks either way).

Receivers receive straight into one flat staging buffer while the engine keeps generating
with the old weights; all receives are posted up front, and a relay forwards bucket i (on
its per-child send threads) while bucket i+1 is still arriving. The caller swaps at an
iteration boundary: ``engine.load_weights(staged.tensors.items(), staged.version)``.

Integrity: the root computes each bucket's checksum once and it travels in the header,
forwarded unchanged by relays; every receiver recomputes it. A relay forwards what it got
without waiting for its own check, so corruption anywhere upstream is caught by every
receiver downstream. A receiver with any mismatch refuses the version (``ok=False``, no
tensors, the error names the bucket and its tensors).
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Iterable, Mapping

import torch
import torch.distributed as dist

from workers.weight_sync.checksum import bucket_checksum
from workers.weight_sync.links import HEADER_WORDS, Countdown, Links, Outgoing
from workers.weight_sync.plan import Bucket, SyncPlan


@dataclass
class SyncReport:
    """What one rank did in one sync. ``bytes_by_link``: bytes this rank sent per link class
    (headers + payload incl. alignment padding); ``tensor_bytes_by_link``: the tensor data
    in them (sums over ranks to model bytes x copies)."""

    rank: int
    version: int
    seconds: float
    buckets_sent: int = 0
    bytes_by_link: dict[str, int] = field(default_factory=dict)
    tensor_bytes_by_link: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    # link class -> (first send posted, last send done), time.time() on this rank
    link_spans: dict[str, tuple[float, float]] = field(default_factory=dict)


@dataclass
class StagedWeights:
    """A receiver's result: ``tensors`` (HF name -> tensor, views of one staging buffer) only
    when ``ok``; otherwise empty and ``error`` says which bucket failed and why."""

    version: int
    tensors: dict[str, torch.Tensor]
    ok: bool
    error: str = ""
    report: SyncReport | None = None


def _children(plan: SyncPlan, rank: int) -> list[int]:
    return [c for tree in plan.trees for c in tree.children_of(rank)]


class WeightSyncSender:
    """A trainer rank: sends the buckets it roots down their trees.

    ``max_packed``: most packed (copied) buckets alive at once; ``corrupt_buckets`` is a
    test hook: flip a byte of those buckets after the checksum is computed."""

    def __init__(self, plan: SyncPlan, rank: int, group=None, timeout_s: float = 600.0,
                 max_packed: int = 16, corrupt_buckets: Iterable[int] = ()) -> None:
        if rank not in plan.senders:
            raise ValueError(f"WeightSyncSender: rank {rank} is not a sender of the plan {list(plan.senders)}")
        self.plan, self.rank, self.group = plan, rank, group
        self.timeout_s, self.max_packed = timeout_s, max_packed
        self.corrupt_buckets = frozenset(corrupt_buckets)
        self._free: list[torch.Tensor] = []   # pooled pack buffers, uint8 [max bucket bytes]

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
             version: int) -> SyncReport:
        """Send this rank's buckets of ``named_tensors`` tagged with ``version``; returns
        once every send completed. Raises ValueError naming a missing or mismatched tensor."""
        t0 = time.perf_counter()
        mine = self.plan.buckets_of_root(self.rank)
        flat = self._flat_bytes(named_tensors, mine)
        links = Links(self.plan.topology, self.rank, _children(self.plan, self.rank), self.group,
                      self.timeout_s)
        inflight: list[tuple[torch.Tensor, Countdown]] = []   # packed buffers still being sent
        try:
            for b in mine:
                kids = self.plan.tree_of(b).children_of(self.rank)
                payload = _view(b, flat)
                buf = None
                if payload is None or b.index in self.corrupt_buckets:
                    buf = self._buffer(inflight, flat)
                    payload = _pack(b, flat, buf[:b.nbytes], payload)
                header = _header(version, b.index, bucket_checksum(payload))
                if b.index in self.corrupt_buckets:
                    payload[:1].bitwise_not_()
                done = Countdown(len(kids))
                tb = sum(p.nbytes for p in b.pieces)
                for kid in kids:
                    links.send(kid, Outgoing(b.index, header, payload, tb, done))
                if buf is not None:
                    inflight.append((buf, done))
        finally:
            links.close()
            self._free.extend(buf for buf, _ in inflight)
        report = SyncReport(self.rank, version, time.perf_counter() - t0, len(mine),
                            dict(links.wire_bytes), dict(links.tensor_bytes), list(links.errors),
                            {k: (v[0], v[1]) for k, v in links.busy.items()})
        if links.errors:
            raise RuntimeError(f"weight sync sender rank {self.rank}: " + "; ".join(links.errors))
        return report

    def _buffer(self, inflight: list, flat: dict[str, torch.Tensor]) -> torch.Tensor:
        """A pack buffer: a free pooled one, the oldest in flight once it is sent (at most
        ``max_packed`` exist), or a new one. Pooled across pushes: no fresh pages per sync."""
        while inflight and inflight[0][1].finished():
            self._free.append(inflight.pop(0)[0])
        if self._free:
            return self._free.pop()
        if len(inflight) >= self.max_packed:
            buf, done = inflight.pop(0)
            done.wait()
            return buf
        size = max(bk.nbytes for bk in self.plan.buckets)
        return torch.empty(size, dtype=torch.uint8, device=next(iter(flat.values())).device)

    def _flat_bytes(self, named_tensors, mine: list[Bucket]) -> dict[str, torch.Tensor]:
        """name -> contiguous uint8 view of the tensors this rank's buckets need."""
        given = dict(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        need = {p.name for b in mine for p in b.pieces}
        slots = {s.name: s for s in self.plan.slots}
        flat = {}
        for name in sorted(need):
            if name not in given:
                raise ValueError(f"weight sync push (rank {self.rank}): tensor {name!r} is in the plan "
                                 "but not in named_tensors")
            t, slot = given[name], slots[name]
            if tuple(t.shape) != slot.shape or t.dtype != slot.dtype:
                raise ValueError(f"weight sync push (rank {self.rank}): tensor {name!r} is "
                                 f"{tuple(t.shape)} {t.dtype}, plan says {slot.shape} {slot.dtype}")
            flat[name] = t.detach().contiguous().view(-1).view(torch.uint8)
        return flat


class WeightSyncReceiver:
    """A generation instance: receives every bucket into a staging buffer, forwards to its
    children, verifies. ``expected_version``: refuse any other version (None: any one).
    ``corrupt_buckets``: test hook, flip a byte of those buckets after receiving them
    (before forwarding), as if the relay's memory were bad.

    Staging buffers (``staging_buffers`` of them, used in turn) are allocated and touched
    once, here, so a sync never pays first-touch page faults (on this VM ~4 ms/MB, more than
    the transfer itself). The tensors of a StagedWeights stay valid until that many more
    ``receive`` calls: load them into the engine (which copies) before the next receive,
    or ask for 2 buffers to keep the previous version while receiving the next.

    ``ordered``: handle buckets strictly in plan order on one thread (None: only on NCCL,
    see ``_in_order``); otherwise one thread per tree."""

    def __init__(self, plan: SyncPlan, rank: int, group=None, device: torch.device | str = "cpu",
                 timeout_s: float = 600.0, expected_version: int | None = None,
                 corrupt_buckets: Iterable[int] = (), staging_buffers: int = 1,
                 ordered: bool | None = None) -> None:
        if staging_buffers < 1:
            raise ValueError(f"WeightSyncReceiver: staging_buffers must be >= 1, got {staging_buffers}")
        self._staging = [torch.zeros(plan.total_bytes, dtype=torch.uint8, device=device)  # [total]
                         for _ in range(staging_buffers)]
        self._next = 0
        self.ordered = ordered
        if rank not in plan.receivers:
            raise ValueError(f"WeightSyncReceiver: rank {rank} is not a receiver of the plan {list(plan.receivers)}")
        self.plan, self.rank, self.group, self.device = plan, rank, group, torch.device(device)
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.expected_version = expected_version
        self.corrupt_buckets = frozenset(corrupt_buckets)

    def receive_async(self) -> "concurrent.futures.Future[StagedWeights]":
        """Run ``receive`` on a background thread (the engine keeps generating meanwhile)."""
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"weight-sync-recv-{self.rank}")
        fut = pool.submit(self.receive)
        pool.shutdown(wait=False)
        return fut

    def receive(self) -> StagedWeights:
        """Receive one version. Never raises for transfer or integrity faults: returns
        StagedWeights(ok=False, error=...) instead."""
        t0 = time.perf_counter()
        plan, rank = self.plan, self.rank
        staging = self._staging_buffer()                                                  # [total]
        headers = torch.zeros(len(plan.buckets), HEADER_WORDS, dtype=torch.int64, device=self.device)
        sums = torch.zeros(len(plan.buckets), 2, dtype=torch.int64, device=self.device)
        buckets = plan.ordered_buckets()
        links = Links(plan.topology, rank, _children(plan, rank), self.group, self.timeout_s)
        errors: list[str] = []
        try:
            lanes: dict[int, list] = {}             # tree -> [(bucket, header work, payload work)]
            for b in buckets:                       # post every receive up front
                parent = plan.tree_of(b).parent_of(rank)
                if parent is None:
                    raise RuntimeError(f"rank {rank} is not in the tree of bucket {b.index}")
                lane = lanes.setdefault(-1 if self._in_order() else b.tree, [])
                lane.append((b, dist.irecv(headers[b.index], src=parent, group=self.group, tag=2 * b.index),
                             dist.irecv(staging[b.start:b.end], src=parent, group=self.group,
                                        tag=2 * b.index + 1)))
            # One thread per tree, so a bucket late on one tree never holds up the others.
            threads = [threading.Thread(target=self._lane, args=(lane, staging, headers, sums, links, errors),
                                        name=f"weight-sync-recv-{rank}", daemon=True)
                       for lane in lanes.values()]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        except Exception as e:  # noqa: BLE001 - a failed transfer refuses the version
            errors.append(str(e))
        finally:
            links.close()
        error = f"weight sync receiver rank {rank}: transfer failed: {errors[0]}" if errors else ""
        if links.errors and not error:
            error = f"weight sync receiver rank {rank}: forwarding failed: " + "; ".join(links.errors)
        version = int(headers[buckets[0].index, 0]) if buckets else -1
        if not error:
            error = self._verify(headers, sums, version)
        report = SyncReport(rank, version, time.perf_counter() - t0,
                            sum(len(plan.tree_of(b).children_of(rank)) > 0 for b in buckets),
                            dict(links.wire_bytes), dict(links.tensor_bytes), list(links.errors),
                            {k: (v[0], v[1]) for k, v in links.busy.items()})
        if error:
            return StagedWeights(version, {}, False, error, report)
        return StagedWeights(version, self._views(staging), True, "", report)

    def _in_order(self) -> bool:
        """Handle all buckets in plan order on one thread? Needed on NCCL, which matches
        point-to-point messages per pair by issue order, not by tag; gloo matches tags."""
        if self.ordered is not None:
            return self.ordered
        return dist.get_backend(self.group) == "nccl"

    def _lane(self, lane: list, staging: torch.Tensor, headers: torch.Tensor, sums: torch.Tensor,
              links: Links, errors: list[str]) -> None:
        """Wait for each bucket of the lane in order, forward it, checksum it."""
        try:
            for b, wh, wp in lane:
                wh.wait(self.timeout)
                wp.wait(self.timeout)
                payload = staging[b.start:b.end]
                if b.index in self.corrupt_buckets:
                    payload[:1].bitwise_not_()
                kids = self.plan.tree_of(b).children_of(self.rank)
                done = Countdown(len(kids))
                tb = sum(p.nbytes for p in b.pieces)
                for kid in kids:                    # forward first, check while it flies
                    links.send(kid, Outgoing(b.index, headers[b.index], payload, tb, done))
                sums[b.index] = bucket_checksum(payload)
        except Exception as e:  # noqa: BLE001 - reported in StagedWeights.error
            errors.append(f"bucket {b.index}: {e}")

    def _staging_buffer(self) -> torch.Tensor:
        buf = self._staging[self._next]
        self._next = (self._next + 1) % len(self._staging)
        return buf

    def _verify(self, headers: torch.Tensor, sums: torch.Tensor, version: int) -> str:
        """headers: int64 [nb, 4]; sums: int64 [nb, 2]. '' when all good, else the first fault."""
        plan = self.plan
        if self.expected_version is not None and version != self.expected_version:
            return (f"weight sync receiver rank {self.rank}: got version {version}, "
                    f"expected {self.expected_version}")
        idx = torch.arange(len(plan.buckets), device=headers.device)
        bad = ((headers[:, 0] != version) | (headers[:, 1] != idx)
               | (headers[:, 2:] != sums).any(dim=1)).nonzero().flatten().tolist()   # one host sync
        if not bad:
            return ""
        b = plan.buckets[bad[0]]
        h = headers[b.index].tolist()
        if h[0] != version or h[1] != b.index:
            what = f"header (version {h[0]}, index {h[1]}) does not match version {version}"
        else:
            what = "checksum mismatch"
        return (f"weight sync receiver rank {self.rank}: refusing version {version}: bucket {b.index} "
                f"(bytes {b.start}-{b.end}, tensors {b.tensor_names()}, root {b.root}) {what}"
                + (f"; {len(bad) - 1} more bad bucket(s): {bad[1:8]}" if len(bad) > 1 else ""))

    def _views(self, staging: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each tensor as a typed view of the staging buffer (no copy)."""
        out = {}
        for s in self.plan.slots:
            out[s.name] = staging[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)
        return out


def _header(version: int, index: int, checksum: torch.Tensor) -> torch.Tensor:
    """-> int64 [4] on checksum's device: (version, bucket index, s1, s2)."""
    head = torch.tensor([version, index], dtype=torch.int64, device=checksum.device)
    return torch.cat([head, checksum])


def _view(b: Bucket, flat: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The bucket's payload as a view of one tensor (no copy) when a single tensor fills it
    and the view is 8-byte aligned; else None (it must be packed)."""
    if len(b.pieces) == 1 and b.pieces[0].nbytes == b.nbytes:
        p = b.pieces[0]
        view = flat[p.name][p.tensor_start:p.tensor_start + p.nbytes]
        if view.data_ptr() % 8 == 0:
            return view
    return None


def _pack(b: Bucket, flat: dict[str, torch.Tensor], out: torch.Tensor,
          view: torch.Tensor | None) -> torch.Tensor:
    """Copy bucket b into ``out`` (uint8 [b.nbytes]): from ``view`` when given (a test
    hook will modify it), else the pieces, zero-padded."""
    if view is not None:
        return out.copy_(view)
    out.zero_()
    for p in b.pieces:
        out[p.flat_start - b.start:p.flat_start - b.start + p.nbytes] = \
            flat[p.name][p.tensor_start:p.tensor_start + p.nbytes]
    return out
