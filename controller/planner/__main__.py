"""Planner CLI: plan a cluster for an RL job, or compare allocations at cluster scale.

    python -m controller.planner plan --cluster configs/plan_cluster_h800.yaml --model qwen2.5-7b \
        --trace data/length_traces/llama33_70b_rg_easy.val.jsonl.gz
    python -m controller.planner report --trace data/length_traces/llama33_70b_rg_easy.val.jsonl.gz

``plan`` prints the generation tensor-parallel size (``tp``, searched unless the cluster file
fixes ``gen_tp``; ``tp_tried``: Algorithm 1's iteration time with each size tried), and for
each pipeline mode the recommended allocation with the objective it minimises (the async
modes: Algorithm 1's max(gen, train), planned on every simulated iteration's batch; batch,
minibatch, stream: their own simulated iteration time; colocated: every GPU), its simulated
iteration time, samples/s and samples per dollar; on one datacenter also the even split (one
JSON object).
``report`` runs the cluster-scale comparisons of docs/planner.md for Qwen2.5 7B..72B: the
mode's recommended allocation vs an even split on one H800 datacenter, and H20 generation +
H800 training (cross-DC) vs all-H800, in samples per dollar. One JSON line per model, then a
summary.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from controller.planner.cluster import MAX_GPUS, Cluster, Datacenter, load_cluster, load_model
from controller.planner.planner import Planner, describe, describe_mode
from controller.planner.workloads import load_trace, sample_workloads
from controller.planner.hardware import MODELS, PASSES
from controller.planner.simulator import MODES


MAX_LEN_SCALE = 1e6  # --len-scale: a trace answer (<= 1e9 words) times this stays a finite token count
# the reported time leaves the first iteration out (warm-up) and averages whole pipeline periods
# (SimResult.steady_iteration_s): two iterations in the one-step off-policy modes
MIN_ITERATIONS = 3


def _number(kind, strict: bool = True, lo: float = 0, hi: float | None = None, why: str = ""):
    """argparse type: a finite number of ``kind`` > ``lo`` (``strict``) or >= ``lo``, and <=
    ``hi``; a bad value (nan, inf, a negative) exits 2 with argparse's usage line naming the flag."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if not (v > lo if strict else v >= lo):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {lo:g}{why}, got {text}")
        if hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"must be <= {hi:g}{why}, got {text}")
        return v
    parse.__name__ = f"{'positive' if strict else 'non-negative'} {kind.__name__}"
    return parse


def _planner(cluster: Cluster, model, args) -> Planner:
    trace = load_trace(args.trace, args.max_len, args.len_scale)
    if args.group_size is not None and args.algorithm != "remax":
        raise ValueError(f"--group-size is remax's (its greedy response per prompt); --algorithm {args.algorithm} "
                         "generates and trains the same samples")
    if args.algorithm == "remax" and args.group_size is None:
        raise ValueError("--algorithm remax needs --group-size N (samples per prompt, train.group_size): "
                         "remax generates one greedy response per prompt besides them, which trains nothing")
    wl = sample_workloads(trace, args.batch, args.iterations, args.seed, greedy_group=args.group_size or 0)
    whiten = {"auto": None, "on": True, "off": False}[args.whiten]
    return Planner(cluster, model, wl, args.algorithm, args.dispatcher, whiten, args.reference,
                   args.filter_groups, args.is_batch_normalize)


def cmd_plan(args) -> dict:
    p = _planner(load_cluster(args.cluster), load_model(args.model), args)
    out = {"cluster": p.cluster.name, "model": p.model.name, "tp": p.tp, "algorithm": p.algorithm, "whiten": p.whiten,
           "filter_groups": p.filter_groups, "is_batch_normalize": p.is_batch_normalize,
           "train_at_end": p.train_at_end, "reference": p.reference,
           "tp_from": "gen_tp (cluster file)" if p.tp_fixed else "searched",
           "tp_tried": [o.summary() for o in p.tp_options],
           "recommended": {mode: describe_mode(plan, mode) for mode, plan in p.recommend().items()}}
    if not p.cluster.cross_dc:
        even, refused = p.even_split()
        out["even_split"] = {"skipped": refused} if refused else describe(p.simulate_modes(even))
    print(json.dumps(out, indent=1))
    return out


