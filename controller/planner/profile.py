"""Stage profiles measured on the real hardware: generation PTL(BS) and trainer time per token.

``profile_engine`` drives any ``workers.types.Engine`` (native or vLLM) with length-forced
requests: for each batch size it admits BS requests, waits until all are decoding, then
times ``decode_steps`` steps: PTL(BS) = elapsed / steps. KV capacity comes from the
engine's stats. ``profile_trainer`` times a callable that trains on a batch of a given
number of tokens and fits ``time = fixed_s + s_per_token * tokens``. Both are saved as
JSON (``StageProfiles``) and reused by the planner and the dispatcher.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from controller.ptl_profile import from_json
from controller.scheduling import PTLProfile
from workers.types import Engine, Request, SamplingParams
from workers.atomic import write_text


def _drain(engine: Engine) -> None:
    while engine.has_work():
        engine.step()


def _requests(n: int, prompt_len: int, out_len: int, vocab: int, first_id: int, seed: int) -> list[Request]:
    """``n`` random prompts, new ones for every ``first_id``: the same ones again would be found in
    the engine's prefix cache, and a prefill probe would time a few tokens, not ``prompt_len``."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + first_id)
    return [Request(sample_id=first_id + i, prompt_ids=torch.randint(3, vocab, (prompt_len,), generator=g),
                    max_tokens=out_len, min_tokens=out_len,
                    sampling=SamplingParams(temperature=1.0, seed=seed + first_id + i))
            for i in range(n)]


