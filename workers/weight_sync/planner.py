"""Weight-sync planner: a pure function from (topology, senders, receivers, tensors, bucket
size) to a SyncPlan (paper section 6, weight transmission).

* Buckets: the flat layout cut into ranges of at most ``bucket_bytes``; a bucket never mixes
  tensors of two owners (sharded trainer). Replicated buckets go to the sender with the
  fewest bytes so far (greedy = round-robin for equal buckets), so every sender's NIC works.
* Trees: one per root. Inside the root's datacenter the receivers form a chain (or binary
  tree) ordered by node, so consecutive hops stay on a node; each tree starts at a different
  receiver so relays share the forwarding. For every other datacenter the root sends ONE
  copy to a gateway receiver there, which re-broadcasts over a local chain/tree: exactly one
  copy of the model crosses each inter-datacenter link.
* ``plan_naive``: the baseline: every root sends straight to every receiver.
"""
from __future__ import annotations

from typing import Callable, Sequence

from workers.weight_sync.plan import (ALIGN, Bucket, Piece, SyncPlan, TensorSlot, TensorSpec, Tree,
                                      check_ranks, parse_dtype)
from workers.weight_sync.topology import Topology

# (parent, ordered nodes) -> edges (parent, child) that connect all nodes under parent.
TreeShape = Callable[[int, list[int]], list[tuple[int, int]]]


def _chain(parent: int, nodes: list[int]) -> list[tuple[int, int]]:
    """parent -> n0 -> n1 -> ...: every node receives once and sends once (bandwidth-optimal
    with pipelined buckets)."""
    chain = [parent] + nodes
    return [(chain[i], chain[i + 1]) for i in range(len(nodes))]


