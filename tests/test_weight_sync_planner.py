"""Weight-sync topology, planner, checksum and shaper: pure functions, no processes."""
from __future__ import annotations

import pytest
import torch

from workers.weight_sync import (LinkClass, LinkShaper, StagedWeights, TensorSpec, Topology, WeightSyncConfig,
                                 plan_naive, plan_sync, tree_depth)
from workers.weight_sync.checksum import CHUNK_WORDS, bucket_checksum

SPEC = [("embed", (64, 40), torch.float32), ("norm", (40,), torch.bfloat16),
        ("proj", (40, 30), torch.float16), ("scale", (), torch.float32), ("ids", (17,), torch.int64)]
TWO_DC = {"datacenters": {"train": [0, 1, 2], "remote": [3, 4, 5]}}


def model_bytes(spec) -> int:
    return sum(TensorSpec(n, s, d).nbytes for n, s, d in spec)


def crossing_copies(plan) -> int:
    """Bucket bytes sent over inter-DC edges, in units of whole models."""
    total = 0
    for b in plan.buckets:
        edges = plan.tree_of(b).edges()
        total += sum(b.nbytes for a, c in edges if plan.topology.link(a, c) is LinkClass.INTER_DC)
    return total / sum(b.nbytes for b in plan.buckets)


def check_tiling(plan) -> None:
    """Buckets cover the layout in order, apart from alignment padding between them; pieces
    cover every tensor byte exactly once."""
    spans = sorted((b.start, b.end) for b in plan.buckets)
    assert spans[0][0] == 0 and spans[-1][1] == plan.total_bytes
    assert all(0 <= b[0] - a[1] < 64 for a, b in zip(spans, spans[1:]))
    covered = {s.name: 0 for s in plan.slots}
    for b in plan.buckets:
        assert 0 < b.nbytes <= max(plan.bucket_bytes, 64) and b.start % 64 == 0
        for p in b.pieces:
            assert b.start <= p.flat_start and p.flat_start + p.nbytes <= b.end
            covered[p.name] += p.nbytes
    assert covered == {s.name: s.nbytes for s in plan.slots}
    assert sorted(plan.order) == list(range(len(plan.buckets)))


def check_spanning(plan) -> None:
    """Each tree reaches every receiver exactly once, from its root."""
    for tree in plan.trees:
        kids = [c for _, c in tree.edges()]
        assert sorted(kids) == sorted(plan.receivers)
        assert tree.root in plan.senders


# ---- topology ------------------------------------------------------------------------
def test_default_topology_is_one_datacenter():
    topo = Topology.from_config(None)
    assert topo.dc(0) == topo.dc(17) == "dc0"
    assert topo.link(0, 5) is LinkClass.INTRA_DC
    assert topo.bandwidth[LinkClass.INTER_DC] == pytest.approx(80e9 / 8)
    assert topo.shaped == frozenset()


def test_topology_from_config():
    topo = Topology.from_config({**TWO_DC, "nodes": {"n0": [0, 1]},
                                 "bandwidth_gbps": {"inter_dc": 1.2}, "shaped_links": ["inter_dc"]})
    assert topo.link(0, 1) is LinkClass.INTRA_NODE
    assert topo.link(0, 2) is LinkClass.INTRA_DC
    assert topo.link(2, 3) is LinkClass.INTER_DC
    assert topo.dc(99) == "train"          # unlisted ranks: the first datacenter
    assert topo.bandwidth_between(1, 4) == pytest.approx(150e6)
    assert topo.is_shaped(0, 3) and not topo.is_shaped(0, 1)
    # An unlisted rank lives in the default DC and may share a node with ranks listed there.
    topo = Topology.from_config({**TWO_DC, "nodes": {"n0": [2, 9]}})
    assert topo.link(2, 9) is LinkClass.INTRA_NODE and topo.dc(9) == "train"


@pytest.mark.parametrize("cfg, needle", [
    ({"datacenter": {}}, "topology.datacenter: unknown key; did you mean 'datacenters'?"),
    ({"datacenters": {"a": [0, 1], "b": [1]}}, "rank 1 listed in both 'a' and 'b'"),
    ({"datacenters": {"a": [0, -1]}}, "datacenters.a: rank -1"),
    ({"datacenters": {"a": 3}}, "datacenters.a must be a list"),
    ({"bandwidth_gbps": {"inter_dc": 0}}, "bandwidth_gbps.inter_dc must be a finite number > 0"),
    ({"bandwidth_gbps": {"wan": 1}}, "bandwidth_gbps.wan: unknown link class"),
    ({"shaped_links": ["wan"]}, "shaped_links: unknown link class 'wan'"),
    ({**TWO_DC, "nodes": {"n": [2, 3]}}, "nodes.n: ranks span datacenters"),
])
def test_topology_errors_name_the_key(cfg, needle):
    with pytest.raises(ValueError) as e:
        Topology.from_config(cfg)
    assert needle in str(e.value)


