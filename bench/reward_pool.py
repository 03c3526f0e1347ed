"""The trainer's reward pool (``trainer.reward_workers`` / ``reward_pool``): the task's score of
a batch of samples, one call after another (the trainer before session 38) against the pool's
threads and processes, same completions, run side by side.

    python bench/reward_pool.py [--quick] [--samples 64]

Rewards: ``wait`` (each call waits 20 ms, the way a request to a judge model or a code sandbox
does: threads overlap the waits), ``sympy`` (each call checks that two expressions are equal
with sympy's ``simplify``, math-verify's kind of work: pure Python, so the GIL serialises
threads and only processes run calls at once) and ``rule`` (the built-in ``math`` verifier,
microseconds a call: what the pool costs a cheap reward) and ``judge`` (a reward server that takes
batches: a request waits 20 ms plus 1 ms a sample; its task has ``score_batch``, and the extra
competitor ``batched`` hands the pool arrivals of ``--arrival`` samples, each one request, as the
trainer does: ``RewardPool.submit_many``). Prints one JSON line per competitor
and reward, and a summary line with each reward's best pool over one-at-a-time
(``wait_speedup``, ``sympy_speedup``, ``rule_speedup``, ``judge_speedup``). Process start-up (spawn, imports) is
timed apart (``start_s``), before the measured batch."""
from __future__ import annotations

import argparse
import os
import time

from jsonline import json_line  # bench/ is the script's folder
from argcheck import fill_defaults, positive_int

from workers.tasks.reward_pool import RewardPool
from workers.tasks.scoring import safe_score
from workers.tasks.verifiers import math_boxed
from workers.types import TaskPrompt

EXPRS = ["(y + 1)**2", "sin(y)**2 + cos(y)**2", "(y**2 - 1)/(y - 1)", "exp(2*log(y))", "(y + 2)*(y - 3)",
         "tan(y)*cos(y)", "(y**3 - 8)/(y - 2)", "2*sin(y)*cos(y)"]
EQUAL = ["y**2 + 2*y + 1", "1", "y + 1", "y**2", "y**2 - y - 6", "sin(y)", "y**2 + 2*y + 4", "sin(2*y)"]


class Wait:
    def prompts(self, split):
        return []

    def score(self, prompt, completion):
        time.sleep(0.02)
        return math_boxed(prompt, completion)


class Sympy:
    def prompts(self, split):
        return []

    def score(self, prompt, completion):
        import sympy

        return float(sympy.simplify(sympy.sympify(completion) - sympy.sympify(prompt.answer)) == 0)


class Rule:
    def prompts(self, split):
        return []

    def score(self, prompt, completion):
        return math_boxed(prompt, completion)


class Judge:
    """A reward server that batches: each request waits 20 ms + 1 ms a sample."""

    def prompts(self, split):
        return []

    def score(self, prompt, completion):
        return self.score_batch([prompt], [completion])[0]

    def score_batch(self, prompts, completions):
        time.sleep(0.02 + 0.001 * len(completions))
        return [math_boxed(p, c) for p, c in zip(prompts, completions)]


TASKS = {"wait": Wait, "sympy": Sympy, "rule": Rule, "judge": Judge}


def batch(kind: str, n: int, offset: int = 0) -> list[tuple[TaskPrompt, str]]:
    """``n`` samples whose rewards are all 1.0. sympy's: each its own expression (y shifted by
    the sample's index), so no call is a hit of sympy's cache; ``offset`` gives each competitor
    and warm-up samples of its own (a cache warmed by one would speed up the next)."""
    out = []
    for i in range(offset, offset + n):
        j = i % len(EXPRS)
        if kind == "sympy":
            shift = f"(y + {i})"
            out.append((TaskPrompt(prompt="simplify", answer=EQUAL[j].replace("y", shift), task="s"),
                        EXPRS[j].replace("y", shift)))
        else:
            out.append((TaskPrompt(prompt="q", answer=str(i % 7), task="r"), f"the answer is \\boxed{{{i % 7}}}"))
    return out


def one_at_a_time(task, items) -> tuple[list[float], float]:
    t = time.perf_counter()
    scores = [safe_score(task, p, c)[0] for p, c in items]
    return scores, time.perf_counter() - t


