"""Weight-sync integrity checks the rest of the suite let through when changed by one line
(mutation review, session 56): buckets of two versions refused, two staging buffers keep the
staged version, a tensor of another dtype than the plan's refused, the checksum covers a bucket's
tail bytes, a header of another bucket refused. Real senders and receivers over gloo."""
import pytest
import torch
import torch.distributed as dist

from workers.weight_sync import (Topology, WeightSyncReceiver, WeightSyncSender, plan_sync, tensor_spec)
from workers.weight_sync.checksum import bucket_checksum
from workers.weight_sync.localrun import run_local


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
