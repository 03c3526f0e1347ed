"""Per-bucket checksum: two int64 words computed with torch on the bucket's own device
(no host copy). s1 = wrap-around sum of the bytes viewed as int64 words (catches any single
changed word); s2 = sum over 1024-word chunks of (chunk index + 1) * chunk sum (catches
chunks swapped or shifted). Integer addition mod 2**64 is associative, so CPU and CUDA
agree bit-for-bit."""
from __future__ import annotations

import torch

CHUNK_WORDS = 1024


def bucket_checksum(payload: torch.Tensor) -> torch.Tensor:
    """payload: uint8 [N], N a multiple of 8 -> int64 [2] (on payload's device)."""
    words = payload.view(torch.int64)                      # [N / 8]
    n_full = words.numel() // CHUNK_WORDS
    chunk_sums = words[: n_full * CHUNK_WORDS].view(n_full, CHUNK_WORDS).sum(dim=1)  # [n_full]
    tail = words[n_full * CHUNK_WORDS:].sum()
    weights = torch.arange(1, n_full + 1, dtype=torch.int64, device=payload.device)
    s1 = chunk_sums.sum() + tail
    s2 = (chunk_sums * weights).sum() + tail * (n_full + 1)
    return torch.stack([s1, s2])
