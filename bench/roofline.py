"""This machine's limits for a generation workload (the roofline of bench/engine_throughput.py).

Two measured rates: the fp32 matmul FLOP/s and the memory read bandwidth (a reduction over a
buffer far larger than any last-level cache), both on the run's device, threads and clock.
Two counts of the work: its forward FLOPs, and the bytes its decode steps must read, that is,
each step's K/V rows (every context token, every layer) and the model's weights once per step.
From them, two floors on the run's time:

* ``overlap_s = max(compute_s, memory_s)``: arithmetic and memory traffic fully overlapped;
* ``serial_s = compute_s + memory_s``: none overlapped, as in a decode step whose GEMMs
  (compute-bound) and attention (memory-bound) run one after the other on all cores.

The byte count is a lower bound where the K/V and weights outgrow the last-level cache (each
step then reads them from DRAM again): workload (a) past its first few steps, and (c). The
prefill's own traffic is not counted, and the step count is its lower bound (the batch never
holds more than ``batch`` sequences), so the floors stay floors. The compute rate is a
matmul's in the work's dtype (bf16 for workload (c): on a CPU with AVX512-BF16 or AMX, its dot
products outrun fp32's).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from workers.model import ModelConfig

Work = list[tuple[torch.Tensor, int]]  # (prompt ids, forced new tokens)


def _best_rate(op: Callable[[], None], amount: float, seconds: float, now: Callable[[], float],
               sync: Callable[[], None]) -> float:
    """Best ``amount / seconds`` of repeated ``op`` calls over ``seconds`` (after a warm-up):
    on a shared machine the best run is the machine, the others are its neighbours."""
    op()
    sync()
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t = now()
        op()
        sync()
        best = max(best, amount / max(now() - t, 1e-9))
    return best


def matmul_flops(device: str, now: Callable[[], float], sync: Callable[[], None],
                 n: int = 1024, seconds: float = 1.0, dtype: torch.dtype = torch.float32) -> float:
    """Measured matmul FLOP/s in ``dtype`` (fp32: on CUDA with TF32 off, i.e. true fp32)."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return _best_rate(lambda: a @ b, 2 * n ** 3, seconds, now, sync)


def read_bandwidth(device: str, now: Callable[[], float], sync: Callable[[], None],
                   mib: int = 256, seconds: float = 1.0) -> float:
    """Measured memory read bytes/s: ``sum`` over an fp32 buffer of ``mib`` MiB (8x this
    machine's 32 MiB L3), the rate at which a streaming reader on all threads gets data."""
    x = torch.ones(mib * 2 ** 18, device=device)
    return _best_rate(lambda: x.sum(), x.numel() * 4, seconds, now, sync)


def _layer_matmul_params(cfg: ModelConfig) -> int:
    """One decoder layer's GEMM weights: q, k, v, o projections and the three MLP ones."""
    d, dh = cfg.hidden_size, cfg.dim_head
    return d * dh * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2) + 3 * d * cfg.intermediate_size


def model_flops(cfg: ModelConfig, work: Work) -> float:
    """Forward FLOPs of the work: 2 x matmul params per token (lm_head only for generated
    tokens), plus attention (QK^T and PV over the context)."""
    d, dh, per_layer = cfg.hidden_size, cfg.dim_head, _layer_matmul_params(cfg)
    total = 0.0
    for prompt, n in work:
        p = len(prompt)
        tokens = p + n - 1
        ctx_sum = tokens * (tokens + 1) / 2  # each token attends to all before it
        total += 2 * per_layer * cfg.num_hidden_layers * tokens + 2 * d * cfg.vocab_size * n
        total += 4 * cfg.num_hidden_layers * cfg.num_attention_heads * dh * ctx_sum
    return total


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters a decode step reads as GEMM weights: every layer's projections and lm_head
    (the embedding is a gather of one row per token; norms and biases are negligible)."""
    return _layer_matmul_params(cfg) * cfg.num_hidden_layers + cfg.hidden_size * cfg.vocab_size


def decode_steps(work: Work, batch: int) -> int:
    """The fewest decode steps the work can take: the longest sample's, or the generated tokens
    spread over full batches (a sample's first token comes from its prefill)."""
    rest = [n - 1 for _, n in work]
    return max(max(rest, default=0), -(-sum(rest) // batch))


def decode_bytes(cfg: ModelConfig, work: Work, batch: int, weight_bytes: int, kv_bytes: int) -> tuple[float, float]:
    """(K/V bytes, weight bytes) the work's decode steps read, ``weight_bytes`` and
    ``kv_bytes`` per element. Generated token j (1-based) of a prompt of p tokens, j >= 2, is
    decoded at position p + j - 2 and attends to p + j - 1 rows of K and V in every layer."""
    row = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.dim_head * kv_bytes
    rows = 0
    for prompt, n in work:
        p = len(prompt)
        rows += (p + 1 + p + n - 1) * (n - 1) // 2  # sum of p+1 .. p+n-1
    return float(rows * row), float(matmul_params(cfg) * weight_bytes * decode_steps(work, batch))


@dataclass(frozen=True)
class Roofline:
    """A workload's floors on this machine (seconds) and the tokens/s they allow."""
    tokens: int
    compute_s: float
    kv_bytes: float
    weight_bytes: float
    memory_s: float

    @property
    def overlap_s(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def serial_s(self) -> float:
        return self.compute_s + self.memory_s

    @property
    def overlap_tok_s(self) -> float:
        return self.tokens / self.overlap_s

    @property
    def serial_tok_s(self) -> float:
        return self.tokens / self.serial_s


def roofline(cfg: ModelConfig, work: Work, batch: int, dtype: torch.dtype, kv_dtype: torch.dtype,
             flops_per_s: float, bytes_per_s: float) -> Roofline:
    if flops_per_s <= 0 or bytes_per_s <= 0:
        raise ValueError(f"roofline: rates must be positive, got {flops_per_s} FLOP/s and {bytes_per_s} B/s")
    kv, w = decode_bytes(cfg, work, batch, dtype.itemsize, kv_dtype.itemsize)
    return Roofline(tokens=sum(n for _, n in work), compute_s=model_flops(cfg, work) / flops_per_s,
                    kv_bytes=kv, weight_bytes=w, memory_s=(kv + w) / bytes_per_s)