# ---- planner -------------------------------------------------------------------------
def test_single_sender_chain_covers_everything():
    plan = plan_sync(Topology(), [0], [1, 2, 3, 4], SPEC, 1000)
    check_tiling(plan)
    check_spanning(plan)
    assert plan.roots() == [0]
    assert plan.model_bytes() == model_bytes(SPEC)
    assert plan.trees[0].edges() == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert tree_depth(plan.trees[0]) == 4
    assert any(len({p.name for p in b.pieces}) > 1 for b in plan.buckets)   # small tensors packed
    assert sum(1 for b in plan.buckets for p in b.pieces if p.name == "embed") > 1  # big one split
    assert plan == plan_sync(Topology(), [0], [1, 2, 3, 4], SPEC, 1000)     # pure, deterministic


def test_two_senders_are_both_roots_and_balanced():
    plan = plan_sync(Topology(), [0, 1], [2, 3, 4, 5], SPEC, 1000)
    check_tiling(plan)
    check_spanning(plan)
    per_root = plan.bytes_by_root()
    assert sorted(per_root) == [0, 1]
    assert abs(per_root[0] - per_root[1]) <= 1024
    # Trees start at different receivers, so the relays share the forwarding work.
    heads = [t.children_of(t.root)[0] for t in plan.trees]
    assert len(set(heads)) == 2
    # Send order interleaves the roots (both NICs busy from the start).
    first_roots = [plan.buckets[i].root for i in plan.order[:2]]
    assert sorted(first_roots) == [0, 1]


def test_sharded_buckets_are_rooted_at_their_owner():
    spec = [TensorSpec(n, s, d, owner=i % 2) for i, (n, s, d) in enumerate(SPEC)]
    plan = plan_sync(Topology(), [0, 1], [2, 3, 4], spec, 512, tree_shape="binary")
    check_tiling(plan)
    check_spanning(plan)
    owner = {s.name: s.owner for s in spec}
    for b in plan.buckets:
        assert {owner[p.name] for p in b.pieces} == {b.root}


def test_cross_dc_sends_exactly_one_copy_over_the_link():
    topo = Topology.from_config(TWO_DC)
    for shape in ("chain", "binary"):
        plan = plan_sync(topo, [0], [1, 2, 3, 4, 5], SPEC, 700, tree_shape=shape)
        check_tiling(plan)
        check_spanning(plan)
        assert crossing_copies(plan) == 1.0
        (tree,) = plan.trees
        assert tree.children_of(0)[0] == 3          # gateway first: the slow link starts first
    naive = plan_naive(topo, [0], [1, 2, 3, 4, 5], SPEC, 700)
    check_spanning(naive)
    assert crossing_copies(naive) == 3.0
    assert naive.trees[0].edges() == [(0, r) for r in [1, 2, 3, 4, 5]]


def test_cross_dc_two_senders_and_three_datacenters():
    topo = Topology.from_config({"datacenters": {"a": [0, 1], "b": [2, 3, 4], "c": [5, 6]}})
    plan = plan_sync(topo, [0, 1], [2, 3, 4, 5, 6], SPEC, 512)
    check_spanning(plan)
    assert plan.roots() == [0, 1]
    assert crossing_copies(plan) == 2.0             # one copy into b, one into c


def test_chain_follows_nodes():
    topo = Topology.from_config({"nodes": {"n0": [1, 3, 5], "n1": [2, 4, 6]}})
    plan = plan_sync(topo, [0], [1, 2, 3, 4, 5, 6], SPEC, 4096)
    hops = [topo.link(a, b) for a, b in plan.trees[0].edges() if a != 0]
    assert hops.count(LinkClass.INTER_DC) == 0
    assert hops.count(LinkClass.INTRA_DC) == 1      # one jump between the two nodes
    assert hops.count(LinkClass.INTRA_NODE) == 4


