"""fp32 decode GEMMs on the CPU: the engine's panel GEMM against oneDNN's prepacked GEMM and
plain ``F.linear``, at the GEMM shapes of a decode layer (q/k/v, o, gate/up, down) plus lm_head.

    python bench/cpu_gemm.py                 # workload (a)'s tiny model and Qwen2.5-0.5B's shapes
    python bench/cpu_gemm.py --quick         # (a)'s shapes, fewer trials (seconds)

For each model, row count and cache state (``hot``: the same call repeated; ``cold``: ~44 MB
read between calls, what a decode step's K/V stream does to the weights) the three run
alternately, one layer's GEMMs plus lm_head per trial; medians. One JSON line per (model,
rows, state, implementation) with microseconds and GFLOP/s, then a summary line with the
panel GEMM's speed-up over each competitor (time ratios, >1: panel faster) per model and
row count, and the geometric means. Needs an AVX-512 CPU (the panel GEMM's); elsewhere it
prints one line saying it skipped, and why. Threads: ``--threads`` (default 2).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.argcheck import positive_int  # noqa: E402
from bench.jsonline import json_line  # noqa: E402
from workers.generation import panel_gemm, prepacked  # noqa: E402

# (name, hidden, intermediate, q/k/v out, vocab): one layer's GEMMs and lm_head
MODELS = {"tiny_a": (256, 688, 512, 512), "qwen2.5-0.5b": (896, 4864, 1152, 151936)}
TRIALS = {"tiny_a": 40, "qwen2.5-0.5b": 6}  # each trial of 0.5B multiplies its 545 MB lm_head


def emit(**kw) -> None:
    print(json_line(kw), flush=True)


def shapes(model: str) -> list[tuple[str, int, int]]:
    """(name, K, N) of each GEMM."""
    d, inter, qkv, vocab = MODELS[model]
    return [("qkv", d, qkv), ("o", d, d), ("gate_up", d, 2 * inter), ("down", inter, d), ("lm_head", d, vocab)]


def parse_args(argv=None) -> argparse.Namespace:
    """The command line: a bad value is one line naming the flag, exit code 2."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="(a)'s shapes, fewer trials (seconds)")
    ap.add_argument("--threads", type=positive_int, default=2, help="torch threads (default 2)")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if not panel_gemm.available(torch.float32):
        emit(skipped=True, reason="the panel GEMM needs an AVX-512 CPU and a C++ compiler "
             f"(capability {torch.backends.cpu.get_cpu_capability()})")
        return
    have_onednn = prepacked.available(torch.float32)
    models = ["tiny_a"] if args.quick else list(MODELS)
    rows = [1, 16, 64] if args.quick else [1, 16, 64, 256]
    flush = torch.randn(44 * 2**20 // 4)
    speedups: dict[str, list[float]] = {"onednn": [], "torch": []}
    summary: dict[str, float] = {}
    g = torch.Generator().manual_seed(0)
    for model in models:
        ws = [torch.randn(n, k, generator=g) * 0.05 for _, k, n in shapes(model)]
        packs = {"panel": [panel_gemm.pack(w) for w in ws], "onednn": [prepacked.pack(w, 16) for w in ws]
                 if have_onednn else None, "torch": ws}
        calls = {"panel": panel_gemm.linear, "onednn": prepacked.linear, "torch": F.linear}
        for m in rows:
            xs = [torch.randn(m, k, generator=g) for _, k, _ in shapes(model)]
            flops = sum(2 * m * k * n for _, k, n in shapes(model))
            for name in calls:  # untimed: oneDNN's first calls of a shape took 20-66 ms (its setup), and in
                if packs[name] is not None:  # half the trials of a cell they moved the median (review, s52)
                    for _ in range(3):
                        for x, p in zip(xs, packs[name]):
                            calls[name](x, p, None)
            for state in ("hot", "cold"):
                times: dict[str, list[float]] = {name: [] for name in calls if packs[name] is not None}
                for t in range(15 if args.quick else TRIALS[model]):
                    order = list(times) if t % 2 == 0 else list(times)[::-1]
                    for name in order:
                        if state == "cold":
                            flush.sum()
                        start = time.perf_counter()
                        for x, p in zip(xs, packs[name]):
                            calls[name](x, p, None)
                        times[name].append(time.perf_counter() - start)
                med = {name: statistics.median(v) for name, v in times.items()}
                for name, sec in med.items():
                    emit(model=model, rows=m, state=state, impl=name, us=round(sec * 1e6, 1),
                         gflop_s=round(flops / sec / 1e9, 1), threads=args.threads)
                for name in med:
                    if name != "panel":
                        r = med[name] / med["panel"]
                        speedups[name].append(r)
                        summary[f"panel_over_{name}_{model}_{m}_{state}"] = round(r, 3)
    emit(summary=True, threads=args.threads, quick=args.quick, onednn=have_onednn,
         panel_over_onednn_geomean=_geomean(speedups["onednn"]), panel_over_torch_geomean=_geomean(speedups["torch"]),
         **summary)


def _geomean(xs: list[float]) -> float | None:
    return round(math.exp(sum(map(math.log, xs)) / len(xs)), 3) if xs else None


if __name__ == "__main__":
    main()
