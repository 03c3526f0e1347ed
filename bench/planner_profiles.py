"""The profiles and host terms bench/planner_accuracy.py predicts from, measured on this host:
the engine's PTL(BS) (``profile_engine``), the trainer's per-token time (``TrainerPasses``),
and everything else the simulator needs (``host_terms``: weight sync, RPC round trip, the
engine's weight swap, the controller's own work, generation through the runtime's generate
path, each stage's slowdown next to the other and next to a copy of itself). See
planner_accuracy's docstring for why each is measured the way it is."""
from __future__ import annotations

import time

import numpy as np
import torch

from controller.planner.colocated import measure_colocated_generation, measure_colocated_training
from controller.planner.host import (concurrent_slowdown, measure_weight_sync, runtime_generate_factor,
                                     train_handover_s, trainer_load)
from controller.planner.overlap import generate_timer, runtime_engine_load
from controller.planner.profile import TrainerPasses, TrainProfile, profile_engine
from controller.planner.simulator import SimConfig, Workload, simulate
from controller.scheduling import PTLProfile

# Controller round trips on an iteration's critical path (controller/program.py): begin_iteration,
# generate (launch and report), step, weight push.
RPC_ROUND_TRIPS = 4
RUNTIME_GEN_BATCHES = 12  # synthetic iterations timed through GenerationInstance.generate vs the bare loop
COLOCATED_TRAIN_ITERATIONS = 5  # two DP ranks training at once, per measurement
PTL_DECODE_STEPS = 32  # timed decode steps per batch size (8 left PTL(BS) noisy enough to bend its shape)


def controller_work_s(cfg, tok, task, wl: Workload, repeats: int = 3) -> float:
    """The controller's own per-iteration work: tokenize a batch of prompts and plan the
    dispatch (Program.make_batch + SGS.launch), the fastest of ``repeats``."""
    from controller.scheduling import make_dispatcher
    from controller.sgs import default_profile

    items = list(task.prompts("train"))[:cfg.train.batch_prompts]
    dispatcher = make_dispatcher("round_robin")
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        ids = [torch.tensor(tok.encode_prompt(it.prompt), dtype=torch.long) for it in items]
        dispatcher.plan([float(x) for x in wl.out_lens], [default_profile()], prompt_lens=[len(x) for x in ids] * 2)
        best = min(best, time.perf_counter() - t0)
    return best


def model_gen_s(gen: PTLProfile, out_lens: list[int], prompt_lens: list[int]) -> float:
    """The instance model's (engine_sim) seconds for one instance generating these requests."""
    r = simulate(SimConfig("batch", 1, gen, TrainProfile(s_per_token=0.0, fixed_s=0.0), dispatcher="round_robin"),
                 [Workload(list(out_lens), list(prompt_lens))])
    return r.gen_end[0] - r.gen_start[0]


def generation_passes(cfg, model_dir: str, gen_batches: list[Workload]) -> dict:
    """Generation timed the runtime's way on synthetic iterations of the workload's shapes, at
    one moment: one instance with every request (``runtime_generate_factor``: the runtime's
    generate path, A/B with the bare engine loop) and two colocated instance processes
    (``measure_colocated_generation``: each half alone, both at once). Taken before and after
    each pipeline run and pooled, like the trainer's passes (``TrainerPasses``): the host's
    speed moves over minutes, and one side alone put a run's generation 40% off (s5-8)."""
    full = [(w.out_lens, w.prompt_lens) for w in gen_batches]
    window = cfg.pipeline.stream_window_s
    rt = runtime_generate_factor(cfg.engine, model_dir, full, window_s=window)
    co = measure_colocated_generation(cfg.engine, model_dir, full, window_s=window)
    return {"runtime": rt, "colocated": co}


