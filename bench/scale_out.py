"""Benchmark: dynamic scale-out of generation as output lengths grow (paper Figure 11, scaled down).

    python bench/scale_out.py [--quick] [--profile FILE] [--logdir DIR]

Writes its run (logs, TensorBoard, the model, ptl_profile.json, joiner.log) to a new folder
runs/bench_scale_out/YYYYmmdd-HHMMSS, or to --logdir DIR (relative to the repository root),
which must not hold a run already (refused up front; nothing there is written).

Starts its own processes: torchrun with 3 ranks (controller, 1 generation instance, 1 trainer
rank) and one spare process ``controller/main.py --join ADDR --role generation`` that
registers with the controller and waits. The run is the real controller session
(``controller/session.Session``: its ``ScaleOutPolicy``, TensorBoard metrics and join path);
only the output lengths are forced, through ``Program.length_of``: every sample of iteration
i gets ``start + (end - start) * i / (grow - 1)`` tokens (then stays at ``end``). Generation
time grows with the lengths; the policy adds the spare instance at the first iteration
boundary after delta = gen - train reaches delta' (the predicted saving of one more
instance). The PTL profile the policy uses is measured here first with ``profile_engine``
and passed as ``dispatch.profile``. ``placement.force_scale_out_at`` is NOT used.

Prints one JSON line per iteration (iteration, forced_len, gen_s, train_s, delta_s,
delta_prime_s, instances, wanted: delta >= delta', add: an add decided with a joiner waiting) and a summary line (scale_out_iteration, delta_at_scale_out,
delta_prime_at_scale_out, gen_s_before, gen_s_after, logdir, tb_delta: the delta curve read
back from the TensorBoard event file).
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jsonline import json_line  # noqa: E402  (bench/ is the script's folder)

DEFAULT_LOGDIR = "runs/bench_scale_out"  # a new timestamped sub-folder per run
QUICK = {"iterations": 16, "grow": 12}  # --quick's defaults; flags given win
FULL = {"iterations": 24, "grow": 20}


def parse_args(argv=None):
    from argcheck import fill_defaults, folder, int_at_least, positive_int
    from controller.modes import MODES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short run (~1 minute)")
    ap.add_argument("--iterations", type=positive_int,
                    help=f"iterations in all (default {FULL['iterations']}, --quick {QUICK['iterations']})")
    ap.add_argument("--grow", type=positive_int, help=f"iterations over which the length rises "
                                                      f"(default {FULL['grow']}, --quick {QUICK['grow']})")
    ap.add_argument("--start-len", type=positive_int, default=8, help="forced length of iteration 0")
    ap.add_argument("--end-len", type=positive_int, default=128, help="forced length once grown (>= --start-len)")
    ap.add_argument("--prompts", type=positive_int, default=4, help="prompts per iteration")
    ap.add_argument("--group", type=int_at_least(2), default=4, help="samples per prompt (GRPO: >= 2)")
    ap.add_argument("--prompt-terms", type=positive_int, default=28,
                    help="numbers per prompt (long prompts: training pays for them, generation barely)")
    ap.add_argument("--mode", default="stream", choices=[m for m, mode in MODES.items() if not mode.colocated],
                    help="pipeline mode (colocated runs are static: nothing to scale out)")
    ap.add_argument("--profile", default="",
                    help="reuse this PTL profile JSON instead of measuring one (relative to the repository root)")
    ap.add_argument("--logdir", default="",
                    help=f"run folder, relative to the repository root; must not hold a run "
                         f"(default: a new {DEFAULT_LOGDIR}/YYYYmmdd-HHMMSS)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.end_len < a.start_len:
        ap.error(f"argument --end-len: must be >= --start-len ({a.start_len}): the length rises, got {a.end_len}")
    if a.profile and not (ROOT / a.profile).is_file():  # the ranks run in the repository root
        ap.error(f"argument --profile: no such file: {ROOT / a.profile}")
    if a.profile:
        from controller.ptl_profile import PTLProfile

        try:
            PTLProfile.load(ROOT / a.profile)
        except (ValueError, OSError) as e:
            ap.error(f"argument --profile: {e}")
    if a.logdir:
        try:
            folder(str(ROOT / a.logdir))
        except argparse.ArgumentTypeError as e:
            ap.error(f"argument --logdir: {e}")
    if not a.worker:  # the launcher picks the folder and passes it on to the ranks
        if not a.logdir:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            a.logdir, n = f"{DEFAULT_LOGDIR}/{stamp}", 1
            while (ROOT / a.logdir).exists():  # two runs started within a second
                n += 1
                a.logdir = f"{DEFAULT_LOGDIR}/{stamp}-{n}"
        else:
            from controller.config import ConfigError
            from controller.preflight import refuse_previous_run

            try:  # the controller's own test, made before anything is written or started
                refuse_previous_run(ROOT / a.logdir)
            except ConfigError:
                ap.error(f"--logdir {a.logdir} already holds a run; pass a new folder, or leave --logdir out "
                         f"(a new timestamped folder under {DEFAULT_LOGDIR}/)")
    return fill_defaults(a, QUICK, FULL)


def forced_len(a, iteration: int) -> int:
    """Linear rise from start_len to end_len over ``grow`` iterations, then flat."""
    f = min(1.0, iteration / max(1, a.grow - 1))
    return int(round(a.start_len + (a.end_len - a.start_len) * f))


def bench_config(a, profile: str = ""):
    from controller.config import from_dict

    return from_dict({
        "model": {"path": f"{a.logdir}/model", "init": {"hidden_size": 128, "intermediate_size": 384,
                                                          "num_hidden_layers": 2, "num_attention_heads": 4,
                                                          "num_key_value_heads": 2, "vocab_size": 384}},
        "task": {"name": "synthetic", "kwargs": {"kind": "running_sum", "num_train": 2048, "max_value": 999,
                                                         "min_terms": a.prompt_terms, "max_terms": a.prompt_terms}},
        "engine": {"max_batch_size": 64, "kv_cache_tokens": 32768, "device": "cpu"},
        "trainer": {"algorithm": "grpo", "lr": 1e-5, "max_tokens_per_microbatch": 1024},
        "placement": {"generation": [1], "trainer": [2]},
        "pipeline": {"mode": a.mode},
        "dispatch": {"profile": profile},
        "train": {"batch_prompts": a.prompts, "group_size": a.group, "max_tokens": a.end_len,
                  "iterations": a.iterations, "sft_steps": 0, "eval_every": 0, "ckpt_every": 0},
        "logging": {"logdir": a.logdir, "progress": False, "timeline_every": 0},
    }, world_size=3)


def measure_profile(cfg, model_dir: str, path: Path):
    """PTL(BS) of this model's engine on this machine (the policy's relative savings)."""
    from controller.planner.profile import profile_engine
    from workers.generation.factory import make_engine

    engine = make_engine(cfg.engine, model_dir)
    prof = profile_engine(engine, batch_sizes=(1, 2, 4, 8, 16, 32, 64), prompt_len=16, decode_steps=16, vocab=300,
                          name="scale-out-bench", long_context=256, repeats=3)
    del engine
    prof.save(str(path))
    return prof


def read_tb(logdir: Path) -> dict:
    """The balance curves as TensorBoard stored them (EventAccumulator on <logdir>/tb)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    out = {}
    for tag in ("balance/delta_s", "balance/delta_prime_s", "sgs/instances"):
        if tag in acc.Tags().get("scalars", []):
            out[tag] = [(e.step, round(e.value, 4)) for e in acc.Scalars(tag)]
    return out