def test_buckets_never_exceed_bucket_bytes():
    """bucket_bytes is a ceiling: a split tensor's chunks are bucket_bytes rounded DOWN to
    64 B (was: up, 1024-byte buckets for bucket_bytes 1000)."""
    spec = [("w", (1000,), "float32")]                                  # 4000 B
    plan = plan_sync(Topology(), [0], [1], spec, 1000)
    assert [b.nbytes for b in plan.buckets] == [960, 960, 960, 960, 160]   # was [1024, 1024, 1024, 928]
    assert [b.start for b in plan.buckets] == [0, 960, 1920, 2880, 3840]
    check_tiling(plan)
    plan = WeightSyncConfig.from_dict({"bucket_mb": 0.0011}).plan([0], [1], spec)
    assert plan.bucket_bytes == 1100 and [b.nbytes for b in plan.buckets] == [1088, 1088, 1088, 736]  # was 1152 x3
    # A tensor of exactly bucket_bytes is packed whole, not cut at the aligned step.
    plan = plan_sync(Topology(), [0], [1], [("a", (250,), "float32"), ("b", (10,), "float32")], 1000)
    assert [b.nbytes for b in plan.buckets] == [1000, 40]
    # Below one alignment unit the library still cuts 64-byte chunks (it takes any size >= 1).
    plan = plan_sync(Topology(), [0], [1], [("w", (40,), "float32")], 10)
    assert [b.nbytes for b in plan.buckets] == [64, 64, 32]


def test_owned_buckets_are_counted_before_replicated_ones_are_shared():
    """Roots do not depend on tensor order: a replicated tensor listed before a sharded one
    was split before the shard was counted ({0: 24192, 1: 7808})."""
    rep, shard = ("rep", (4000,), "float32", None), ("shard0", (4000,), "float32", 0)
    for spec in ([rep, shard], [shard, rep]):
        plan = plan_sync(Topology(), [0, 1], [2, 3], spec, 4096)
        assert plan.bytes_by_root() == {0: 16000, 1: 16000}, spec
        assert {b.root for b in plan.buckets if b.pieces[0].name == "shard0"} == {0}
    # Replicated buckets go largest first to the least-loaded sender: 3000 B owned by 0, then
    # 2000 -> 1, 1200 -> 1, 1000 -> 0 (in tensor order: 1000 -> 1, 1200 -> 1, 2000 -> 0: 5000 vs 2200).
    spec = [("a", (250,), "float32"), ("b", (300,), "float32"), ("c", (500,), "float32"),
            ("own", (750,), "float32", 0)]
    plan = plan_sync(Topology(), [0, 1], [2], spec, 2048)
    assert {b.pieces[0].name: b.root for b in plan.buckets} == {"a": 0, "b": 1, "c": 1, "own": 0}
    assert plan.bytes_by_root() == {0: 4000, 1: 3200}
    assert plan == plan_sync(Topology(), [0, 1], [2], spec, 2048)     # deterministic


def _receiver_hops(plan, topo) -> list[list[LinkClass]]:
    """Per tree: the link class of every receiver-to-receiver edge."""
    return [[topo.link(a, b) for a, b in t.edges() if a != t.root] for t in plan.trees]


def test_chain_starts_on_the_roots_node():
    """Root 0 shares node nB with receivers 2, 3: they come first (was 0->4 4->5 5->2 2->3,
    two cross-node hops, sorted by node name)."""
    topo = Topology.from_config({"nodes": {"nB": [0, 2, 3], "nA": [4, 5]}})
    plan = plan_sync(topo, [0], [2, 3, 4, 5], [("w", (1000,), "float32")], 4096)
    assert plan.trees[0].edges() == [(0, 2), (2, 3), (3, 4), (4, 5)]
    links = [topo.link(a, b) for a, b in plan.trees[0].edges()]
    assert links.count(LinkClass.INTRA_DC) == 1                  # was 2


def test_rotated_chains_keep_each_node_whole():
    """3 roots over 2 nodes of 2 receivers: each tree starts at a different receiver, yet
    enters each node once (tree 1 was 1->4 4->5 5->6 6->3: node nA split, 2 cross hops)."""
    topo = Topology.from_config({"nodes": {"nA": [3, 4], "nB": [5, 6]}})
    spec = [(n, (1000,), "float32") for n in "abc"]
    plan = plan_sync(topo, [0, 1, 2], [3, 4, 5, 6], spec, 4096)
    check_spanning(plan)
    assert [t.edges() for t in plan.trees] == [[(0, 3), (3, 4), (4, 5), (5, 6)],
                                               [(1, 4), (4, 3), (3, 5), (5, 6)],
                                               [(2, 5), (5, 6), (6, 3), (3, 4)]]
    assert [hops.count(LinkClass.INTRA_DC) for hops in _receiver_hops(plan, topo)] == [1, 1, 1]


