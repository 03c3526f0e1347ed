"""``StatSums``: the trainer's statistics over an iteration (what ``train_terms`` and the
samples give), summed across ranks, and the metrics they make (verl's meanings)."""
from __future__ import annotations

import functools
import math

import torch

from workers.trainer.buffer import Prepared
from workers.trainer.losses import fraction_agg, loss_divisor
from workers.trainer import rollout_correction as rc


class StatSums:
    """Statistics of one iteration: sums packed into one tensor for a SUM all-reduce, and the
    maxima and minima into another for a MAX all-reduce (minima kept negated, so one op does
    both: a sum cannot carry an extreme)."""

    KEYS = ("num_samples", "score_sum", "score_sq_sum", "resp_len_sum", "staleness_sum", "skipped_samples",
            "skipped_microbatches", "incomplete_groups", "duplicates", "num_tokens", "num_seqs", "pg_loss", "kl",
            "entropy", "clipfrac", "ratio", "value_loss", "ppo_kl", "vf_clipfrac", "advantage_sum", "values_sum",
            "returns_sum", "vpred_sum", "tis_weight", "score_s", "score_wait_s", "overlong_sum",
            "reward_kl_sum", "groups", "uniform_groups", "filtered_groups", "surplus_groups", "baselines",
            "baseline_sum", "unbased_groups", "turns_sum", "observation_tokens_sum",
            "env_reward_sum", "seq_tokens_sum", "clipfrac_lower", "seq_reward_sum", "returns_sq_sum",
            "residual_sum", "residual_sq_sum") + rc.SUMS
    PER_UNIT = ("pg_loss", "kl", "entropy", "clipfrac", "ratio", "value_loss", "ppo_kl", "vf_clipfrac", "tis_weight",
                "clipfrac_lower")
    LATER = PER_UNIT + ("num_tokens", "num_seqs")  # summed over the passes after the first (fold_later)
    # averaged per fraction_agg(loss_agg)
    FRACTIONS = ("clipfrac", "ratio", "ppo_kl", "vf_clipfrac", "tis_weight", "clipfrac_lower")
    # metric -> its sum, over every trained token whatever loss_agg (verl's masked_mean)
    TOKEN_MEANS = {"advantage_mean": "advantage_sum", "values_mean": "values_sum", "returns_mean": "returns_sum",
                   "vpred_mean": "vpred_sum"}
    # reported only with a critic
    CRITIC = ("values_mean", "returns_mean", "vf_clipfrac", "vpred_mean", "values_max", "values_min", "returns_max",
              "returns_min")
    # rank_tokens_*: the most and fewest tokens (prompts and responses) a rank took (verl's
    # global_seqlen/max, min): what pipeline.balance_batch evens out
    MAXIMA = ("reward_max", "response_len_max", "advantage_max", "rank_tokens_max", "seq_reward_max", "values_max",
              "returns_max") + rc.MAXIMA
    MINIMA = ("reward_min", "response_len_min", "advantage_min", "rank_tokens_min", "seq_reward_min", "values_min",
              "returns_min") + rc.MINIMA
    EXTREMES = MAXIMA + MINIMA

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, torch.Tensor | float] = {k: 0.0 for k in self.KEYS}
        self.extremes: dict[str, torch.Tensor | float] = {k: -math.inf for k in self.EXTREMES}
        # passes after the first (ppo_epochs > 1, mini_batches > 1): their per-token statistics,
        # averaged into the first's as verl averages every update's (review, s54)
        self.later: dict[str, torch.Tensor | float] = {k: 0.0 for k in self.LATER}
        self.later_passes = 0

    def add_later(self, counts: dict[str, torch.Tensor]) -> None:
        for k in self.LATER:
            if k in counts:
                self.later[k] = self.later[k] + counts[k].detach().double().to(self.device)

    def fold_later(self, m: dict[str, float], totals: torch.Tensor, loss_agg: str, scale: float | None,
                   first: tuple[float, float]) -> None:
        """Average the later passes' per-token statistics (``totals``: ``later``, all-reduced) into
        ``m``'s first-pass ones, each pass weighted by its divisor (``first``: the first pass's loss
        and fraction divisors)."""
        t = dict(zip(self.LATER, totals.tolist()))
        later = (loss_divisor(t["num_tokens"], t["num_seqs"], loss_agg, scale),
                 loss_divisor(t["num_tokens"], t["num_seqs"], fraction_agg(loss_agg)))
        for k in self.PER_UNIT:
            i = int(k in self.FRACTIONS)
            if k in m and first[i] + later[i] > 0:
                m[k] = (m[k] * first[i] + t[k]) / (first[i] + later[i])

    def add(self, key: str, value) -> None:
        self.sums[key] = self.sums[key] + value

    def add_extreme(self, key: str, value: float | torch.Tensor) -> None:
        """Fold ``value`` into the running maximum (or minimum) ``key``; a tensor stays on the
        device (no host sync per micro-batch), a float stays a float (none per sample)."""
        value = -value if key in self.MINIMA else value
        cur = self.extremes[key]
        if torch.is_tensor(cur) or torch.is_tensor(value):
            as_t = functools.partial(torch.as_tensor, dtype=torch.float64, device=self.device)
            self.extremes[key] = torch.maximum(as_t(cur), as_t(value))
        else:
            self.extremes[key] = max(cur, value)

    def add_sample(self, p: Prepared, version: int) -> None:
        self.add("num_samples", 1.0)
        self.add("score_sum", p.score)
        self.add("score_sq_sum", p.score * p.score)
        self.add("overlong_sum", p.overlong)
        self.add("reward_kl_sum", p.reward_kl)
        self.add("resp_len_sum", float(p.num_tokens))  # observation tokens included (verl's response_length)
        self.add("seq_tokens_sum", float(p.num_tokens + p.prompt_ids.numel()))
        self.add("staleness_sum", float(version - p.weight_version))
        self.add("turns_sum", float(p.turns))  # multi-turn: assistant turns, and the environment's tokens
        self.add("observation_tokens_sum", float(p.observation_tokens))
        self.add("env_reward_sum", p.env_reward)
        self.add("seq_reward_sum", p.reward)  # verl's critic/rewards: the score shaped (overlong, KL in the reward)
        for k, v in (("reward", float(p.score)), ("response_len", float(p.num_tokens)), ("seq_reward", float(p.reward))):
            self.add_extreme(f"{k}_max", v)
            self.add_extreme(f"{k}_min", v)
        for k, v in p.correction.items():  # rollout correction's metric terms (rollout_corr/*)
            if k in self.EXTREMES:
                self.add_extreme(k, v)
            else:
                self.add(k, v)

    def add_counts(self, counts: dict[str, torch.Tensor]) -> None:
        for k, v in counts.items():
            v = v.detach().double().to(self.device)
            if k in self.EXTREMES:
                self.add_extreme(k, v)
            else:
                self.add(k, v)

    def packed(self) -> torch.Tensor:
        return torch.stack([torch.as_tensor(self.sums[k], dtype=torch.float64, device=self.device)
                            for k in self.KEYS])

    def packed_extremes(self) -> torch.Tensor:
        """[len(EXTREMES)] float64, minima negated: all-reduced with MAX (-inf: nothing seen)."""
        for k in ("rank_tokens_max", "rank_tokens_min"):  # this rank's total, once all its samples came
            self.extremes[k] = -math.inf
            self.add_extreme(k, self.sums["seq_tokens_sum"])
        return torch.stack([torch.as_tensor(self.extremes[k], dtype=torch.float64, device=self.device)
                            for k in self.EXTREMES])

    def metrics(self, totals: torch.Tensor, loss_agg: str, scale: float | None = None,
                extremes: torch.Tensor | None = None, critic: bool = False, tis: bool = False, kl: bool = True,
                overlong: bool = False, reward_kl: bool = False, grouped: bool = False,
                filtered: bool = False, baselines: bool = False, dual_clip: bool = False) -> dict[str, float]:
        """``totals``: ``packed()``, ``extremes``: ``packed_extremes()`` (None: this rank's), both
        all-reduced. ``scale``: ``loss_scale_factor`` (``seq_mean_token_sum_norm``). ``critic``:
        report the critic's statistics; ``tis``: the mean truncated importance weight; ``kl``: the
        KL to the reference (there is one: ``kl_coef`` > 0); ``overlong``:
        the mean overlong penalty; ``reward_kl``: the mean over samples of each one's mean per-token
        KL(old || ref) (``kl_mode: reward``); ``grouped``: the share of the groups whose samples all
        scored the same (advantage 0 under grpo / rloo); ``filtered``: the groups the group filter
        dropped (uniform) and left over (past ``train_groups``); ``baselines``: remax's mean greedy
        reward and the groups skipped without one; ``dual_clip``: the share of tokens the dual clip
        bounded (verl's ``pg_clipfrac_lower``). A maximum or minimum over nothing is 0.0, as the
        means."""
        t = dict(zip(self.KEYS, totals.tolist()))
        n = max(t["num_samples"], 1.0)
        divisor = loss_divisor(t["num_tokens"], t["num_seqs"], loss_agg, scale)
        frac_divisor = loss_divisor(t["num_tokens"], t["num_seqs"], fraction_agg(loss_agg))
        mean = t["score_sum"] / n
        m = {"reward_mean": mean, "reward_std": max(t["score_sq_sum"] / n - mean * mean, 0.0) ** 0.5,
             "response_len_mean": t["resp_len_sum"] / n, "staleness_mean": t["staleness_sum"] / n,
             # multi-turn: per sample, of the population of reward_mean (single-turn: 1 and 0)
             "turns_mean": t["turns_sum"] / n,
             "observation_tokens_mean": t["observation_tokens_sum"] / n,
             "env_reward_mean": t["env_reward_sum"] / n}  # the part of reward_mean the environment gave
        for k in ("num_samples", "num_tokens", "num_seqs", "skipped_samples", "skipped_microbatches",
                  "incomplete_groups", "duplicates", "score_s", "score_wait_s"):
            m[k] = t[k]
        for k in self.PER_UNIT:
            d = frac_divisor if k in self.FRACTIONS else divisor
            m[k] = t[k] / d if d > 0 else 0.0
        m["_frac_divisor"] = frac_divisor
        for k, s in self.TOKEN_MEANS.items():
            m[k] = t[s] / t["num_tokens"] if t["num_tokens"] > 0 else 0.0
        ext = self.packed_extremes() if extremes is None else extremes
        signed = {k: -v if k in self.MINIMA else v for k, v in zip(self.EXTREMES, ext.tolist())}  # +-inf: none
        for k in self.EXTREMES:
            if k not in rc.MAXIMA + rc.MINIMA:
                m[k] = signed[k] if math.isfinite(signed[k]) else 0.0
        m.update(rc.metrics(t, signed))  # verl's rollout_corr/*, when samples were corrected
        m["seq_reward_mean"] = t["seq_reward_sum"] / n
        if critic:  # verl's critic/vf_explained_var: 1 - Var(returns - values) / Var(returns), token-wise
            m["vf_explained_var"] = explained_variance(t["num_tokens"], t["returns_sum"], t["returns_sq_sum"],
                                                       t["residual_sum"], t["residual_sq_sum"])
        else:
            for k in self.CRITIC:
                del m[k]
        if not dual_clip:
            del m["clipfrac_lower"]
        if not tis:  # reported only with trainer.tis_cap
            del m["tis_weight"]
        if not kl:  # no reference without a KL coefficient (verl's actor/kl_loss: only with use_kl_loss)
            del m["kl"]
        if overlong:  # reported only with trainer.overlong_buffer (the reward_* metrics are the task's scores)
            m["overlong_penalty_mean"] = t["overlong_sum"] / n
        if reward_kl:  # verl's actor/reward_kl_penalty
            m["reward_kl"] = t["reward_kl_sum"] / n
        if grouped:  # what trainer.filter_groups drops (DAPO's dynamic sampling)
            m["uniform_group_frac"] = t["uniform_groups"] / t["groups"] if t["groups"] > 0 else 0.0
        if filtered:  # trainer.filter_groups
            m["filtered_groups"], m["surplus_groups"] = t["filtered_groups"], t["surplus_groups"]
        if baselines:
            m["baseline_reward_mean"] = t["baseline_sum"] / t["baselines"] if t["baselines"] > 0 else 0.0
            m["groups_without_baseline"] = t["unbased_groups"]
        m["_divisor"] = divisor
        return m


def explained_variance(n: float, ret: float, ret_sq: float, res: float, res_sq: float) -> float:
    """1 - Var(returns - values) / (Var(returns) + 1e-5) over ``n`` tokens from their sums, the
    variances unbiased (verl's ``masked_var``); 0.0 with fewer than 2 tokens."""
    if n < 2:
        return 0.0
    var_ret = max(ret_sq - ret * ret / n, 0.0) / (n - 1)
    var_res = max(res_sq - res * res / n, 0.0) / (n - 1)
    return 1.0 - var_res / (var_ret + 1e-5)
