"""Trainer memory and step time with the AdamW state whole on every data-parallel rank ("plain"),
sharded over the ranks (ZeRO-1, ``trainer.shard_optimizer``: "zero"), with LoRA adapters of
rank 8 on every linear layer ("lora", ``trainer.lora_rank``), or without a KL coefficient, so
without a reference policy ("noref", ``trainer.kl_coef: 0``), run side by side: the same model,
samples and ranks (gloo, local processes), GRPO (KL loss 0.001, verl's GRPO example, but
"noref"), a few iterations each.

    python bench/trainer_memory.py [--quick] [--ranks 2] [--repeats 2]

Prints one JSON line per competitor and repeat (the largest rank's figures) and a summary line
with ``state_mb_<name>``, ``rss_mb_<name>``, ``step_s_<name>``, ``receive_s_<name>`` for each
competitor and ``zero_over_plain_state``, ``zero_over_plain_step``, ``lora_over_plain_rss``,
``noref_over_plain_rss``, ``noref_over_plain_receive``."""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from workers.heap import rss_mb, trim
from workers.model import ModelConfig
from workers.tasks import make_task
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer.bootstrap import build_model_dir
from workers.trainer.optimizer import local_state_elements, sharded
from workers.trainer.rollout import rollout
from workers.weight_sync.localrun import run_local
from jsonline import json_line  # bench/ is the script's folder
from argcheck import fill_defaults, int_at_least, positive_int

COMPETITORS = ("plain", "zero", "lora", "noref")
LORA_RANK = 8


def _task():
    return make_task("synthetic", max_terms=3, num_train=64, num_test=16)


class _VariedReward:  # rewards that differ inside a group: the update is not zero
    def __init__(self):
        self.base = _task()

    def prompts(self, split):
        return self.base.prompts(split)

    def score(self, prompt, completion):
        return (len(completion) % 5) / 4


def _rank(rank: int, world: int, model_dir: str, data, name: str, iterations: int) -> dict:
    samples, prompts, groups = data
    cfg = TrainerConfig(algorithm="grpo", lr=1e-4, shard_optimizer=name == "zero", max_tokens_per_microbatch=512,
                        lora_rank=LORA_RANK if name == "lora" else 0, kl_coef=0.0 if name == "noref" else 0.001,
                        max_staleness=1000)  # the same samples each iteration
    w = TrainerWorker(cfg, model_dir, _VariedReward(), rank=rank, world_size=world, device="cpu")
    assert sharded(w.optimizer) is (name == "zero")
    steps, receives = [], []
    for it in range(iterations):
        w.begin_iteration(it, prompts, groups)
        t = time.perf_counter()
        w.receive([s for s in samples if s.group_id % world == rank])
        receives.append(time.perf_counter() - t)
        t = time.perf_counter()
        w.step()
        steps.append(time.perf_counter() - t)
    params = sum(p.numel() for p in w.actor.parameters())
    trim()  # freed heap back to the kernel first (workers/heap.py): RSS then counts what is held
    return {"state_mb": local_state_elements(w.optimizer) * 4 / 1e6, "rss_mb": rss_mb(),
            "step_s": statistics.median(steps[1:]) if len(steps) > 1 else steps[0],
            "receive_s": statistics.median(receives[1:]) if len(receives) > 1 else receives[0], "params": params}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a 4-layer model, 3 iterations (else 8 layers, 4)")
    ap.add_argument("--ranks", type=int_at_least(2), default=2, help="data-parallel trainer ranks")
    ap.add_argument("--repeats", type=positive_int, default=2, help="alternations of the competitors")
    ap.add_argument("--layers", type=positive_int, default=None, help="decoder layers (hidden 512)")
    ap.add_argument("--iterations", type=int_at_least(2), default=None,
                    help="iterations a competitor runs (the first allocates the AdamW state; step time is "
                         "the median of the others)")
    return fill_defaults(ap.parse_args(argv), quick={"layers": 4, "iterations": 3}, full={"layers": 8, "iterations": 4})


def main(argv=None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=300, hidden_size=512, intermediate_size=1536, num_hidden_layers=a.layers,
                      num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)
    best: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_model_dir(Path(tmp) / "m", _task(), cfg, seed=0)[0])
        ref = TrainerWorker(TrainerConfig(), model_dir, _task(), device="cpu")
        data = rollout(ref.actor, ref.tokenizer, _task().prompts("train")[:4 * a.ranks], 4, 24, seed=1)
        del ref
        for repeat in range(a.repeats):
            for name in COMPETITORS:
                ranks = run_local(a.ranks, _rank, model_dir, data, name, a.iterations)
                row = {k: max(r[k] for r in ranks) for k in ("state_mb", "rss_mb", "step_s", "receive_s")}
                row["state_mb_total"] = sum(r["state_mb"] for r in ranks)
                print(json_line({"bench": "trainer_memory", "competitor": name, "repeat": repeat, "ranks": a.ranks,
                                 "params": ranks[0]["params"], **{k: round(v, 4) for k, v in row.items()}}),
                      flush=True)
                prev = best.get(name)
                best[name] = {k: min(row[k], prev[k]) if prev else row[k] for k in row}
    p, z, lo, nr = best["plain"], best["zero"], best["lora"], best["noref"]
    summary = {"summary": True, "ranks": a.ranks, "layers": a.layers}
    for name, b in best.items():
        summary.update({f"state_mb_{name}": round(b["state_mb"], 2), f"rss_mb_{name}": round(b["rss_mb"], 1),
                        f"step_s_{name}": round(b["step_s"], 4), f"receive_s_{name}": round(b["receive_s"], 4)})
    summary.update(zero_over_plain_state=round(z["state_mb"] / p["state_mb"], 3),
                   zero_over_plain_step=round(z["step_s"] / p["step_s"], 3),
                   lora_over_plain_rss=round(lo["rss_mb"] / p["rss_mb"], 3),
                   noref_over_plain_rss=round(nr["rss_mb"] / p["rss_mb"], 3),
                   noref_over_plain_receive=round(nr["receive_s"] / p["receive_s"], 3))
    print(json_line(summary), flush=True)


if __name__ == "__main__":
    main()
