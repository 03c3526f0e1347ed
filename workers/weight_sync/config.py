"""``weight_sync:`` config section -> typed WeightSyncConfig, and the plan it implies.

    weight_sync:
      bucket_mb: 4             # bucket size (MB, 1e6 bytes)
      tree_shape: chain        # chain | binary | star
      naive: false             # true: root sends to every instance (baseline)

The topology (topology.py) is the run config's top-level ``topology:`` section
(controller/config.py); ``from_dict`` takes it built. Only the weight sync reads it: the
pipeline planner (controller/planner) takes bandwidths from its cluster file.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from workers.config_schema import Range, build_section, ranged
from workers.weight_sync.plan import SyncPlan, TensorSpec
from workers.weight_sync.planner import TREE_SHAPES, plan_naive, plan_sync
from workers.weight_sync.topology import Topology

# Smallest bucket a config may ask for (MB): every bucket is two messages per tree edge (a
# 32-byte header, then the payload) and starts on a 64-byte boundary, so below ~1 KB the
# header and the per-message latency are the whole cost (gloo on loopback: ~1.3 ms a bucket,
# 13,388 buckets of 100 B took 18 s for a 1.7 MB model). Smaller is a typo, not a tuning.
# The library itself (WeightSyncConfig(bucket_bytes=...), plan_sync) takes any size >= 1 B.
MIN_BUCKET_MB = 0.001
DEFAULT_TREE_SHAPE = "chain"


@dataclass(frozen=True)
class WeightSyncSection:
    """The ``weight_sync:`` keys as written (checked by ``build_section``: names, types, ranges)."""

    bucket_mb: float = ranged(4.0, Range(MIN_BUCKET_MB, note="MB; below 1 KB each bucket's header and "
                                         "message latency are the whole cost"))
    tree_shape: str = DEFAULT_TREE_SHAPE
    naive: bool = False


@dataclass(frozen=True)
class WeightSyncConfig:
    bucket_bytes: int = 4_000_000
    tree_shape: str = DEFAULT_TREE_SHAPE
    naive: bool = False
    topology: Topology = field(default_factory=Topology)

    def __post_init__(self) -> None:
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes <= 0:
            raise ValueError(f"weight_sync.bucket_mb must give > 0 bytes, got {self.bucket_bytes!r}")
        if self.tree_shape not in TREE_SHAPES:
            raise ValueError(f"weight_sync.tree_shape: unknown {self.tree_shape!r}; allowed: {sorted(TREE_SHAPES)}")
        if self.naive and self.tree_shape != DEFAULT_TREE_SHAPE:
            # naive plans a star from each root whatever the shape: taking it would make a
            # "binary" naive run look like a measurement of binary trees
            raise ValueError(f"weight_sync.tree_shape: {self.tree_shape!r} is not used with weight_sync.naive: true "
                             f"(the baseline sends from each root straight to every instance); drop "
                             f"weight_sync.tree_shape or set weight_sync.naive: false")

    def to_config(self) -> dict[str, Any]:
        """The ``weight_sync`` section as written (its topology is the run's ``topology``)."""
        return {"bucket_mb": self.bucket_bytes / 1e6, "tree_shape": self.tree_shape, "naive": self.naive}

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any] | None, topology: Topology | None = None) -> "WeightSyncConfig":
        """Validate the ``weight_sync`` section (None -> defaults; ``ConfigError`` naming the key).
        ``topology``: the run's (None: one datacenter)."""
        sec = build_section(WeightSyncSection, "weight_sync", dict(cfg) if isinstance(cfg, Mapping) else cfg)
        return cls(bucket_bytes=max(1, round(sec.bucket_mb * 1e6)), tree_shape=sec.tree_shape, naive=sec.naive,
                   topology=Topology() if topology is None else topology)

    def plan(self, senders: Sequence[int], receivers: Sequence[int],
             tensor_spec: Sequence[TensorSpec | tuple]) -> SyncPlan:
        """The SyncPlan for these ranks and tensors (pure; same on every rank)."""
        if self.naive:
            return plan_naive(self.topology, senders, receivers, tensor_spec, self.bucket_bytes)
        return plan_sync(self.topology, senders, receivers, tensor_spec, self.bucket_bytes, self.tree_shape)
