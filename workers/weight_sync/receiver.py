"""Generation-instance side of the weight sync: WeightSyncReceiver.receive (see __init__.py for the protocol)."""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Iterable

import torch
import torch.distributed as dist

from workers.weight_sync.checksum import bucket_checksum
from workers.weight_sync.links import HEADER_WORDS, Countdown, Links, Outgoing
from workers.weight_sync.plan import Bucket, SyncPlan
from workers.weight_sync.reports import StagedWeights, SyncReport


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

    ``ordered``: issue every receive and forward strictly in plan order on one thread
    (None: only on NCCL, see ``_in_order``); otherwise one thread per tree."""

    def __init__(self, plan: SyncPlan, rank: int, group=None, device: torch.device | str = "cpu",
                 timeout_s: float = 600.0, expected_version: int | None = None,
                 corrupt_buckets: Iterable[int] = (), staging_buffers: int = 1,
                 ordered: bool | None = None) -> None:
        if rank not in plan.receivers:
            raise ValueError(f"WeightSyncReceiver: rank {rank} is not a receiver of the plan {list(plan.receivers)}")
        if staging_buffers < 1:
            raise ValueError(f"WeightSyncReceiver: staging_buffers must be >= 1, got {staging_buffers}")
        self._staging = [torch.zeros(plan.total_bytes, dtype=torch.uint8, device=device)  # [total]
                         for _ in range(staging_buffers)]
        self._next = 0
        self.ordered = ordered
        self.plan, self.rank, self.group, self.device = plan, rank, group, torch.device(device)
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.expected_version = expected_version
        self.corrupt_buckets = frozenset(corrupt_buckets)

    def receive(self) -> StagedWeights:
        """Receive one version. Never raises for transfer or integrity faults: returns
        StagedWeights(ok=False, error=...) instead."""
        t0 = time.perf_counter()
        plan, rank = self.plan, self.rank
        staging = self._staging_buffer()                                                  # [total]
        headers = torch.zeros(len(plan.buckets), HEADER_WORDS, dtype=torch.int64, device=self.device)
        sums = torch.zeros(len(plan.buckets), 2, dtype=torch.int64, device=self.device)
        buckets = plan.ordered_buckets()
        in_order = self._in_order()
        links = Links(plan.topology, rank, plan.children_of(rank), self.group, self.timeout_s, inline=in_order)
        errors: list[str] = []
        arrived: set[int] = set()           # buckets whose header came in (the rest stay zeros)
        try:
            if in_order:
                self._receive_in_order(buckets, staging, headers, sums, links, errors, arrived)
            else:
                self._receive_by_tree(buckets, staging, headers, sums, links, errors, arrived)
        except Exception as e:  # noqa: BLE001 - a failed transfer refuses the version
            errors.append(str(e))
        finally:
            links.close()
        error = f"weight sync receiver rank {rank}: transfer failed: {errors[0]}" if errors else ""
        if links.errors and not error:
            error = f"weight sync receiver rank {rank}: forwarding failed: " + "; ".join(links.errors)
        version = self._received_version(headers, buckets, arrived)
        if error and not arrived:
            error += " (no bucket header arrived: the version pushed is unknown)"
        if not error:
            error = self._verify(headers, sums, version)
        report = SyncReport(rank, version, time.perf_counter() - t0,
                            sum(len(plan.tree_of(b).children_of(rank)) > 0 for b in buckets),
                            dict(links.wire_bytes), dict(links.tensor_bytes), list(links.errors),
                            {k: (v[0], v[1]) for k, v in links.busy.items()})
        if error:
            return StagedWeights(version, {}, False, error, report)
        return StagedWeights(version, self._views(staging), True, "", report)

    def _received_version(self, headers: torch.Tensor, buckets: list[Bucket], arrived: set[int]) -> int:
        """The version in the first header, in plan order, that arrived: a failed sync must
        not report the zeros of a header that never came (version 0 while 7 was pushed).
        None arrived: ``expected_version`` when set, else -1 (unknown)."""
        for b in buckets:
            if b.index in arrived:
                return int(headers[b.index, 0])
        return -1 if self.expected_version is None else self.expected_version

    def _in_order(self) -> bool:
        """Handle all buckets in plan order on one thread? Needed on NCCL, which matches
        point-to-point messages per pair by issue order, not by tag; gloo matches tags."""
        if self.ordered is not None:
            return self.ordered
        return dist.get_backend(self.group) == "nccl"

    def _post_recv(self, b: Bucket, staging: torch.Tensor, headers: torch.Tensor) -> tuple:
        parent = self.plan.tree_of(b).parent_of(self.rank)
        if parent is None:
            raise RuntimeError(f"rank {self.rank} is not in the tree of bucket {b.index}")
        return (dist.irecv(headers[b.index], src=parent, group=self.group, tag=2 * b.index),
                dist.irecv(staging[b.start:b.end], src=parent, group=self.group, tag=2 * b.index + 1))

    def _receive_by_tree(self, buckets: list[Bucket], staging, headers, sums, links, errors, arrived) -> None:
        """gloo: post every receive up front; one thread per tree waits for that tree's
        buckets in order, so a bucket late on one tree never holds up the others."""
        lanes: dict[int, list] = {}                 # tree -> [(bucket, header work, payload work)]
        for b in buckets:
            lanes.setdefault(b.tree, []).append((b, *self._post_recv(b, staging, headers)))
        threads = [threading.Thread(target=self._lane, args=(lane, staging, headers, sums, links, errors, arrived),
                                    name=f"weight-sync-recv-{self.rank}", daemon=True)
                   for lane in lanes.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _receive_in_order(self, buckets: list[Bucket], staging, headers, sums, links, errors, arrived) -> None:
        """NCCL: one thread issues everything in plan order -- receive bucket i, then post its
        forwards (inline links), then receive i+1. Every pair then sees its messages in
        (bucket, depth) order on both ends, which cannot deadlock even when two trees use
        the same pair in opposite directions; forwards still overlap the next receive."""
        for b in buckets:
            self._lane([(b, *self._post_recv(b, staging, headers))], staging, headers, sums, links, errors,
                       arrived)
            if errors:
                return

    def _lane(self, lane: list, staging: torch.Tensor, headers: torch.Tensor, sums: torch.Tensor,
              links: Links, errors: list[str], arrived: set[int]) -> None:
        """Wait for each bucket of the lane in order, forward it, checksum it; ``arrived``
        gets each bucket whose header came in."""
        try:
            for b, wh, wp in lane:
                wh.wait(self.timeout)
                arrived.add(b.index)
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
            # A zero-size tensor's slot may sit past the end of the buffer (after the last
            # bucket), where the clamped storage offset need not suit its dtype: view [0, 0).
            start = s.offset if s.nbytes else 0
            out[s.name] = staging[start:start + s.nbytes].view(s.dtype).view(s.shape)
        return out
