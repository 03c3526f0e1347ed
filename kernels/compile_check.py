"""Compile the Triton kernels for NVIDIA targets on a machine without a GPU.

The interpreter accepts shapes a GPU compile rejects (e.g. ``tl.dot`` dims < 16), so passing
interpreter tests says nothing about compiling. This runs the real compiler pipeline
(TTIR -> TTGIR -> LLVM -> PTX -> cubin via the ptxas bundled with triton) on exactly the
launches ``paged_decode`` would make (built on the meta device), specialised the way triton's
JIT specialises at run time (ints equal to 1 become constants; pointers and ints divisible by
16 get the divisibility hint), and reports registers, spills and shared memory from the
bundled cuobjdump. No CUDA device or driver is needed.

Must run in a process where ``TRITON_INTERPRET`` is unset or 0 (``@triton.jit`` then yields a
compilable function). Usage::

    python -m kernels.compile_check [80 90 ...]   # JSON line per kernel and variant
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch

from kernels import interpreting, triton_available
from kernels.paged_decode import choose_launch

_TRITON_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                 torch.int32: "i32", torch.int64: "i64"}


@dataclass(frozen=True)
class Variant:
    """One decode shape: cache dtype, head_dim, GQA group, block size, split count."""
    dtype: torch.dtype
    head_dim: int
    group: int
    block_size: int
    num_splits: int = 4
    upcast: bool | None = None  # None: what choose_launch picks for a CUDA cache of dtype


DEFAULT_VARIANTS = (
    Variant(torch.bfloat16, 128, 4, 16),           # Qwen2.5-7B-like
    Variant(torch.bfloat16, 128, 8, 16, 1),        # no split: final output from one kernel
    Variant(torch.float16, 64, 8, 32),
    Variant(torch.float32, 128, 1, 16),
    Variant(torch.bfloat16, 64, 2, 32),            # Qwen2.5-0.5B-like (GQA 7 pads the same)
)


def resource_usage(cubin: bytes) -> dict:
    """Registers per thread and spill/stack bytes of a cubin, from the cuobjdump bundled with
    triton ({} if it is missing)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                              text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text)
    return dict(registers=int(m[1]), stack_bytes=int(m[2]), local_bytes=int(m[3])) if m else {}


def specialise(fn, args: tuple, consts: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) for ASTSource, as triton's JIT would build them."""
    signature, constexprs, attrs = {}, dict(consts), {}
    for i, (name, value) in enumerate(zip(fn.arg_names, args)):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TRITON_DTYPE[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 256-byte aligned
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:
            constexprs[name] = 1
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
    return {n: signature[n] for n in fn.arg_names}, constexprs, attrs


def compile_variant(v: Variant, capability: int) -> list[dict]:
    """Compile every launch of one variant (batch 8, 2 KV heads, 4096-token table) for
    ``sm_<capability>``; one record per kernel."""
    from kernels import _paged_decode_triton as impl

    meta = torch.device("meta")
    q = torch.empty(8, 2 * v.group, v.head_dim, dtype=v.dtype, device=meta)
    k = torch.empty(4096, v.block_size, 2, v.head_dim, dtype=v.dtype, device=meta)
    tables = torch.empty(8, 4096 // v.block_size, dtype=torch.int32, device=meta)
    lens = torch.empty(8, dtype=torch.int32, device=meta)
    cfg = choose_launch(q, k, tables, v.num_splits)
    upcast = (v.dtype == torch.float32) if v.upcast is None else v.upcast
    cfg = type(cfg)(**{**cfg.__dict__, "upcast": upcast})
    _, calls = impl.plan(q, k, k, tables, lens, 0.1, cfg)
    return [dict(head_dim=v.head_dim, group=v.group, block_size=v.block_size,
                 splits=cfg.num_splits, upcast=upcast, **_compile(call, capability, v.dtype))
            for call in calls]


def compile_norm_rope(capability: int, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Compile the fused RMSNorm (Qwen2.5-0.5B width, with residual) and rotary (14 heads x 64)
    launches for ``sm_<capability>``."""
    from kernels import _norm_rope_triton as impl

    meta = torch.device("meta")
    x = torch.empty(64, 896, dtype=dtype, device=meta)
    w = torch.empty(896, dtype=dtype, device=meta)
    qk = torch.empty(64, 14, 64, dtype=dtype, device=meta)
    cos = torch.empty(64, 64, dtype=dtype, device=meta)
    calls = [impl.rms_norm_plan(x, w, 1e-6, x)[-1], impl.rotary_plan(qk, cos, cos)[-1]]
    return [dict(shape=shape, **rec) for shape, call in zip(("[64, 896]", "[64, 14, 64]"), calls)
            for rec in [_compile(call, capability, dtype)]]


def _compile(call, capability: int, dtype: torch.dtype) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, consts, attrs = specialise(call.fn, call.args, call.consts)
    kernel = triton.compile(ASTSource(fn=call.fn, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", capability, 32), options=call.options)
    return dict(kernel=call.fn.__name__, sm=capability, dtype=_TRITON_DTYPE[dtype],
                num_warps=call.options.get("num_warps", 4), shared_bytes=kernel.metadata.shared,
                cubin_bytes=len(kernel.asm["cubin"]), **resource_usage(kernel.asm["cubin"]))


def main(argv: list[str] | None = None) -> int:
    if not triton_available():
        print(json.dumps({"skipped": "triton is not installed: bash scripts/setup.sh test,kernels "
                                     "(or pip install -e .[kernels])"}))
        return 1
    if interpreting():
        print(json.dumps({"skipped": "TRITON_INTERPRET is set: unset it to compile"}))
        return 1
    caps = [int(a) for a in (argv if argv is not None else sys.argv[1:])] or [80, 90]
    for cap in caps:
        for v in DEFAULT_VARIANTS:
            for rec in compile_variant(v, cap):
                print(json.dumps(rec), flush=True)
        for rec in compile_norm_rope(cap):
            print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
