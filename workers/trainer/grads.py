"""Gradient utilities: bucketed SUM all-reduce (data parallel) and norm clipping."""
from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_sum(tensors: list[torch.Tensor], group, bucket_bytes: int = 32 << 20) -> None:
    """SUM-all-reduce ``tensors`` in place, flattened into buckets (few large collectives)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors + [None]:
        if t is not None and (not bucket or (size + t.numel() * t.element_size() <= bucket_bytes
                                             and t.dtype == bucket[0].dtype)):
            bucket.append(t)
            size += t.numel() * t.element_size()
            continue
        if bucket:
            flat = torch.cat([b.reshape(-1) for b in bucket])
            dist.all_reduce(flat, group=group)
            for b, chunk in zip(bucket, flat.split([b.numel() for b in bucket])):
                b.copy_(chunk.view_as(b))
        bucket, size = ([t], t.numel() * t.element_size()) if t is not None else ([], 0)


def clip_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    return torch.nn.utils.get_total_norm([p.grad for p in params])
