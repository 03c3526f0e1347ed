"""Trainer -> generation weight sync: topology, pure planner, pipelined p2p executor,
link shaper (paper section 6, weight transmission). See docs/weight_sync.md.

The executor: bucketed, pipelined broadcast over torch.distributed point-to-point (gloo on
CPU, NCCL on GPU), following a SyncPlan.

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
from workers.weight_sync.config import WeightSyncConfig
from workers.weight_sync.plan import (WIRE_DTYPES, Bucket, SyncPlan, TensorSlot, TensorSpec, Tree, sent_dtype,
                                      tensor_spec, wire_dtype)
from workers.weight_sync.planner import TREE_SHAPES, plan_naive, plan_sync, tree_depth
from workers.weight_sync.receiver import WeightSyncReceiver
from workers.weight_sync.reports import StagedWeights, SyncReport
from workers.weight_sync.sender import WeightSyncSender
from workers.weight_sync.shaper import LinkShaper
from workers.weight_sync.topology import LinkClass, Topology

__all__ = [
    "Bucket", "LinkClass", "LinkShaper", "StagedWeights", "SyncPlan", "SyncReport", "TREE_SHAPES",
    "TensorSlot", "TensorSpec", "Topology", "Tree", "WeightSyncConfig", "WeightSyncReceiver",
    "WeightSyncSender",
    "plan_naive", "plan_sync", "sent_dtype", "tensor_spec", "tree_depth", "WIRE_DTYPES", "wire_dtype",
]
