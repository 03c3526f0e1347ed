"""The cluster simulator's predicted iteration time vs the runtime's measured one, per mode.

    python bench/planner_accuracy.py                         # runs bench/pipeline_modes.py first
    python bench/planner_accuracy.py --measured runs/bench/planner_accuracy/measured.jsonl
    python bench/planner_accuracy.py --quick                 # pipeline_modes.py --quick (noisier)

Measured: bench/pipeline_modes.py (engineer G's), the six pipeline modes on this machine
(controller + 1 generation rank + 1 trainer rank; colocated: 2 + 2 on the same ranks), in
``--segments`` segments (default 3: pipeline_modes with 2 rounds each, the modes in one order
then the other, then every profile, so each segment is predicted from profiles taken right
after it; the error is on the segments' mean, each segment's own error printed too). This
host's speed moves by 10-30% over minutes (the same training pass: 0.32-0.40 s, CPU time equal
to wall: shared caches and memory, not the run queue), so one segment's error is mostly
that noise; the mean of 3 interleaved segments halves it.
Predicted: controller/planner/simulator.py driven only by what is measured here, on the same
model and configs, never by the measured run: the engine's PTL(BS) and step cost per cached
token (profile_engine), the trainer's time per token (B's TrainerWorker timed at 4 sizes before
and after each pipeline run, TrainerPasses, the samples handed over in the order the instance
finishes them, as the runtime's trainer rank gets them: host.finish_order);
the host terms (controller/planner/host.py): the weight-sync executor's time between two local
processes, an RPC round trip, the engine's weight swap, the controller's per-iteration
batching and dispatch; generation through the runtime's own generate path
(GenerationInstance.generate with its Outbox, on synthetic requests of the workload's shapes,
timed before and after each pipeline run and pooled, like the trainer's passes) over the
instance model's time for the same requests, which scales the generation profile;
each stage's slowdown while the other stage computes in a second process ("shared host", A/B
with a paused background, generation timed through the runtime path on both sides,
controller/planner/overlap.py); and colocated, measured the way the runtime runs it
(controller/planner/colocated.py): two instance processes with real RPC, each half alone and
both at once (the colocated runtime factor and gen_colocated_slowdown; also before and after
each run), and two trainer DP
ranks training at once with the trainer's all-reduce (train_colocated_slowdown). The
simulator applies a slowdown only where stages overlap. Same workload (the bench's prompts,
forced lengths and prompt order). One JSON line per segment (profiles, host terms, load
average), one per mode, then a summary with ``max_rel_error`` (target <= 0.15).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import pipeline_modes as pm  # noqa: E402
from planner_profiles import RUNTIME_GEN_BATCHES, generation_passes, measure_profiles  # noqa: E402

from controller.bootstrap import ensure_model  # noqa: E402
from controller.data import PromptStream  # noqa: E402
from controller.planner.host import make_train_tokens  # noqa: E402
from controller.planner.profile import TrainerPasses, TrainProfile  # noqa: E402
from controller.planner.simulator import SimConfig, Workload, scaled_profile, simulate  # noqa: E402
from controller.scheduling import PTLProfile  # noqa: E402
from jsonline import json_line  # noqa: E402
from argcheck import positive_int  # noqa: E402

SEGMENT_ROUNDS = 2  # pipeline_modes rounds per segment: the modes in one order, then reversed
TRAIN_PROFILE_REPEATS = 3  # passes per size, before and after each pipeline run (fit: median per size)
TRAIN_WARMUP_PASSES = 3  # full passes before a trainer is timed


def measured_rows(a, logdir: str, segment: int = 0, rounds: int = 0) -> tuple[dict[str, dict], Path]:
    """One measured segment: bench/pipeline_modes.py's per-mode lines (``rounds`` rounds over
    the modes, 0: its default; its model and timelines in ``logdir``), or the lines of
    ``--measured``; and the folder of that run's timelines. A segment's timelines are copied
    beside its lines (``measured_<k>_timelines/``, named in its summary as ``timelines``): every
    segment runs in ``logdir``, and the next one overwrote them (diff review, s54)."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = Path(a.measured) if a.measured else out / f"measured_{segment}.jsonl"
    if not a.measured:
        cmd = [sys.executable, str(ROOT / "bench" / "pipeline_modes.py")] + (["--quick"] if a.quick else [])
        cmd += (["--repeat", str(rounds)] if rounds else []) + ["--logdir", logdir]
        text = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
        kept = out / f"measured_{segment}_timelines"
        kept.mkdir(exist_ok=True)
        for f in (ROOT / logdir).glob("timeline_*.json"):
            shutil.copy2(f, kept / f.name)
        lines = [json.dumps({**d, "timelines": str(kept.resolve())}) if d.get("summary") else line
                 for line, d in ((x, json.loads(x) if x.startswith("{") else {}) for x in text.splitlines())]
        path.write_text("".join(x + "\n" for x in lines))
    rows, timelines, digests = {}, ROOT / logdir, {}
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            if "mode" in d:
                rows[d["mode"]] = d
            elif d.get("summary"):
                timelines = Path(d.get("timelines") or d.get("logdir") or timelines)
                digests = d.get("timeline_digests") or {}
    if not rows:
        raise SystemExit(f"planner_accuracy: no per-mode lines in {path}")
    for mode, want in digests.items():  # a later pipeline_modes run into that --logdir rewrote them
        f = timelines / f"timeline_{mode}.json"
        if f.exists() and pm.file_digest(f) != want:
            raise SystemExit(f"planner_accuracy: {f} is not the timeline of the run {path} holds (a later run "
                             "into the same --logdir rewrote it): run bench/pipeline_modes.py again, or pass "
                             "its own --logdir")
    return rows, timelines


