"""Weight-sync benchmark: naive (root sends to every instance) vs network-aware tree, on
local gloo ranks over loopback with the slow links emulated by the link shaper.

    python bench/weight_sync.py [--quick] [--model-mb 104] [--inter-dc-mbps 50]

Case cross_dc: 1 trainer rank (0) + 2 instances (1, 2) in datacenter "train", 2 instances
(3, 4) in "remote"; the inter-DC link is shaped to --inter-dc-mbps MB/s; local links are
unshaped loopback. Default 50 MB/s: on the shared 2-core dev VM (load ~10) one loopback
gloo hop moves only ~100-300 MB/s, so at 150 MB/s the local re-broadcast, not the emulated
link, is the bottleneck; 50 MB/s keeps the emulated link the bottleneck. On an idle box
use --inter-dc-mbps 150.
  time_lower_bound = model bytes / inter-DC bandwidth + one local stage, where one local
  stage = one bucket over one unshaped local hop (measured here: a full-model single-hop
  sync divided by its bucket count), i.e. the gateway forwarding the last bucket.
Case single_dc: 2 trainer ranks (0, 1), 4 instances (2-5), one datacenter, every rank's
intra-DC NIC shaped to --intra-dc-mbps; binary trees with 1 root vs 2 roots, and chains.
Prints one JSON line per measurement, the last one the summary.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.distributed as dist

from argcheck import fill_defaults  # bench/ is the script's folder
from workers.weight_sync import Topology, WeightSyncReceiver, WeightSyncSender, plan_naive, plan_sync
from workers.weight_sync.checksum import bucket_checksum
from workers.weight_sync.localrun import run_local
from jsonline import json_line  # bench/ is the script's folder

WORLD = 6
MB = 1e6


def model_shapes(model_mb: float) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """A decoder-shaped state dict of about model_mb MB: a bf16 embedding (4 MB), fp32 MLP
    matrices (8 MB each) and fp32 norms."""
    out = [("model.embed_tokens.weight", (2048, 1024), torch.bfloat16)]
    size, i = 2048 * 1024 * 2, 0
    while size < model_mb * MB:
        out.append((f"model.layers.{i}.mlp.up_proj.weight", (1024, 2048), torch.float32))
        out.append((f"model.layers.{i}.input_layernorm.weight", (1024,), torch.float32))
        size += (1024 * 2048 + 1024) * 4
        i += 1
    return out


def make_model(model_mb: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(shape, generator=g).to(dtype) for n, shape, dtype in model_shapes(model_mb)}


def spec_of(model_mb: float):
    return [(n, shape, dtype) for n, shape, dtype in model_shapes(model_mb)]


def cases(args) -> list[tuple[str, str, object]]:
    """(case, variant, plan) in run order."""
    spec = spec_of(args.model_mb)
    bucket = int(args.bucket_mb * MB)
    two_dc = Topology.from_config({"datacenters": {"train": [0, 1, 2], "remote": [3, 4]},
                                   "bandwidth_gbps": {"inter_dc": args.inter_dc_mbps * 8 / 1000},
                                   "shaped_links": ["inter_dc"]})
    one_dc = Topology.from_config({"bandwidth_gbps": {"intra_dc": args.intra_dc_mbps * 8 / 1000},
                                   "shaped_links": ["intra_dc"]})
    return [
        ("local_hop", "unshaped", plan_sync(Topology(), [0], [1], spec, bucket)),
        ("cross_dc", "naive", plan_naive(two_dc, [0], [1, 2, 3, 4], spec, bucket)),
        ("cross_dc", "tree", plan_sync(two_dc, [0], [1, 2, 3, 4], spec, bucket)),
        ("single_dc", "binary_1root", plan_sync(one_dc, [0], [2, 3, 4, 5], spec, bucket, "binary")),
        ("single_dc", "binary_2roots", plan_sync(one_dc, [0, 1], [2, 3, 4, 5], spec, bucket, "binary")),
        ("single_dc", "chain_2roots", plan_sync(one_dc, [0, 1], [2, 3, 4, 5], spec, bucket, "chain")),
    ]


def bench_rank(rank: int, world: int, args) -> list[dict]:
    """Every rank runs every case in order; returns its per-case reports."""
    model = make_model(args.model_mb) if rank in (0, 1) else None
    ref = ({n: bucket_checksum(t.reshape(-1).view(torch.uint8)).tolist() for n, t in model.items()}
           if model is not None else None)
    out = []
    for case, variant, plan in cases(args):
        # One sender/receiver object per plan, as in a run (staging allocated and touched
        # at construction, outside the timed region).
        role = (WeightSyncSender(plan, rank) if rank in plan.senders else
                WeightSyncReceiver(plan, rank) if rank in plan.receivers else None)
        for rep in range(args.reps):
            dist.barrier()
            start = time.time()
            row = {"case": case, "variant": variant, "rep": rep, "rank": rank, "start": start}
            if isinstance(role, WeightSyncSender):
                report = role.push(model, version=rep + 1)
                row.update(role="sender", ok=True, report=report, ref=ref)
            elif isinstance(role, WeightSyncReceiver):
                staged = role.receive()
                row.update(role="receiver", ok=staged.ok, error=staged.error, report=staged.report,
                           end=time.time())
                if staged.ok:
                    row["sums"] = {n: bucket_checksum(t.reshape(-1).view(torch.uint8)).tolist()
                                   for n, t in staged.tensors.items()}
                del staged
            else:
                row["role"] = "idle"
            row.setdefault("end", time.time())
            out.append(row)
        del role
    dist.barrier()
    return out


def summarize_run(rows: list[dict]) -> dict:
    """rows: one case instance, all ranks -> measurement line."""
    active = [r for r in rows if r["role"] != "idle"]
    ref = next(r["ref"] for r in active if r["role"] == "sender")
    # Per-tensor checksum (checksum.py) of what each receiver staged == the trainer's.
    match = all(r.get("sums") == ref for r in active if r["role"] == "receiver")
    link = {"intra_node": 0, "intra_dc": 0, "inter_dc": 0}
    for r in active:
        for k, v in r["report"].tensor_bytes_by_link.items():
            link[k] += v
    spans = [r["report"].link_spans["inter_dc"] for r in active if "inter_dc" in r["report"].link_spans]
    inter_dc_s = round(max(e for _, e in spans) - min(s for s, _ in spans), 4) if spans else 0.0
    by_root = {r["rank"]: sum(r["report"].tensor_bytes_by_link.values()) for r in active if r["role"] == "sender"}
    return {"case": rows[0]["case"], "variant": rows[0]["variant"], "rep": rows[0]["rep"],
            "time_s": round(max(r["end"] for r in active) - min(r["start"] for r in active), 4),
            "ok": all(r["ok"] for r in active), "weights_match": match,
            "bytes_cross_dc": link["inter_dc"], "inter_dc_link_s": inter_dc_s, "bytes_by_link": link,
            "bytes_sent_by_root": by_root}


def parse_args(argv=None) -> argparse.Namespace:
    """The bench's arguments, checked before any rank starts (a bad one: one line naming the
    flag, exit code 2, like argparse's own errors)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one timed repetition per case (< 2 minutes)")
    ap.add_argument("--model-mb", type=float, default=104.0, help="model size in MB (>= 100)")
    ap.add_argument("--bucket-mb", type=float, default=4.0, help="bucket size in MB (> 0)")
    ap.add_argument("--inter-dc-mbps", type=float, default=50.0, help="shaped inter-DC MB/s (> 0)")
    ap.add_argument("--intra-dc-mbps", type=float, default=50.0, help="shaped per-rank NIC MB/s (single_dc; > 0)")
    ap.add_argument("--reps", type=int, help="timed repetitions per case (>= 1; default 3, --quick 1)")
    args = ap.parse_args(argv)
    if not (math.isfinite(args.model_mb) and args.model_mb >= 100):
        ap.error(f"--model-mb must be a finite number >= 100, got {args.model_mb:g}")
    if not (math.isfinite(args.bucket_mb) and args.bucket_mb * MB >= 1):
        ap.error(f"--bucket-mb must be a finite number > 0 (at least 1 byte), got {args.bucket_mb:g}")
    for flag in ("--inter-dc-mbps", "--intra-dc-mbps"):
        v = getattr(args, flag[2:].replace("-", "_"))
        if not (math.isfinite(v) and v > 0):
            ap.error(f"{flag} must be a finite number > 0, got {v:g}")
    fill_defaults(args, {"reps": 1}, {"reps": 3})  # a --reps given wins over --quick
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    return args


