"""Benchmark: the six pipeline modes, one after another in one run, on the same ranks.

    python bench/pipeline_modes.py [--quick]

Starts its own processes (torchrun, 3 ranks: controller + 2 workers). Workload: the same tiny
Qwen2-architecture model (random weights) and a length-forced long-tail workload: each
prompt's output length is a real response length from ``data/length_traces`` (the project's copy of the trace)
(words / ``--scale``, clipped), so every mode generates exactly the same tokens. ``colocated``
puts both stages on both worker ranks in turn (2 instances, then 2 trainer DP ranks); the other
modes use rank 1 for generation and rank 2 for training. Each mode: 1 warm-up iteration, then
``--iterations`` measured ones (pipeline fill and drain included). ``--repeat`` rounds over the
modes (full run: 4, alternating forward and reverse order, so a load that drifts during the run weighs
on every mode alike; each mode's line sums its rounds).

Prints one JSON line per mode (samples/s, iteration time, bubble fraction per worker, busy and
CPU seconds per rank) and a summary line with ``async_stream_over_batch``, ``stream_over_batch``,
``async_stream_over_colocated`` (targets: >= 1.5 and >= 1.15 for the first two).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jsonline import json_line  # noqa: E402  (bench/ is the script's folder)
from argcheck import fill_defaults, folder, int_at_least, names_from, positive_float, positive_int  # noqa: E402

TRACE = ROOT / "data" / "length_traces" / "llama33_70b_rg_easy.train.jsonl.gz"
ORDER = ("colocated", "batch", "minibatch", "stream", "async_batch", "async_stream")
QUICK = {"iterations": 4, "prompts": 24, "max_len": 80, "repeat": 1}  # --quick's defaults; flags given win
FULL = {"iterations": 12, "prompts": 48, "max_len": 160, "repeat": 4}


def file_digest(path: Path) -> str:
    """A file's content digest: planner_accuracy --measured checks the timelines it reads are
    this run's (a later run into the same --logdir rewrites them; review, s55)."""
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def parse_args(argv=None, description: str | None = None):
    """The command line, checked before any process starts: a bad value is one line naming
    the flag, exit code 2. ``--quick`` sets the defaults of the counts."""
    ap = argparse.ArgumentParser(description=description or __doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small run (< 2 minutes)")
    ap.add_argument("--iterations", type=positive_int,
                    help=f"measured iterations per mode (default {FULL['iterations']}, --quick {QUICK['iterations']})")
    ap.add_argument("--prompts", type=int_at_least(2),
                    help=f"prompts per iteration, >= 2: colocated trains on 2 DP ranks (default {FULL['prompts']}, "
                         f"--quick {QUICK['prompts']})")
    ap.add_argument("--scale", type=positive_float, default=8.0, help="trace words per generated token")
    ap.add_argument("--max-len", type=positive_int,
                    help=f"longest forced output (default {FULL['max_len']}, --quick {QUICK['max_len']})")
    ap.add_argument("--modes", type=names_from(ORDER), default=",".join(ORDER),
                    help="comma-separated modes, run in this order (the summary needs batch, stream, async_stream, "
                         "colocated)")
    ap.add_argument("--repeat", type=positive_int,
                    help=f"rounds over the modes (default {FULL['repeat']}, --quick {QUICK['repeat']}), alternating "
                         "forward and reverse order, which cancels a linear drift of the machine's load; each mode's "
                         "line sums its rounds")
    ap.add_argument("--logdir", type=folder, default="runs/bench_pipeline_modes")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return fill_defaults(ap.parse_args(argv), QUICK, FULL)


def trace_lengths(n: int, scale: float, max_len: int) -> list[int]:
    """First ``n`` prompts' first response length (words / scale), clipped to [2, max_len]."""
    out = []
    with gzip.open(TRACE, "rt") as f:
        for line in f:
            words = json.loads(line)["resp_words"][0]
            out.append(int(min(max_len, max(2, round(words / scale)))))
            if len(out) == n:
                break
    return out


def bench_config(a):
    from controller.config import from_dict

    return from_dict({
        "model": {"path": f"{a.logdir}/model", "init": {"hidden_size": 128, "intermediate_size": 384,
                                                          "num_hidden_layers": 2, "num_attention_heads": 4,
                                                          "num_key_value_heads": 2, "vocab_size": 384}},
        "task": {"name": "synthetic", "kwargs": {"kind": "running_sum", "num_train": 2048}},
        "engine": {"max_batch_size": 64, "kv_cache_tokens": 32768, "device": "cpu"},
        "trainer": {"algorithm": "grpo", "lr": 1e-5, "max_tokens_per_microbatch": 512},
        "placement": {"generation": [1], "trainer": [2]},
        "train": {"batch_prompts": a.prompts, "group_size": 2, "max_tokens": a.max_len},
        "logging": {"logdir": a.logdir, "progress": False, "timeline_every": 0},
    }, world_size=3)


def run_mode(cfg, mode: str, a, model_dir, tok, task, length_of) -> dict:
    from dataclasses import replace

    from controller.program import Program
    from controller.rpc import wait_all
    from controller.scheduling import make_dispatcher
    from controller.timeline import bubble_fractions, gantt_figure, write_chrome_trace
    from controller.world import build_world

    colocated = mode == "colocated"
    place = replace(cfg.placement, generation=[1, 2] if colocated else [1], trainer=[1, 2] if colocated else [2],
                    colocated=colocated)
    cfg_m = replace(cfg, pipeline=replace(cfg.pipeline, mode=mode, minibatch_size=max(2, a.prompts // 2)),
                    placement=place)
    world = build_world(cfg_m, model_dir, [tok.eos_id], {1, 2}, make_dispatcher("round_robin"))
    prog = Program(cfg_m, world, tok, task)
    prog.length_of = length_of
    prog.run(1)  # warm-up: first-touch allocations, thread pools
    prog.drain_spans()
    cpu0 = cpu_snapshot()
    t0 = time.time()
    res = prog.run(a.iterations)
    t1 = time.time()
    cpu = cpu_delta(cpu0, cpu_snapshot())
    spans = prog.drain_spans()
    control = [s for s in spans if s.worker == "controller"]
    spans = [s for s in spans if s.worker != "controller"]
    wait_all([h.call("close") for h in world.trainers + world.sgs.handles])
    samples = sum(r.num_samples for r in res)
    logdir = Path(a.logdir)
    write_chrome_trace(spans, logdir / f"timeline_{mode}.json")
    fig = gantt_figure([s for s in spans + control if s.end >= t0], f"{mode}: {a.iterations} iterations")
    fig.savefig(logdir / f"timeline_{mode}.png", dpi=90)
    return {"mode": mode, "samples_per_s": samples / (t1 - t0), "iteration_s": (t1 - t0) / a.iterations,
            "seconds": t1 - t0, "samples": samples, "tokens": sum(r.num_tokens for r in res), "iterations": a.iterations,
            "bubble": {w: round(f, 3) for w, f in bubble_fractions(spans, (t0, t1), per_device=True).items()},
            "staleness_max": max(r.staleness_max for r in res),
            "busy_s": {w: round(sum(s.duration for s in spans if s.worker == w and s.stage in ("generate", "train")
                                    and s.start >= t0), 3) for w in sorted({s.worker for s in spans})},
            "cpu_s": cpu}


def merge_rounds(rows: list[dict]) -> dict:
    """One mode's rounds as one line: throughput = all samples / all measured seconds; bubbles
    time-weighted; busy and CPU seconds summed; ``rounds``: each round's samples/s."""
    if len(rows) == 1:
        return rows[0]
    secs = sum(r["seconds"] for r in rows)
    workers = sorted({w for r in rows for w in r["bubble"]})
    return {"mode": rows[0]["mode"], "samples_per_s": sum(r["samples"] for r in rows) / secs,
            "iteration_s": secs / sum(r["iterations"] for r in rows), "seconds": secs,
            "samples": sum(r["samples"] for r in rows), "tokens": sum(r["tokens"] for r in rows),
            "iterations": sum(r["iterations"] for r in rows),
            "bubble": {w: round(sum(r["bubble"].get(w, 0.0) * r["seconds"] for r in rows) / secs, 3) for w in workers},
            "staleness_max": max(r["staleness_max"] for r in rows),
            # (busy seconds are per span worker, gen1 / train1; bubbles per device: colocated's rank1)
            "busy_s": {w: round(sum(r["busy_s"].get(w, 0.0) for r in rows), 3)
                       for w in sorted({w for r in rows for w in r["busy_s"]})},
            "cpu_s": {p: {k: round(sum(r["cpu_s"].get(p, {}).get(k, 0.0) for r in rows), 2)
                          for k in sorted({k for r in rows for k in r["cpu_s"].get(p, {})})}
                      for p in sorted({p for r in rows for p in r["cpu_s"]})},
            "rounds": [round(r["samples_per_s"], 1) for r in rows]}


def cpu_snapshot() -> dict[str, dict[str, float]]:
    """Per rank (controller + the two workers): CPU seconds per thread name (controller.process_state.thread_cpu)."""
    import torch.distributed.rpc as rpc

    from controller.process_state import thread_cpu

    out = {"controller": thread_cpu()}
    for r in (1, 2):
        out[f"worker{r}"] = rpc.rpc_sync(f"worker{r}", thread_cpu, timeout=60)
    return out


def cpu_delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """CPU seconds each rank used between two snapshots: total, and the busiest named threads
    (threads that ended meanwhile only count in the total)."""
    out = {}
    for proc, now in after.items():
        d = {k: v - before.get(proc, {}).get(k, 0.0) for k, v in now.items()}
        top = sorted(((k, v) for k, v in d.items() if k != "total" and v >= 0.05), key=lambda kv: -kv[1])[:4]
        out[proc] = {"total": round(d.get("total", 0.0), 2), **{k: round(v, 2) for k, v in top}}
    return out


def controller(a) -> int:
    import torch.distributed.rpc as rpc

    from controller.bootstrap import ensure_model
    from controller.process_state import request_exit
    from workers.tasks.registry import make_task
    from workers.tokenizer import Tokenizer

    cfg = bench_config(a)
    Path(a.logdir).mkdir(parents=True, exist_ok=True)
    boot = rpc.rpc_sync("worker2", ensure_model, args=(cfg.model.path, cfg.model.init, cfg.task.name,
                                                       dict(cfg.task.kwargs), 0, 1e-3, 0), timeout=600)
    tok = Tokenizer.load(boot["path"])
    task = make_task(cfg.task.name, **dict(cfg.task.kwargs))
    items = list(task.prompts("train"))
    lens = trace_lengths(len(items), a.scale, a.max_len)
    by_prompt = {it.prompt: lens[i % len(lens)] for i, it in enumerate(items)}
    rounds: dict[str, list[dict]] = {m: [] for m in a.modes}
    for r in range(a.repeat):
        for mode in (a.modes if r % 2 == 0 else a.modes[::-1]):
            row = run_mode(cfg, mode, a, boot["path"], tok, task, lambda it: by_prompt[it.prompt])
            rounds[mode].append(row)
            if a.repeat == 1:
                print(json_line(row), flush=True)
            else:
                print(json_line({"round": r, **row}), file=sys.stderr, flush=True)
    rows = {m: merge_rounds(rs) for m, rs in rounds.items()}
    if a.repeat > 1:
        for m in a.modes:
            print(json_line(rows[m]), flush=True)
    sps = {m: r["samples_per_s"] for m, r in rows.items()}
    ratios = {"async_stream_over_batch": ("async_stream", "batch"), "stream_over_batch": ("stream", "batch"),
              "async_stream_over_colocated": ("async_stream", "colocated"),
              "minibatch_over_batch": ("minibatch", "batch"), "async_batch_over_batch": ("async_batch", "batch")}
    print(json_line({"summary": True, "quick": a.quick, "iterations": a.iterations, "prompts": a.prompts,
                      "repeat": a.repeat, "scale": a.scale, "max_len": a.max_len,
                      "logdir": str(Path(a.logdir).resolve()),  # its timelines (planner_accuracy --measured)
                      "timeline_digests": {m: file_digest(Path(a.logdir) / f"timeline_{m}.json") for m in rows},
                      **{k: sps[x] / sps[y] for k, (x, y) in ratios.items() if x in sps and y in sps}}), flush=True)
    for r in (1, 2):
        rpc.rpc_sync(f"worker{r}", request_exit, args=(0,))
    return 0


def main() -> int:
    a = parse_args()
    if not a.worker:  # launcher: start our own torchrun job
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port", str(port),
               __file__, "--worker", *sys.argv[1:]]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        return subprocess.call(cmd, cwd=ROOT, env=env)
    import torch

    from controller.processes import run_rank

    torch.set_num_threads(1)
    return run_rank(lambda: controller(a), 600.0)


if __name__ == "__main__":
    sys.exit(main())