def test_roots_node_mates_are_rotated_per_tree():
    """Two roots sharing node nA with receivers 2, 3: each tree still starts on the roots'
    node, but tree k starts k/n of the way along the node-mates (and the other node), so the
    two trees start at different receivers and no relay forwards both halves first."""
    topo = Topology.from_config({"nodes": {"nA": [0, 1, 2, 3], "nB": [4, 5]}})
    spec = [("a", (1000,), "float32"), ("b", (1000,), "float32")]
    plan = plan_sync(topo, [0, 1], [2, 3, 4, 5], spec, 4096)
    check_spanning(plan)
    assert [t.edges() for t in plan.trees] == [[(0, 2), (2, 3), (3, 4), (4, 5)],
                                               [(1, 3), (3, 2), (2, 5), (5, 4)]]
    assert [hops.count(LinkClass.INTRA_DC) for hops in _receiver_hops(plan, topo)] == [1, 1]


def test_binary_tree_enters_each_node_once():
    """A plain heap over the node order crossed nodes at every level (4 cross-node relay
    hops for 2 nodes of 4); now each node hangs off one edge, fan-out still <= 2."""
    topo = Topology.from_config({"nodes": {"nA": [1, 2, 3, 4], "nB": [5, 6, 7, 8]}})
    plan = plan_sync(topo, [0], list(range(1, 9)), SPEC, 4096, tree_shape="binary")
    check_spanning(plan)
    (tree,) = plan.trees
    assert tree.edges() == [(0, 1), (0, 5), (1, 2), (1, 3), (2, 4), (5, 6), (5, 7), (6, 8)]
    assert _receiver_hops(plan, topo) == [[LinkClass.INTRA_NODE] * 6]          # was 4 intra_dc
    assert max(len(tree.children_of(r)) for r in range(9)) == 2 and tree_depth(tree) == 3
    # The root's node-mates come first here too: one cross-node hop (was 4: 0->4 0->5 4->2 4->3).
    topo = Topology.from_config({"nodes": {"nB": [0, 2, 3], "nA": [4, 5]}})
    plan = plan_sync(topo, [0], [2, 3, 4, 5], SPEC, 4096, tree_shape="binary")
    assert plan.trees[0].edges() == [(0, 2), (0, 3), (2, 4), (4, 5)]
    # One rank per node (the default topology): still the heap.
    plan = plan_sync(Topology(), [0], [1, 2, 3, 4, 5], SPEC, 4096, tree_shape="binary")
    assert plan.trees[0].edges() == [(0, 1), (0, 2), (1, 3), (1, 4), (2, 5)]


def test_remote_datacenter_gateway_keeps_its_node_first():
    """The gateway's node-mates follow it, then the other node: one cross-node hop inside
    the remote DC for every tree, and the two roots use different gateways."""
    topo = Topology.from_config({"datacenters": {"t": [0, 1], "g": [2, 3, 4, 5]},
                                 "nodes": {"nA": [2, 3], "nB": [4, 5]}})
    spec = [("a", (1000,), "float32"), ("b", (1000,), "float32")]
    for shape in ("chain", "binary"):
        plan = plan_sync(topo, [0, 1], [2, 3, 4, 5], spec, 4096, tree_shape=shape)
        check_spanning(plan)
        assert crossing_copies(plan) == 1.0
        assert [t.children_of(t.root) for t in plan.trees] == [(2,), (4,)], shape
        assert [hops.count(LinkClass.INTRA_DC) for hops in _receiver_hops(plan, topo)] == [1, 1], shape


@pytest.mark.parametrize("kwargs, needle", [
    (dict(senders=[], receivers=[1]), "senders is empty"),
    (dict(senders=[0], receivers=[]), "receivers is empty"),
    (dict(senders=[0, 1], receivers=[1, 2]), "ranks [1] are both senders and receivers"),
    (dict(senders=[0, 0], receivers=[1]), "senders has duplicate ranks"),
    (dict(bucket_bytes=0), "bucket_bytes must be an int > 0"),
    (dict(spec=[("a", (2,), "float32", 7)]), "owner rank 7 is not a sender"),
    (dict(spec=[("a", (2,), "float32"), ("a", (3,), "float32")]), "duplicate tensor name 'a'"),
    (dict(spec=[("a", (2,), "floaty")]), "tensor_spec[0] (a): unknown dtype 'floaty'"),
    (dict(spec=[]), "tensor_spec is empty"),
    (dict(shape="ring"), "unknown tree_shape 'ring'"),
])
def test_planner_errors(kwargs, needle):
    args = dict(senders=[0], receivers=[1, 2], spec=SPEC, bucket_bytes=256, shape="chain")
    args.update(kwargs)
    with pytest.raises(ValueError) as e:
        plan_sync(Topology(), args["senders"], args["receivers"], args["spec"], args["bucket_bytes"],
                  tree_shape=args["shape"])
    assert needle in str(e.value)


