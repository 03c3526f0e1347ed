"""Synthetic task family with rule-verified, worked answers whose length grows with the prompt.

``running_sum`` (default): "sum 3 5 2 8" -> "3+5=8; 8+2=10; 10+8=18; answer=18". One step per
extra term, and the number of terms is drawn from a long-tailed (power-law) distribution, so
answer length depends on the prompt (a length ranker has signal) and has a long tail.
``countdown``: "count 23 by 3" -> "23 20 17 14 11 8 5 2; answer=8" (8 numbers) — trace length
is value / step, again read off the prompt.

Demonstrations for SFT (``demonstrations(split)``) can be made deliberately imperfect with
``demo_noise``: that fraction of them stops the trace early and answers with the partial sum
(a noisy teacher). A warm-started model then stops early about that often: partial reward
that RL, judged by the verifier, quickly removes.

The test split (``prompts("test")``, also ``"eval"``) is disjoint from train: it is drawn as
train is (with another seed, repeats allowed), leaving out every prompt that train holds, so
its prompts lean to the less likely (longer) ones where train holds most of the prompt space.
It has ``num_test`` prompts unless those train lacks are too rare to find: drawing stops after
``TEST_DRAWS`` x ``num_test`` tries, leaving it shorter; with none found (few terms, a small
``max_value``, a large ``num_train``) it is a ValueError naming the settings to change.

Score in [0, 1]: half for the fraction of trace steps that are right at their position (extra
steps dilute it), half for a correct final ``answer=N`` that ends the completion. Any
malformed completion scores 0 (the verifier never raises).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable, Sequence

from workers.types import TaskPrompt

SPLIT_SEEDS = {"train": 0, "test": 1_000_003, "eval": 1_000_003}
TEST_DRAWS = 100  # tries per test prompt before the test split settles for fewer (see above)
_STEP = re.compile(r"(-?\d+)\s*\+\s*(-?\d+)\s*=\s*(-?\d+)")
_ANSWER = re.compile(r"answer\s*=\s*(-?\d+)")


def _power_law(rng: random.Random, lo: int, hi: int, tail: float) -> int:
    """An integer in [lo, hi] with P(n) proportional to (n - lo + 1) ** -tail."""
    weights = [(n - lo + 1) ** -tail for n in range(lo, hi + 1)]
    return rng.choices(range(lo, hi + 1), weights=weights)[0]


def _final_credit(completion: str, total: int) -> float:
    m = _ANSWER.search(completion)
    if m is None or completion[m.end():].strip():
        return 0.0
    return float(int(m.group(1)) == total)


# ---- running_sum ---------------------------------------------------------------------------
def _running_sum_item(rng: random.Random, cfg: "SyntheticTask") -> TaskPrompt:
    n = _power_law(rng, cfg.min_terms, cfg.max_terms, cfg.tail)
    terms = [rng.randint(1, cfg.max_value) for _ in range(n)]
    steps, acc = [], terms[0]
    for t in terms[1:]:
        steps.append(f"{acc}+{t}={acc + t}")
        acc += t
    answer = "; ".join(steps + [f"answer={acc}"])
    return TaskPrompt(prompt="sum " + " ".join(map(str, terms)), answer=answer,
                      task="synthetic/running_sum", meta={"terms": terms, "total": acc})


def _running_sum_score(prompt: TaskPrompt, completion: str) -> float:
    terms = [int(x) for x in prompt.prompt.split()[1:]]
    want, acc = [], terms[0]
    for t in terms[1:]:
        want.append((acc, t, acc + t))
        acc += t
    head = completion.split("answer", 1)[0]
    got = [tuple(int(x) for x in m.groups()) for m in _STEP.finditer(head)]
    right = sum(1 for w, g in zip(want, got) if w == g)
    steps = right / max(len(want), len(got)) if (want or got) else 1.0
    return 0.5 * steps + 0.5 * _final_credit(completion, acc)


def _running_sum_truncate(item: TaskPrompt, rng: random.Random) -> str:
    steps = item.answer.split("; ")[:-1]
    keep = rng.randint(0, len(steps) - 1)  # stop before the last step at the latest
    partial = item.meta["terms"][0] if keep == 0 else int(steps[keep - 1].split("=")[-1])
    return "; ".join(steps[:keep] + [f"answer={partial}"])


# ---- countdown -----------------------------------------------------------------------------
def _countdown_item(rng: random.Random, cfg: "SyntheticTask") -> TaskPrompt:
    n = _power_law(rng, cfg.min_terms, cfg.max_terms, cfg.tail)  # numbers in the trace
    step = rng.randint(1, max(1, cfg.max_value))
    last = rng.randint(0, step - 1)
    start = last + step * (n - 1)
    seq = list(range(start, last - 1, -step))
    answer = " ".join(map(str, seq)) + f"; answer={len(seq)}"
    return TaskPrompt(prompt=f"count {start} by {step}", answer=answer, task="synthetic/countdown",
                      meta={"start": start, "step": step, "total": len(seq)})


def _countdown_truncate(item: TaskPrompt, rng: random.Random) -> str:
    nums = item.answer.split(";")[0].split()
    keep = rng.randint(1, max(1, len(nums) - 1))
    return " ".join(nums[:keep]) + f"; answer={keep}"


def _countdown_score(prompt: TaskPrompt, completion: str) -> float:
    _, start, _, step = prompt.prompt.split()
    start, step = int(start), int(step)
    want = list(range(start, -1, -step))
    head = completion.split(";", 1)[0] if ";" in completion else completion.split("answer", 1)[0]
    got = [int(x) for x in re.findall(r"-?\d+", head)]
    right = sum(1 for w, g in zip(want, got) if w == g)
    steps = right / max(len(want), len(got), 1)
    return 0.5 * steps + 0.5 * _final_credit(completion, len(want))


# kind -> (make an item, score a completion, a truncated (noisy) demonstration)
KINDS: dict[str, tuple[Callable, Callable, Callable]] = {
    "running_sum": (_running_sum_item, _running_sum_score, _running_sum_truncate),
    "countdown": (_countdown_item, _countdown_score, _countdown_truncate),
}


@dataclass(frozen=True)
class SyntheticTask:
    """``prompts(split)`` is deterministic in (seed, split); ``score`` never raises."""

    kind: str = "running_sum"
    num_train: int = 4096
    num_test: int = 256
    min_terms: int = 2
    max_terms: int = 12
    tail: float = 1.2  # power-law exponent of the number of terms (bigger: shorter answers)
    max_value: int = 9
    seed: int = 0
    demo_noise: float = 0.0  # fraction of SFT demonstrations that stop early (noisy teacher)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"task.kwargs.kind: {self.kind!r} is not one of {sorted(KINDS)}")
        if not 1 <= self.min_terms <= self.max_terms:
            raise ValueError(f"task: need 1 <= min_terms ({self.min_terms}) <= max_terms ({self.max_terms})")
        if self.kind == "running_sum" and self.min_terms < 2:
            raise ValueError("task.min_terms must be >= 2 for running_sum")
        if self.max_value < 1 or self.num_train < 1 or self.num_test < 1 or self.tail < 0:
            raise ValueError("task: max_value, num_train, num_test must be >= 1 and tail >= 0")
        if not 0.0 <= self.demo_noise <= 1.0:
            raise ValueError(f"task.kwargs.demo_noise: must be in [0, 1], got {self.demo_noise}")

    def prompts(self, split: str) -> Sequence[TaskPrompt]:
        if split not in SPLIT_SEEDS:
            raise ValueError(f"task split {split!r} is not one of {sorted(SPLIT_SEEDS)}")
        rng = random.Random(self.seed * 7919 + SPLIT_SEEDS[split])
        make = KINDS[self.kind][0]
        if split == "train":
            return [make(rng, self) for _ in range(self.num_train)]
        train = {item.prompt for item in self.prompts("train")}
        items: list[TaskPrompt] = []
        for _ in range(TEST_DRAWS * self.num_test):
            item = make(rng, self)
            if item.prompt not in train:
                items.append(item)
                if len(items) == self.num_test:
                    break
        if not items:
            raise ValueError(f"task: every {split} prompt drawn is a train prompt ({self.kind}, {self.num_train} train "
                             f"prompts over {self.min_terms}-{self.max_terms} terms up to {self.max_value}): lower "
                             "task.kwargs.num_train, or raise max_terms or max_value")
        return items

    def demonstrations(self, split: str = "train") -> list[tuple[TaskPrompt, str]]:
        """(item, demonstration completion) pairs for SFT; ``demo_noise`` of them truncated."""
        rng = random.Random(self.seed * 31 + 17)
        truncate = KINDS[self.kind][2]
        return [(item, truncate(item, rng) if rng.random() < self.demo_noise else item.answer)
                for item in self.prompts(split)]

    def score(self, prompt: TaskPrompt, completion: str) -> float:
        try:
            return float(KINDS[self.kind][1](prompt, completion))
        except Exception:  # a verifier never crashes: malformed input scores 0
            return 0.0
