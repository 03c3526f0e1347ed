"""The data a weight sync is planned into: tensor specs, the flat byte layout, buckets and
broadcast trees. Pure, picklable dataclasses; the planner builds them, the executor reads them.

Layout: every tensor of the model gets a 64-byte-aligned slot in one flat byte buffer of
``SyncPlan.total_bytes``. A receiver receives straight into that buffer (its staging area)
and exposes each tensor as a view of it, so receiving needs no copy. A bucket is a
contiguous byte range of the layout, owned by one root, and may split a large tensor.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from workers.weight_sync.topology import Topology

ALIGN = 64  # bytes; slot and bucket starts (typed views and int64 checksum words line up)


def parse_dtype(dtype: torch.dtype | str, where: str) -> torch.dtype:
    """torch.dtype or its name ("bfloat16", "torch.float32") -> torch.dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"{where}: unknown dtype {dtype!r}")
    return dt


@dataclass(frozen=True)
class TensorSpec:
    """One tensor the trainer holds. ``owner``: the sender rank holding it (sharded
    trainer), or None when every sender holds a full copy (replicated)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    owner: int | None = None

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


WIRE_DTYPES = ("torch.float32", "torch.bfloat16", "torch.float16")  # what weights are sent in


def wire_dtype(engine_dtypes: list[str | None]) -> str | None:
    """The dtype weight sync sends in: the engines' own when they agree on it, else the widest
    (fp32 over bf16); None (the trainer's fp32) when an engine does not say, says something
    other than a float dtype of ``WIRE_DTYPES`` (a user's engine: int8 would truncate the
    weights), or two 16-bit kinds differ (bf16 and fp16: only fp32 holds both exactly)."""
    if not engine_dtypes or any(d not in WIRE_DTYPES for d in engine_dtypes):
        return None
    kinds = {parse_dtype(d, "engine weight_dtype") for d in engine_dtypes}
    widest = max(kinds, key=lambda d: d.itemsize)
    if len([d for d in kinds if d.itemsize == widest.itemsize]) > 1:
        return None
    return str(widest)


def sent_dtype(tensor: torch.Tensor, wire: str | None) -> torch.dtype:
    """The dtype ``tensor`` travels in: ``wire`` (``wire_dtype``'s answer) for a floating
    tensor, its own dtype otherwise (int buffers, or no wire dtype: the trainer's own)."""
    return parse_dtype(wire, "wire dtype") if wire is not None and tensor.is_floating_point() else tensor.dtype


def tensor_spec(named_tensors: Iterable[tuple[str, torch.Tensor]], owner: int | None = None) -> list[TensorSpec]:
    """Spec of real tensors (all owned by ``owner``, or replicated when None)."""
    return [TensorSpec(n, tuple(t.shape), t.dtype, owner) for n, t in named_tensors]


@dataclass(frozen=True)
class TensorSlot:
    """Where tensor ``name`` lives in the flat layout: bytes [offset, offset + nbytes)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Piece:
    """Bytes [tensor_start, tensor_start + nbytes) of tensor ``name`` sit at ``flat_start``."""

    name: str
    tensor_start: int
    flat_start: int
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    """Bytes [start, end) of the flat layout (start a multiple of ALIGN), sent by ``root``
    over tree ``tree``. ``pieces`` say which tensor bytes fill it; gaps are zero padding.
    Alignment padding after the last piece belongs to no bucket."""

    index: int
    root: int
    tree: int
    start: int
    end: int
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def tensor_names(self) -> list[str]:
        return list(dict.fromkeys(p.name for p in self.pieces))


@dataclass(frozen=True)
class Tree:
    """A broadcast tree: ``root`` and, per node, its children in send order."""

    root: int
    children: tuple[tuple[int, tuple[int, ...]], ...]

    def children_of(self, rank: int) -> tuple[int, ...]:
        for node, kids in self.children:
            if node == rank:
                return kids
        return ()

    def parent_of(self, rank: int) -> int | None:
        for node, kids in self.children:
            if rank in kids:
                return node
        return None

    def nodes(self) -> list[int]:
        out = [self.root]
        for _, kids in self.children:
            out.extend(kids)
        return list(dict.fromkeys(out))

    def edges(self) -> list[tuple[int, int]]:
        return [(node, kid) for node, kids in self.children for kid in kids]


@dataclass(frozen=True)
class SyncPlan:
    """Everything every participant needs: same plan object on every rank.

    ``order``: bucket indices in the order roots send them and receivers expect them
    (interleaved across roots so every root's bandwidth is in use at once)."""

    senders: tuple[int, ...]
    receivers: tuple[int, ...]
    slots: tuple[TensorSlot, ...]
    total_bytes: int
    buckets: tuple[Bucket, ...]
    trees: tuple[Tree, ...]
    order: tuple[int, ...]
    bucket_bytes: int
    kind: str = "tree"
    topology: Topology = field(default_factory=Topology)

    def model_bytes(self) -> int:
        """Bytes of tensor data (without alignment padding)."""
        return sum(s.nbytes for s in self.slots)

    def roots(self) -> list[int]:
        return sorted({b.root for b in self.buckets})

    def bytes_by_root(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for b in self.buckets:
            out[b.root] = out.get(b.root, 0) + b.nbytes
        return out

    def buckets_of_root(self, rank: int) -> list[Bucket]:
        return [self.buckets[i] for i in self.order if self.buckets[i].root == rank]

    def children_of(self, rank: int) -> list[int]:
        """Every rank ``rank`` sends to, over all trees (with repeats)."""
        return [c for tree in self.trees for c in tree.children_of(rank)]

    def tree_of(self, bucket: Bucket) -> Tree:
        return self.trees[bucket.tree]

    def ordered_buckets(self) -> list[Bucket]:
        return [self.buckets[i] for i in self.order]

    def describe(self) -> str:
        """One line per tree: root -> edges, and how many bytes each root sends."""
        lines = [f"{self.kind} plan: {len(self.buckets)} buckets of <= {self.bucket_bytes} B, "
                 f"{self.total_bytes} B total"]
        per_root = self.bytes_by_root()
        for t, tree in enumerate(self.trees):
            edges = " ".join(f"{a}->{b}" for a, b in tree.edges())
            lines.append(f"  tree {t} root {tree.root} ({per_root.get(tree.root, 0)} B): {edges}")
        return "\n".join(lines)


def check_ranks(senders: Sequence[int], receivers: Sequence[int]) -> None:
    """Senders and receivers: non-empty, distinct, disjoint lists of ranks >= 0."""
    if not senders:
        raise ValueError("weight sync: senders is empty (need at least one trainer rank)")
    if not receivers:
        raise ValueError("weight sync: receivers is empty (need at least one generation instance)")
    for what, ranks in (("senders", senders), ("receivers", receivers)):
        for r in ranks:
            if not isinstance(r, int) or isinstance(r, bool) or r < 0:
                raise ValueError(f"weight sync: {what} rank {r!r} must be an int >= 0")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"weight sync: {what} has duplicate ranks {list(ranks)}")
    both = sorted(set(senders) & set(receivers))
    if both:
        raise ValueError(f"weight sync: ranks {both} are both senders and receivers "
                         "(colocated ranks share weights in memory; do not sync them)")