def cmd_report(args) -> dict:
    n, m_h20, n_h800 = args.gpus, args.h20_gpus, args.h800_gpus
    unit = {"gen_unit": args.unit, "trainer_unit": args.unit} if args.unit else {}
    h800 = Cluster("all-h800", [Datacenter("dc", "H800", n, args.h800_price)], **unit)
    hetero = Cluster("h20-gen+h800-train", [Datacenter("gen", "H20", m_h20, args.h20_price, "generation"),
                                           Datacenter("train", "H800", n_h800, args.h800_price, "trainer")],
                     link_gbps=args.link_gbps, **unit)
    mode = args.mode
    rows = []
    for name in args.models:
        model = MODELS[name]
        p = _planner(h800, model, args)
        best = p.recommend([mode])[mode]
        even, refused = p.even_split()  # half the GPUs do not hold the trainer: no baseline to compare
        even = None if refused else p.simulate_modes(even, [mode])
        q = _planner(hetero, model, args)
        het = q.recommend([mode])[mode]
        per_dollar = het.modes[mode]["samples_per_dollar"], best.modes[mode]["samples_per_dollar"]
        row = {"model": name, "mode": mode, "algorithm": p.algorithm, "whiten": p.whiten,
               "filter_groups": p.filter_groups, "is_batch_normalize": p.is_batch_normalize,
               "train_at_end": p.train_at_end,
               "planned_h800": describe_mode(best, mode),
               "even_h800": {"skipped": refused} if refused else describe(even),
               "h20_h800": describe_mode(het, mode),
               "alloc_vs_even_throughput": None if refused else
               round(best.modes[mode]["samples_per_s"] / even.modes[mode]["samples_per_s"], 3),
               # null when a price of 0 makes either side's samples per dollar null (unbounded)
               "hetero_vs_h800_samples_per_dollar": None if None in per_dollar else round(per_dollar[0] / per_dollar[1], 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {"summary": {r["model"]: {"alloc_vs_even": r["alloc_vs_even_throughput"],
                                        "hetero_per_dollar": r["hetero_vs_h800_samples_per_dollar"]} for r in rows}}
    print(json.dumps(summary))
    return summary


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` names each flag's default (docs/planner.md lists them in brackets), except
    where there is none: a required flag, one left unset, or a switch (``--no-reference``'s
    "default: True" read as if the switch were on by default)."""

    def _get_help_string(self, action):
        switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        return action.help if action.required or action.default is None or switch else super()._get_help_string(action)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m controller.planner", description=__doc__.splitlines()[0],
                                 formatter_class=_Help)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{plan,report}")
    helps = {"plan": "each pipeline mode's recommended generation/training split (async modes: Algorithm 1; "
                     "batch/minibatch/stream: their own shortest simulated iteration) with its simulated iteration "
                     "time, samples/s and samples per dollar, for one cluster and model",
             "report": "cluster-scale comparisons for Qwen2.5 7B..72B: the mode's recommended split vs an even split, and "
                       "H20 generation + H800 training vs all-H800 (docs/planner.md)"}
    for name in ("plan", "report"):
        s = sub.add_parser(name, help=helps[name], description=helps[name],
                           formatter_class=_Help)
        s.add_argument("--trace", required=True, help="length trace (.jsonl.gz) or JSON list of lengths")
        s.add_argument("--batch", type=_number(int), default=1024, help="samples per iteration")
        s.add_argument("--iterations", type=_number(int, strict=False, lo=MIN_ITERATIONS,
                                                    why=" (the first is warm-up, then at least one "
                                                        "period of two in the async modes)"), default=4,
                       help="simulated iterations (>= 3), each its own batch; Algorithm 1 plans on all of them (mean "
                            "stage times); the first is warm-up (left out of the reported time), which averages "
                            "whole periods (in the async modes two iterations: one waits for a weight sync, one not)")
        s.add_argument("--max-len", type=_number(int), default=20000, help="output length cap (tokens)")
        s.add_argument("--len-scale", type=_number(float, hi=MAX_LEN_SCALE), default=1.0,
                       help=f"multiply the trace's lengths (<= {MAX_LEN_SCALE:g})")
        s.add_argument("--algorithm", default="ppo", choices=sorted(PASSES), help="trainer.algorithm simulated")
        s.add_argument("--group-size", type=_number(int), default=None,
                       help="remax only (required there): samples per prompt; each prompt also generates one greedy "
                            "response (generation work that trains nothing)")
        s.add_argument("--whiten", default="auto", choices=["auto", "on", "off"],
                       help="trainer.whiten_advantages (auto: on for ppo and REINFORCE++, as the trainer and verl): "
                            "with it on, every mode trains after the iteration's last sample")
        s.add_argument("--filter-groups", action="store_true",
                       help="trainer.filter_groups (DAPO's dynamic sampling): every mode trains after the "
                            "iteration's last sample (the refill batches it may generate are not simulated)")
        s.add_argument("--is-batch-normalize", action="store_true",
                       help="trainer.rollout_is_batch_normalize: every mode trains after the iteration's last sample")
        s.add_argument("--no-reference", dest="reference", action="store_false",
                       help="trainer.kl_coef 0: no reference model to hold or run (as verl without use_kl_loss / "
                            "use_kl_in_reward): one forward a token fewer, one bf16 model less in the trainer's memory")
        s.add_argument("--dispatcher", default="skew_paper", help="controller.scheduling dispatcher name")
        s.add_argument("--seed", type=_number(int, strict=False), default=0, help="workload draw seed (>= 0)")
        if name == "plan":
            s.add_argument("--cluster", required=True,
                           help="planner cluster file (YAML: datacenters with GPU type, count, price and role, "
                                "links; configs/plan_cluster_*.yaml)")
            s.add_argument("--model", required=True, help=f"file or one of {sorted(MODELS)}")
        else:
            s.add_argument("--models", nargs="+", choices=sorted(MODELS),
                           default=sorted(MODELS, key=lambda k: MODELS[k].params), help="models compared")
            s.add_argument("--mode", default="async_stream", choices=[m for m in MODES if m != "colocated"],
                           help="pipeline mode compared (colocated has no cross-datacenter form)")
            s.add_argument("--gpus", type=_number(int, hi=MAX_GPUS), default=128,
                           help="H800 GPUs of the homogeneous cluster")
            s.add_argument("--h20-gpus", type=_number(int, hi=MAX_GPUS), default=64,
                           help="H20 GPUs (generation) of the heterogeneous cluster")
            s.add_argument("--h800-gpus", type=_number(int, hi=MAX_GPUS), default=64,
                           help="H800 GPUs (training) of the heterogeneous cluster")
            s.add_argument("--h800-price", type=_number(float, strict=False), default=2.0,
                           help="dollars per GPU-hour (>= 0)")
            s.add_argument("--h20-price", type=_number(float, strict=False), default=0.7,
                           help="dollars per GPU-hour (>= 0)")
            s.add_argument("--link-gbps", type=_number(float), default=80.0,
                           help="the cross-datacenter link (Gbit/s)")
            s.add_argument("--unit", type=_number(int), default=None,
                           help="GPU granularity of both stages (unset: the cluster default, 8)")
    args = ap.parse_args(argv)
    try:
        {"plan": cmd_plan, "report": cmd_report}[args.cmd](args)
    except (ValueError, OSError) as e:  # bad input files and values: one line, exit 2
        print(f"planner: {e}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
