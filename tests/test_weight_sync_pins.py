"""Weight-sync integrity checks the rest of the suite let through when changed by one line
(mutation review, session 56): buckets of two versions refused, two staging buffers keep the
staged version, a tensor of another dtype than the plan's refused, the checksum covers a bucket's
tail bytes, a header of another bucket refused. Real senders and receivers over gloo."""
import time

import pytest
import torch
import torch.distributed as dist

import workers.weight_sync.links as links_mod
from workers.weight_sync import (Topology, WeightSyncReceiver, WeightSyncSender, plan_sync, tensor_spec)
from workers.weight_sync.checksum import bucket_checksum
from workers.weight_sync.links import Countdown, Links, Outgoing
from workers.weight_sync.localrun import run_local
from workers.weight_sync.topology import LinkClass


def _weights(seed):
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(96, 40, generator=g), "norm": torch.randn(40, generator=g).bfloat16(),
            "proj": torch.randn(40, 24, generator=g).half()}


def _plan():
    return plan_sync(Topology(), [0, 1], [2], tensor_spec(_weights(0).items()), 2048)


def _rank(rank, world):
    plan, out = _plan(), {}
    # 1) the two roots push different versions (one trainer rank a step behind)
    if rank in (0, 1):
        WeightSyncSender(plan, rank, timeout_s=60).push(_weights(7 + rank), 7 + rank)
    else:
        st = WeightSyncReceiver(plan, rank, timeout_s=60).receive()
        out["mixed"] = (st.ok, st.error)
    dist.barrier()
    # 2) two staging buffers: version 1's tensors must survive receiving version 2
    for v in (1, 2):
        if rank in (0, 1):
            WeightSyncSender(plan, rank, timeout_s=60).push(_weights(v), v)
        elif v == 1:
            rx = WeightSyncReceiver(plan, rank, timeout_s=60, staging_buffers=2)
            first = rx.receive()
        else:
            second = rx.receive()
            out["kept"] = (first.ok, second.ok, all(torch.equal(first.tensors[k], t) for k, t in _weights(1).items()))
    return out


def test_receiver_refuses_mixed_versions_and_keeps_the_previous_staging():
    res = run_local(3, _rank, threads=1)[2]
    ok, error = res["mixed"]
    assert not ok and "does not match version" in error, error
    assert res["kept"] == (True, True, True)


def test_push_refuses_a_tensor_of_the_wrong_dtype():
    """No process group needed: the check runs before any send."""
    spec = tensor_spec([("w", torch.zeros(64, 8, dtype=torch.bfloat16))])
    plan = plan_sync(Topology(), [0], [1], spec, 4096)
    with pytest.raises(ValueError, match="plan says"):
        WeightSyncSender(plan, 0).push({"w": torch.zeros(64, 8, dtype=torch.float16)}, 1)


def test_checksum_sees_the_tail_bytes():
    data = torch.arange(13, dtype=torch.uint8)  # 8 bytes of a word + 5 tail bytes
    ref = bucket_checksum(data)
    changed = data.clone()
    changed[-1] ^= 1
    swapped = data.clone()
    swapped[-2], swapped[-1] = data[-1].clone(), data[-2].clone()
    assert not torch.equal(ref, bucket_checksum(changed))
    assert not torch.equal(ref, bucket_checksum(swapped))


def test_verify_refuses_a_header_of_another_bucket():
    """A fake header table: on gloo the tags keep a header in its own bucket's row, so real
    transfers cannot produce the mix-up this check exists for (NCCL matches by issue order)."""
    plan = plan_sync(Topology(), [0], [1], tensor_spec(_weights(0).items()), 2048)
    rx = WeightSyncReceiver(plan, 1)
    n = len(plan.buckets)
    assert n >= 2
    sums = torch.zeros(n, 2, dtype=torch.int64)
    headers = torch.zeros(n, 4, dtype=torch.int64)
    headers[:, 0] = 5
    headers[:, 1] = torch.arange(n)
    assert rx._verify(headers, sums, 5) == ""
    headers[0, 1], headers[1, 1] = 1, 0   # buckets 0 and 1 landed in each other's place
    assert "does not match" in rx._verify(headers, sums, 5)


THREE_DC = {"datacenters": {"a": [0, 1, 2], "b": [3, 4], "c": [5]},
            "bandwidth_gbps": {"intra_dc": 16, "inter_dc": 8}, "shaped_links": ["intra_dc", "inter_dc"]}


