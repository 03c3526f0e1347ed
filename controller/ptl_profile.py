"""PTLProfile: one generation instance's measured (or analytic) per-token latency as a
function of batch size, PTL(BS), with its KV capacity and prefill / cached-token costs; saved
and loaded as JSON. Made by controller/planner/profile.py, read by the dispatchers
(controller/scheduling.py), the instance model and the planner."""
from __future__ import annotations

import bisect
import json
import math
import numbers
import os
from dataclasses import asdict, dataclass, field

from workers.atomic import write_text


def _whole(v) -> bool:
    """A whole number (8192 or 8192.0; not NaN, inf or a bool)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and float(v).is_integer()


@dataclass
class PTLProfile:
    """One generation instance's per-token latency vs batch size, and its KV capacity.

    ptl_s[i] is the wall time of one decode step (every running sequence gains one token)
    at batch size batch_sizes[i]; a sample of L tokens in a batch of BS takes ~PTL(BS) * L.
    kv_tokens is the KV-cache capacity in tokens, allocated in blocks of block_size.
    A prefill step (admitting requests) costs prefill_step_s + prefill_s_per_token * prompt
    tokens (0 when not measured). ptl_s was measured with ``ref_context`` cached tokens per
    sequence; each cached token beyond that adds ``kv_s_per_token`` to a step (attention
    reads the whole KV cache): see ``step_time``."""

    batch_sizes: list[int]
    ptl_s: list[float]
    kv_tokens: int
    block_size: int = 1
    max_batch_size: int = 0  # 0: only memory limits the batch
    prefill_s_per_token: float = 0.0
    name: str = ""
    meta: dict = field(default_factory=dict)
    prefill_step_s: float = 0.0
    kv_s_per_token: float = 0.0
    ref_context: float = 0.0

    def __post_init__(self):
        if not self.batch_sizes or len(self.batch_sizes) != len(self.ptl_s):
            raise ValueError("PTLProfile: batch_sizes and ptl_s must be non-empty and of equal length "
                             f"(got {len(self.batch_sizes)} and {len(self.ptl_s)})")
        # counts are whole numbers and times numbers (not bools; NaN passed every `< 1` test)
        for key in ("kv_tokens", "block_size", "max_batch_size"):
            v = getattr(self, key)
            if not _whole(v):
                raise ValueError(f"PTLProfile.{key} must be a whole number, got {v!r}")
            setattr(self, key, int(v))
        if not all(_whole(b) for b in self.batch_sizes):
            raise ValueError(f"PTLProfile.batch_sizes must be whole numbers, got {self.batch_sizes}")
        if any(not isinstance(p, numbers.Real) or isinstance(p, bool) for p in self.ptl_s):
            raise ValueError(f"PTLProfile.ptl_s must be numbers, got {self.ptl_s}")
        if any(b < 1 for b in self.batch_sizes) or list(self.batch_sizes) != sorted(set(self.batch_sizes)):
            raise ValueError(f"PTLProfile.batch_sizes must be increasing and >= 1, got {self.batch_sizes}")
        if any(not (p > 0) for p in self.ptl_s):
            raise ValueError(f"PTLProfile.ptl_s must be > 0, got {self.ptl_s}")
        costs = {k: getattr(self, k) for k in ("prefill_s_per_token", "prefill_step_s", "kv_s_per_token",
                                                "ref_context")}
        bad = {k: v for k, v in costs.items() if not (0 <= v < math.inf)}
        if bad:
            raise ValueError(f"PTLProfile: {bad} must be finite and >= 0")
        if any(not (p < math.inf) for p in self.ptl_s):
            raise ValueError(f"PTLProfile.ptl_s must be finite, got {self.ptl_s}")
        if self.kv_tokens < 1 or self.block_size < 1 or self.max_batch_size < 0:
            raise ValueError(f"PTLProfile: kv_tokens ({self.kv_tokens}) and block_size ({self.block_size}) "
                             f"must be >= 1, max_batch_size ({self.max_batch_size}) >= 0")
        self.batch_sizes = [int(b) for b in self.batch_sizes]
        self.ptl_s = [float(p) for p in self.ptl_s]

    def ptl(self, bs: float) -> float:
        """Per-token latency at batch size bs: piecewise linear through the measured points,
        flat below the first, extended with the last segment's (non-negative) slope above."""
        xs, ys = self.batch_sizes, self.ptl_s
        if bs <= xs[0] or len(xs) == 1:
            return ys[0] if bs <= xs[0] else ys[-1]
        if bs >= xs[-1]:
            slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
            return ys[-1] + slope * (bs - xs[-1])
        j = bisect.bisect_right(xs, bs)  # xs[j-1] <= bs < xs[j]
        x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
        return y0 + (y1 - y0) * (bs - x0) / (x1 - x0)

    def step_time(self, bs: int, cached_tokens: float) -> float:
        """One decode step of ``bs`` sequences holding ``cached_tokens`` KV tokens in all."""
        extra = self.kv_s_per_token * (cached_tokens - bs * self.ref_context)
        return max(0.5 * self.ptl(bs), self.ptl(bs) + extra)

    def seq_kv_tokens(self, length: float) -> int:
        """KV tokens one sequence of ``length`` tokens (prompt + output) holds: whole blocks."""
        return max(1, math.ceil(length / self.block_size)) * self.block_size

    def max_batch_for_len(self, length: float) -> int:
        """Largest batch of ``length``-token sequences whose KV fits (>= 1), capped by max_batch_size."""
        bs = max(1, self.kv_tokens // self.seq_kv_tokens(length))
        return min(bs, self.max_batch_size) if self.max_batch_size else bs

    def save(self, path: str | os.PathLike) -> None:
        write_text(path, json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "PTLProfile":
        """A saved profile; a missing key, a wrong value or a truncated / corrupted file is a
        ValueError naming the file."""
        with open(path) as f:
            try:
                d = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}: not a PTLProfile JSON file ({e})") from None
        return cls.from_dict(d, str(path))

    @classmethod
    def from_dict(cls, d, where: str = "PTLProfile") -> "PTLProfile":
        """The profile in ``d`` (a saved profile's JSON object); errors name ``where``."""
        missing = {"batch_sizes", "ptl_s", "kv_tokens"} - set(d) if isinstance(d, dict) else set()
        if missing:
            raise ValueError(f"{where}: PTLProfile is missing {sorted(missing)}")
        return from_json(cls, d, where)


def from_json(cls, d: dict, where: str):
    """``cls(**d)`` for a dataclass read from a file: unknown keys or bad values are a
    ValueError naming ``where``."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a JSON object for {cls.__name__}, got {type(d).__name__}")
    unknown = set(d) - set(cls.__dataclass_fields__)
    if unknown:
        raise ValueError(f"{where}: unknown {cls.__name__} keys {sorted(unknown)}")
    try:
        return cls(**d)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: not a valid {cls.__name__} ({e})") from None
