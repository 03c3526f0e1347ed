"""Rollout correction (verl's ``algorithm.rollout_correction``, its decoupled mode): from the
sampler's log-probs (pi_rollout, ``Sample.logprobs``) to the trainer's own old ones (pi_old,
recomputed at receive time), per sample, with log r = log pi_old - log pi_rollout per token:

* ``is_weights``: truncated importance weights (``trainer.rollout_is`` token / sequence,
  ``rollout_is_threshold``), multiplying each token's policy loss;
* ``RejectionCheck``: rejection sampling (``trainer.rollout_rs``, ``rollout_rs_threshold``), a
  token / sequence mask that drops tokens from every loss term and count;
* ``batch_normalize``: the weights divided by their mean over the iteration, at ``step()``;
* ``batch_stats`` / ``sample_stats`` / ``metrics``: verl's ``rollout_corr/*`` metrics as sums over the iteration.

The numbers are verl's (``verl/trainer/ppo/rollout_corr_helper.py``): log-ratios clamped to
+-``SAFETY_BOUND`` before ``exp``, the truncation after it, k1 bounds on ratios.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from workers.trainer.losses import seq_sum

if TYPE_CHECKING:
    from workers.trainer.worker import TrainerWorker

SAFETY_BOUND = 20.0  # verl's: exp(+-20) bounds every ratio, weight and divergence

# trainer.rollout_is: log r [L] -> the untruncated weight of each token [L]
IS_WEIGHTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "token": lambda log_r: torch.exp(log_r.clamp(-SAFETY_BOUND, SAFETY_BOUND)),  # pi_old / pi_rollout per token
    # the product over the sequence, on each of its tokens
    "sequence": lambda log_r: torch.exp(log_r.sum().clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_r),
}
IS_LEVELS = tuple(IS_WEIGHTS)

# divergence estimators of one token, of log r (clamped to +-SAFETY_BOUND): verl's token_k*
RS_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": lambda log_r: -log_r,  # log(pi_rollout / pi_old); bounded below and above (ratio bounds)
    "k2": lambda log_r: 0.5 * log_r ** 2,
    "k3": lambda log_r: torch.exp(log_r) - 1.0 - log_r,
}
# how a sequence's per-token statistics [L] become its one value [] (None: each token on its own)
RS_LEVELS: dict[str, Callable[[torch.Tensor], torch.Tensor] | None] = {
    "token": None, "seq_sum": torch.sum, "seq_mean": torch.mean, "seq_max": torch.max,
}
# verl's SUPPORTED_ROLLOUT_RS_OPTIONS (no seq_max_k1: the max of -log r bounds nothing useful)
RS_OPTIONS = tuple(f"{level}_{k}" for level in RS_LEVELS for k in RS_ESTIMATORS if (level, k) != ("seq_max", "k1"))


@dataclass(frozen=True)
class RejectionCheck:
    """One ``rollout_rs`` option: ``level`` (token, seq_sum, seq_mean, seq_max) of the estimator
    ``estimator`` (k1, k2, k3), kept where ``lower <= statistic <= upper``. For k1 the bounds are
    ratio bounds, stored as their logs (verl's); for k2 / k3 ``lower`` is None."""

    option: str
    level: str
    estimator: str
    lower: float | None
    upper: float

    def keep(self, log_r: torch.Tensor, seq_index: torch.Tensor | None = None,
             seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        """log r: [L] of one sample, or [N] of a packed batch with its ``seq_index`` [N] and
        ``seq_lens`` [B] (bypass mode's, in each forward) -> the same shape, bool: the tokens this
        check keeps."""
        stat = RS_ESTIMATORS[self.estimator](log_r.clamp(-SAFETY_BOUND, SAFETY_BOUND))  # [L]
        reduce = RS_LEVELS[self.level]
        if reduce is not None and seq_index is None:
            stat = reduce(stat).expand_as(log_r)  # the sequence's value on each token
        elif reduce is not None:  # each sequence's value on each of its tokens
            b = seq_lens.numel()
            if self.level == "seq_max":
                stat = torch.full((b,), -math.inf, dtype=stat.dtype, device=stat.device).scatter_reduce(
                    0, seq_index, stat, "amax")[seq_index]
            else:
                sums = seq_sum(stat, seq_index, b)
                stat = (sums if self.level == "seq_sum" else sums / seq_lens.to(stat.dtype))[seq_index]
        ok = stat <= self.upper
        return ok & (stat >= self.lower) if self.lower is not None else ok


def parse_rejection(options: str, thresholds: str | float | None) -> tuple[RejectionCheck, ...]:
    """``trainer.rollout_rs`` (comma-separated options, duplicates dropped, verl's) and
    ``trainer.rollout_rs_threshold`` (one entry for all, or one per option, comma-separated; a k1
    option takes ``lower_upper`` ratio bounds, or one upper bound with lower = 1 / upper; k2 / k3
    one upper bound) -> the checks. ValueError naming the key otherwise."""
    names = list(dict.fromkeys(o.strip() for o in options.split(",") if o.strip()))
    if not names:
        raise ValueError(f"trainer.rollout_rs: {options!r} names no option; one or more of {RS_OPTIONS}, "
                         f"comma-separated (or null: off)")
    for name in names:
        if name not in RS_OPTIONS:
            raise ValueError(f"trainer.rollout_rs: {name!r} is not one of {RS_OPTIONS}")
    if thresholds is None:
        raise ValueError(f"trainer.rollout_rs_threshold: trainer.rollout_rs {options!r} needs its threshold(s) "
                         f"(verl has no default either)")
    specs = [thresholds] if isinstance(thresholds, (int, float)) else [s.strip() for s in thresholds.split(",")
                                                                        if s.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"trainer.rollout_rs_threshold: {thresholds!r} gives {len(specs)} thresholds for "
                         f"{len(names)} trainer.rollout_rs options; give one for all, or one per option")
    specs = specs * len(names) if len(specs) == 1 else specs
    return tuple(_check(name, spec) for name, spec in zip(names, specs))


def _check(option: str, spec: str | float) -> RejectionCheck:
    level, estimator = option.rsplit("_", 1)
    where = f"trainer.rollout_rs_threshold: {spec!r} for option {option!r}"
    parts = str(spec).split("_") if isinstance(spec, str) else [spec]
    if len(parts) > 2 or (len(parts) == 2 and estimator != "k1"):
        raise ValueError(f"{where}: {'only k1 options take lower_upper ratio bounds; ' if estimator != 'k1' else ''}"
                         f"expected {'lower_upper or an upper bound' if estimator == 'k1' else 'one upper bound'}")
    try:
        bounds = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"{where}: not a number") from None
    if not all(math.isfinite(b) and b > 0 for b in bounds):
        raise ValueError(f"{where}: bounds must be finite and > 0")
    if estimator != "k1":
        return RejectionCheck(option, level, estimator, None, bounds[0])
    lower, upper = bounds if len(bounds) == 2 else (1.0 / bounds[0], bounds[0])
    return RejectionCheck(option, level, estimator, math.log(lower), math.log(upper))


def is_weights(log_r: torch.Tensor, level: str, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log r: [L] (one sample) -> (truncated weights [L] = min(untruncated, threshold), the
    untruncated (safety-bounded) weights [L], what verl's metrics are of)."""
    raw = IS_WEIGHTS[level](log_r)  # [L]
    return raw.clamp(max=threshold), raw


def keep_mask(log_r: torch.Tensor, checks: tuple[RejectionCheck, ...]) -> torch.Tensor:
    """log r: [L] -> [L] bool: the tokens every check keeps (verl ANDs its options)."""
    keep = torch.ones_like(log_r, dtype=torch.bool)
    for check in checks:
        keep &= check.keep(log_r)
    return keep


# ---- metrics: verl's rollout_corr/* as sums over the iteration (all-reduced with StatSums') ------
SUMS = ("rc_tokens", "rc_seqs", "rc_kl", "rc_k3_kl", "rc_training_ppl", "rc_training_log_ppl", "rc_rollout_ppl",
        "rc_rollout_log_ppl", "rc_log_ppl_diff", "rc_log_ppl_abs_diff", "rc_ppl_ratio", "rc_rho_sq", "rc_rho_seq_sq",
        "rc_is_tokens", "rc_is_units", "rc_is_w", "rc_is_high", "rc_is_low", "rc_is_wc", "rc_is_wc_sq",
        "rc_is_seq_w", "rc_is_seq_w_sq", "rc_is_seq_high", "rc_is_seq_low",
        "rc_rs_tokens", "rc_rs_seqs", "rc_rs_rejected", "rc_rs_rejected_seqs")
MAXIMA = ("rc_log_ppl_diff_max", "rc_is_max", "rc_is_seq_max", "rc_is_seq_max_deviation",
          "rollout_is_batch_norm_factor")
MINIMA = ("rc_log_ppl_diff_min", "rc_is_min", "rc_is_seq_min")


def batch_stats(old: torch.Tensor, sampler: torch.Tensor, seq_index: torch.Tensor, seq_lens: torch.Tensor,
                level: str | None, threshold: float, raw: torch.Tensor | None,
                keep: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The terms of ``metrics`` (keys of SUMS, MAXIMA, MINIMA) of a packed batch of sequences
    (``seq_index`` [N], ``seq_lens`` [B]): sums over its sequences, extremes of them, as 0-dim
    float64 tensors (on the device, the counts known on the host: no host sync). old: the
    policy's log-probs [N] (bypass mode: the current one's), sampler [N]; ``level`` /
    ``threshold``: trainer.rollout_is's (None: no weights); ``raw``: the untruncated weights [N];
    ``keep``: the rejection mask [N] (None: no rejection)."""
    old, sampler = old.double(), sampler.double()
    b, n = seq_lens.numel(), old.numel()
    lens = seq_lens.to(old.device, torch.float64)
    seg = lambda x: seq_sum(x, seq_index, b)  # noqa: E731
    count = lambda x: x.sum().double()  # noqa: E731  (a bool count as a float64 tensor)
    log_r = old - sampler  # [N]
    mean_old, mean_sampler = seg(old) / lens, seg(sampler) / lens  # [B]
    diff = mean_sampler - mean_old  # [B] log(training ppl / rollout ppl)
    log_seq = seg(log_r)  # [B]
    const = lambda v: torch.tensor(float(v), dtype=torch.float64)  # noqa: E731  (a count known on the host)
    s = {"rc_tokens": const(n), "rc_seqs": const(b), "rc_kl": (sampler - old).sum(),
         "rc_k3_kl": (torch.exp(log_r) - log_r - 1).sum(),
         "rc_training_ppl": torch.exp((-mean_old).clamp(max=700.0)).sum(), "rc_training_log_ppl": (-mean_old).sum(),
         "rc_rollout_ppl": torch.exp((-mean_sampler).clamp(max=700.0)).sum(),
         "rc_rollout_log_ppl": (-mean_sampler).sum(), "rc_log_ppl_diff": diff.sum(),
         "rc_log_ppl_abs_diff": diff.abs().sum(), "rc_ppl_ratio": torch.exp(diff.clamp(max=700.0)).sum(),
         "rc_log_ppl_diff_max": diff.max(), "rc_log_ppl_diff_min": diff.min(),
         "rc_rho_sq": torch.exp(2.0 * log_r.clamp(-SAFETY_BOUND, SAFETY_BOUND)).sum(),
         "rc_rho_seq_sq": torch.exp(2.0 * log_seq.clamp(-SAFETY_BOUND, SAFETY_BOUND)).sum()}
    if level is not None:
        raw = raw.double()
        low = 1.0 / threshold
        wc = raw.clamp(low, threshold)  # what verl's std and ESS are of
        seq_w = seg(raw) / lens  # [B]
        s.update(rc_is_tokens=const(n), rc_is_w=raw.sum(), rc_is_wc=wc.sum(), rc_is_wc_sq=(wc ** 2).sum(),
                 rc_is_seq_w=seq_w.sum(), rc_is_seq_w_sq=(seq_w ** 2).sum(), rc_is_seq_high=count(seq_w > threshold),
                 rc_is_seq_low=count(seq_w < low), rc_is_seq_max=seq_w.max(), rc_is_seq_min=seq_w.min(),
                 rc_is_seq_max_deviation=(seq_w - 1.0).abs().max())
        if level == "sequence":  # per sequence, in log space: unclamped below, as verl's
            s.update(rc_is_units=const(b), rc_is_high=count(log_seq > math.log(threshold)),
                     rc_is_low=count(log_seq < math.log(low)),
                     rc_is_max=torch.exp(log_seq.max().clamp(max=SAFETY_BOUND)),
                     rc_is_min=torch.exp(log_seq.min().clamp(max=700.0)))
        else:
            s.update(rc_is_units=const(n), rc_is_high=count(raw > threshold), rc_is_low=count(raw < low),
                     rc_is_max=raw.max(), rc_is_min=raw.min())
    if keep is not None:
        rejected = (~keep).double()
        s.update(rc_rs_tokens=const(n), rc_rs_seqs=const(b), rc_rs_rejected=rejected.sum(),
                 rc_rs_rejected_seqs=count(seg(rejected) > 0))
    return s


def sample_stats(old: torch.Tensor, sampler: torch.Tensor, level: str | None, threshold: float,
                 raw: torch.Tensor | None, keep: torch.Tensor | None) -> dict[str, float]:
    """One sample's terms of ``metrics``: ``batch_stats`` of a batch of one sequence, as floats.
    old, sampler: [L] log-probs; ``raw``: the untruncated weights [L] (with ``level``); ``keep``:
    the rejection mask [L] (None: no rejection)."""
    n = old.numel()
    one = batch_stats(old, sampler, torch.zeros(n, dtype=torch.long, device=old.device),
                      torch.tensor([n], device=old.device), level, threshold, raw, keep)
    return {k: float(v) for k, v in one.items()}


def _exp(x: float) -> float:
    """exp for a metric: finite (a float32 exp, verl's, is inf past 88; a float's raises past 709)."""
    return math.exp(min(x, 700.0))


def metrics(t: dict[str, float], ext: dict[str, float]) -> dict[str, float]:
    """The iteration's sums ``t`` and extremes ``ext`` (all-reduced; -inf: none seen) -> verl's
    ``rollout_corr/*`` metrics: the off-policy diagnostics when any sample was corrected, the IS
    ones with trainer.rollout_is, the RS ones with trainer.rollout_rs (each absent otherwise)."""
    if t["rc_tokens"] <= 0:
        return {}
    tokens, seqs = t["rc_tokens"], t["rc_seqs"]
    m = {"kl": t["rc_kl"] / tokens, "k3_kl": t["rc_k3_kl"] / tokens, "chi2_token": t["rc_rho_sq"] / tokens - 1.0,
         "chi2_seq": t["rc_rho_seq_sq"] / seqs - 1.0, "log_ppl_diff_max": ext["rc_log_ppl_diff_max"],
         "log_ppl_diff_min": ext["rc_log_ppl_diff_min"]}
    for k in ("training_ppl", "training_log_ppl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
              "log_ppl_abs_diff", "ppl_ratio"):
        m[k] = t[f"rc_{k}"] / seqs
    if t["rc_is_tokens"] > 0:
        n, s = t["rc_is_tokens"], t["rc_seqs"]
        wc_mean = t["rc_is_wc"] / n
        seq_mean = t["rc_is_seq_w"] / s
        m.update(rollout_is_mean=t["rc_is_w"] / n, rollout_is_max=ext["rc_is_max"], rollout_is_min=ext["rc_is_min"],
                 rollout_is_ratio_fraction_high=t["rc_is_high"] / t["rc_is_units"],
                 rollout_is_ratio_fraction_low=t["rc_is_low"] / t["rc_is_units"],
                 rollout_is_std=math.sqrt(max(t["rc_is_wc_sq"] / n - wc_mean ** 2, 0.0)) if n > 1 else 0.0,
                 rollout_is_eff_sample_size=(wc_mean + 1e-8) ** 2 / (t["rc_is_wc_sq"] / n),
                 rollout_is_seq_mean=seq_mean,
                 rollout_is_seq_std=math.sqrt(max(t["rc_is_seq_w_sq"] - s * seq_mean ** 2, 0.0) / (s - 1))
                 if s > 1 else 0.0,
                 rollout_is_seq_max=ext["rc_is_seq_max"], rollout_is_seq_min=ext["rc_is_seq_min"],
                 rollout_is_seq_max_deviation=ext["rc_is_seq_max_deviation"],
                 rollout_is_seq_fraction_high=t["rc_is_seq_high"] / s, rollout_is_seq_fraction_low=t["rc_is_seq_low"] / s)
        if math.isfinite(ext["rollout_is_batch_norm_factor"]):
            m["rollout_is_batch_norm_factor"] = ext["rollout_is_batch_norm_factor"]
    if t["rc_rs_tokens"] > 0:
        m.update(rollout_rs_masked_fraction=t["rc_rs_rejected"] / t["rc_rs_tokens"],
                 rollout_rs_seq_masked_fraction=t["rc_rs_rejected_seqs"] / t["rc_rs_seqs"])
    return {f"rollout_corr/{k}": v for k, v in m.items()}


# ---- batch normalisation (at step(): the iteration's every sample on every rank) -------------------
def batch_normalize(w: "TrainerWorker") -> None:
    """With ``trainer.rollout_is_batch_normalize``, divide the truncated weights of every sample
    ready to train (the iteration's, after the group filter; every rank calls this once per step)
    by their mean over all ranks: over (sampled) tokens for ``token`` weights, over sequences for
    ``sequence`` ones (verl's, whose batch is the step's whole training batch). A mean <= 1e-8
    leaves them (factor 1, as verl). Logged as ``rollout_corr/rollout_is_batch_norm_factor``."""
    assert not w._trained_any, "normalising importance weights after training started"
    items = list(w.buffer.ready)
    per_sequence = w.cfg.is_level == "sequence"
    total, units = 0.0, 0  # this rank's weight sum and its units (tokens, or sequences)
    for p in items:
        weights = p.tis_weight if p.sampled is None else p.tis_weight[p.sampled]  # not observation tokens'
        weights = weights[:1] if per_sequence else weights  # a sequence weight is on each token
        total, units = total + float(weights.double().sum()), units + weights.numel()
    sums = torch.tensor([total, float(units)], dtype=torch.float64, device=w.device)
    if w.world_size > 1:
        dist.all_reduce(sums, group=w.group)
    mean = float(sums[0] / sums[1]) if float(sums[1]) > 0 else 0.0
    factor = mean if mean > 1e-8 else 1.0
    for p in items:
        p.tis_weight = p.tis_weight / factor
    w.stats.add_extreme("rollout_is_batch_norm_factor", factor)
