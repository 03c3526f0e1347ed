"""The cluster simulator's predicted iteration time vs the runtime's measured one, per mode.

    python bench/planner_accuracy.py --quick                 # runs bench/pipeline_modes.py --quick first
    python bench/planner_accuracy.py --quick --measured runs/bench/planner_accuracy/measured.jsonl

Measured: bench/pipeline_modes.py (engineer G's), the six pipeline modes on this machine
(controller + 1 generation rank + 1 trainer rank; colocated: 2 + 2 on the same ranks).
Predicted: controller/planner/simulator.py driven only by profiles measured here, after the
run, on the same model and configs — the engine's PTL(BS) and step cost per cached token
(profile_engine), the trainer's time per token (profile_trainer over B's TrainerWorker), a
weight-sync time from a bandwidth model — and the same workload (the bench's prompts,
forced lengths and prompt order). One JSON line per mode, then a summary with
``max_rel_error`` (target <= 0.15).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import pipeline_modes as pm  # noqa: E402

from controller.data import PromptStream  # noqa: E402
from controller.planner.profile import TrainProfile, profile_engine, profile_trainer  # noqa: E402
from controller.planner.simulator import SimConfig, Workload, simulate, sync_time_s  # noqa: E402
from workers.types import Sample  # noqa: E402

# Assumptions (not measured): weights cross a local gloo link at ~1 GB/s plus two RPC round trips;
# the controller spends ~20 ms per iteration on batching, RPC fan-out and bookkeeping.
LOCAL_SYNC_GBPS = 8.0
SYNC_LATENCY_S = 0.02
ITERATION_OVERHEAD_S = 0.02


def measured_rows(a) -> dict[str, dict]:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = Path(a.measured) if a.measured else out / "measured.jsonl"
    if not a.measured:
        cmd = [sys.executable, str(ROOT / "bench" / "pipeline_modes.py")] + (["--quick"] if a.quick else [])
        text = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
        path.write_text(text)
    rows = {}
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            if "mode" in d:
                rows[d["mode"]] = d
    if not rows:
        raise SystemExit(f"planner_accuracy: no per-mode lines in {path}")
    return rows


def stage_seconds(spans, first_iteration: int = 0) -> dict[str, list[float]]:
    """Per iteration: generation span length (longest instance) and summed train spans."""
    gen, train = {}, {}
    for sp in spans:
        it, d = sp["iteration"], sp["end"] - sp["start"]
        if it < first_iteration:
            continue
        if sp["stage"] == "generate":
            gen[it] = max(gen.get(it, 0.0), d)
        elif sp["stage"] == "train":
            train[it] = train.get(it, 0.0) + d
    return {"gen_s": [gen[k] for k in sorted(gen)], "train_s": [train[k] for k in sorted(train)]}


def measured_stages(logdir: Path, mode: str) -> dict[str, list[float]]:
    """The measured run's timeline (Chrome trace written by bench/pipeline_modes.py)."""
    path = logdir / f"timeline_{mode}.json"
    if not path.exists():
        return {}
    ev = json.loads(path.read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in ev if e["ph"] == "M"}
    spans = [{"worker": names[e["tid"]], "stage": e["name"], "start": e["ts"] / 1e6,
              "end": (e["ts"] + e["dur"]) / 1e6, "iteration": e["args"]["iteration"]} for e in ev if e["ph"] == "X"]
    first = min((s["iteration"] for s in spans), default=0) + 1  # skip the warm-up iteration
    return stage_seconds([s for s in spans if s["worker"].startswith(("gen", "train"))], first)


def workloads(a, pa, cfg, tok, task) -> list[Workload]:
    """The bench's iterations, prompt by prompt: one warm-up batch, then the measured ones."""
    items = list(task.prompts("train"))
    lens = pm.trace_lengths(len(items), pa.scale, pa.max_len)
    by_prompt = {it.prompt: lens[i % len(lens)] for i, it in enumerate(items)}
    stream = PromptStream(items, cfg.train.seed)
    g = cfg.train.group_size
    out = []
    for _ in range(1 + pa.iterations):
        batch = stream.next(cfg.train.batch_prompts)
        plen = [len(tok.encode(tok.format_prompt(it.prompt))) for it in batch for _ in range(g)]
        out.append(Workload([by_prompt[it.prompt] for it in batch for _ in range(g)], plen))
    return out[1:]


