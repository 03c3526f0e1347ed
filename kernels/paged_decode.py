"""Paged grouped-query decode attention: one new query token per sequence against its KV cache.

Cache layout (contract 1, shared with the engine):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables:     int32 [B, max_blocks]   (block ids of each sequence, unused entries 0)
    context_lens:     int32 [B]               (tokens in the cache, including the current one)
    q:                [B, H, head_dim]        (H a multiple of num_kv_heads)

``paged_decode_attention`` runs the Triton kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``);
``paged_decode_attention_ref`` is the torch reference with the same signature.
The Triton module is imported on first call, never at import time.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kernels import interpreter_mismatch, interpreting, triton_available, triton_usable

DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # of q and the K/V caches

MIN_DOT = 16            # tl.dot needs every dim >= 16 when compiled for a GPU
MIN_SPLIT_TOKENS = 128  # don't split a sequence into pieces shorter than this
MAX_SPLITS = 64


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class DecodeLaunch:
    """Compile-time/launch choices of the Triton kernels (all dot dims >= MIN_DOT)."""
    block_g: int           # query heads per KV head, padded to a power of 2 >= 16
    block_d: int           # head_dim padded to a power of 2 >= 16
    block_n: int           # tokens per tile (a power of 2 >= 16)
    num_splits: int        # split-K pieces per sequence (1: no reduce kernel)
    min_split_tokens: int  # no piece shorter (a multiple of block_n); pieces follow each length
    upcast: bool           # dot operands in fp32 (fp32 caches; bf16 in the interpreter)
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_g", "block_d", "block_n"):
            v = getattr(self, name)
            if v < MIN_DOT or v & (v - 1):
                raise ValueError(f"DecodeLaunch.{name}={v}: must be a power of 2 >= {MIN_DOT}")
        if self.num_splits < 1 or self.min_split_tokens < self.block_n or \
                self.min_split_tokens % self.block_n:
            raise ValueError(f"DecodeLaunch: num_splits={self.num_splits} must be >= 1 and "
                             f"min_split_tokens={self.min_split_tokens} a positive multiple of "
                             f"block_n={self.block_n}")


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter: any fixed number keeps the choice deterministic


def choose_launch(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                  num_splits: int | None = None) -> DecodeLaunch:
    """Pick tile sizes and the split count from shapes only (no host sync on context_lens).

    Without ``num_splits``, ``B * Hkv * splits`` programs cover about two waves of the GPU's
    SMs, four when ``B * Hkv`` alone is fewer programs than SMs (or the power of two below
    that count when its last wave is fuller: ``_fill_waves``), and no more splits than MIN_SPLIT_TOKENS-token
    pieces of the block table's capacity (``max_blocks * block_size``).
    The kernel cuts each sequence's own context into that many pieces, none shorter than
    MIN_SPLIT_TOKENS (``num_splits`` given: one tile), so shorter sequences fill fewer.
    The four waves and 128-token pieces come from ``bench/kernels.py --sweep`` on an H200: on
    every shape where two waves of 256-token pieces was not the fastest choice, the fastest
    split more (docs/benchmarks.md)."""
    bsz, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    block_d = max(MIN_DOT, _next_pow2(head_dim))
    block_g = max(MIN_DOT, _next_pow2(num_heads // num_kv_heads))
    block_n = 64 if block_d <= 128 else 32
    capacity = max(1, block_tables.shape[1] * block_size)
    if num_splits is None:
        programs, sms = max(1, bsz * num_kv_heads), _sm_count(q.device)
        waves = 4 if programs < sms else 2
        most = max(1, min(-(-capacity // MIN_SPLIT_TOKENS), MAX_SPLITS))
        num_splits = _fill_waves(programs, sms, -(-waves * sms // programs), most)
        # a full-length sequence's pieces are whole tiles: drop splits that rounding leaves empty
        piece = -(-capacity // num_splits)
        num_splits = -(-capacity // (-(-piece // block_n) * block_n))
        min_split_tokens = -(-MIN_SPLIT_TOKENS // block_n) * block_n
    elif isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"paged_decode_attention: num_splits={num_splits!r} must be an int >= 1")
    else:
        min_split_tokens = block_n
    # fp32 caches dot in fp32; the interpreter's bf16 dot is wrong (numpy has no bf16), its
    # fp16 dot is fine, so fp16 runs the GPU's native-dtype path there too
    upcast = k_cache.dtype == torch.float32 or (interpreting() and k_cache.dtype == torch.bfloat16)
    num_warps = 8 if upcast and block_d >= 128 else 4  # fp32 tiles: halve registers per thread
    return DecodeLaunch(block_g, block_d, block_n, num_splits, min_split_tokens, upcast, num_warps)


def _fill_waves(programs: int, sms: int, want: int, most: int) -> int:
    """``want`` splits, or the power of two below it where the last wave of ``programs *
    splits`` programs is fuller: time goes as the number of waves over the splits (each
    program's share of the work). On an H200 (132 SMs), 8 sequences x 8 KV heads aimed at 4
    waves want 9 splits, 4.4 waves: the fifth wave runs a third full and took 343 us against
    260 us for 8 splits (3.9 waves) in two sweeps (sessions 16 and 36). Never more splits than
    ``want`` (each split adds partial results to write and reduce); a tie keeps ``want``."""
    want = min(want, most)
    low = 1 << (want.bit_length() - 1)
    return low if -(-programs * low // sms) / low < -(-programs * want // sms) / want else want


def check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
    """Raise ValueError naming the argument whose shape/dtype/device breaks the contract."""
    if q.dim() != 3:
        raise ValueError(f"paged_decode_attention: q must be [B, H, head_dim], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("paged_decode_attention: k_cache and v_cache must both be "
                         "[num_blocks, block_size, num_kv_heads, head_dim]; got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    bsz, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"paged_decode_attention: q head_dim {head_dim} != cache head_dim "
                         f"{k_cache.shape[3]}")
    if min(num_heads, num_kv_heads, head_dim) < 1:
        raise ValueError(f"paged_decode_attention: q {tuple(q.shape)} and k_cache {tuple(k_cache.shape)} need "
                         "at least one head and head_dim >= 1")
    if num_heads % num_kv_heads:
        raise ValueError(f"paged_decode_attention: {num_heads} query heads is not a multiple "
                         f"of {num_kv_heads} KV heads")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"paged_decode_attention: dtypes differ: q {q.dtype}, k_cache "
                         f"{k_cache.dtype}, v_cache {v_cache.dtype}")
    if q.dtype not in DTYPES:
        raise ValueError(f"paged_decode_attention: dtype {q.dtype} is not supported (only "
                         f"{', '.join(str(d) for d in DTYPES)}; no fp8 KV cache)")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != bsz:
        raise ValueError(f"paged_decode_attention: block_tables must be int32 [B={bsz}, "
                         f"max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}")
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:  # rows may be strided, not their entries
        raise ValueError(f"paged_decode_attention: block_tables rows must be contiguous, got stride "
                         f"{block_tables.stride()}")
    if context_lens.dtype != torch.int32 or tuple(context_lens.shape) != (bsz,):
        raise ValueError(f"paged_decode_attention: context_lens must be int32 [B={bsz}], got "
                         f"{context_lens.dtype} {tuple(context_lens.shape)}")
    if bsz > 1 and context_lens.stride(0) != 1:
        raise ValueError(f"paged_decode_attention: context_lens must be contiguous, got stride "
                         f"{context_lens.stride()}")
    devs = {t.device for t in (q, k_cache, v_cache, block_tables, context_lens)}
    if len(devs) > 1:
        raise ValueError(f"paged_decode_attention: inputs on several devices: {sorted(map(str, devs))}")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None) -> torch.Tensor:
    """Triton paged GQA decode attention. q: [B, H, Dh] -> [B, H, Dh] (q's dtype).

    ``num_splits`` splits each sequence's context into that many pieces (split-K, combined by
    log-sum-exp); None picks it from the shapes (``choose_launch``). A sequence with
    ``context_lens == 0`` gets zeros."""
    check_inputs(q, k_cache, v_cache, block_tables, context_lens)
    if not triton_usable(q.device):
        why = ("triton is not installed (pip install streamrl[kernels])" if not triton_available()
               else f"tensors are on {q.device}: triton needs CUDA, or TRITON_INTERPRET=1 set "
                    "before the first kernel call")
        raise RuntimeError(f"paged_decode_attention: cannot run the Triton kernel: {why}; "
                           "use attention_backend='torch'")
    if (why := interpreter_mismatch()) is not None:
        raise RuntimeError(f"paged_decode_attention: {why}")
    from kernels import _paged_decode_triton  # lazy: see kernels/__init__.py

    cfg = choose_launch(q, k_cache, block_tables, num_splits)
    return _paged_decode_triton.launch(q, k_cache, v_cache, block_tables, context_lens,
                                       float(scale), cfg)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, num_splits: int | None = None) -> torch.Tensor:
    """Torch reference: gather each sequence's tokens, softmax in fp32. Same signature and
    result as ``paged_decode_attention`` (``num_splits`` is ignored). Loops over the batch and
    reads ``context_lens`` on the host: for tests and CPU decode, not for speed."""
    check_inputs(q, k_cache, v_cache, block_tables, context_lens)
    bsz, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(bsz, num_heads, head_dim, dtype=torch.float32, device=q.device)
    lens = context_lens.tolist()
    room = block_tables.shape[1] * block_size
    bad = [(b, n) for b, n in enumerate(lens) if not 0 <= n <= room]
    if bad:  # the kernel cannot check this without a host sync: there it is undefined
        b, n = bad[0]
        raise ValueError(f"paged_decode_attention: context_lens[{b}] = {n} is outside [0, {room}] (the block "
                         f"table's {block_tables.shape[1]} blocks of {block_size} tokens)")
    for b, n in enumerate(lens):
        if n == 0:
            continue
        blocks = block_tables[b, :math.ceil(n / block_size)].long()
        # k, v: [n, H, Dh] (each KV head repeated for its group of query heads)
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale  # [H, n]
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v)
    return out.to(q.dtype)


__all__ = ["paged_decode_attention", "paged_decode_attention_ref", "choose_launch",
           "DecodeLaunch", "check_inputs"]
