"""ReMax's greedy baseline responses: generated beside their groups (StreamRL) or in a second pass
after the batch (verl's ``gen_max``), side by side on the native engine.

    python bench/remax_baseline.py [--quick] [--prompts 16] [--group-size 4] [--cap 1024]
                                   [--batch 64] [--repeats 4] [--threads 2]

The same work for both: ``--prompts`` prompts, each with ``--group-size`` sampled responses
(temperature 1) and one greedy response, every length forced (min = max new tokens) from the
length trace of ``data/length_traces`` (a prompt's answers' words x 4/3, capped at ``--cap``),
on the tiny random Qwen2 of ``bench/engine_throughput.py`` (fp32, CPU). ``beside``: one round of
every request, a group's greedy request in the group (it shares the prompt's KV blocks and fills
the batch while long samples finish). ``second_pass``: the sampled requests, then, once the last
of them finished, the greedy ones (verl: ``generate_sequences`` on the batch, then on the
greedy batch). Decode work is the same; what differs is how full the batches stay. Prints one
JSON line per run, then a summary: ``beside_s``, ``second_pass_s`` (best of the repeats),
``second_pass_over_beside`` (> 1: beside is faster), the median of the repeats' own ratios
(``_paired``) and each (``_per_repeat``). The second pass finds its prompts' full KV blocks in
the engine's prefix cache (``engine.prefix_caching``, on by default since session 46) unless they
were evicted; it prefills the last partial block again (blocks of 128 tokens).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workers.generation.config import EngineConfig  # noqa: E402
from workers.generation.generate_all import generate_all  # noqa: E402
from workers.generation.factory import make_engine  # noqa: E402
from workers.types import Request, SamplingParams  # noqa: E402
from argcheck import positive_int  # noqa: E402  (bench/ is the script's folder)
from engine_throughput import TRACE, random_prompts, tiny_config, write_model  # noqa: E402
from jsonline import json_line  # noqa: E402

Job = list[tuple[torch.Tensor, list[int], int]]  # per prompt: ids, the sampled lengths, the greedy length


def emit(**kw) -> dict:
    print(json_line(kw), flush=True)
    return kw


def workload(prompts: int, group_size: int, cap: int, vocab: int, seed: int = 0) -> Job:
    """Each prompt's ids, its samples' forced lengths (its trace answers in turn) and its greedy
    response's (its first answer's)."""
    with gzip.open(TRACE, "rt") as f:
        rows = [json.loads(line) for line in f]
    pick = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))[:prompts].tolist()
    lens = [min(256, max(8, len(rows[i]["question"]) // 4)) for i in pick]

    def tokens(words: int) -> int:
        return min(cap, max(1, round(words * 4 / 3)))

    job = []
    for ids, i in zip(random_prompts(lens, vocab, seed), pick):
        words = rows[i]["resp_words"]
        job.append((ids, [tokens(words[k % len(words)]) for k in range(group_size)], tokens(words[0])))
    return job


def fresh(job: Job, k: int, vocab: int) -> Job:
    """``job`` with every prompt id shifted by ``k`` (mod the vocabulary): the same lengths and
    work, prompts no earlier run left in the prefix cache."""
    return [((ids + k) % vocab, lens, g) for ids, lens, g in job]


def requests(job: Job, sampled: bool, greedy: bool) -> list[Request]:
    """The job's sampled and / or greedy requests, each group's under its prompt's group id."""
    out = []
    for j, (ids, lens, greedy_len) in enumerate(job):
        per = len(lens) + 1
        if sampled:
            out += [Request(j * per + k, ids, n, n, group_id=j, sampling=SamplingParams(1.0, seed=j * per + k))
                    for k, n in enumerate(lens)]
        if greedy:
            out.append(Request(j * per + len(lens), ids, greedy_len, greedy_len, group_id=j, baseline=True,
                               sampling=SamplingParams(0.0)))
    return out


def run(engine, job: Job, how: str) -> tuple[float, int]:
    """Seconds and generated tokens of the whole job, ``how`` = beside | second_pass."""
    t = time.perf_counter()
    if how == "beside":
        out = generate_all(engine, requests(job, True, True))
    else:
        out = generate_all(engine, requests(job, True, False)) + generate_all(engine, requests(job, False, True))
    dt = time.perf_counter() - t
    want = sum(sum(lens) + g for _, lens, g in job)
    got = sum(len(s.output_ids) for s in out)
    assert got == want, f"{how}: {got} tokens generated, the job forces {want}"
    assert sum(s.baseline for s in out) == len(job), f"{how}: not one greedy response per prompt"
    return dt, got


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 prompts, cap 128, 1 repeat (~5 s)")
    ap.add_argument("--prompts", type=positive_int, default=None)
    ap.add_argument("--group-size", type=positive_int, default=4)
    ap.add_argument("--cap", type=positive_int, default=None, help="longest forced response (tokens)")
    ap.add_argument("--batch", type=positive_int, default=64, help="the engine's max batch size")
    ap.add_argument("--repeats", type=positive_int, default=None)
    ap.add_argument("--threads", type=positive_int, default=2)
    a = ap.parse_args(argv)
    a.prompts = a.prompts or (8 if a.quick else 16)
    a.cap = a.cap or (128 if a.quick else 1024)
    a.repeats = a.repeats or (1 if a.quick else 4)  # even: each competitor goes first as often
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = tiny_config()
    job = workload(a.prompts, a.group_size, a.cap, cfg.vocab_size)
    longest = max(len(ids) + max(max(lens), g) for ids, lens, g in job)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model(cfg, Path(tmp) / "model", torch.float32)
        ecfg = EngineConfig(max_batch_size=a.batch, block_size=128, device="cpu", dtype="float32",
                            attention_backend="cpu", max_model_len=longest + 16, max_prefill_tokens=8192,
                            kv_cache_tokens=max(a.batch * (longest + 128) + 1024, 16384))
        engine = make_engine(ecfg, str(folder))
        run(engine, fresh(job, 0, cfg.vocab_size), "beside")  # warm-up: kernels built, the KV cache's pages
        runs: dict[str, list[float]] = {"beside": [], "second_pass": []}  # touched (the first run was ~25% slower)
        for rep in range(a.repeats):
            for k, how in enumerate(("beside", "second_pass") if rep % 2 == 0 else ("second_pass", "beside")):
                # each run its own prompts (same lengths): the prefix cache kept the run before's,
                # where an iteration's prompts are new (a second pass still finds its own first's)
                dt, tokens = run(engine, fresh(job, 1 + 2 * rep + k, cfg.vocab_size), how)
                runs[how].append(dt)
                emit(run=how, repeat=rep, seconds=round(dt, 3), tokens=tokens, tok_s=round(tokens / dt, 1))
        engine.close()
    best = {k: min(v) for k, v in runs.items()}
    ratios = [s / b for s, b in zip(runs["second_pass"], runs["beside"])]  # each repeat's pair, minutes apart
    return emit(summary=True, prompts=a.prompts, group_size=a.group_size, cap=a.cap, batch=a.batch,
                repeats=a.repeats, threads=a.threads, cpu_count=os.cpu_count(),
                beside_s=round(best["beside"], 3), second_pass_s=round(best["second_pass"], 3),
                second_pass_over_beside=round(best["second_pass"] / best["beside"], 3),
                second_pass_over_beside_paired=round(statistics.median(ratios), 3),
                second_pass_over_beside_per_repeat=[round(r, 3) for r in ratios])


if __name__ == "__main__":
    main()