def main() -> None:
    args = parse_args()
    t0 = time.time()
    per_rank = run_local(WORLD, bench_rank, args, threads=1)
    lines = [summarize_run([per_rank[r][i] for r in range(WORLD)]) for i in range(len(per_rank[0]))]
    for line in lines:
        print(json_line(line), flush=True)
    model_bytes = cases(args)[0][2].model_bytes()
    n_buckets = len(cases(args)[0][2].buckets)

    def pick(case: str, variant: str) -> list[dict]:
        return [l for l in lines if l["case"] == case and l["variant"] == variant]

    def med(case: str, variant: str) -> float:
        return round(statistics.median(l["time_s"] for l in pick(case, variant)), 4)

    naive, tree = pick("cross_dc", "naive"), pick("cross_dc", "tree")
    hop = med("local_hop", "unshaped")
    bound = model_bytes / (args.inter_dc_mbps * MB) + hop / n_buckets
    t_naive, t_tree = med("cross_dc", "naive"), med("cross_dc", "tree")
    two_roots = pick("single_dc", "binary_2roots")[0]
    summary = {
        "summary": True, "model_bytes": model_bytes, "bucket_bytes": int(args.bucket_mb * MB),
        "inter_dc_MBps": args.inter_dc_mbps, "reps": args.reps,
        "bytes_cross_dc_naive": naive[0]["bytes_cross_dc"], "bytes_cross_dc_tree": tree[0]["bytes_cross_dc"],
        "time_naive": t_naive, "time_tree": t_tree, "time_local_hop_full_model": hop,
        "time_lower_bound": round(bound, 4), "tree_over_bound": round(t_tree / bound, 3),
        "naive_over_tree": round(t_naive / t_tree, 3),
        "one_copy_crosses": all(l["bytes_cross_dc"] == model_bytes for l in tree),
        "all_weights_match": all(l["ok"] and l["weights_match"] for l in lines),
        "single_dc_roots_used": sorted(r for r, b in two_roots["bytes_sent_by_root"].items() if b > 0),
        "single_dc_bytes_by_root": two_roots["bytes_sent_by_root"],
        "single_dc_intra_MBps": args.intra_dc_mbps,
        "single_dc_time_binary_1root": med("single_dc", "binary_1root"),
        "single_dc_time_binary_2roots": med("single_dc", "binary_2roots"),
        "single_dc_time_chain_2roots": med("single_dc", "chain_2roots"),
        "wall_s": round(time.time() - t0, 1),
    }
    summary["tree_within_1_25x"] = summary["tree_over_bound"] <= 1.25
    print(json_line(summary), flush=True)


if __name__ == "__main__":
    main()
