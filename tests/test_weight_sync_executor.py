"""Weight-sync executor over real gloo point-to-point on loopback: 6 local ranks started
once (forkserver, 1 thread each) run every scenario in turn; tests assert on the results."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from workers.weight_sync import (TensorSpec, Topology, WeightSyncReceiver, WeightSyncSender, plan_naive,
                                 plan_sync, tensor_spec)
from workers.weight_sync.localrun import free_port, run_local

WORLD = 6
TWO_DC = {"datacenters": {"train": [0, 1, 2], "remote": [3, 4, 5]}}


def weights(seed: int) -> dict[str, torch.Tensor]:
    """A small model with mixed dtypes, a tensor bigger than a bucket and a scalar."""
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(96, 40, generator=g),
            "norm": torch.randn(40, generator=g).bfloat16(),
            "proj": torch.randn(40, 24, generator=g).half(),
            "scale": torch.tensor(1.5 + seed),
            "ids": torch.randint(0, 1 << 40, (17,), generator=g)}


def model_bytes() -> int:
    return sum(t.numel() * t.element_size() for t in weights(0).values())


def sharded_spec():
    return [TensorSpec(s.name, s.shape, s.dtype, owner=i % 2) for i, s in enumerate(tensor_spec(weights(0).items()))]


def _plans():
    """name -> (plan, pushes: list of (seed, version), receiver kwargs per push, hooks)."""
    spec = tensor_spec(weights(0).items())
    two_dc = Topology.from_config({**TWO_DC, "shaped_links": ["inter_dc"], "bandwidth_gbps": {"inter_dc": 2.0}})
    return {
        "single": (plan_sync(Topology(), [0], [1, 2, 3, 4, 5], spec, 4096), {}),
        "two_roots": (plan_sync(Topology(), [0, 1], [2, 3, 4, 5], spec, 2048), {}),
        # The NCCL-safe single-thread path, on binary trees that use pair (2, 4) both ways.
        "two_roots_in_order": (plan_sync(Topology(), [0, 1], [2, 3, 4, 5], spec, 2048, "binary"),
                               {"ordered": True}),
        "cross_dc": (plan_sync(two_dc, [0], [1, 2, 3, 4, 5], spec, 4096), {}),
        "naive_cross_dc": (plan_naive(two_dc, [0], [1, 2, 3, 4, 5], spec, 4096), {}),
        "sharded": (plan_sync(Topology.from_config({"datacenters": {"a": [0, 1, 2, 3], "b": [4, 5]}}),
                              [0, 1], [2, 3, 4, 5], sharded_spec(), 1024, tree_shape="binary"), {}),
        "corrupt_root": (plan_sync(Topology(), [0], [1, 2, 3], spec, 4096), {"sender_corrupt": [1]}),
        "corrupt_relay": (plan_sync(Topology(), [0], [1, 2, 3], spec, 4096), {"relay": 1, "relay_corrupt": [2]}),
        "versions": (plan_sync(Topology(), [0], [1, 2], spec, 8192), {"versions": [(1, None), (2, 2), (3, 4)]}),
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (dtype, shape and every byte)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def _rpc_push(plan, version: int):
    """Runs on a trainer rank's RPC thread, like the controller's TrainerRank.push_weights."""
    return WeightSyncSender(plan, dist.get_rank()).push(weights(version), version)


def _rpc_receive(plan):
    """Runs on an instance's RPC thread; the engine would keep generating meanwhile."""
    st = WeightSyncReceiver(plan, dist.get_rank()).receive()
    w = weights(st.version)
    return st.ok, st.error, st.version, st.ok and all(_same(st.tensors[k], w[k]) for k in w)


def _rpc_scenario(rank: int, world: int, rpc_port: int):
    """Rank 0 plays the controller: rpc_async to sender rank 1 and receivers 2..5 at once."""
    import torch.distributed.rpc as rpc

    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{rpc_port}", rpc_timeout=60)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    out = None
    if rank == 0:
        two_dc = Topology.from_config(TWO_DC)
        plan = plan_sync(two_dc, [1], [2, 3, 4, 5], tensor_spec(weights(0).items()), 2048)
        futs = [rpc.rpc_async("worker1", _rpc_push, args=(plan, 11))]
        futs += [rpc.rpc_async(f"worker{r}", _rpc_receive, args=(plan,)) for r in (2, 3, 4, 5)]
        out = [f.wait() for f in futs]
    rpc.shutdown()
    return out


