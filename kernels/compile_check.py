"""Compile the Triton kernels for NVIDIA targets on a machine without a GPU.

The interpreter accepts shapes a GPU compile rejects (e.g. ``tl.dot`` dims < 16), so passing
interpreter tests says nothing about compiling. This runs the real compiler pipeline
(TTIR -> TTGIR -> LLVM -> PTX -> cubin via the ptxas bundled with triton) for given targets
and reports registers/shared memory; no CUDA device or driver is needed.

Must run in a process where ``TRITON_INTERPRET`` is unset or 0 (``@triton.jit`` then yields a
compilable function). Usage::

    python -m kernels.compile_check            # JSON line per kernel variant, sm_80 and sm_90
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import torch

from kernels import interpreting
from kernels.paged_decode import choose_launch

_TRITON_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class Variant:
    """One specialisation of the decode kernels."""
    dtype: torch.dtype
    head_dim: int
    group: int
    block_size: int
    upcast: bool | None = None  # None: what choose_launch picks for a CUDA cache of dtype


DEFAULT_VARIANTS = (
    Variant(torch.bfloat16, 128, 4, 16),
    Variant(torch.float16, 64, 8, 32),
    Variant(torch.float32, 128, 1, 16),
    Variant(torch.bfloat16, 64, 2, 16, upcast=True),  # the interpreter's choice, compiled
)


def _signature(fn, ptr_types: dict[str, str], scalars: dict[str, str], consts: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptr_types:
            sig[name] = ptr_types[name]
        else:
            sig[name] = scalars.get(name, "i32")  # strides and counts
    return sig


def compile_variant(v: Variant, capability: int) -> list[dict]:
    """Compile the partial (split) kernel and the reduce kernel for one variant; returns one
    record per kernel with registers, spills and shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import _paged_decode_triton as m

    q = torch.empty(1, v.group * 2, v.head_dim, dtype=v.dtype)
    k = torch.empty(4, v.block_size, 2, v.head_dim, dtype=v.dtype)
    cfg = choose_launch(q, k, torch.empty(1, 256, dtype=torch.int32), num_splits=4)
    upcast = (v.dtype == torch.float32) if v.upcast is None else v.upcast
    t = _TRITON_DTYPE[v.dtype]
    partial_consts = dict(GROUP=v.group, BLOCK_G=cfg.block_g, HEAD_DIM=v.head_dim,
                          BLOCK_D=cfg.block_d, BLOCK_SIZE=v.block_size, BLOCK_N=cfg.block_n,
                          UPCAST=upcast, WRITE_LSE=True)
    partial_ptrs = dict(q_ptr=f"*{t}", k_ptr=f"*{t}", v_ptr=f"*{t}", bt_ptr="*i32",
                        lens_ptr="*i32", o_ptr="*fp32", lse_ptr="*fp32")
    reduce_consts = dict(HEAD_DIM=v.head_dim, BLOCK_D=cfg.block_d, BLOCK_S=4)
    reduce_ptrs = dict(o_part_ptr="*fp32", lse_ptr="*fp32", out_ptr=f"*{t}")
    records = []
    for fn, ptrs, consts, extra in (
            (m._paged_decode_partial, partial_ptrs, partial_consts, {"num_warps": cfg.num_warps}),
            (m._paged_decode_reduce, reduce_ptrs, reduce_consts, {})):
        sig = _signature(fn, ptrs, {"qk_scale": "fp32"}, consts)
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                                target=GPUTarget("cuda", capability, 32), options=extra)
        records.append(dict(kernel=fn.__name__, sm=capability, dtype=t, head_dim=v.head_dim,
                            group=v.group, block_size=v.block_size, upcast=upcast,
                            shared_bytes=kernel.metadata.shared,
                            ptx_lines=kernel.asm["ptx"].count("\n"),
                            cubin_bytes=len(kernel.asm["cubin"])))
    return records


def main(argv: list[str] | None = None) -> int:
    if interpreting():
        print(json.dumps({"skipped": "TRITON_INTERPRET is set: unset it to compile"}))
        return 1
    caps = [int(a) for a in (argv if argv is not None else sys.argv[1:])] or [80, 90]
    for cap in caps:
        for v in DEFAULT_VARIANTS:
            for rec in compile_variant(v, cap):
                print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
