"""Length-forced runs (``train.length_trace``, the paper's benchmarks): each training prompt
generates exactly the length of one trace row's first answer."""
from __future__ import annotations

import zlib

from controller.config import ConfigError


def forced_lengths(trace: str, scale: float, max_tokens: int):
    """``train.length_trace``: prompt -> forced output tokens, from the first answer of the
    trace row its text hashes to (words x 1.3 tokens x ``scale``, within [1, ``max_tokens``])."""
    from controller.planner.workloads import trace_tokens
    from ranker.data import read_traces

    try:
        lens = [trace_tokens(r.lengths[0], scale, max_tokens) for r in read_traces(trace)]
    except (ValueError, OSError, EOFError) as e:  # TraceError names the file and line
        raise ConfigError(f"train.length_trace: {e}") from None
    if not lens:
        raise ConfigError(f"train.length_trace: {trace} holds no rows")
    return lambda item: lens[zlib.crc32(item.prompt.encode()) % len(lens)]
