"""What a weight sync returns: SyncReport (every rank) and StagedWeights (receivers)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SyncReport:
    """What one rank did in one sync. ``bytes_by_link``: bytes this rank sent per link class
    (headers + payload incl. alignment padding); ``tensor_bytes_by_link``: the tensor data
    in them (sums over ranks to model bytes x copies)."""

    rank: int
    version: int
    seconds: float
    buckets_sent: int = 0
    bytes_by_link: dict[str, int] = field(default_factory=dict)
    tensor_bytes_by_link: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    # link class -> (first send posted, last send done), time.time() on this rank
    link_spans: dict[str, tuple[float, float]] = field(default_factory=dict)


@dataclass
class StagedWeights:
    """A receiver's result: ``tensors`` (HF name -> tensor, views of one staging buffer) only
    when ``ok``; otherwise empty and ``error`` says which bucket failed and why."""

    version: int
    tensors: dict[str, torch.Tensor]
    ok: bool
    error: str = ""
    report: SyncReport | None = None

    def load_into(self, engine) -> None:
        """The swap, at an iteration boundary: ``engine.load_weights(tensors, version)``.
        Raises RuntimeError (with ``error``) for a refused version; the engine keeps its weights."""
        if not self.ok:
            raise RuntimeError(f"not loading refused weights: {self.error}")
        engine.load_weights(self.tensors.items(), self.version)
