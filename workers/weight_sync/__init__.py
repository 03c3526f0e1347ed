"""Trainer -> generation weight sync: topology, pure planner, pipelined p2p executor,
link shaper (paper section 6, weight transmission). See docs/weight_sync.md."""
from workers.weight_sync.config import WeightSyncConfig
from workers.weight_sync.executor import StagedWeights, SyncReport, WeightSyncReceiver, WeightSyncSender
from workers.weight_sync.plan import Bucket, SyncPlan, TensorSlot, TensorSpec, Tree, tensor_spec
from workers.weight_sync.planner import TREE_SHAPES, plan_naive, plan_sync, tree_depth
from workers.weight_sync.shaper import LinkShaper
from workers.weight_sync.topology import LinkClass, Topology

__all__ = [
    "Bucket", "LinkClass", "LinkShaper", "StagedWeights", "SyncPlan", "SyncReport", "TREE_SHAPES",
    "TensorSlot", "TensorSpec", "Topology", "Tree", "WeightSyncConfig", "WeightSyncReceiver",
    "WeightSyncSender",
    "plan_naive", "plan_sync", "tensor_spec", "tree_depth",
]
