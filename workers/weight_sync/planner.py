"""Weight-sync planner: a pure function from (topology, senders, receivers, tensors, bucket
size) to a SyncPlan (paper section 6, weight transmission).

* Buckets: the flat layout cut into ranges of at most ``bucket_bytes`` (a split tensor's
  chunks are ``bucket_bytes`` rounded down to 64 B); a bucket never mixes tensors of two
  owners (sharded trainer). Owned buckets go to their owner; the replicated ones then go,
  largest first, to the sender with the fewest bytes, so every sender's NIC works.
* Trees: one per root. Inside the root's datacenter the receivers are grouped by node, the
  root's own node first, so consecutive hops stay on a node (a chain enters each other node
  once, so does a binary tree); each tree starts at a different receiver, rotating whole
  nodes, so relays share the forwarding. For every other datacenter the root sends ONE
  copy to a gateway receiver there, which re-broadcasts over a local chain/tree: exactly one
  copy of the model crosses each inter-datacenter link.
* ``plan_naive``: the baseline: every root sends straight to every receiver.
"""
from __future__ import annotations

from typing import Callable, Sequence

from workers.weight_sync.plan import (ALIGN, Bucket, Piece, SyncPlan, TensorSlot, TensorSpec, Tree,
                                      check_ranks, parse_dtype)
from workers.weight_sync.topology import Topology

# (parent, node groups) -> edges (parent, child) that connect every rank of the groups under
# parent. groups[0] holds the ranks on the parent's own node (may be empty), each later group
# the ranks of one other node; a shape keeps a group's ranks together so a node is entered once.
TreeShape = Callable[[int, list[list[int]]], list[tuple[int, int]]]


def _flat(groups: list[list[int]]) -> list[int]:
    return [r for g in groups for r in g]


def _chain(parent: int, groups: list[list[int]]) -> list[tuple[int, int]]:
    """parent -> r0 -> r1 -> ...: every rank receives once and sends once (bandwidth-optimal
    with pipelined buckets); one hop into each other node."""
    chain = [parent] + _flat(groups)
    return [(chain[i], chain[i + 1]) for i in range(len(chain) - 1)]


def _binary(parent: int, groups: list[list[int]]) -> list[tuple[int, int]]:
    """Binary tree: ranks join in group order, each under the shallowest rank with a free
    slot on its own node, else the shallowest anywhere. So each other node is entered by one
    edge (a plain heap over the order would cross between nodes at every level), and with
    one rank per node this is the heap: depth log2(n), each relay sends at most twice."""
    node = {parent: 0, **{r: g for g, ranks in enumerate(groups) for r in ranks}}
    depth, kids, open_ = {parent: 0}, {parent: 0}, [parent]   # open_: ranks with < 2 children
    edges: list[tuple[int, int]] = []
    for r in _flat(groups):
        local = [o for o in open_ if node[o] == node[r]]
        up = min(local or open_, key=lambda o: depth[o])          # min keeps join order on ties
        edges.append((up, r))
        kids[up] += 1
        if kids[up] == 2:
            open_.remove(up)
        depth[r], kids[r] = depth[up] + 1, 0
        open_.append(r)
    return edges


def _star(parent: int, groups: list[list[int]]) -> list[tuple[int, int]]:
    """parent sends to every node itself (the naive baseline)."""
    return [(parent, n) for n in _flat(groups)]


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
    trees = tuple(_edges_to_tree(r, _star(r, [sorted(receivers)])) for r in tree_roots)
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
        raw.extend((g, b_start, b_end, pieces) for b_start, b_end, pieces in _cut(mine, bucket_bytes))
    if not raw:
        raise ValueError("weight sync: tensor_spec has 0 bytes in total")
    return tuple(slots), groups, raw


