"""Paged GQA decode attention on CUDA: achieved memory bandwidth vs the GPU's peak, vs torch
SDPA on a dense cache, vs the engine's torch paged path, vs vLLM's Triton kernel (if present).

    python bench/kernels.py            # full sweep (~1-2 min on an H100-class GPU)
    python bench/kernels.py --quick    # a few shapes (bench/gpu_check.sh)

One JSON line per (shape, implementation); the last line is the summary with keys
``device, peak_gbps, dtype, triton_median_pct_peak, triton_max_gbps, triton_vs_sdpa_dense,
triton_vs_torch_paged, triton_vs_vllm``, the same from CUDA-graph replays
(``triton_median_pct_peak_graph, triton_vs_sdpa_dense_graph, triton_vs_torch_paged_graph``:
the GPU's time without the host's launch cost, which dominates small shapes),
``rms_norm_vs_torch, rotary_vs_torch, wide_table_vs_capacity_pieces, wide_table_vs_tight,
vllm`` (speedups are time ratios, geometric means over shapes for attention; >1 means ours is
faster; docs/benchmarks.md says what each is). Also times the fused RMSNorm (+ residual) and
rotary kernels against the model's eager torch ops.
On a machine without CUDA it prints one JSON line saying it skipped, and why.

Bytes counted per call: K and V of every cached token (the kernel's compulsory traffic) plus
q, out and block tables. The dense SDPA competitor reads a contiguous [B, Hkv, L, Dh] cache
(no paging, no gather: a bound for what torch can do); "torch_paged" is the engine's torch
decode path (gather blocks with index_select, then SDPA).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F

# this file is bench/kernels.py: keep `import kernels` from finding itself instead of the package
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

from bench.jsonline import json_line  # noqa: E402  (bench/ is off the path: a namespace package)

# HBM peak, GB/s, by a substring of torch.cuda.get_device_name() (most specific first: "GH200"
# holds "H200")
PEAK_GBPS = [("GH200", 4000), ("H200", 4800), ("H100 NVL", 3900), ("H100 PCIe", 2000),
             ("H100", 3350), ("H800", 3350), ("B200", 8000), ("A100-SXM4-80GB", 2039),
             ("A100-PCIE-80GB", 1935), ("A100 80GB PCIe", 1935), ("A100", 1555), ("A800", 2039),
             ("L40S", 864), ("L40", 864), ("A10G", 600), ("A10", 600), ("L4", 300),
             ("RTX 4090", 1008), ("RTX 3090", 936), ("V100", 900), ("T4", 320), ("MI300X", 5300)]

# (name, query heads, kv heads, head_dim)
MODELS = [("qwen2.5-0.5b", 14, 2, 64), ("qwen2.5-7b", 28, 4, 128), ("llama3-8b", 32, 8, 128)]
FULL_SHAPES = [(1, 4096), (8, 4096), (64, 1024), (64, 4096), (256, 1024), (256, 2048), (8, 32768)]
QUICK_SHAPES = [(8, 4096), (64, 2048)]
BLOCK_SIZE = 16


def peak_gbps(name: str) -> float | None:
    return next((p for key, p in PEAK_GBPS if key in name), None)


def paged_inputs(bsz, heads, kv_heads, head_dim, lens, dtype, dev, seed=0):
    """q and a paged cache whose blocks are scattered at random (a fragmented cache)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    nblk = [-(-n // BLOCK_SIZE) for n in lens]
    total = sum(nblk)
    k = torch.randn(total, BLOCK_SIZE, kv_heads, head_dim, device=dev, dtype=dtype, generator=g)
    v = torch.randn_like(k)
    perm = torch.randperm(total, device=dev, generator=g).int()
    tables = torch.zeros(bsz, max(nblk), dtype=torch.int32, device=dev)
    used = 0
    for b, n in enumerate(nblk):
        tables[b, :n] = perm[used:used + n]
        used += n
    q = torch.randn(bsz, heads, head_dim, device=dev, dtype=dtype, generator=g)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32, device=dev)


def torch_paged(q, k, v, tables, lens, scale):
    """The engine's torch decode path: gather each sequence's blocks, one masked SDPA."""
    bsz, heads, dh = q.shape
    hkv = k.shape[2]
    keys = k[tables.long()].view(bsz, -1, hkv, dh).transpose(1, 2)  # [B, Hkv, Lk, Dh]
    vals = v[tables.long()].view(bsz, -1, hkv, dh).transpose(1, 2)
    mask = (torch.arange(keys.shape[2], device=q.device)[None] < lens[:, None])[:, None, None]
    return F.scaled_dot_product_attention(q[:, :, None], keys, vals, attn_mask=mask, scale=scale,
                                          enable_gqa=heads != hkv)[:, :, 0]


def vllm_kernel():
    """vLLM's Triton paged attention (the TRITON_ATTN backend's kernel), or a reason it's absent."""
    for mod in ("vllm.v1.attention.ops.triton_unified_attention",
                "vllm.attention.ops.triton_unified_attention"):
        try:
            return __import__(mod, fromlist=["unified_attention"]).unified_attention, mod
        except Exception as e:  # ImportError, or vLLM failing to initialise
            why = f"{type(e).__name__}: {e}"
    return None, why


def run_vllm(fn, q, k, v, tables, lens, scale, max_len):
    bsz, heads, dh = q.shape
    out = torch.empty_like(q)
    one = torch.ones(1, device=q.device, dtype=torch.float32)
    cu_q = torch.arange(bsz + 1, device=q.device, dtype=torch.int32)
    segs = 16
    seg_o = torch.empty(bsz, heads, segs, 1 << (dh - 1).bit_length(), device=q.device,
                        dtype=torch.float32)
    seg_m = torch.empty(bsz, heads, segs, device=q.device, dtype=torch.float32)
    seg_e = torch.empty_like(seg_m)

    def call():
        fn(q, k, v, out, cu_q, 1, lens, max_len, scale, True, (-1, -1), tables, 0, None, one, one,
           seq_threshold_3D=bsz, num_par_softmax_segments=segs, softmax_segm_output=seg_o,
           softmax_segm_max=seg_m, softmax_segm_expsum=seg_e)
        return out
    return call


def measure(rec: dict, fn, ref, nbytes: int, peak, rows: list) -> None:
    """Time ``fn`` (its max error against ``ref`` when given), print ``rec`` as a JSON line and
    keep it in ``rows`` when it ran; a competitor's error is printed, never fatal."""
    import triton.testing

    try:
        out = fn()
        if ref is not None:
            rec["max_err"] = float((out.float() - ref).abs().max())
        ms = triton.testing.do_bench(fn, warmup=10, rep=50)
    except Exception as e:  # a competitor's API drift must not kill the run
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
        print(json_line(rec), flush=True)
        return
    gbps = nbytes / (ms * 1e-3) / 1e9
    rec.update(us=round(ms * 1e3, 2), gbps=round(gbps, 1),
               pct_peak=round(100 * gbps / peak, 1) if peak else None)
    try:  # replayed from a CUDA graph: the GPU's time alone, without the host's launch cost
        ms_g = triton.testing.do_bench_cudagraph(fn, rep=50)
        gbps_g = nbytes / (ms_g * 1e-3) / 1e9
        rec.update(us_graph=round(ms_g * 1e3, 2), gbps_graph=round(gbps_g, 1),
                   pct_peak_graph=round(100 * gbps_g / peak, 1) if peak else None)
    except Exception as e:
        rec["graph_error"] = f"{type(e).__name__}: {e}"[:200]
    print(json_line(rec), flush=True)
    rows.append(rec)


def bench_shape(model, bsz, ctx, dtype, dev, peak, vllm_fn, ragged=False):
    from kernels.paged_decode import paged_decode_attention, paged_decode_attention_ref

    name, heads, kv_heads, dh = model
    g = torch.Generator().manual_seed(bsz * 7 + ctx)
    lens = (torch.randint(1, 2 * ctx, (bsz,), generator=g).tolist() if ragged else [ctx] * bsz)
    q, k, v, tables, lens_t = paged_inputs(bsz, heads, kv_heads, dh, lens, dtype, dev)
    scale = dh ** -0.5
    esize = q.element_size()
    kv_bytes = 2 * sum(lens) * kv_heads * dh * esize
    io_bytes = kv_bytes + 2 * q.numel() * esize + tables.numel() * 4
    ref = paged_decode_attention_ref(q, k, v, tables, lens_t, scale).float()

    impls = {"triton": lambda: paged_decode_attention(q, k, v, tables, lens_t, scale),
             "torch_paged": lambda: torch_paged(q, k, v, tables, lens_t, scale)}
    if not ragged:
        kd = torch.randn(bsz, kv_heads, ctx, dh, device=dev, dtype=dtype)  # [B, Hkv, L, Dh]
        vd = torch.randn_like(kd)
        impls["sdpa_dense"] = lambda: F.scaled_dot_product_attention(
            q[:, :, None], kd, vd, scale=scale, enable_gqa=heads != kv_heads)
    if vllm_fn is not None:
        impls["vllm_triton"] = run_vllm(vllm_fn, q, k, v, tables, lens_t, scale, max(lens))
    rows = []
    for impl, fn in impls.items():
        rec = dict(bench="kernels", model=name, batch=bsz, ctx=ctx, ragged=ragged,
                   dtype=str(dtype)[6:], impl=impl)
        # sdpa_dense reads its own dense cache: no error against the paged reference
        measure(rec, fn, None if impl == "sdpa_dense" else ref, io_bytes, peak, rows)
    del q, k, v, tables, impls
    torch.cuda.empty_cache()
    return rows


def sweep_launch(model, bsz, ctx, dtype, dev, ragged=False) -> list[dict]:
    """Time the decode kernel over launch choices (split count, tile width, warps) for one
    shape, from CUDA-graph replays; one JSON line with the heuristic's choice (``choose_launch``)
    against the best one found. What ``choose_launch`` should pick is read off these lines."""
    import triton.testing

    from kernels import _paged_decode_triton
    from kernels.paged_decode import MIN_SPLIT_TOKENS, DecodeLaunch, choose_launch, paged_decode_attention_ref

    name, heads, kv_heads, dh = model
    g = torch.Generator().manual_seed(bsz * 7 + ctx)
    lens = (torch.randint(1, 2 * ctx, (bsz,), generator=g).tolist() if ragged else [ctx] * bsz)
    q, k, v, tables, lens_t = paged_inputs(bsz, heads, kv_heads, dh, lens, dtype, dev)
    scale = dh ** -0.5
    ref = paged_decode_attention_ref(q, k, v, tables, lens_t, scale).float()
    capacity = tables.shape[1] * BLOCK_SIZE
    heur = choose_launch(q, k, tables)
    cands = {heur}
    for block_n in (32, 64):
        for warps in (4, 8):
            least = -(-MIN_SPLIT_TOKENS // block_n) * block_n  # shortest piece, whole tiles
            for splits in (1, 2, 4, 8, 16, 32, 64):
                if splits > 1 and least * (splits - 1) >= capacity:
                    continue  # trailing splits past every sequence's end
                cands.add(DecodeLaunch(heur.block_g, heur.block_d, block_n, splits, least,
                                       heur.upcast, warps))
    times = {}
    for cfg in cands:
        fn = lambda cfg=cfg: _paged_decode_triton.launch(q, k, v, tables, lens_t, scale, cfg)  # noqa: E731
        try:
            err = float((fn().float() - ref).abs().max())
            if err > 0.05:
                raise AssertionError(f"max error {err}")
            times[cfg] = triton.testing.do_bench_cudagraph(fn, rep=20) * 1e3
        except Exception as e:
            print(json_line(dict(bench="kernels_sweep", model=name, batch=bsz, ctx=ctx,
                                 config=str(cfg), error=f"{type(e).__name__}: {e}"[:200])))
    best = min(times, key=times.get)
    kv_bytes = 2 * sum(lens) * kv_heads * dh * q.element_size()
    rec = dict(bench="kernels_sweep", model=name, batch=bsz, ctx=ctx, ragged=ragged,
               heuristic=dict(splits=heur.num_splits, block_n=heur.block_n, warps=heur.num_warps,
                              us=round(times.get(heur, float("nan")), 2)),
               best=dict(splits=best.num_splits, block_n=best.block_n, warps=best.num_warps,
                         us=round(times[best], 2)),
               heuristic_over_best=round(times.get(heur, float("nan")) / times[best], 3),
               best_gbps=round(kv_bytes / (times[best] * 1e-6) / 1e9, 1), tried=len(times),
               # every candidate, so another rule can be judged from this line alone
               all=sorted([c.num_splits, c.block_n, c.num_warps, round(t, 2)] for c, t in times.items()))
    print(json_line(rec), flush=True)
    del q, k, v, tables
    torch.cuda.empty_cache()
    return [rec]


def bench_wide_table(model, bsz, ctx, width, dtype, dev, peak) -> list[dict]:
    """The same ``bsz`` x ``ctx`` contexts with a block table ``width`` tokens wide, as the
    engine's CUDA graphs pass it (sized for ``max_model_len``), from graph replays:
    ``triton`` (choose_launch; the kernel cuts each sequence's own length into the splits),
    ``triton_capacity_pieces`` (the same split count with pieces sized from the table's width,
    what the kernel did before session 8: short sequences fill few splits) and
    ``triton_tight`` (the table cut to the contexts: the best case)."""
    import dataclasses

    from kernels import _paged_decode_triton
    from kernels.paged_decode import choose_launch, paged_decode_attention_ref

    name, heads, kv_heads, dh = model
    q, k, v, tight, lens_t = paged_inputs(bsz, heads, kv_heads, dh, [ctx] * bsz, dtype, dev)
    wide = torch.zeros(bsz, width // BLOCK_SIZE, dtype=torch.int32, device=dev)
    wide[:, :tight.shape[1]] = tight
    scale = dh ** -0.5
    ref = paged_decode_attention_ref(q, k, v, tight, lens_t, scale).float()
    cfg = choose_launch(q, k, wide)
    per = -(-width // cfg.num_splits)
    old = dataclasses.replace(cfg, min_split_tokens=-(-per // cfg.block_n) * cfg.block_n)
    impls = {"triton": (wide, cfg), "triton_capacity_pieces": (wide, old),
             "triton_tight": (tight, choose_launch(q, k, tight))}
    nbytes = 2 * bsz * ctx * kv_heads * dh * q.element_size()
    rows = []
    for impl, (table, launch) in impls.items():
        rec = dict(bench="kernels_wide_table", model=name, batch=bsz, ctx=ctx, table_tokens=width,
                   dtype=str(dtype)[6:], impl=impl, splits=launch.num_splits)
        fn = lambda t=table, c=launch: _paged_decode_triton.launch(q, k, v, t, lens_t, scale, c)  # noqa: E731
        measure(rec, fn, ref, nbytes, peak, rows)
    del q, k, v, tight, wide
    torch.cuda.empty_cache()
    return rows


def bench_norm_rope(tokens, hidden, heads, head_dim, dtype, dev, peak):
    """Fused RMSNorm (+ residual add) and rotary vs the model's eager torch ops."""
    from kernels.norm_rope import rms_norm, rms_norm_ref, rotary, rotary_ref

    x = torch.randn(tokens, hidden, device=dev, dtype=dtype)
    res, w = torch.randn_like(x), torch.ones(hidden, device=dev, dtype=dtype)
    q = torch.randn(tokens, heads, head_dim, device=dev, dtype=dtype)
    ang = torch.rand(tokens, head_dim, device=dev)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    e = x.element_size()
    cases = {  # name -> (bytes moved, {impl: fn})
        "rms_norm_residual": (4 * x.numel() * e, {
            "triton": lambda: rms_norm(x, w, 1e-6, residual=res)[0],
            "torch_eager": lambda: rms_norm_ref(x, w, 1e-6, residual=res)[0]}),
        "rotary": (2 * q.numel() * e, {
            "triton": lambda: rotary(q, cos, sin),
            "torch_eager": lambda: rotary_ref(q, cos, sin)}),
    }
    rows = []
    for op, (nbytes, impls) in cases.items():
        ref = impls["torch_eager"]().float()
        for impl, fn in impls.items():
            rec = dict(bench="kernels", op=op, tokens=tokens, dtype=str(dtype)[6:], impl=impl)
            measure(rec, fn, ref, nbytes, peak, rows)
    return rows


def op_speedup(rows, op):
    t = {r["impl"]: r["us"] for r in rows if r.get("op") == op}
    return round(t["torch_eager"] / t["triton"], 3) if len(t) == 2 and t["triton"] > 0 else None


def geomean_speedup(rows, other, key="us"):
    """Geometric mean over shapes of t(other) / t(triton) (``key``: "us", or "us_graph" for
    CUDA-graph replay times)."""
    by = {}
    for r in rows:
        if "model" not in r or key not in r:
            continue
        by.setdefault((r["model"], r["batch"], r["ctx"], r.get("ragged")), {})[r["impl"]] = r[key]
    ratios = [d[other] / d["triton"] for d in by.values() if other in d and "triton" in d]
    return round(math.exp(statistics.fmean(map(math.log, ratios))), 3) if ratios else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few shapes only (gpu_check.sh)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--sweep", action="store_true",
                    help="time the decode kernel over launch choices per shape (graph replays) "
                         "and compare choose_launch's pick with the best")
    args = ap.parse_args()
    import kernels

    why = None
    if not torch.cuda.is_available():
        why = "no CUDA device: this benchmark measures GPU memory bandwidth"
    elif not kernels.triton_available():
        why = "triton not installed (pip install streamrl[kernels])"
    elif kernels.interpreting():
        why = "TRITON_INTERPRET is set: unset it to time compiled kernels"
    if why:
        print(json_line({"bench": "kernels", "skipped": why}))
        return 0
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    peak = peak_gbps(name)
    vllm_fn, vllm_src = vllm_kernel()
    dtype = getattr(torch, args.dtype)
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    models = MODELS[1:2] if args.quick else MODELS
    if args.sweep:
        recs = []
        for model in models:
            for bsz, ctx in shapes:
                recs += sweep_launch(model, bsz, ctx, dtype, dev)
            recs += sweep_launch(model, 64, 2048, dtype, dev, ragged=True)
        ratios = [r["heuristic_over_best"] for r in recs if r["heuristic_over_best"] == r["heuristic_over_best"]]
        print(json_line(dict(bench="kernels_sweep", summary=True, device=name, shapes=len(recs),
                             heuristic_over_best_geomean=round(math.exp(statistics.fmean(
                                 map(math.log, ratios))), 3) if ratios else None,
                             heuristic_over_best_max=max(ratios, default=None))))
        return 0
    rows = []
    for model in models:
        for bsz, ctx in shapes:
            rows += bench_shape(model, bsz, ctx, dtype, dev, peak, vllm_fn)
        rows += bench_shape(model, 64, 2048, dtype, dev, peak, vllm_fn, ragged=True)
    wide = [r for model in models for bsz, ctx in ((1, 4096), (8, 4096), (8, 8192))
            for r in bench_wide_table(model, bsz, ctx, 32768, dtype, dev, peak)]
    elementwise = bench_norm_rope(4096, 3584, 28, 128, dtype, dev, peak)  # Qwen2.5-7B widths
    pct = [r["pct_peak"] for r in rows if r["impl"] == "triton" and r.get("pct_peak") is not None]
    pct_g = [r["pct_peak_graph"] for r in rows
             if r["impl"] == "triton" and r.get("pct_peak_graph") is not None]
    extra = dict(rms_norm_vs_torch=op_speedup(elementwise, "rms_norm_residual"),
                 rotary_vs_torch=op_speedup(elementwise, "rotary"),
                 wide_table_vs_capacity_pieces=geomean_speedup(wide, "triton_capacity_pieces", "us_graph"),
                 wide_table_vs_tight=geomean_speedup(wide, "triton_tight", "us_graph"))
    print(json_line(dict(
        bench="kernels", summary=True, device=name, peak_gbps=peak, dtype=args.dtype,
        triton_median_pct_peak=statistics.median(pct) if pct else None,
        triton_max_gbps=max((r["gbps"] for r in rows if r["impl"] == "triton"), default=None),
        triton_vs_sdpa_dense=geomean_speedup(rows, "sdpa_dense"),
        triton_vs_torch_paged=geomean_speedup(rows, "torch_paged"),
        triton_vs_vllm=geomean_speedup(rows, "vllm_triton"),
        triton_median_pct_peak_graph=statistics.median(pct_g) if pct_g else None,
        triton_vs_sdpa_dense_graph=geomean_speedup(rows, "sdpa_dense", "us_graph"),
        triton_vs_torch_paged_graph=geomean_speedup(rows, "torch_paged", "us_graph"),
        **extra, vllm=vllm_src if vllm_fn is not None else f"absent ({vllm_src})")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