def host_terms(cfg, model_dir: str, tok, task, wl: Workload, train_tokens, gen_batches: list[Workload],
               gen: PTLProfile, train_prof: TrainProfile, gen_before: dict | None = None) -> dict:
    """Everything the simulator needs about this host besides the stage profiles (see the
    module docstring); all measured."""
    from workers.generation.factory import make_engine
    from workers.model import load_pretrained

    named = {k: v.detach().clone() for k, v in load_pretrained(model_dir, device="cpu").named_parameters()}
    link = measure_weight_sync(named, 1 << 22)  # controller.world.World.bucket_bytes
    engine = make_engine(cfg.engine, model_dir)
    swap = min(_timed(lambda v=v: engine.load_weights(named.items(), v)) for v in range(1, 4))
    total = int(sum(wl.out_lens) + sum(wl.prompt_lens))
    # each stage next to the other stage (disaggregated modes overlap that way; A/B with a
    # paused background process); next to a copy of itself (colocated) below, the runtime's way
    train = lambda: _timed(lambda: train_tokens(total))  # noqa: E731
    train_bg = (cfg.trainer, model_dir, cfg.task.name, dict(cfg.task.kwargs), wl.out_lens, wl.prompt_lens,
                cfg.train.group_size, total)
    # generation as the runtime runs it (GenerationInstance.generate + Outbox) on one iteration
    # of the workload's shapes, on both sides of the A/B (the bare decode loop was ~2x
    # slowed next to training under load while the pipeline's generation was not)
    window = cfg.pipeline.stream_window_s
    gen_iter = generate_timer(cfg.engine, model_dir, wl.out_lens, wl.prompt_lens, window)
    gen_iter()  # warm-up
    g = concurrent_slowdown(gen_iter, trainer_load, train_bg)
    t = concurrent_slowdown(train, runtime_engine_load, (cfg.engine, model_dir, wl.out_lens, wl.prompt_lens, window))
    # colocated training: the two DP ranks (two processes, the trainer's gloo all-reduce) each
    # train half the tokens at once; over the trainer profile's time for one rank's half
    # (+ the all-reduce, timed as a weight-sized sync): the two-ranks slowdown
    ct = measure_colocated_training(*train_bg[:-1], tokens=total // 2, iterations=COLOCATED_TRAIN_ITERATIONS)
    ct_ref = train_prof.s_per_token * (total // 2) + train_prof.fixed_s + link["sync_s"]
    work = controller_work_s(cfg, tok, task, wl)
    handover = train_handover_s(train_tokens, total, cfg.trainer.max_tokens_per_microbatch)
    # generation through the runtime's generate path (GenerationInstance.generate: Outbox
    # thread, samples pickled for the RPC), on synthetic requests (random prompt ids) of the
    # workload's shapes, one instance with every request. Its seconds over the instance
    # model's (engine_sim on the profile) scale the profile: the profile as the runtime's own
    # generate path runs it.
    # colocated: the same path in two worker processes with real RPC (controller/planner/
    # colocated.py), each instance with its round-robin half, samples to both processes'
    # trainer sinks; each half alone (-> the runtime factor at the half, over the instance
    # model of the slower half) and both at once (-> the two-instance slowdown, A/B per iteration).
    # Timed now (after the run) and, when given, before it: pooled.
    sides = [generation_passes(cfg, model_dir, gen_batches)] + ([gen_before] if gen_before else [])
    full_model = [model_gen_s(gen, w.out_lens, w.prompt_lens) for w in gen_batches]
    halves_model = [max(model_gen_s(gen, w.out_lens[k::2], w.prompt_lens[k::2]) for k in (0, 1)) for w in gen_batches]
    # runtime / model per synthetic iteration and side; each factor is the median over both
    # sides' iterations (one iteration hit by a load spike moves a sum, not the median)
    rt_ratios = [[t / m for t, m in zip(sd["runtime"]["runtime_s"], full_model)] for sd in sides]
    co_ratios = [[a / m for a, m in zip(sd["colocated"].alone_s, halves_model)] for sd in sides]
    pooled = lambda per_side: float(np.median([x for r in per_side for x in r]))  # noqa: E731
    co_runs = [sd["colocated"] for sd in sides]
    runtime_over_bare = sum(sum(sd["runtime"]["runtime_s"]) for sd in sides) / sum(sum(sd["runtime"]["bare_s"]) for sd in sides)
    th, ta = co_runs[0].together_threads, co_runs[0].alone_threads
    return {"weight_bytes": sum(v.numel() * v.element_size() for v in named.values()), "sync_s": link["sync_s"],
            "rpc_rtt_s": link["rpc_rtt_s"], "swap_s": swap, "controller_work_s": work,
            "iteration_overhead_s": work + swap + RPC_ROUND_TRIPS * link["rpc_rtt_s"],
            "gen_shared_slowdown": g["slowdown"], "train_shared_slowdown": t["slowdown"],
            "train_handover_s": handover,
            "gen_colocated_slowdown": max(1.0, pooled([[t / a for a, t in zip(c.alone_s, c.together_s)] for c in co_runs])),
            "train_self_slowdown": max(1.0, float(np.median(ct["together_s"])) / ct_ref),
            "colocated_train_together_s": float(np.median(ct["together_s"])), "colocated_train_profile_s": ct_ref,
            "colocated_train_runq_share": ct["threads"]["runq_share"],
            "colocated_gen_alone_s": float(np.mean([x for c in co_runs for x in c.alone_s])),
            "colocated_gen_together_s": float(np.mean([x for c in co_runs for x in c.together_s])),
            "colocated_runq_share_alone": ta["runq_share"], "colocated_runq_share_together": th["runq_share"],
            "colocated_cpu_over_wall_together": th["cpu_s"] / th["wall_s"],
            "colocated_blocked_share_together": th["blocked_s"] / th["wall_s"],
            "gen_iteration_alone_s": g["alone_s"], "gen_iteration_shared_s": g["shared_s"],
            "train_alone_s": t["alone_s"], "train_shared_s": t["shared_s"], "gen_runtime_over_bare": runtime_over_bare,
            "gen_runtime_factor": pooled(rt_ratios), "gen_runtime_factor_colocated": pooled(co_ratios),
            "gen_runtime_factor_sides": [round(float(np.median(r)), 3) for r in rt_ratios],  # after, before
            "gen_runtime_factor_colocated_sides": [round(float(np.median(r)), 3) for r in co_ratios]}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure_profiles(a, cfg, model_dir: str, tok, task, wls: list[Workload], trainer: TrainerPasses,
                     gen_before: dict | None = None) -> tuple[PTLProfile, TrainProfile, dict]:
    """Every profile and host term, measured now, each stage alone (see the module docstring)."""
    from workers.generation.factory import make_engine

    w0 = wls[0]
    engine = make_engine(cfg.engine, model_dir)
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= cfg.engine.max_batch_size]
    gen = profile_engine(engine, batch_sizes=sizes, prompt_len=int(np.mean(w0.prompt_lens)), decode_steps=PTL_DECODE_STEPS, vocab=300,
                         name="bench-model", long_context=1024, repeats=3)
    del engine
    trainer.sample()  # after the run (the first sample was taken before it)
    train = trainer.profile()
    host = host_terms(cfg, model_dir, tok, task, w0, trainer.train_tokens, wls[:RUNTIME_GEN_BATCHES], gen, train,
                      gen_before)
    host["train_profile_passes_s"] = {str(k): [round(x, 4) for x in v] for k, v in trainer.passes.items()}
    return gen, train, host
