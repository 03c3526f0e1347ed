"""Fused elementwise ops of the engine's forward for CPUs (C++: ``csrc/fused_ops.cpp``,
compiled on first use).

Used by ``FusedForward`` with the "cpu" attention backend (which needs the same toolchain):
RMSNorm in one pass over each row, SwiGLU's ``silu(gate) * up`` in one pass, RoPE on the
q and k columns of the fused qkv projection in place (no copies; the attention kernel reads
q as a row-strided view). Each is one parallel loop over tokens (``at::parallel_for``);
torch composes the same maths from 3-6 passes and temporaries. Math in fp32; fp32, bf16
and fp16 tensors. ``write_kv`` puts a step's new K/V rows into their paged-cache slots (a
row copy each; ``index_copy_`` from the strided k/v views took ~25 us a call); ``sample``
is the sampler's one-pass draw (``sampler.py``). Plus ``linear``: a decode-sized GEMM whose
output columns are split into one single-threaded GEMM per torch thread (MKL's own
threading of an M=64 GEMM scales ~1.3x on 2 threads).
"""
from __future__ import annotations

from workers.generation.cpp_build import build, csrc

_SOURCE = csrc("vexp.h", "fused_ops.cpp")


def load():
    """The compiled extension (built on first call, then cached on disk and in memory)."""
    return build("streamrl_fused_ops_cpu", _SOURCE, ("rms_norm", "silu_mul", "rope_", "linear", "sample",
                                                        "write_kv"),
                 "engine: fused CPU ops")
