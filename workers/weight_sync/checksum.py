"""Per-bucket checksum: two int64 words computed with torch on the bucket's own device
(no host copy). s1 = wrap-around sum of the bytes viewed as int64 words (catches any single
changed word); s2 = sum over 1024-word chunks of (chunk index + 1) * chunk sum (catches
chunks swapped or shifted). Integer addition mod 2**64 is associative, so CPU and CUDA
agree bit-for-bit."""
from __future__ import annotations

import torch

CHUNK_WORDS = 1024


def bucket_checksum(payload: torch.Tensor) -> torch.Tensor:
    """payload: uint8 [N] starting 8-byte aligned -> int64 [2] (on payload's device).
    Trailing N % 8 bytes are added as (byte value + 1) * (position + 1)."""
    n8 = payload.numel() // 8 * 8
    words = payload[:n8].view(torch.int64)                 # [N // 8]
    n_full = words.numel() // CHUNK_WORDS
    chunk_sums = words[: n_full * CHUNK_WORDS].view(n_full, CHUNK_WORDS).sum(dim=1)  # [n_full]
    rest = payload[n8:].to(torch.int64) + 1                 # [N % 8]
    rest = (rest * torch.arange(1, rest.numel() + 1, dtype=torch.int64, device=payload.device)).sum()
    tail = words[n_full * CHUNK_WORDS:].sum() + rest
    weights = torch.arange(1, n_full + 1, dtype=torch.int64, device=payload.device)
    s1 = chunk_sums.sum() + tail
    s2 = (chunk_sums * weights).sum() + tail * (n_full + 1)
    return torch.stack([s1, s2])
