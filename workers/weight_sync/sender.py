"""Trainer side of the weight sync: WeightSyncSender.push (the protocol: workers/weight_sync/__init__.py)."""
from __future__ import annotations

import time
from typing import Iterable, Mapping

import torch

from workers.weight_sync.checksum import bucket_checksum
from workers.weight_sync.links import Countdown, Links, Outgoing
from workers.weight_sync.plan import Bucket, SyncPlan
from workers.weight_sync.reports import SyncReport


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
        links = Links(self.plan.topology, self.rank, self.plan.children_of(self.rank), self.group,
                      self.timeout_s)
        inflight: list[tuple[torch.Tensor, Countdown]] = []   # packed buffers still being sent
        try:
            for b in mine:
                kids = self.plan.tree_of(b).children_of(self.rank)
                payload = _view(b, flat)
                buf = None
                if payload is None or b.index in self.corrupt_buckets:
                    buf = self._buffer(inflight, flat, links)
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

    def _buffer(self, inflight: list, flat: dict[str, torch.Tensor], links: Links) -> torch.Tensor:
        """A pack buffer: a free pooled one, the oldest in flight once it is sent (at most
        ``max_packed`` exist), or a new one. Pooled across pushes: no fresh pages per sync.
        Waiting for the oldest, the links finish what they posted first (a send is marked done
        only when a child's window fills: with 16 packed buckets in flight and fewer than 64
        sends a child, the push waited forever, session 52)."""
        while inflight and inflight[0][1].finished():
            self._free.append(inflight.pop(0)[0])
        if self._free:
            return self._free.pop()
        if len(inflight) >= self.max_packed:
            buf, done = inflight[0]
            links.flush()
            if not done.wait(self.timeout_s):
                raise TimeoutError(f"weight sync sender rank {self.rank}: a packed bucket's sends did not finish "
                                   f"in {self.timeout_s:g} s (timeout_s)")
            inflight.pop(0)
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