def _binary(parent: int, nodes: list[int]) -> list[tuple[int, int]]:
    """Heap-shaped binary tree under parent: depth log2(n), each relay sends twice."""
    heap = [parent] + nodes
    return [(heap[(i - 1) // 2], heap[i]) for i in range(1, len(heap))]


def _star(parent: int, nodes: list[int]) -> list[tuple[int, int]]:
    """parent sends to every node itself (the naive baseline)."""
    return [(parent, n) for n in nodes]


TREE_SHAPES: dict[str, TreeShape] = {"chain": _chain, "binary": _binary, "star": _star}


def plan_sync(topology: Topology, senders: Sequence[int], receivers: Sequence[int],
              tensor_spec: Sequence[TensorSpec | tuple], bucket_bytes: int,
              tree_shape: str = "chain") -> SyncPlan:
    """Network-aware plan: load-balanced roots, one copy per inter-DC link, local trees of
    ``tree_shape`` ("chain" | "binary" | "star")."""
    if tree_shape not in TREE_SHAPES:
        raise ValueError(f"weight sync: unknown tree_shape {tree_shape!r}; allowed: {sorted(TREE_SHAPES)}")
    shape = TREE_SHAPES[tree_shape]
    slots, groups, buckets = _layout(senders, receivers, tensor_spec, bucket_bytes)
    roots = _assign_roots(groups, buckets, senders)
    tree_roots = sorted(set(roots))
    trees = tuple(_tree(topology, root, k, len(tree_roots), receivers, shape)
                  for k, root in enumerate(tree_roots))
    return _finish(senders, receivers, slots, buckets, roots, tree_roots, trees, bucket_bytes, "tree", topology)


def plan_naive(topology: Topology, senders: Sequence[int], receivers: Sequence[int],
               tensor_spec: Sequence[TensorSpec | tuple], bucket_bytes: int) -> SyncPlan:
    """Baseline: each root sends every one of its buckets to every receiver directly,
    ignoring the topology (so N_remote copies cross the inter-DC link)."""
    slots, groups, buckets = _layout(senders, receivers, tensor_spec, bucket_bytes)
    roots = _assign_roots(groups, buckets, senders)
    tree_roots = sorted(set(roots))
    trees = tuple(_edges_to_tree(r, _star(r, sorted(receivers))) for r in tree_roots)
    return _finish(senders, receivers, slots, buckets, roots, tree_roots, trees, bucket_bytes, "naive",
                   topology)  # topology kept only for link accounting and shaping


# ---- layout and buckets --------------------------------------------------------------
def _spec(item: TensorSpec | tuple, i: int) -> TensorSpec:
    if isinstance(item, TensorSpec):
        return TensorSpec(item.name, tuple(item.shape), parse_dtype(item.dtype, f"tensor_spec[{i}]"), item.owner)
    if not isinstance(item, (tuple, list)) or len(item) not in (3, 4):
        raise ValueError(f"tensor_spec[{i}]: expected TensorSpec or (name, shape, dtype[, owner]), got {item!r}")
    name, shape, dtype = item[0], item[1], item[2]
    owner = item[3] if len(item) == 4 else None
    return TensorSpec(str(name), tuple(shape), parse_dtype(dtype, f"tensor_spec[{i}] ({name})"), owner)


def _layout(senders, receivers, tensor_spec, bucket_bytes):
    """-> slots, owner groups [(owner, start, end)], raw buckets [(group index, start, end, pieces)]."""
    check_ranks(senders, receivers)
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes <= 0:
        raise ValueError(f"weight sync: bucket_bytes must be an int > 0, got {bucket_bytes!r}")
    specs = [_spec(s, i) for i, s in enumerate(tensor_spec)]
    if not specs:
        raise ValueError("weight sync: tensor_spec is empty")
    seen: set[str] = set()
    for i, s in enumerate(specs):
        if s.name in seen:
            raise ValueError(f"tensor_spec[{i}]: duplicate tensor name {s.name!r}")
        seen.add(s.name)
        if any((not isinstance(d, int)) or d < 0 for d in s.shape):
            raise ValueError(f"tensor_spec[{i}] ({s.name}): bad shape {s.shape!r}")
        if s.owner is not None and s.owner not in senders:
            raise ValueError(f"tensor_spec[{i}] ({s.name}): owner rank {s.owner} is not a sender {list(senders)}")
    # Group by owner (first-appearance order) so each owner's bytes are one contiguous range.
    owners = list(dict.fromkeys(s.owner for s in specs))
    slots: list[TensorSlot] = []
    groups: list[tuple[int | None, int, int]] = []
    raw = []
    offset = 0
    for g, owner in enumerate(owners):
        start, mine = offset, []
        for s in specs:
            if s.owner == owner:
                mine.append(TensorSlot(s.name, s.shape, s.dtype, offset, s.nbytes))
                offset += _align(s.nbytes)
        slots.extend(mine)
        groups.append((owner, start, offset))
        raw.extend((g, b_start, b_end, pieces) for b_start, b_end, pieces in _cut(mine, _align(bucket_bytes)))
    if not raw:
        raise ValueError("weight sync: tensor_spec has 0 bytes in total")
    return tuple(slots), groups, raw


def _cut(slots: list[TensorSlot], step: int) -> list[tuple[int, int, tuple[Piece, ...]]]:
    """Buckets over consecutive slots: a tensor bigger than ``step`` is split into its own
    ``step``-sized buckets (sent without a copy); smaller tensors are packed whole into
    buckets of at most ``step`` bytes. A bucket ends where its last tensor's data ends."""
    out: list[tuple[int, int, tuple[Piece, ...]]] = []
    cur: list[Piece] = []

    def close() -> None:
        if cur:
            out.append((cur[0].flat_start, cur[-1].flat_start + cur[-1].nbytes, tuple(cur)))
            cur.clear()

    for sl in slots:
        if sl.nbytes == 0:
            continue
        if sl.nbytes > step:
            close()
            for off in range(0, sl.nbytes, step):
                n = min(step, sl.nbytes - off)
                out.append((sl.offset + off, sl.offset + off + n, (Piece(sl.name, off, sl.offset + off, n),)))
            continue
        if cur and sl.offset + sl.nbytes - cur[0].flat_start > step:
            close()
        cur.append(Piece(sl.name, 0, sl.offset, sl.nbytes))
    close()
    return out


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _assign_roots(groups, raw, senders) -> list[int]:
    """Root per raw bucket: the owner, or (replicated) the least-loaded sender."""
    load = {s: 0 for s in senders}
    roots = []
    for g, start, end, _ in raw:
        owner = groups[g][0]
        if owner is not None:
            root = owner
        else:
            root = min(senders, key=lambda s: (load[s], s))
        load[root] += end - start
        roots.append(root)
    return roots


# ---- trees ---------------------------------------------------------------------------
def _rotated(nodes: list[int], k: int, n: int) -> list[int]:
    off = (k * len(nodes)) // n if nodes else 0
    return nodes[off:] + nodes[:off]


def _tree(topology: Topology, root: int, k: int, n_trees: int, receivers: Sequence[int],
          shape: TreeShape) -> Tree:
    """Tree k of n_trees rooted at ``root``: gateways to remote DCs first, then the local tree."""
    by_dc: dict[str, list[int]] = {}
    for r in sorted(receivers, key=lambda r: (topology.node(r), r)):
        by_dc.setdefault(topology.dc(r), []).append(r)
    root_dc = topology.dc(root)
    edges: list[tuple[int, int]] = []
    for dc in sorted(d for d in by_dc if d != root_dc):
        members = _rotated(by_dc[dc], k, n_trees)
        gateway = members[0]
        edges.append((root, gateway))                      # the one inter-DC copy
        edges.extend(shape(gateway, members[1:]))
    edges.extend(shape(root, _rotated(by_dc.get(root_dc, []), k, n_trees)))
    return _edges_to_tree(root, edges)


def _edges_to_tree(root: int, edges: list[tuple[int, int]]) -> Tree:
    children: dict[int, list[int]] = {}
    for a, b in edges:
        children.setdefault(a, []).append(b)
    return Tree(root, tuple((a, tuple(kids)) for a, kids in children.items()))


def _finish(senders, receivers, slots, raw, roots, tree_roots, trees, bucket_bytes, kind,
            topology) -> SyncPlan:
    tree_of = {r: i for i, r in enumerate(tree_roots)}
    buckets = tuple(Bucket(i, roots[i], tree_of[roots[i]], start, end, pieces)
                    for i, (_, start, end, pieces) in enumerate(raw))
    per_root = [[b.index for b in buckets if b.root == r] for r in tree_roots]
    order = [p[col] for col in range(max(len(p) for p in per_root)) for p in per_root if col < len(p)]
    total = max(b.end for b in buckets)
    return SyncPlan(tuple(senders), tuple(receivers), slots, total, buckets, trees, tuple(order),
                    bucket_bytes, kind, topology)


def tree_depth(tree: Tree) -> int:
    """Longest root-to-leaf hop count."""
    depth = {tree.root: 0}
    frontier = [tree.root]
    while frontier:
        nxt = []
        for a in frontier:
            for b in tree.children_of(a):
                depth[b] = depth[a] + 1
                nxt.append(b)
        frontier = nxt
    return max(depth.values())

