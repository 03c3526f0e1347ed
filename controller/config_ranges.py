"""The valid values of every numeric run-config key (``RANGES``), checked at load by
``controller.config`` after the types: -1 is not "every iteration", NaN is not a timeout."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers.types import GREEDY_BELOW, MAX_TEMPERATURE, MIN_SAMPLED_TEMPERATURE


@dataclass(frozen=True)
class Range:
    """The valid values of a numeric key: ``lo <= v <= hi`` (``<`` at an ``open`` end; None:
    unbounded). ``note`` says what special values mean (``0: never``)."""

    lo: float | None = None
    hi: float | None = None
    open_lo: bool = False
    open_hi: bool = False
    note: str = ""

    def __contains__(self, v) -> bool:
        return ((self.lo is None or (v > self.lo if self.open_lo else v >= self.lo))
                and (self.hi is None or (v < self.hi if self.open_hi else v <= self.hi)))

    def __str__(self) -> str:
        if self.hi is None:
            text = f"{'>' if self.open_lo else '>='} {self.lo}"
        else:
            text = f"in {'(' if self.open_lo else '['}{self.lo}, {self.hi}{')' if self.open_hi else ']'}"
        return f"{text} ({self.note})" if self.note else text


TEMPERATURES = f"below {GREEDY_BELOW:g}: greedy; sampled from {MIN_SAMPLED_TEMPERATURE:g}, as both engines serve"
SEEDS = Range(0, 2**32, open_hi=True)  # numpy's seed range; sampling seeds are train.seed * 7919 + index
# Every numeric key of the run sections, and the owned sections' keys their own classes leave
# unchecked. Checked at load after the types (every float must also be finite: no .nan/.inf);
# a tuple's range applies to each value. docs/config.md lists the same.
RANGES: dict[str, Range] = {
    "pipeline.minibatch_size": Range(1),
    "pipeline.stream_window_s": Range(0, 10, note="seconds"),
    "ranker.update_every": Range(0, note="0: never"),
    "ranker.bootstrap_prompts": Range(2),
    "placement.rpc_timeout_s": Range(0, open_lo=True),
    "placement.force_scale_out_at": Range(-1, note="-1: never"),
    "train.iterations": Range(1),
    "train.batch_prompts": Range(1),
    "train.group_size": Range(1),
    "train.max_tokens": Range(1),
    "train.min_tokens": Range(0),
    "train.temperature": Range(0, MAX_TEMPERATURE, note=TEMPERATURES),
    "train.top_k": Range(-1, note="0 or -1: off"),
    "train.top_p": Range(0, 1, open_lo=True, note="1: off"),
    "train.eval_every": Range(0, note="0: never"),
    "train.eval_prompts": Range(0, note="0: the whole test split"),
    "train.eval_samples": Range(1),
    "train.eval_temperature": Range(0, MAX_TEMPERATURE, note=TEMPERATURES),
    "train.ckpt_every": Range(0, note="0: only at the end"),
    "train.ckpt_keep": Range(1, note="null: keep every checkpoint, as verl's 0 or null"),
    "train.sft_steps": Range(0),
    "train.sft_lr": Range(0, open_lo=True),
    "train.seed": SEEDS,
    "train.length_scale": Range(0, open_lo=True),
    "train.max_prompt_tokens": Range(0, note="0: the engines' context"),
    "logging.timeline_every": Range(0, note="0: never"),
    "engine.seed": SEEDS,
    "trainer.seed": SEEDS,
    "trainer.betas": Range(0, 1, open_hi=True),
    "trainer.min_lr_ratio": Range(0, 1, note="the fraction of lr the schedule decays to"),
}


def range_error(key: str, value: Any) -> str | None:
    """Why ``value`` is outside ``key``'s range (None when inside, or when the key has none)."""
    rng = RANGES.get(key)
    if rng is None or value is None:
        return None
    for i, v in enumerate(value) if isinstance(value, tuple) else [(None, value)]:
        if v not in rng:
            name = key if i is None else f"{key}[{i}]"
            return f"{name} must be {'an int ' if isinstance(v, int) else ''}{rng}, got {v!r}"
    return None