def profile_engine(engine: Engine, batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32), prompt_len: int = 16,
                   decode_steps: int = 16, warmup_steps: int = 2, vocab: int = 64, block_size: int | None = None,
                   name: str = "", clock: Callable[[], float] = time.perf_counter, seed: int = 0,
                   long_context: int = 0, repeats: int = 1) -> PTLProfile:
    """Measure PTL(BS) of ``engine`` at each batch size, its KV capacity and prefill cost
    (one prefill step = prefill_step_s + prefill_s_per_token * prompt tokens), and the step
    cost per cached token (a mid batch size re-timed at ``long_context`` tokens, default
    4 * prompt_len + 64). ``repeats`` > 1 keeps the fastest of that many timings (on a shared
    machine other tenants only ever add time).

    Requests are forced to prompt_len + warmup_steps + decode_steps + 2 tokens so none finishes
    inside the timed window; the engine is drained between sizes and left empty. vocab bounds
    the random prompt ids (and is lowered to the engine's ``vocab_size``: an in-process BPE may
    learn fewer tokens than asked). block_size defaults to the engine's own ``block_size`` (vLLM's),
    else ``engine.cfg.block_size`` (else 1)."""
    if engine.has_work():
        raise ValueError("profile_engine: the engine still has work; profile an idle engine")
    sizes = sorted({int(b) for b in batch_sizes})
    vocab = min(vocab, getattr(engine, "vocab_size", vocab))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"profile_engine: batch_sizes must be >= 1, got {list(batch_sizes)}")
    cfg = getattr(engine, "cfg", None)
    # the engine's own block (vLLM's CPU blocks are 32 tokens whatever cfg asks), else its config's
    block = block_size or int(getattr(engine, "block_size", None) or getattr(cfg, "block_size", 1) or 1)
    st = engine.stats()
    old_cap = st.max_batch_size
    kv_tokens = (st.kv_blocks_used + st.kv_blocks_free) * block
    out_len = warmup_steps + decode_steps + 2
    need = sizes[-1] * (-(-(prompt_len + out_len) // block) * block)
    if need > kv_tokens:
        raise ValueError(f"profile_engine: batch size {sizes[-1]} x {prompt_len + out_len} tokens needs {need} "
                         f"KV tokens, the engine has {kv_tokens}; lower batch_sizes or prompt_len")
    engine.set_max_batch_size(sizes[-1])
    ptl, next_id = [], 0
    try:
        def timed(bs: int, plen: int) -> float:
            nonlocal next_id
            refused = engine.add(_requests(bs, plen, out_len, vocab, next_id, seed))
            next_id += bs
            if refused:
                raise ValueError(f"profile_engine: the engine refused a {plen}-token prompt: {refused[0].error}")
            for _ in range(bs * plen + 8):  # prefill, possibly chunked over steps
                if engine.stats().running >= bs:
                    break
                engine.step()
            else:
                raise RuntimeError(f"profile_engine: the engine never ran {bs} requests at once "
                                   f"(running {engine.stats().running}); check its max_batch_size / KV size")
            for _ in range(warmup_steps):
                engine.step()
            t0 = clock()
            for _ in range(decode_steps):
                engine.step()
            dt = (clock() - t0) / decode_steps
            _drain(engine)
            return dt

        def best(bs: int, plen: int) -> float:  # contention only ever adds time: keep the fastest
            return min(timed(bs, plen) for _ in range(max(1, repeats)))

        for bs in sizes:
            ptl.append(best(bs, prompt_len))
        # attention cost per cached token: a mid batch at a long context
        bs_kv = sizes[len(sizes) // 2]
        long_ctx = long_context or 4 * prompt_len + 64
        long_ctx = min(long_ctx, kv_tokens // bs_kv - out_len - block)
        max_len = int(getattr(engine, "max_model_len", 0) or 0)  # the native engine's limit
        if max_len:
            long_ctx = min(long_ctx, max_len - out_len - 1)
        kv_coef = 0.0
        if long_ctx > prompt_len:
            t_long = best(bs_kv, long_ctx)
            kv_coef = max(0.0, (t_long - ptl[sizes.index(bs_kv)]) / (bs_kv * (long_ctx - prompt_len)))
        # prefill step: a short and a long prompt alone; fixed + per-token cost. Each probe fits
        # one step's prefill budget: a longer prompt is prefilled in chunks over several steps,
        # and timing the first step would give a per-token cost of only its chunk (review, s54)
        pre = []
        long_prompt = min(4 * prompt_len, kv_tokens // 2)
        if max_len:
            long_prompt = min(long_prompt, max_len - 2)  # room for its 2 output tokens
        budget = int(getattr(cfg, "max_prefill_tokens", 0) or 0)
        if budget:
            long_prompt = min(long_prompt, budget)
        short_prompt = prompt_len if prompt_len < long_prompt else max(1, long_prompt // 4)
        for n in (short_prompt, long_prompt):
            refused = engine.add(_requests(1, n, 2, vocab, next_id, seed))
            next_id += 1
            if refused:  # timing an empty step would give a prefill cost of 0
                raise ValueError(f"profile_engine: the engine refused a {n}-token prompt: {refused[0].error}")
            t0 = clock()
            engine.step()
            pre.append((n, clock() - t0))
            _drain(engine)
        (n1, t1), (n2, t2) = pre
        per_token = max(0.0, (t2 - t1) / (n2 - n1)) if n2 > n1 else 0.0
        step_s = max(0.0, t1 - per_token * n1)
    finally:
        engine.set_max_batch_size(old_cap)
    # measured noise can make PTL dip with BS; the cost model wants it non-decreasing
    mono = list(np.maximum.accumulate(np.maximum(ptl, 1e-9)))
    return PTLProfile(sizes, [float(x) for x in mono], int(kv_tokens), block, int(old_cap), float(per_token), name,
                      meta={"raw_ptl_s": ptl, "prompt_len": prompt_len, "decode_steps": decode_steps,
                            "source": "measured", "prefill_probe_tokens": [short_prompt, long_prompt]},
                      prefill_step_s=float(step_s), kv_s_per_token=float(kv_coef),
                      ref_context=float(prompt_len + warmup_steps + decode_steps / 2))


@dataclass
class TrainProfile:
    """Trainer time for one iteration's batch: fixed_s + s_per_token * tokens, on ``ranks``
    data-parallel ranks (tokens = prompt + response tokens of all samples). ``source`` says
    whether it was measured or is an analytic (roofline) estimate."""

    s_per_token: float
    fixed_s: float = 0.0
    ranks: int = 1
    source: str = "measured"

    def __post_init__(self):
        # as PTLProfile: a NaN or inf (JSON takes NaN) would reach every planner time unseen
        costs = {"s_per_token": self.s_per_token, "fixed_s": self.fixed_s}
        bad = {k: v for k, v in costs.items()
               if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 <= v < math.inf}
        if bad:
            raise ValueError(f"TrainProfile: {bad} must be finite numbers >= 0")
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, numbers.Integral) or self.ranks < 1:
            raise ValueError(f"TrainProfile: ranks must be an int >= 1, got {self.ranks!r}")
        self.s_per_token, self.fixed_s, self.ranks = float(self.s_per_token), float(self.fixed_s), int(self.ranks)

    def time(self, tokens: float, ranks: int | None = None) -> float:
        """Seconds to train ``tokens`` on ``ranks`` ranks (ideal DP scaling from the profile)."""
        r = ranks or self.ranks
        return self.fixed_s + self.s_per_token * tokens * self.ranks / r


def profile_trainer(train_tokens: Callable[[int], None], token_counts: Sequence[int] = (256, 1024),
                    repeats: int = 3, ranks: int = 1, clock: Callable[[], float] = time.perf_counter) -> TrainProfile:
    """Time ``train_tokens(T)`` (one full training pass over a batch of T tokens, optimizer
    step included) ``repeats`` times at each T; least-squares fit of time = fixed_s +
    s_per_token * T through the median pass at each T. The median, not the fastest: a run
    pays its typical pass (the fastest of 3 under-predicted the trainer by 9-22% in
    bench/planner_accuracy.py)."""
    if len(set(token_counts)) < 2:
        raise ValueError(f"profile_trainer: need at least 2 distinct token_counts, got {list(token_counts)}")
    if repeats < 1:
        raise ValueError(f"profile_trainer: repeats must be >= 1, got {repeats}")
    passes = TrainerPasses(train_tokens, token_counts, warmup=0, repeats=repeats, clock=clock)
    passes.sample()
    return passes.profile(ranks)


def fit_train_profile(passes: dict[int, Sequence[float]], ranks: int = 1) -> TrainProfile:
    """time = fixed_s + s_per_token * T, least squares through the median pass at each T
    (``passes``: tokens -> seconds of each timed pass, e.g. pooled from several sessions)."""
    sizes = sorted(t for t, v in passes.items() if len(v))
    if len(sizes) < 2:
        raise ValueError(f"fit_train_profile: need passes at >= 2 distinct token counts, got {sorted(passes)}")
    slope, icpt = np.polyfit([float(t) for t in sizes], [float(np.median(passes[t])) for t in sizes], 1)
    return TrainProfile(float(max(slope, 1e-12)), float(max(icpt, 0.0)), ranks, "measured")


class TrainerPasses:
    """Timed training passes behind a ``TrainProfile``, that can be taken at several moments
    and pooled: ``train_tokens(T)`` (one full pass over about T tokens) is warmed up with
    ``warmup`` passes at the largest size (a fresh trainer's first full passes run 10-30%
    slower here: allocator growth), then each ``sample()`` times ``repeats`` passes at each
    of ``sizes``. On a host whose speed moves within minutes, samples taken before and after
    the run being predicted bracket it in time; ``profile()`` fits the median per size
    (``fit_train_profile``)."""

    def __init__(self, train_tokens: Callable[[int], None], sizes: Sequence[int], warmup: int = 3, repeats: int = 3,
                 clock: Callable[[], float] = time.perf_counter):
        self.train_tokens, self.repeats, self.clock = train_tokens, int(repeats), clock
        self.sizes = [int(t) for t in sizes]
        self.passes: dict[int, list[float]] = {}
        for _ in range(warmup):
            train_tokens(max(self.sizes))

    def sample(self) -> None:
        for t in self.sizes:
            for _ in range(self.repeats):
                t0 = self.clock()
                self.train_tokens(t)
                self.passes.setdefault(t, []).append(self.clock() - t0)

    def profile(self, ranks: int = 1) -> TrainProfile:
        return fit_train_profile(self.passes, ranks)


def save_json(obj, path: str | os.PathLike) -> None:
    """Write a profile dataclass as indented JSON, atomically."""
    write_text(path, json.dumps(asdict(obj), indent=1))


def load_json(path: str | os.PathLike, name: str, required: Sequence[str]) -> dict:
    """Read a saved profile's JSON object; a truncated or corrupted file, or a missing
    required key, is a ValueError naming the file."""
    with open(path) as f:
        try:
            d = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a {name} JSON file ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: a {name} file holds a JSON object, got {type(d).__name__}")
    missing = set(required) - set(d)
    if missing:
        raise ValueError(f"{path}: {name} is missing {sorted(missing)}")
    return d



@dataclass
class StageProfiles:
    """What the planner needs about one deployment: a generation instance's PTL profile and
    the trainer's profile, plus the weight bytes to sync. Saved as one JSON file."""

    generation: PTLProfile
    trainer: TrainProfile
    weight_bytes: float = 0.0
    meta: dict = field(default_factory=dict)

    def save(self, path: str | os.PathLike) -> None:
        save_json(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "StageProfiles":
        d = load_json(path, "StageProfiles", ("generation", "trainer"))
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{path}: unknown StageProfiles keys {sorted(unknown)}")
        gen = PTLProfile.from_dict(d["generation"], f"{path}: generation")
        trainer = from_json(TrainProfile, d["trainer"], f"{path}: trainer")
        from controller.planner.hardware import check_number  # (hardware imports this module)

        weight_bytes = check_number(f"{path}: weight_bytes", d.get("weight_bytes", 0.0), strict=False)
        return cls(gen, trainer, weight_bytes, d.get("meta", {}))
