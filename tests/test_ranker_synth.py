"""A small learnable synthetic length trace for the ranker tests: answer length is a
deterministic function of the task template and the instance size (plus small noise)."""
from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

WORDS = ["apple", "river", "stone", "cloud", "tiger", "maple", "orbit", "piano", "quartz", "lemon"]


def _one(rng: random.Random) -> tuple[str, float]:
    kind = rng.randrange(4)
    if kind == 0:
        n = rng.randint(2, 30)
        nums = ", ".join(str(rng.randint(0, 999)) for _ in range(n))
        return f"Sort these numbers in ascending order: {nums}", 12.0 * n
    if kind == 1:
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        return f"What is {a} + {b}? Answer with a number.", 6.0
    if kind == 2:
        n = rng.randint(2, 9)
        return f"Solve the tower of hanoi puzzle with {n} disks. List every move.", 3.0 * 2 ** n
    w = rng.choice(WORDS) * rng.randint(1, 4)
    return f"Reverse the letters of the word '{w}'.", 10.0 + len(w)


def synth(n: int, seed: int = 0) -> tuple[list[str], list[float]]:
    """``n`` (prompt, mean length in words) pairs."""
    rng = random.Random(seed)
    prompts, lengths = [], []
    for _ in range(n):
        p, ln = _one(rng)
        prompts.append(p)
        lengths.append(ln * rng.uniform(0.9, 1.1))
    return prompts, lengths


def write_trace(path: Path, n: int, seed: int = 0) -> Path:
    """A gzip trace in the shared traces' format (3 answers per prompt)."""
    prompts, lengths = synth(n, seed)
    with gzip.open(path, "wt") as f:
        for p, ln in zip(prompts, lengths):
            words = [round(ln * k) for k in (0.95, 1.0, 1.05)]
            f.write(json.dumps({"task": "synthetic", "question": p, "resp_words": words,
                                "resp_chars": [5 * w for w in words]}) + "\n")
    return path


# Small, fast configs for the default test tier (threads 1).
SMALL_FEATURES = {"space": {"max_columns": 3000, "svd_dims": 16, "hash_bits": 16}, "knn_k": 5}
SMALL_LGBM = {"rounds": 60, "update_rounds": 5, "threads": 1, "features": SMALL_FEATURES}