# ---- checksum and shaper -------------------------------------------------------------
def test_checksum_detects_flips_and_swaps():
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (8 * CHUNK_WORDS * 3 + 64,), dtype=torch.uint8, generator=g)
    ref = bucket_checksum(data)
    assert torch.equal(ref, bucket_checksum(data.clone()))
    flipped = data.clone()
    flipped[12345] ^= 1
    assert not torch.equal(ref, bucket_checksum(flipped))
    swapped = data.clone()
    c = 8 * CHUNK_WORDS
    swapped[:c], swapped[c:2 * c] = data[c:2 * c].clone(), data[:c].clone()
    assert not torch.equal(ref, bucket_checksum(swapped))


def test_shaper_paces_to_the_rate():
    now = [0.0]
    slept = []

    def sleep(dt):
        slept.append(dt)
        now[0] += dt

    shaper = LinkShaper(1000.0, burst_s=0.0, clock=lambda: now[0], sleep=sleep)
    assert shaper.acquire(500) == pytest.approx(0.5)     # arrives after 500 B at 1000 B/s
    assert shaper.acquire(1500) == pytest.approx(2.0)
    now[0] = 10.0                                          # idle link: no backlog carried
    assert shaper.acquire(100) == pytest.approx(10.1)
    assert sum(slept) == pytest.approx(2.1)
    assert shaper.bytes_booked == 2100
    # With a burst allowance: none on first use, a late wake-up (0.03 s) is credited, a long
    # idle spell only by 0.05 s.
    now[0] = 0.0
    shaper = LinkShaper(1000.0, burst_s=0.05, clock=lambda: now[0], sleep=lambda dt: None)
    assert shaper.acquire(1000) == pytest.approx(1.0)
    now[0] = 1.03
    assert shaper.acquire(1000) == pytest.approx(2.0)
    now[0] = 5.0
    assert shaper.acquire(100) == pytest.approx(5.05)
    with pytest.raises(ValueError, match="rate must be > 0"):
        LinkShaper(0)


# ---- config section and swap helper ---------------------------------------------------
def test_weight_sync_config():
    cfg = WeightSyncConfig.from_dict({"bucket_mb": 0.002, "tree_shape": "binary"}, Topology.from_config(TWO_DC))
    assert cfg.bucket_bytes == 2000 and cfg.topology.dc(4) == "remote"
    assert cfg.plan([0], [1, 2, 3, 4], SPEC).kind == "tree"
    assert WeightSyncConfig.from_dict({"naive": True}).plan([0], [1, 2], SPEC).kind == "naive"
    assert WeightSyncConfig.from_dict(None) == WeightSyncConfig()
    for bad, needle in [({"bucket": 1}, "weight_sync.bucket: unknown key; did you mean 'bucket_mb'?"), ({"bucket_mb": -1}, "weight_sync.bucket_mb"),
                        ({"tree_shape": "ring"}, "weight_sync.tree_shape"), ({"naive": "yes"}, "weight_sync.naive"),
                        ({"topology": TWO_DC}, "weight_sync.topology: unknown key"),
                        # naive plans a star from each root: another shape was silently ignored
                        ({"naive": True, "tree_shape": "binary"},
                         "weight_sync.tree_shape: 'binary' is not used with weight_sync.naive: true"),
                        ({"naive": True, "tree_shape": "star"}, "weight_sync.tree_shape: 'star'")]:
        with pytest.raises(ValueError) as e:
            WeightSyncConfig.from_dict(bad)
        assert needle in str(e.value)


def test_staged_weights_load_into_refuses_bad_versions():
    from workers.generation.config import EngineConfig
    from workers.generation.engine import NativeEngine
    from workers.model import CausalLM, ModelConfig, init_weights

    mc = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)
    eng = NativeEngine(EngineConfig(device="cpu", kv_cache_tokens=256), model=init_weights(CausalLM(mc), seed=0))
    norm = eng.model.model.norm.weight
    new = torch.full_like(norm, 2.0)
    StagedWeights(3, {"model.norm.weight": new}, True).load_into(eng)
    assert eng.stats().weight_version == 3 and torch.equal(norm, new)  # copied in place
    with pytest.raises(RuntimeError, match="bucket 2"):
        StagedWeights(4, {"model.norm.weight": new * 3}, False,
                      "refusing version 4: bucket 2 checksum mismatch").load_into(eng)
    assert eng.stats().weight_version == 3 and torch.equal(norm, new)  # the engine kept its weights