def measured_run(path: str) -> list[str]:
    """bench/pipeline_modes.py's flags of the run that wrote ``path`` (its summary line): the
    prediction is of that workload and reads that run's timelines. Taken from this run's own
    ``--quick``, a quick file was predicted as the full workload, 2x off (review, s54)."""
    summary = [d for d in map(json.loads, filter(lambda x: x.startswith("{"), Path(path).read_text().splitlines()))
               if d.get("summary")]
    keys = ("iterations", "prompts", "scale", "max_len", "logdir")
    missing = [k for k in keys if not summary or k not in summary[-1]]
    if missing:
        raise SystemExit(f"planner_accuracy: --measured {path}: its summary line names no {', '.join(missing)} "
                         "(bench/pipeline_modes.py writes them since session 54): run it again")
    s = summary[-1]
    return ["--iterations", str(s["iterations"]), "--prompts", str(s["prompts"]), "--scale", str(s["scale"]),
            "--max-len", str(s["max_len"]), "--logdir", s["logdir"]]


def stage_seconds(spans, first_iteration: int = 0) -> dict[str, list[float]]:
    """Per iteration: generation span length (longest instance) and train seconds (summed
    spans of one trainer rank; colocated's two DP ranks train at once: the busier one)."""
    gen, train = {}, {}
    for sp in spans:
        it, d = sp["iteration"], sp["end"] - sp["start"]
        if it < first_iteration:
            continue
        if sp["stage"] == "generate":
            gen[it] = max(gen.get(it, 0.0), d)
        elif sp["stage"] == "train":
            per_rank = train.setdefault(it, {})
            per_rank[sp["worker"]] = per_rank.get(sp["worker"], 0.0) + d
    return {"gen_s": [gen[k] for k in sorted(gen)], "train_s": [max(train[k].values()) for k in sorted(train)]}


def measured_stages(logdir: Path, mode: str) -> dict[str, list[float]]:
    """The measured run's timeline (Chrome trace written by bench/pipeline_modes.py)."""
    path = logdir / f"timeline_{mode}.json"
    if not path.exists():
        return {}
    ev = json.loads(path.read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e.get("name") == "thread_name"}
    spans = [{"worker": names[e["tid"]], "stage": e["name"], "start": e["ts"] / 1e6,
              "end": (e["ts"] + e["dur"]) / 1e6, "iteration": e["args"]["iteration"]} for e in ev if e["ph"] == "X"]
    # the measured iterations only: pipeline_modes.run_mode drops the warm-up's spans before the
    # measured run (a "+ 1" here dropped the first measured iteration, which the prediction keeps)
    first = min((s["iteration"] for s in spans), default=0)
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
        plen = [len(tok.encode_prompt(it.prompt)) for it in batch for _ in range(g)]
        out.append(Workload([by_prompt[it.prompt] for it in batch for _ in range(g)], plen,
                            groups=[j for j in range(len(batch)) for _ in range(g)]))  # group_id parity
    return out[1:]