def test_shaped_links_are_shared_as_the_wires_are():
    """One shaper per link into each remote DC (two DCs: two shapers), one for this rank's NIC
    shared by all its intra-DC children, each at its link class's bytes/s."""
    topo = Topology.from_config(THREE_DC)
    links = Links(topo, 0, [1, 2, 3, 4, 5], inline=True)
    s = links._shaper
    assert s[1] is s[2]                      # the NIC, shared by both intra-DC children
    assert s[3] is s[4]                      # one link into DC b, two children behind it
    assert s[3] is not s[5]                  # DC c's link is another wire
    assert s[1].rate == topo.bandwidth[LinkClass.INTRA_DC] == 16e9 / 8
    assert s[3].rate == s[5].rate == topo.bandwidth[LinkClass.INTER_DC] == 8e9 / 8
    links.close()


def test_link_spans_end_when_the_sends_finish(monkeypatch):
    """busy[link] = [first post, last completion]: the bench's inter_dc_link_s is end - start.
    dist.isend is faked (a completed send): a real one needs a process group, and the span's
    bookkeeping is all that is checked here."""
    import time

    import torch

    from workers.weight_sync.links import Countdown, Outgoing

    class Done:  # a completed send (a fake: no process group here)
        def wait(self, timeout=None):
            return True

    import workers.weight_sync.links as links_mod
    monkeypatch.setattr(links_mod.dist, "isend", lambda *a, **k: Done())
    links = Links(Topology.from_config(THREE_DC), 0, [3], inline=True)
    t0 = time.time()
    done = Countdown(1)
    links.send(3, Outgoing(0, torch.zeros(4, dtype=torch.int64), torch.zeros(1000, dtype=torch.uint8), 1000, done))
    links.flush()
    assert done.wait(5)
    start, end = links.busy["inter_dc"]
    assert t0 <= start <= end <= time.time()
    assert links.wire_bytes["inter_dc"] == 4 * 8 + 1000 and links.tensor_bytes["inter_dc"] == 1000
    links.close()


def test_after_a_failed_send_every_later_bucket_is_marked_done(monkeypatch):
    """A producer waiting on a bucket's Countdown (the sender's pack buffers) must not wait out
    timeout_s after a child's send failed. dist.isend is faked to fail: a real failure needs a
    dead peer."""
    import torch

    import workers.weight_sync.links as links_mod
    from workers.weight_sync.links import Countdown, Outgoing

    def fail(*a, **k):
        raise RuntimeError("connection reset")

    monkeypatch.setattr(links_mod.dist, "isend", fail)
    links = Links(Topology.from_config(THREE_DC), 0, [1], inline=True)
    dones = [Countdown(1) for _ in range(3)]
    for i, done in enumerate(dones):
        links.send(1, Outgoing(i, torch.zeros(4, dtype=torch.int64), torch.zeros(8, dtype=torch.uint8), 8, done))
    assert all(d.finished() for d in dones)
    assert len(links.errors) == 1 and "bucket 0" in links.errors[0]
    links.close()


# ---- mutation review, session 59 ------------------------------------------------------------
def test_a_links_span_starts_at_its_first_send_not_its_last(monkeypatch):
    """busy[link][0] is the FIRST post (the bench's inter_dc_link_s = end - start): a later
    bucket must not move it. dist.isend is faked (a completed send): a real one needs a process
    group, and only the span's bookkeeping is checked."""
    class Done:
        def wait(self, timeout=None):
            return True

    monkeypatch.setattr(links_mod.dist, "isend", lambda *a, **k: Done())
    links = Links(Topology.from_config(THREE_DC), 0, [3], inline=True)
    dones = [Countdown(1), Countdown(1)]
    t0 = time.time()
    links.send(3, Outgoing(0, torch.zeros(4, dtype=torch.int64), torch.zeros(100, dtype=torch.uint8), 100, dones[0]))
    time.sleep(0.2)
    t1 = time.time()
    links.send(3, Outgoing(1, torch.zeros(4, dtype=torch.int64), torch.zeros(100, dtype=torch.uint8), 100, dones[1]))
    links.flush()
    assert all(d.wait(5) for d in dones)
    start, end = links.busy["inter_dc"]
    assert t0 <= start < t1 <= end <= time.time()
    links.close()


# ---- mutation review, session 59 ------------------------------------------------------------
def _rank_one_fails(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def test_run_local_raises_naming_the_rank_that_failed():
    """A rank that raised must fail the caller: its traceback is never handed back as a result
    (every multi-rank test would then pass whatever the rank did)."""
    with pytest.raises(RuntimeError, match=r"(?s)run_local: rank 1 failed:.*boom on rank 1"):
        run_local(2, _rank_one_fails)
