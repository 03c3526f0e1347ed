"""The six pipeline modes (DESIGN.md section 3) as data: one program, a small strategy each.

``release``: how the trainer takes the iteration's samples (``all`` at once, fixed
``minibatch`` hand-overs, or ``stream`` as they arrive). ``lag``: how many weight versions
generation may trail the trainer (0: synchronous, staleness exactly 0; 1: one-step
off-policy, staleness <= 1, the weight push overlaps the next iteration's generation).
``colocated``: generation and training time-share the same ranks.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineMode:
    name: str
    release: str  # "all" | "minibatch" | "stream"
    lag: int  # 0 sync, 1 async
    colocated: bool = False

    @property
    def max_staleness(self) -> int:
        return self.lag


MODES: dict[str, PipelineMode] = {m.name: m for m in (
    PipelineMode("colocated", "all", 0, colocated=True),
    PipelineMode("batch", "all", 0),
    PipelineMode("minibatch", "minibatch", 0),
    PipelineMode("stream", "stream", 0),
    PipelineMode("async_batch", "all", 1),
    PipelineMode("async_stream", "stream", 1),
)}


def get_mode(name: str) -> PipelineMode:
    if name not in MODES:
        raise ValueError(f"pipeline.mode {name!r} is not one of {sorted(MODES)}")
    return MODES[name]