def trainer_profile(cfg, model_dir: str, task, wl: Workload) -> TrainProfile:
    """profile_trainer over B's TrainerWorker: a full iteration (begin, receive, step) on
    length-forced synthetic samples of the workload's shape, at two batch sizes."""
    from workers.trainer.worker import TrainerWorker

    torch.set_num_threads(1)
    worker = TrainerWorker(cfg.trainer, model_dir, task)
    items = list(task.prompts("train"))
    g = cfg.train.group_size
    it = {"n": 100}

    def train_tokens(tokens: int) -> None:
        it["n"] += 1
        prompts, groups, samples = {}, {}, []
        k, used = 0, 0
        while used < tokens:
            j = k % len(wl.out_lens)
            gid = it["n"] * 10_000 + k // g
            sid = it["n"] * 10_000 + k
            out_len, p_len = wl.out_lens[j], wl.prompt_lens[j]
            prompts[sid] = items[(k // g) % len(items)]
            groups[gid] = g
            samples.append(Sample(sid, torch.randint(3, 300, (p_len,)), torch.randint(3, 300, (out_len,)),
                                  torch.full((out_len,), -1.0), worker.version, "length", gid))
            used += out_len + p_len
            k += 1
        while k % g:  # complete the last group
            j = k % len(wl.out_lens)
            sid, gid = it["n"] * 10_000 + k, it["n"] * 10_000 + k // g
            prompts[sid] = items[(k // g) % len(items)]
            samples.append(Sample(sid, torch.randint(3, 300, (wl.prompt_lens[j],)),
                                  torch.randint(3, 300, (wl.out_lens[j],)), torch.full((wl.out_lens[j],), -1.0),
                                  worker.version, "length", gid))
            k += 1
        worker.begin_iteration(it["n"], prompts, groups)
        worker.receive(samples)
        worker.step()

    total = int(sum(wl.out_lens) + sum(wl.prompt_lens))
    train_tokens(total // 4)  # warm-up
    return profile_trainer(train_tokens, token_counts=(total // 4, total), repeats=3, clock=time.perf_counter)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="bench/pipeline_modes.py --quick")
    ap.add_argument("--measured", default="", help="JSON lines of a pipeline_modes run (skip running it)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench" / "planner_accuracy"))
    a = ap.parse_args(argv)
    rows = measured_rows(a)

    from workers.generation.factory import make_engine
    from workers.tasks.registry import make_task
    from workers.tokenizer import Tokenizer

    pa = pm.parse_args(["--quick"] if a.quick else [])
    cfg = pm.bench_config(pa)
    model_dir = str(ROOT / cfg.model.path)
    tok = Tokenizer.load(model_dir)
    task = make_task(cfg.task.name, **dict(cfg.task.kwargs))
    wls = workloads(a, pa, cfg, tok, task)
    w0 = wls[0]
    torch.set_num_threads(1)
    ctx = int(np.mean(w0.prompt_lens))
    engine = make_engine(cfg.engine, model_dir)
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= cfg.engine.max_batch_size]
    gen = profile_engine(engine, batch_sizes=sizes, prompt_len=ctx, decode_steps=8, vocab=300, name="bench-model",
                         long_context=1024, repeats=3)
    del engine
    train = trainer_profile(cfg, model_dir, task, w0)
    weight_bytes = sum(p.numel() * 4 for p in __import__("workers.model", fromlist=["load_pretrained"])
                       .load_pretrained(model_dir, device="cpu").parameters())
    sync = sync_time_s(weight_bytes, LOCAL_SYNC_GBPS, hops=2, latency_s=SYNC_LATENCY_S)
    print(json.dumps({"profiles": {"ptl_ms": [round(x * 1e3, 3) for x in gen.ptl_s], "batch_sizes": gen.batch_sizes,
                                   "context_tokens": ctx, "prefill_step_ms": round(gen.prefill_step_s * 1e3, 3),
                                   "kv_us_per_token": round(gen.kv_s_per_token * 1e6, 4),
                                   "train_ms_per_1k_tokens": round(train.s_per_token * 1e6, 2),
                                   "train_fixed_s": round(train.fixed_s, 3), "sync_s": round(sync, 4)}}), flush=True)
    errors = {}
    for mode, row in rows.items():
        colocated = mode == "colocated"
        trainer = replace(train, s_per_token=train.s_per_token / (2 if colocated else 1))
        sim_cfg = SimConfig(mode, 2 if colocated else 1, gen, trainer, sync_s=0.0 if colocated else sync,
                            dispatcher="round_robin", minibatch_size=max(2, pa.prompts // 2),
                            microbatch_tokens=cfg.trainer.max_tokens_per_microbatch,
                            iteration_overhead_s=ITERATION_OVERHEAD_S)
        r = simulate(sim_cfg, wls)
        predicted = max(r.sync_end[-1], r.train_end[-1]) / len(wls)
        measured = row["iteration_s"]
        errors[mode] = abs(predicted - measured) / measured
        pred = stage_seconds([vars(sp) for sp in r.spans])
        meas = measured_stages(ROOT / pa.logdir, mode)
        mean = lambda xs: round(float(np.mean(xs)), 3) if xs else None  # noqa: E731
        cv = lambda xs: round(float(np.std(xs) / np.mean(xs)), 3) if len(xs) > 1 else None  # noqa: E731
        print(json.dumps({"mode": mode, "measured_iteration_s": round(measured, 3),
                          "predicted_iteration_s": round(predicted, 3), "rel_error": round(errors[mode], 3),
                          "gen_s": {"predicted": mean(pred["gen_s"]), "measured": mean(meas.get("gen_s", [])),
                                    "measured_cv": cv(meas.get("gen_s", []))},
                          "train_s": {"predicted": mean(pred["train_s"]), "measured": mean(meas.get("train_s", [])),
                                      "measured_cv": cv(meas.get("train_s", []))}}), flush=True)
    summary = {"max_rel_error": round(max(errors.values()), 3),
               "mean_rel_error": round(float(np.mean(list(errors.values()))), 3), "quick": a.quick}
    print(json.dumps({"summary": summary}), flush=True)
    return summary


if __name__ == "__main__":
    main()