def _cut(slots: list[TensorSlot], limit: int) -> list[tuple[int, int, tuple[Piece, ...]]]:
    """Buckets of at most ``limit`` bytes over consecutive slots: a tensor bigger than
    ``limit`` is split into its own buckets of ``_split_step(limit)`` bytes (sent without a
    copy); smaller tensors are packed whole. A bucket ends where its last tensor's data ends."""
    step = _split_step(limit)
    out: list[tuple[int, int, tuple[Piece, ...]]] = []
    cur: list[Piece] = []

    def close() -> None:
        if cur:
            out.append((cur[0].flat_start, cur[-1].flat_start + cur[-1].nbytes, tuple(cur)))
            cur.clear()

    for sl in slots:
        if sl.nbytes == 0:
            continue
        if sl.nbytes > limit:
            close()
            for off in range(0, sl.nbytes, step):
                n = min(step, sl.nbytes - off)
                out.append((sl.offset + off, sl.offset + off + n, (Piece(sl.name, off, sl.offset + off, n),)))
            continue
        if cur and sl.offset + sl.nbytes - cur[0].flat_start > limit:
            close()
        cur.append(Piece(sl.name, 0, sl.offset, sl.nbytes))
    close()
    return out


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _split_step(limit: int) -> int:
    """Chunk size for a tensor split across buckets: ``limit`` rounded DOWN to ALIGN (every
    chunk must start aligned; rounding up made buckets bigger than bucket_bytes), but at
    least one ALIGN unit, so a library caller's bucket_bytes < 64 still makes progress."""
    return max(ALIGN, limit // ALIGN * ALIGN)


def _assign_roots(groups, raw, senders) -> list[int]:
    """Root per raw bucket: the owner, or (replicated) the least-loaded sender. Every owned
    bucket is counted first, whatever the tensor order: replicated buckets handed out before
    them would balance against a load that is about to change. Replicated buckets then go
    largest first (greedy LPT) to the sender with the fewest bytes; ties by bucket index and
    sender rank, so every rank computes the same plan."""
    load = {s: 0 for s in senders}
    roots: list[int | None] = [groups[g][0] for g, _, _, _ in raw]
    for root, (_, start, end, _) in zip(roots, raw):
        if root is not None:
            load[root] += end - start
    replicated = sorted((i for i, root in enumerate(roots) if root is None),
                        key=lambda i: (raw[i][1] - raw[i][2], i))          # largest first
    for i in replicated:
        root = min(senders, key=lambda s: (load[s], s))
        load[root] += raw[i][2] - raw[i][1]
        roots[i] = root
    return roots


# ---- trees ---------------------------------------------------------------------------
def _rotate(items: list, k: int, n: int) -> list:
    """items started at position k/n of the way along (tree k of n), wrapping around."""
    off = (k * len(items)) // n if items else 0
    return items[off:] + items[:off]


def _rotate_groups(groups: list[list[int]], k: int, n: int) -> list[list[int]]:
    """Tree k of n starts at rank position k/n of the way along (as ``_rotate`` over all the
    ranks, so different trees start at different ranks) but moves whole node groups: the
    start's group comes first, rotated inside itself, then the groups after it, wrapping.
    Rotating single ranks would split a node across the two ends of the order."""
    flat = [(g, i) for g, ranks in enumerate(groups) for i in range(len(ranks))]
    if not flat:
        return []
    g, i = flat[(k * len(flat)) // n]
    return [groups[g][i:] + groups[g][:i]] + groups[g + 1:] + groups[:g]


def _node_groups(topology: Topology, ranks: list[int], lead: int, k: int, n: int) -> list[list[int]]:
    """``ranks`` by node for tree k of n under ``lead``: lead's own node first (its hop is
    the cheapest; [] when lead has no node-mates here), then the other nodes (by name,
    rotated per tree by ``_rotate_groups``). Each node's ranks stay consecutive."""
    by_node: dict[str, list[int]] = {}
    for r in sorted(ranks):
        by_node.setdefault(topology.node(r), []).append(r)
    own = by_node.pop(topology.node(lead), [])
    return [_rotate(own, k, n)] + _rotate_groups([by_node[name] for name in sorted(by_node)], k, n)


def _tree(topology: Topology, root: int, k: int, n_trees: int, receivers: Sequence[int],
          shape: TreeShape) -> Tree:
    """Tree k of n_trees rooted at ``root``: gateways to remote DCs first, then the local tree."""
    by_dc: dict[str, list[int]] = {}
    for r in receivers:
        by_dc.setdefault(topology.dc(r), []).append(r)
    root_dc = topology.dc(root)
    edges: list[tuple[int, int]] = []
    for dc in sorted(d for d in by_dc if d != root_dc):
        # The root is on no node of this DC: the gateway is the first rank of the first node.
        first, *rest = [g for g in _node_groups(topology, by_dc[dc], root, k, n_trees) if g]
        gateway = first[0]
        edges.append((root, gateway))                      # the one inter-DC copy
        edges.extend(shape(gateway, [first[1:]] + rest))
    edges.extend(shape(root, _node_groups(topology, by_dc.get(root_dc, []), root, k, n_trees)))
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

