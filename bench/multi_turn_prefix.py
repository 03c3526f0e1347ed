"""Multi-turn rollouts with and without the native engine's automatic prefix caching, side by side.

    python bench/multi_turn_prefix.py [--quick] [--prompts 32] [--prompt-len 256] [--turns 4]
                                      [--obs-len 64] [--repeats 3] [--threads 2]

The same work for both: ``--prompts`` random prompts of ``--prompt-len`` tokens on the tiny
random Qwen2 of ``bench/engine_throughput.py`` (fp32, CPU; sampled at temperature 1 with a seed
per request, as its greedy output repeats a token for ever), each a trajectory of
``--turns`` assistant turns through ``MultiTurnEngine`` (workers/generation/multi_turn.py): an
environment answers every turn but the last with an observation of ``--obs-len`` tokens. The
random model's turns end within a few tokens (half the vocabulary is EOS), so a turn's cost is
mostly the prefill of its context, which grows by an observation a turn. ``caching_on``:
``engine.prefix_caching: true`` (the default), each continuation finds the blocks of its
context so far by hash and computes only its new tokens and the last partial block;
``caching_off``: each continuation prefills its whole context again. One JSON line per run
(seconds, the prompt tokens submitted over every turn, the cache's hit tokens, what was
computed), then a summary: ``off_over_on`` (best against best; > 1: caching is faster), the
median of the repeats' own ratios (``_paired``), and the prefill tokens each computed.
"""
from __future__ import annotations

import argparse
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
from workers.generation.multi_turn import MultiTurnEngine  # noqa: E402
from workers.tokenizer import train_bpe  # noqa: E402
from workers.types import Request, SamplingParams  # noqa: E402
from argcheck import positive_int  # noqa: E402  (bench/ is the script's folder)
from engine_throughput import random_prompts, tiny_config, write_model  # noqa: E402
from jsonline import json_line  # noqa: E402


def emit(**kw) -> dict:
    print(json_line(kw), flush=True)
    return kw


class Observer:
    """Answers turns 1 .. turns-1 with ``text``; None after the last."""

    def __init__(self, text: str, turns: int):
        self.text, self.turns = text, turns

    def __call__(self, task, messages):
        done = sum(m["role"] == "assistant" for m in messages)
        return self.text if done < self.turns else None


def observation_text(tok, n: int) -> str:
    """A text of exactly ``n`` tokens under ``tok`` (words repeated, then trimmed by tokens)."""
    ids = tok.encode("the tool answered with a long result " * n)[:n]
    text = tok.decode(ids)
    assert len(tok.encode(text)) == n, "the observation does not re-encode to n tokens"
    return text


def submitted_tokens(samples, prompt_len: int) -> int:
    """Prompt tokens of every turn's request: the prompt, then at each turn's start everything before it."""
    total = 0
    for s in samples:
        mask = s.loss_mask.tolist()
        starts = [0] + [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]
        total += sum(prompt_len + i for i in starts)
    return total


def run(folder: Path, tok, prompts: list[torch.Tensor], args, caching: bool) -> dict:
    vocab = tiny_config().vocab_size  # the model's (the tokenizer's may be smaller)
    cfg = EngineConfig(max_batch_size=64, block_size=16, kv_cache_tokens=65536, device="cpu", dtype="float32",
                       prefix_caching=caching, eos_ids=tuple(range(vocab // 2, vocab)))
    env = Observer(observation_text(tok, args.obs_len), args.turns)
    eng = MultiTurnEngine(make_engine(cfg, str(folder)), tok, env, "bench", max_turns=args.turns,
                          max_observation_tokens=args.obs_len)
    budget = args.turns * (args.obs_len + 64)
    reqs = [Request(i, p, budget, sampling=SamplingParams(temperature=1.0, seed=i)) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    out = generate_all(eng, reqs)
    seconds = time.perf_counter() - t0
    hits = eng.stats().prefix_cache_hit_tokens
    eng.close()
    assert all(s.finish_reason != "error" for s in out), [s.error for s in out if s.error][:1]
    sent = submitted_tokens(out, args.prompt_len)
    return {"seconds": seconds, "turns_mean": statistics.mean(s.turns for s in out), "submitted_tokens": sent,
            "hit_tokens": hits, "computed_tokens": sent - hits,
            "generated_tokens": sum(int(s.loss_mask.sum()) for s in out)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 prompts of 64 tokens, 3 turns, 1 repeat (flags given win)")
    ap.add_argument("--prompts", type=positive_int, default=None, help="[32]")
    ap.add_argument("--prompt-len", type=positive_int, default=None, help="[256]")
    ap.add_argument("--turns", type=positive_int, default=None, help="[4]")
    ap.add_argument("--obs-len", type=positive_int, default=64)
    ap.add_argument("--repeats", type=positive_int, default=None, help="[3]")
    ap.add_argument("--threads", type=positive_int, default=2)
    args = ap.parse_args(argv)
    for key, full, quick in (("prompts", 32, 8), ("prompt_len", 256, 64), ("turns", 4, 3), ("repeats", 3, 1)):
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    torch.set_num_threads(args.threads)
    texts = ["the tool answered with a long result", "what is the answer to the question"] * 50
    tok = train_bpe(texts, vocab_size=tiny_config().vocab_size)
    runs: dict[str, list[dict]] = {"caching_on": [], "caching_off": []}
    with tempfile.TemporaryDirectory() as d:
        folder = write_model(tiny_config(), Path(d) / "model", torch.float32)
        prompts = random_prompts([args.prompt_len] * args.prompts, tok.vocab_size, seed=0)
        run(folder, tok, prompts[:2], args, True)  # warm-up: the C++ kernels built and loaded
        for k in range(args.repeats):
            for name in (("caching_on", "caching_off") if k % 2 == 0 else ("caching_off", "caching_on")):
                r = run(folder, tok, prompts, args, name == "caching_on")
                runs[name].append(r)
                emit(run=name, repeat=k, prompts=args.prompts, prompt_len=args.prompt_len, turns=args.turns,
                     obs_len=args.obs_len, **r)
    best = {k: min(r["seconds"] for r in v) for k, v in runs.items()}
    pairs = [off["seconds"] / on["seconds"] for on, off in zip(runs["caching_on"], runs["caching_off"])]
    return emit(summary=True, quick=args.quick, caching_on_s=best["caching_on"], caching_off_s=best["caching_off"],
                off_over_on=best["caching_off"] / best["caching_on"], off_over_on_paired=statistics.median(pairs),
                off_over_on_per_repeat=pairs, computed_tokens_on=runs["caching_on"][0]["computed_tokens"],
                computed_tokens_off=runs["caching_off"][0]["computed_tokens"],
                turns_mean=runs["caching_on"][0]["turns_mean"])


if __name__ == "__main__":
    main()
