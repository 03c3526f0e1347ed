"""Length traces -> the batches the planner plans on and simulates: a trace's answer lengths
(words, 1.3 tokens each) or a JSON list of output lengths, sampled into per-iteration batches."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from controller.planner.simulator import Workload


@dataclass
class Trace:
    out_lens: list[int]
    prompt_lens: list[int]


TOKENS_PER_WORD = 1.3  # the traces count whitespace words; the simulated engines count tokens


def trace_tokens(words: float, scale: float = 1.0, max_len: int = 20000) -> int:
    """A trace answer's length in tokens (x ``scale``), within [1, ``max_len``] (capped before
    rounding, so a huge product cannot overflow)."""
    return int(max(1, round(min(max_len, words * TOKENS_PER_WORD * scale))))


def load_trace(path: str | Path, max_len: int = 20000, scale: float = 1.0) -> Trace:
    """A length trace (gzip JSON lines with resp_words and question, 1.3 tokens per word, every
    answer), or a JSON list of output lengths."""
    from ranker.data import MAX_WORDS, length_ok, read_traces  # the traces' one reader: errors name FILE:LINE

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p}: {'not a file' if p.exists() else 'no such file'} (expected a length trace)")
    if ".jsonl" in p.name.lower():
        outs, prompts = [], []
        for row in read_traces(p):
            for w in row.lengths:
                outs.append(trace_tokens(w, scale, max_len))
                prompts.append(int(max(1, round(len(row.prompt.split()) * TOKENS_PER_WORD))))
        return Trace(outs, prompts)
    try:
        lens = json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: neither a length trace (.jsonl, .jsonl.gz) nor a JSON list of output "
                         f"lengths ({e})") from None
    if not isinstance(lens, list) or not lens:
        raise ValueError(f"{p}: expected a non-empty JSON list of output lengths (numbers in [0, {MAX_WORDS:.0e}])")
    bad = next((i for i, x in enumerate(lens) if not length_ok(x)), None)
    if bad is not None:
        raise ValueError(f"{p}: entry {bad} ({lens[bad]!r:.40}) is not an output length: expected numbers in "
                         f"[0, {MAX_WORDS:.0e}] (ranker.data.MAX_WORDS)")
    return Trace([int(max(1, round(min(max_len, x * scale)))) for x in lens], [64] * len(lens))


@dataclass
class Workloads:
    iterations: list[Workload]

    @property
    def tokens_per_iteration(self) -> list[float]:
        """Prompt + output tokens of each iteration's batch (what the trainer trains: not the
        generation-only requests)."""
        return [float(sum(o + q for o, q, t in zip(w.out_lens, w.prompt_lens, w.trains) if t))
                for w in self.iterations]

    @property
    def tokens(self) -> float:
        """The mean tokens per iteration over every simulated batch (what Algorithm 1 plans on)."""
        t = self.tokens_per_iteration
        return sum(t) / len(t)


def sample_workloads(trace: Trace, batch: int, iterations: int, seed: int = 0, greedy_group: int = 0) -> Workloads:
    """``iterations`` batches of ``batch`` samples drawn from ``trace``. ``greedy_group`` n > 0
    (remax): each batch also generates one greedy response per n samples (a prompt's group),
    generation work that does not train; its length is drawn from the trace too (the batch's
    samples are the same draws as without it)."""
    rng, greedy_rng = np.random.default_rng(seed), np.random.default_rng([seed, 1])  # (apart: the same samples)
    out = []
    for _ in range(iterations):
        idx = list(rng.integers(0, len(trace.out_lens), size=batch))
        extra = -(-batch // greedy_group) if greedy_group else 0
        idx += list(greedy_rng.integers(0, len(trace.out_lens), size=extra)) if extra else []
        # (remax) the samples in groups of greedy_group, the j-th greedy response group j's
        groups = [k // greedy_group for k in range(batch)] + list(range(extra)) if extra else None
        out.append(Workload([trace.out_lens[i] for i in idx], [trace.prompt_lens[i] for i in idx], groups=groups,
                            trained=[True] * batch + [False] * extra if extra else None))
    return Workloads(out)