def pooled(task, items, warm_items, workers: int, pool: str, arrival: int = 0) -> tuple[list[float], float, float]:
    """``arrival`` > 0: the samples handed over ``arrival`` at a time (``submit_many``: one
    ``score_batch`` call each); 0: one ``submit`` each."""
    t = time.perf_counter()
    rp = RewardPool(task, workers=workers, pool=pool)
    warm = [rp.submit(p, c, "warm-up") for p, c in warm_items[:workers]]  # start every process
    [rp.result(j) for j in warm]
    start_s = time.perf_counter() - t
    t = time.perf_counter()
    if arrival:
        jobs = [j for k in range(0, len(items), arrival)
                for j in rp.submit_many([(p, c, f"sample {k + i}") for i, (p, c) in enumerate(items[k:k + arrival])])]
    else:
        jobs = [rp.submit(p, c, f"sample {i}") for i, (p, c) in enumerate(items)]
    scores = [rp.result(j).score for j in jobs]
    took = time.perf_counter() - t
    rp.close()
    return scores, took, start_s


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="32 samples a reward (a --samples given wins)")
    ap.add_argument("--samples", type=positive_int, help="samples scored per reward and competitor (default 64, "
                                                          "--quick 32)")
    ap.add_argument("--threads", type=positive_int, default=8, help="reward_workers of the threads pool")
    ap.add_argument("--arrival", type=positive_int, default=8,
                    help="judge's batched competitor: samples per submit_many (one score_batch call)")
    return fill_defaults(ap.parse_args(argv), {"samples": 32}, {"samples": 64})


def competitors(threads: int, procs: int, batched_arrival: int = 0) -> list[tuple[str, int, str, int]]:
    """(name, workers, pool, arrival) of each pooled competitor: one thread, ``threads`` threads
    (once: ``--threads 1`` ran threads_1 twice, the second line overwriting the first; review,
    s55), ``procs`` processes, and with ``batched_arrival`` the batched judge's."""
    out = [("threads_1", 1, "threads", 0)]
    if threads > 1:
        out.append((f"threads_{threads}", threads, "threads", 0))
    out.append((f"processes_{procs}", procs, "processes", 0))
    if batched_arrival:
        out.append((f"threads_{threads}_batched_{batched_arrival}", threads, "threads", batched_arrival))
    return out


def main(argv=None) -> None:
    a = parse_args(argv)
    n = a.samples
    procs = max(1, min(os.cpu_count() or 1, 8))
    summary = {"summary": True, "samples": n, "cpus": os.cpu_count()}
    for kind, make in TASKS.items():
        task = make()
        safe_score(task, *batch(kind, 1, offset=10**6)[0])  # imports and first-call set-up, unmeasured
        ref, base = one_at_a_time(task, batch(kind, n))
        assert ref == [1.0] * n, f"{kind}: one at a time scored {ref}"
        rates = {}
        print(json_line({"bench": "reward_pool", "reward": kind, "competitor": "one_at_a_time",
                          "samples_per_s": round(n / base, 1)}), flush=True)
        for c, (name, workers, pool, arrival) in enumerate(
                competitors(a.threads, procs, a.arrival if hasattr(task, "score_batch") else 0), start=1):
            items, warm = batch(kind, n, offset=2 * c * n), batch(kind, workers, offset=(2 * c + 1) * n)
            scores, took, start_s = pooled(task, items, warm, workers, pool, arrival)
            assert scores == [1.0] * n, f"{name} scored {kind} as {scores}"  # the same rewards, whatever the pool
            rates[name] = n / took
            print(json_line({"bench": "reward_pool", "reward": kind, "competitor": name,
                              "samples_per_s": round(n / took, 1), "over_one_at_a_time": round(base / took, 2),
                              "start_s": round(start_s, 2)}), flush=True)
        best = max(rates, key=rates.get)
        summary[f"{kind}_best"] = best
        summary[f"{kind}_speedup"] = round(rates[best] * base / n, 2)
    print(json_line(summary), flush=True)


if __name__ == "__main__":
    main()