def predict(mode: str, gen: PTLProfile, train: TrainProfile, host: dict, wls: list[Workload], pa, cfg,
            shared: bool) -> tuple[float, float, list]:
    """(predicted seconds per iteration, the same under the other hardware assumption, spans)."""
    colocated = mode == "colocated"
    # the overlaps a mode has: colocated, the two DP ranks train at once (a copy of the same
    # stage), the two instances generate at once (gen_colocated_slowdown), and a rank may
    # start training while an instance still generates; otherwise gen with train
    # the instance as the runtime drives it (generate + Outbox), at its share of the requests
    rt_key = "gen_runtime_factor_colocated" if colocated else "gen_runtime_factor"
    gen_rt = scaled_profile(gen, host.get(rt_key, host.get("gen_runtime_factor", 1.0)))
    slow = {"gen_shared_slowdown": host["gen_shared_slowdown"], "train_shared_slowdown": host["train_shared_slowdown"],
            "gen_colocated_slowdown": host.get("gen_colocated_slowdown", 1.0) if colocated else 1.0,
            "train_colocated_slowdown": host.get("train_self_slowdown", 1.0) if colocated else 1.0}
    flat = {k: 1.0 for k in slow}
    # colocated: each of the 2 DP ranks trains its groups' samples (group_id % 2) once they
    # are all in, then both step together: all-reduce of the gradients (one weight-sized
    # transfer, like the sync) + optimizer; weights reach the instance by a copy in the same
    # process (its cost: the swap, in the overhead)
    # the profile's fixed_s holds one hand-over (one receive per pass); the simulator adds
    # ``train_overhead_per_batch_s`` for each hand-over the mode makes
    handover = host.get("train_handover_s", 0.0)
    trainer = replace(train, fixed_s=max(0.0, train.fixed_s - handover) + (host["sync_s"] if colocated else 0.0))
    sim_cfg = SimConfig(mode, 2 if colocated else 1, gen_rt, trainer, sync_s=0.0 if colocated else host["sync_s"],
                        dispatcher="round_robin", minibatch_size=max(2, pa.prompts // 2),
                        microbatch_tokens=cfg.trainer.max_tokens_per_microbatch,
                        iteration_overhead_s=host["iteration_overhead_s"], stream_window_s=cfg.pipeline.stream_window_s,
                        train_overhead_per_batch_s=handover,
                        **(slow if shared else flat),
                        train_ranks=2 if colocated else 1, colocated_dp=colocated)
    per_it = lambda r: max(r.sync_end[-1], r.train_end[-1]) / len(wls)  # noqa: E731
    r = simulate(sim_cfg, wls)
    other = simulate(replace(sim_cfg, **(flat if shared else slow)), wls)
    return per_it(r), per_it(other), r.spans


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked before any work: a bad value is one line naming the flag,
    exit code 2. ``segments`` is filled in (``--measured``: 1; default 3, --quick 1)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="bench/pipeline_modes.py --quick")
    ap.add_argument("--measured", default="", help="JSON lines of a pipeline_modes run (skip running it; one segment)")
    ap.add_argument("--segments", type=positive_int,
                    help="measured segments (default 3, --quick 1): each runs bench/pipeline_modes.py with "
                         "2 rounds, then measures every profile; a segment is predicted from the "
                         "profiles taken right after it")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench" / "planner_accuracy"))
    ap.add_argument("--reuse-profiles", action="store_true",
                    help="reuse the profiles and host terms of the previous run (OUT/profiles.json)")
    ap.add_argument("--separate-hardware", action="store_true",
                    help="predict without the shared-host slowdowns (each stage on its own hardware)")
    a = ap.parse_args(argv)
    if a.measured and not Path(a.measured).is_file():
        ap.error(f"argument --measured: no such file: {a.measured}")
    if a.measured and (a.segments or 1) != 1:
        ap.error(f"argument --segments: --measured is one segment, got {a.segments}")
    a.segments = a.segments or (1 if (a.measured or a.quick) else 3)
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    n_seg = a.segments

    from workers.tasks.registry import make_task
    from workers.tokenizer import Tokenizer

    # the pipeline run's model and timelines: OUT/pipeline_modes, or --measured's own run
    pa = pm.parse_args(measured_run(a.measured) if a.measured else
                       (["--quick"] if a.quick else []) + ["--logdir", str(Path(a.out).resolve() / "pipeline_modes")])
    cfg = pm.bench_config(pa)
    torch.set_num_threads(1)
    cache = Path(a.out) / "profiles.json"
    cached = json.loads(cache.read_text()) if a.reuse_profiles and cache.exists() else None
    if cached is not None and "segments" not in cached:
        cached = {"segments": [cached]}  # one segment, older file
    shared = not a.separate_hardware
    segs, saved = [], []
    model_dir = str(ROOT / cfg.model.path)
    # the bench's model, as bench/pipeline_modes.py makes it (idempotent): the trainer's
    # first passes are taken before the first pipeline run
    ensure_model(model_dir, cfg.model.init, cfg.task.name, dict(cfg.task.kwargs), 0, 1e-3, 0)
    tok = Tokenizer.load(model_dir)
    task = make_task(cfg.task.name, **dict(cfg.task.kwargs))
    wls = workloads(a, pa, cfg, tok, task)
    for k in range(n_seg):
        reuse = cached is not None and k < len(cached["segments"])
        trainer, gen_before = None, None
        if not reuse:  # the trainer passes behind the profile, on both sides of the run
            w0 = wls[0]
            total = int(sum(w0.out_lens) + sum(w0.prompt_lens))
            trainer = TrainerPasses(make_train_tokens(cfg.trainer, model_dir, cfg.task.name, dict(cfg.task.kwargs),
                                                      w0.out_lens, w0.prompt_lens, cfg.train.group_size,
                                                      max_batch=cfg.engine.max_batch_size),
                                    [total * q // 4 for q in (1, 2, 3, 4)], warmup=TRAIN_WARMUP_PASSES,
                                    repeats=TRAIN_PROFILE_REPEATS)
            if not a.measured:  # before the run (the rest is timed after it)
                trainer.sample()
                gen_before = generation_passes(cfg, model_dir, wls[:RUNTIME_GEN_BATCHES])
        rows, timelines = measured_rows(a, pa.logdir, k, 0 if n_seg == 1 else SEGMENT_ROUNDS)
        meas = {m: measured_stages(timelines, m) for m in rows}  # the segment's last round
        if reuse:
            d = cached["segments"][k]
            gen, train, host = PTLProfile(**d["generation"]), TrainProfile(**d["trainer"]), d["host"]
        else:
            gen, train, host = measure_profiles(a, cfg, model_dir, tok, task, wls, trainer, gen_before)
        saved.append({"generation": asdict(gen), "trainer": asdict(train), "host": host})
        print(json_line({"segment": k, "load_avg_1m": round(os.getloadavg()[0], 2),
                          "profiles": {"ptl_ms": [round(x * 1e3, 3) for x in gen.ptl_s], "batch_sizes": gen.batch_sizes,
                                       "prefill_step_ms": round(gen.prefill_step_s * 1e3, 3),
                                       "kv_us_per_token": round(gen.kv_s_per_token * 1e6, 4),
                                       "train_ms_per_1k_tokens": round(train.s_per_token * 1e6, 2),
                                       "train_fixed_s": round(train.fixed_s, 3)},
                          "host": {k2: round(v, 4) if isinstance(v, float) else v for k2, v in host.items()},
                          "shared_host": shared}), flush=True)
        pred = {m: predict(m, gen, train, host, wls, pa, cfg, shared) for m in rows}
        segs.append({"rows": rows, "pred": pred, "meas": meas})
    cache.write_text(json.dumps({"segments": saved}))
    errors, alt_errors, seg_errors = {}, {}, {}
    mean = lambda xs: round(float(np.mean(xs)), 3) if xs else None  # noqa: E731
    cv = lambda xs: round(float(np.std(xs) / np.mean(xs)), 3) if xs and np.mean(xs) > 0 else None  # noqa: E731
    for mode in segs[0]["rows"]:
        # every segment ran the same iterations per mode: the run's seconds per iteration is the mean
        measured = float(np.mean([s["rows"][mode]["iteration_s"] for s in segs]))
        predicted = float(np.mean([s["pred"][mode][0] for s in segs]))
        alt = float(np.mean([s["pred"][mode][1] for s in segs]))
        errors[mode] = abs(predicted - measured) / measured
        alt_errors[mode] = abs(alt - measured) / measured
        seg_errors[mode] = [round(abs(s["pred"][mode][0] - s["rows"][mode]["iteration_s"])
                                  / s["rows"][mode]["iteration_s"], 3) for s in segs]
        stages = [(stage_seconds([vars(sp) for sp in s["pred"][mode][2]]), s["meas"][mode]) for s in segs]
        line = {"mode": mode, "measured_iteration_s": round(measured, 3), "predicted_iteration_s": round(predicted, 3),
                "rel_error": round(errors[mode], 3), "segment_errors": seg_errors[mode],
                "segment_measured_s": [round(s["rows"][mode]["iteration_s"], 3) for s in segs],
                "segment_predicted_s": [round(s["pred"][mode][0], 3) for s in segs]}
        for key in ("gen_s", "train_s"):  # per iteration, over every segment's iterations
            pred, meas_s = [x for p, _ in stages for x in p[key]], [x for _, m in stages for x in m.get(key, [])]
            line[key] = {"predicted": mean(pred), "measured": mean(meas_s),
                         "predicted_cv": cv(pred), "measured_cv": cv(meas_s)}
        print(json_line(line), flush=True)
    summary = {"summary": True,  # flat, like every bench's summary line
               "max_rel_error": round(max(errors.values()), 3),
               "mean_rel_error": round(float(np.mean(list(errors.values()))), 3), "quick": a.quick,
               "segments": n_seg, "shared_host": shared, "errors": {m: round(e, 3) for m, e in errors.items()},
               "max_segment_error": max(max(v) for v in seg_errors.values()),
               ("max_rel_error_separate_hardware" if shared else "max_rel_error_shared_host"):
                   round(max(alt_errors.values()), 3)}
    print(json_line(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