def controller(a) -> int:
    import torch.distributed.rpc as rpc

    from controller import joiners, runner, session as session_mod
    from controller.bootstrap import ensure_model

    logdir = Path(a.logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    cfg0 = bench_config(a)
    boot = rpc.rpc_sync("worker2", ensure_model, args=(cfg0.model.path, cfg0.model.init, cfg0.task.name,
                                                       dict(cfg0.task.kwargs), 0, 1e-3, 0), timeout=600)
    if a.profile:  # a profile measured earlier (e.g. on a quiet machine)
        from controller.scheduling import PTLProfile

        PTLProfile.load(a.profile).save(str(logdir / "ptl_profile.json"))
        prof = PTLProfile.load(str(logdir / "ptl_profile.json"))
    else:
        prof = measure_profile(cfg0, boot["path"], logdir / "ptl_profile.json")
    print(json_line({"profile": {"batch_sizes": prof.batch_sizes, "ptl_ms": [round(x * 1e3, 3) for x in prof.ptl_s]}}),
          flush=True)
    cfg = bench_config(a, str(logdir / "ptl_profile.json"))
    session = session_mod.Session(cfg, argparse.Namespace(config=None, repl=False, resume="", set=[]), 3)
    prog = session.program
    current = {"it": 0}
    make_batch = prog.make_batch

    def make_batch_at(iteration):
        current["it"] = iteration
        return make_batch(iteration)

    prog.make_batch = make_batch_at
    prog.length_of = lambda item: forced_len(a, current["it"])
    rows: list[dict] = []
    on_iteration = prog.on_iteration

    def log_row(res):
        on_iteration(res)
        d = session.policy.history[-1] if session.policy.history else None
        if d is None or d.iteration != res.iteration:
            return
        row = {"iteration": res.iteration, "forced_len": forced_len(a, res.iteration),
               "delta_s": round(d.delta_s, 4), "delta_prime_s": round(d.delta_prime_s, 4),
               "instances": len(session.world.sgs.slots), "wanted": d.wanted, "add": d.add, "reason": d.reason}
        rows.append(row)

    prog.on_iteration = log_row
    # gen/train busy seconds come from Metrics.log_iteration's derived values
    log_iteration = session.metrics.log_iteration
    derived_by_it: dict[int, dict] = {}

    def log_iteration_keep(res, spans):
        derived = log_iteration(res, spans)
        derived_by_it[res.iteration] = derived
        return derived

    session.metrics.log_iteration = log_iteration_keep
    code = 0
    try:
        summary = session.run()
    except Exception as e:  # noqa: BLE001 - report and stop every process
        print(json_line({"error": repr(e)}), flush=True)
        summary, code = {}, 1
    for row in rows:
        dv = derived_by_it.get(row["iteration"], {})
        row["gen_s"] = round(dv.get("time/generate_busy_s", float("nan")), 4)
        row["train_s"] = round(dv.get("time/train_busy_s", float("nan")), 4)
        print(json_line(row), flush=True)
    adds = [r for r in rows if r["add"]]
    first = adds[0] if adds else None
    # the first iteration that ran with more instances than the first one did (the joiner, rank 3)
    joined_at = next((r["iteration"] for r in rows if rows and r["instances"] > rows[0]["instances"]), None)
    mean = lambda xs: round(sum(xs) / len(xs), 4) if xs else None  # noqa: E731
    before = [r["gen_s"] for r in rows if first and first["iteration"] - 2 <= r["iteration"] <= first["iteration"]]
    after = [r["gen_s"] for r in rows if joined_at is not None and joined_at <= r["iteration"] <= joined_at + 2]
    per_tok = lambda rs: mean([r["gen_s"] / r["forced_len"] * 1e3 for r in rs])  # noqa: E731
    before_ms = per_tok([r for r in rows if first and first["iteration"] - 2 <= r["iteration"] <= first["iteration"]])
    after_ms = per_tok([r for r in rows if joined_at is not None and joined_at <= r["iteration"] <= joined_at + 2])
    tb = read_tb(logdir)
    no_add = None  # why the summary's scale-out fields are null (delta depends on the machine's load)
    if first is None and rows:
        c = max(rows, key=lambda r: r["delta_s"] - r["delta_prime_s"])
        no_add = (f"no add: delta stayed below delta' in all {len(rows)} iterations (closest: iteration "
                  f"{c['iteration']}, delta {c['delta_s']:.3f} s vs delta' {c['delta_prime_s']:.3f} s)"
                  if not any(r["wanted"] for r in rows) else
                  f"no add: {next(r['reason'] for r in rows if r['wanted'])}")
    print(json_line({"summary": True, "quick": a.quick, "iterations": a.iterations,
                      "samples_per_iteration": a.prompts * a.group,
                      "lengths": [forced_len(a, i) for i in range(a.iterations)],
                      "scale_out_iteration": first["iteration"] if first else None, "no_add": no_add,
                      "instance_joined_at": joined_at,
                      "delta_at_scale_out": first["delta_s"] if first else None,
                      "delta_prime_at_scale_out": first["delta_prime_s"] if first else None,
                      "gen_s_before": mean(before), "gen_s_after": mean(after),
                      "gen_ms_per_token_before": before_ms, "gen_ms_per_token_after": after_ms,
                      "forced_len_before": first["forced_len"] if first else None,
                      "forced_len_after": forced_len(a, joined_at) if joined_at is not None else None,
                      "instances_final": len(session.world.sgs.slots),
                      "tb_delta": tb.get("balance/delta_s"), "tb_delta_prime": tb.get("balance/delta_prime_s"),
                      "tb_instances": tb.get("sgs/instances"),
                      "samples_per_s": summary.get("samples_per_s"), "profile_ptl_ms": [round(x * 1e3, 3) for x in prof.ptl_s],
                      "logdir": str(logdir)}), flush=True)
    ranks = [1, 2] + session.joined + session.waiting + joiners.announced()
    runner._stop_workers(ranks, code)
    return code


def main() -> int:
    a = parse_args()
    if not a.worker:  # launcher: torchrun job + one spare generation process that joins it
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        Path(ROOT / a.logdir).mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port", str(port),
               __file__, "--worker", *sys.argv[1:], "--logdir", a.logdir]
        main_p = subprocess.Popen(cmd, cwd=ROOT, env=env)
        with open(ROOT / a.logdir / "joiner.log", "w") as log:
            joiner = subprocess.Popen([sys.executable, "controller/main.py", "--join", f"127.0.0.1:{port}",
                                       "--role", "generation"], cwd=ROOT, env=env, stdout=log, stderr=log)
            try:
                code = main_p.wait(timeout=1800)
            finally:
                for p in (main_p, joiner):
                    if p.poll() is None:
                        try:
                            p.wait(timeout=30)
                        except subprocess.TimeoutExpired:
                            p.kill()
        return code
    import torch

    from controller.processes import run_rank

    torch.set_num_threads(1)
    return run_rank(lambda: controller(a), 600.0)


if __name__ == "__main__":
    sys.exit(main())
