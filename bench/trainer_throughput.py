"""Trainer micro-batch throughput: packed causal attention (one T x T masked attention over the
packed batch) vs per-sequence padded attention (B x S_max^2), forward + backward of the PPO/GRPO
loss on a long-tailed batch of sequences, same model and tokens, run side by side.

    python bench/trainer_throughput.py [--quick] [--threads 2]

Prints one JSON line per measurement and a summary line with ``packed_tok_s``, ``padded_tok_s``,
``padded_over_packed``."""
from __future__ import annotations

import argparse
import random
import time

import torch

from workers.model import CausalAttention, CausalLM, ModelConfig, init_weights
from workers.trainer.losses import aggregate_sum, policy_loss
from workers.trainer.packing import PaddedCausalAttention, pack, token_logprobs
from jsonline import json_line  # bench/ is the script's folder
from argcheck import positive_int


def batch(n: int, prompt: int, max_len: int, vocab: int, seed: int):
    rng = random.Random(seed)
    lens = [min(max_len, int(8 * rng.paretovariate(1.2))) for _ in range(n)]  # long-tailed
    g = torch.Generator().manual_seed(seed)
    return ([torch.randint(0, vocab, (prompt,), generator=g) for _ in lens],
            [torch.randint(0, vocab, (max(1, x),), generator=g) for x in lens])


def step(model: CausalLM, b, attn) -> None:
    hidden = model(b.ids, b.positions, attn)
    logp = token_logprobs(model.logits(hidden[b.resp_pos]).float(), b.resp_ids)
    loss, _ = policy_loss(logp, logp.detach(), torch.ones_like(logp), 0.2, 0.2)
    aggregate_sum(loss, b.seq_index, b.seq_lens, "token_mean").backward()


def measure(model, b, make_attn, reps: int) -> float:
    step(model, b, make_attn())  # warm-up
    t = time.perf_counter()
    for _ in range(reps):
        step(model, b, make_attn())
    return b.ids.numel() * reps / (time.perf_counter() - t)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line: a bad value is one line naming the flag, exit code 2."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="batches of 16 and 64 sequences, 2 repetitions each (else 16, 64 and 128, 5 each)")
    ap.add_argument("--threads", type=positive_int, default=2, help="torch.set_num_threads")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2)
    model = init_weights(CausalLM(cfg))
    reps = 2 if a.quick else 5
    results = {}
    for n in ((16, 64) if a.quick else (16, 64, 128)):
        prompts, outs = batch(n, 16, 512, cfg.vocab_size, seed=n)
        b = pack(prompts, outs, torch.device("cpu"))
        for name, make in (("packed", lambda: CausalAttention(b.cu)),
                           ("padded", lambda: PaddedCausalAttention(b.cu, torch.device("cpu")))):
            tok_s = measure(model, b, make, reps)
            results[(name, n)] = tok_s
            print(json_line({"bench": "trainer_throughput", "attention": name, "sequences": n,
                              "tokens": b.ids.numel(), "max_len": int(b.seq_lens.max()) + 16,
                              "tok_s": round(tok_s, 1)}), flush=True)
    n = max(k[1] for k in results)
    print(json_line({"summary": True, "sequences": n, "packed_tok_s": round(results[("packed", n)], 1),
                      "padded_tok_s": round(results[("padded", n)], 1),
                      "padded_over_packed": round(results[("padded", n)] / results[("packed", n)], 2)}))


if __name__ == "__main__":
    main()