def _rank_main(rank: int, world: int, rpc_port: int) -> dict:
    out = {"rpc": _rpc_scenario(rank, world, rpc_port)}
    for name, (plan, hooks) in _plans().items():
        results = []
        for version, expected in hooks.get("versions", [(7, None)]):
            w = weights(version)
            if rank in plan.senders:
                if name == "sharded":   # a shard holder only has its own tensors
                    owned = {s.name for s in sharded_spec() if s.owner == rank}
                    w = {k: v for k, v in w.items() if k in owned}
                sender = WeightSyncSender(plan, rank, timeout_s=60, corrupt_buckets=hooks.get("sender_corrupt", ()))
                results.append(("sender", sender.push(w, version)))
            elif rank in plan.receivers:
                corrupt = hooks.get("relay_corrupt", ()) if rank == hooks.get("relay") else ()
                st = WeightSyncReceiver(plan, rank, timeout_s=60, expected_version=expected,
                                        corrupt_buckets=corrupt, ordered=hooks.get("ordered")).receive()
                equal = st.ok and set(st.tensors) == set(w) and all(_same(st.tensors[k], w[k]) for k in w)
                results.append(("receiver", st.ok, st.error, st.version, equal, st.report))
        out[name] = results
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs():
    return run_local(WORLD, _rank_main, free_port())


def _receivers(runs, name):
    return {r: res[name] for r, res in enumerate(runs) if res[name] and res[name][0][0] == "receiver"}


def test_controller_style_rpc_async_on_global_ranks(runs):
    report, *received = runs[0]["rpc"]
    assert report.rank == 1 and report.version == 11
    assert report.tensor_bytes_by_link["inter_dc"] == model_bytes()   # rank 1 -> gateway 3
    assert received == [(True, "", 11, True)] * 4


def _link_bytes(runs, name, link, key="tensor_bytes_by_link"):
    total = 0
    for res in runs:
        for entry in res[name]:
            report = entry[1] if entry[0] == "sender" else entry[5]
            total += getattr(report, key)[link]
    return total


@pytest.mark.parametrize("name", ["single", "two_roots", "two_roots_in_order", "cross_dc", "naive_cross_dc",
                                  "sharded"])
def test_every_receiver_gets_the_exact_weights(runs, name):
    recv = _receivers(runs, name)
    assert len(recv) >= 4
    for rank, [(_, ok, error, version, equal, _)] in recv.items():
        assert ok, f"{name} rank {rank}: {error}"
        assert version == 7 and equal, f"{name} rank {rank}"


def test_two_dcs_send_exactly_one_copy_over_the_link(runs):
    assert _link_bytes(runs, "cross_dc", "inter_dc") == model_bytes()
    assert _link_bytes(runs, "naive_cross_dc", "inter_dc") == 3 * model_bytes()
    # Every receiver got one copy in total: 5 copies cross some link either way.
    for name in ("cross_dc", "naive_cross_dc"):
        assert sum(_link_bytes(runs, name, lc) for lc in ("intra_node", "intra_dc", "inter_dc")) == 5 * model_bytes()
    # On the wire: headers + payload incl. alignment padding, still one copy of the layout.
    plan = _plans()["cross_dc"][0]
    wire = sum(b.nbytes for b in plan.buckets) + 32 * len(plan.buckets)
    assert _link_bytes(runs, "cross_dc", "inter_dc", "bytes_by_link") == wire


def test_two_senders_are_both_used_as_roots(runs):
    sent = {r: res["two_roots"][0][1] for r, res in enumerate(runs) if r in (0, 1)}
    assert all(rep.buckets_sent > 0 for rep in sent.values())
    per_sender = [sum(rep.tensor_bytes_by_link.values()) for rep in sent.values()]
    assert sum(per_sender) == model_bytes()          # each root sends its half once, to its tree head
    assert min(per_sender) > 0.3 * model_bytes()


def test_sharded_senders_each_send_their_shard(runs):
    for r in (0, 1):
        report = runs[r]["sharded"][0][1]
        assert report.buckets_sent > 0


def test_corrupted_bucket_at_the_root_is_refused_everywhere(runs):
    recv = _receivers(runs, "corrupt_root")
    assert sorted(recv) == [1, 2, 3]
    for rank, [(_, ok, error, _, _, _)] in recv.items():
        assert not ok
        assert "refusing version 7: bucket 1 " in error and "checksum mismatch" in error, error


def test_corrupted_bucket_at_a_relay_is_caught_downstream(runs):
    recv = _receivers(runs, "corrupt_relay")   # chain 0 -> 1 -> 2 -> 3, rank 1 corrupts bucket 2
    for rank in (1, 2, 3):
        [(_, ok, error, _, _, _)] = recv[rank]
        assert not ok and "bucket 2 " in error, (rank, error)


def test_successive_versions_and_expected_version(runs):
    recv = _receivers(runs, "versions")
    assert sorted(recv) == [1, 2]  # every receiver reported: the checks below cannot pass vacuously
    for rank, results in recv.items():
        (_, ok1, _, v1, eq1, _), (_, ok2, _, v2, eq2, _), (_, ok3, err3, v3, _, _) = results
        assert ok1 and v1 == 1 and eq1
        assert ok2 and v2 == 2 and eq2
        assert not ok3 and v3 == 3 and "got version 3, expected 4" in err3
