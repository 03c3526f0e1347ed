"""The trainer's verl-style metrics against values computed here: reward / response length /
advantage maxima and minima (global over data-parallel ranks), ppo_kl on- and off-policy, and
PPO's values / returns / vpred means and value clip fraction.

Samples are built by hand (known rewards through the prompt's ``meta``, known lengths) and carry
the trainer's own log-probs, optionally shifted by a known amount."""
import math
import statistics
from dataclasses import replace

import pytest
import torch

from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer.packing import pack
from workers.trainer.stat_sums import StatSums
from workers.trainer.step_math import prepare_batch
from workers.types import Sample, TaskPrompt
from workers.weight_sync.localrun import run_local
from tests.trainer_helpers import tiny_model_dir
from tests.test_trainer_math_grad import loop_gae

torch.set_num_threads(1)
NEW_KEYS = ("reward_max", "reward_min", "advantage_mean", "advantage_max", "advantage_min", "response_len_max",
            "response_len_min", "ppo_kl", "seq_reward_mean", "seq_reward_max", "seq_reward_min")


class KnownRewardTask:
    """Each sample's reward is its prompt's ``meta["reward"]``."""

    def prompts(self, split):
        return []

    def score(self, prompt, completion):
        return prompt.meta["reward"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory)


def build(model_dir, groups: list[list[tuple[float, int]]], first_id: int = 0):
    """groups: [[(reward, response length), ...] per group] -> (samples with the trainer's own
    log-probs, sample_id -> prompt, group_id -> size)."""
    samples, prompts, sizes = [], {}, {}
    for gid, members in enumerate(groups):
        sizes[gid] = len(members)
        for reward, length in members:
            sid = first_id + len(samples)
            prompts[sid] = TaskPrompt(prompt=f"p{sid}", answer="", task="t", meta={"reward": reward})
            out = (torch.arange(length) * 7 + sid * 3) % 40 + 15
            samples.append(Sample(sample_id=sid, prompt_ids=torch.tensor([11, 12, 13 + gid]), output_ids=out,
                                  logprobs=torch.zeros(length), weight_version=0, finish_reason="stop",
                                  group_id=gid))
    w = TrainerWorker(TrainerConfig(recompute_old_logprobs=True), model_dir, KnownRewardTask(), device="cpu")
    w._prompts = prompts
    own = [p.old_logp for p in prepare_batch(w, samples)]
    return [replace(s, logprobs=lp) for s, lp in zip(samples, own)], prompts, sizes


def train(model_dir, cfg: TrainerConfig, samples, prompts, sizes, one_by_one: bool = False) -> dict[str, float]:
    w = TrainerWorker(cfg, model_dir, KnownRewardTask(), device="cpu")
    w.begin_iteration(0, prompts, sizes)
    for chunk in ([[s] for s in samples] if one_by_one else [samples]):
        w.receive(chunk)
    return w.step().metrics


def grpo_reference(rewards: list[float], eps: float = 1e-6) -> list[float]:
    mean, std = statistics.mean(rewards), statistics.stdev(rewards)
    return [(r - mean) / (std + eps) for r in rewards]


GRPO_GROUPS = [[(1.0, 3), (0.0, 7), (0.5, 4)], [(-0.5, 5), (0.25, 2)]]


@pytest.mark.parametrize("budget, one_by_one", [(10**6, False), (12, True)])
def test_reward_length_advantage_extremes_grpo(model_dir, budget, one_by_one):
    """One micro-batch, or many (one sample each, trained while streaming): the extremes are
    the iteration's, and the advantage mean is over tokens (a 7-token sample weighs 7)."""
    samples, prompts, sizes = build(model_dir, GRPO_GROUPS)
    m = train(model_dir, TrainerConfig(algorithm="grpo", max_tokens_per_microbatch=budget), samples, prompts, sizes,
              one_by_one)
    assert (m["reward_max"], m["reward_min"]) == (1.0, -0.5)
    assert (m["response_len_max"], m["response_len_min"]) == (7.0, 2.0)
    adv, lens = [], []
    for group in GRPO_GROUPS:
        adv += grpo_reference([r for r, _ in group])
        lens += [n for _, n in group]
    token_mean = sum(a * n for a, n in zip(adv, lens)) / sum(lens)
    assert abs(token_mean - statistics.mean(adv)) > 0.05  # a per-sample mean would fail
    assert m["advantage_mean"] == pytest.approx(token_mean, abs=1e-6)
    assert m["advantage_max"] == pytest.approx(max(adv), rel=1e-6)
    assert m["advantage_min"] == pytest.approx(min(adv), rel=1e-6)
    assert m["ppo_kl"] == pytest.approx(0.0, abs=1e-5)  # the samples carry the trainer's own log-probs
    assert m["reward_mean"] == pytest.approx(statistics.mean(r for g in GRPO_GROUPS for r, _ in g))
    assert not set(StatSums.CRITIC) & set(m)  # no critic, no critic statistics


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean", "seq_mean_token_sum"])
def test_ppo_kl_is_the_mean_old_minus_new_log_prob(model_dir, loss_agg):
    """Old log-probs = the trainer's own + d (known, per token): ppo_kl = the mean of d, over
    tokens or over sequences' token means as clipfrac (token mean under the token-sum modes)."""
    samples, prompts, sizes = build(model_dir, GRPO_GROUPS)
    g = torch.Generator().manual_seed(0)
    shifts = [off + 0.02 * torch.randn(len(s.output_ids), generator=g)
              for off, s in zip((0.1, 0.3, -0.1, 0.0, -0.2), samples)]
    shifted = [replace(s, logprobs=s.logprobs + d) for s, d in zip(samples, shifts)]
    m = train(model_dir, TrainerConfig(algorithm="grpo", loss_agg=loss_agg), shifted, prompts, sizes)
    token_mean = float(torch.cat(shifts).mean())
    seq_mean = statistics.mean(float(d.mean()) for d in shifts)
    assert abs(token_mean - seq_mean) > 0.03  # the two aggregations differ here
    want = seq_mean if loss_agg == "seq_mean" else token_mean
    assert m["ppo_kl"] == pytest.approx(want, abs=1e-5)


def critic_values(critic, s: Sample) -> list[float]:
    with torch.no_grad():
        return critic(pack([s.prompt_ids], [s.output_ids], torch.device("cpu"))).tolist()


def test_ppo_critic_statistics(model_dir):
    """PPO whitens, so receive() only prepares (values taken then) and step() trains: moving
    the critic in between makes the training forward's predictions differ from the GAE's
    values, so the value clip takes both branches. values_mean / returns_mean are the GAE's
    (returns unwhitened), vpred_mean the moved critic's, the advantage stats the whitened ones."""
    samples, prompts, sizes = build(model_dir, [[(1.0, 3), (0.0, 7), (0.5, 4), (-0.5, 5), (0.25, 2)]])
    cfg = TrainerConfig(algorithm="ppo", gamma=0.9, gae_lambda=0.8)
    w = TrainerWorker(cfg, model_dir, KnownRewardTask(), device="cpu")
    g = torch.Generator().manual_seed(0)
    head = w.critic.value_head
    with torch.no_grad():  # a critic whose values are not all 0 (its head starts at zero)
        head.weight.copy_(0.1 * torch.randn(head.weight.shape, generator=g))
        head.bias.fill_(0.3)
    old_v = [critic_values(w.critic, s) for s in samples]
    w.begin_iteration(0, prompts, sizes)
    w.receive(samples)
    assert not w._trained_any
    with torch.no_grad():
        head.weight.add_(0.05 * torch.randn(head.weight.shape, generator=g))
    vpred = [critic_values(w.critic, s) for s in samples]
    m = w.step().metrics

    rewards = [prompts[s.sample_id].meta["reward"] for s in samples]
    advs, rets = [], []
    for r, v in zip(rewards, old_v):
        a = loop_gae([0.0] * (len(v) - 1) + [r], v, cfg.gamma, cfg.gae_lambda)
        advs += a
        rets += [x + y for x, y in zip(a, v)]
    mean = statistics.mean(advs)
    whitened = [(a - mean) / math.sqrt(statistics.variance(advs) + 1e-8) for a in advs]
    flat_old, flat_new = [x for v in old_v for x in v], [x for v in vpred for x in v]
    clipped = []
    for v, o, r in zip(flat_new, flat_old, rets):
        vc = min(max(v, o - cfg.value_clip), o + cfg.value_clip)
        clipped.append(float((vc - r) ** 2 > (v - r) ** 2))
    assert 0 < statistics.mean(clipped) < 1  # both branches taken
    assert abs(statistics.mean(flat_old) - statistics.mean(flat_new)) > 0.01
    assert m["values_mean"] == pytest.approx(statistics.mean(flat_old), abs=1e-5)
    assert m["returns_mean"] == pytest.approx(statistics.mean(rets), abs=1e-5)
    assert m["vpred_mean"] == pytest.approx(statistics.mean(flat_new), abs=1e-5)
    assert m["vf_clipfrac"] == pytest.approx(statistics.mean(clipped), abs=1e-9)
    assert m["advantage_mean"] == pytest.approx(0.0, abs=1e-5)  # whitened
    assert m["advantage_max"] == pytest.approx(max(whitened), rel=1e-4)
    assert m["advantage_min"] == pytest.approx(min(whitened), rel=1e-4)
    assert (m["reward_max"], m["reward_min"], m["response_len_max"], m["response_len_min"]) == (1.0, -0.5, 7.0, 2.0)
    assert m["ppo_kl"] == pytest.approx(0.0, abs=1e-5)
    # verl's critic/values/max, min, returns/max, min, vf_explained_var (masked_var: unbiased), rewards/*
    assert (m["values_max"], m["values_min"]) == pytest.approx((max(flat_old), min(flat_old)), abs=1e-5)
    assert (m["returns_max"], m["returns_min"]) == pytest.approx((max(rets), min(rets)), abs=1e-5)
    residual = [r - v for r, v in zip(rets, flat_old)]
    assert m["vf_explained_var"] == pytest.approx(1 - statistics.variance(residual) / (statistics.variance(rets) + 1e-5),
                                                  abs=1e-5)
    assert (m["seq_reward_mean"], m["seq_reward_max"], m["seq_reward_min"]) == \
        pytest.approx((statistics.mean(rewards), 1.0, -0.5))  # no shaping here: the scores
    assert "clipfrac_lower" not in m  # (no dual clip)


def test_the_dual_clips_share_is_verls_pg_clipfrac_lower(model_dir):
    """The A < 0 tokens whose loss the dual clip bounded: max(-A r, -A clip(r)) > -c A; a sample's
    old log-probs 1.5 lower than the trainer's puts its ratio at e^1.5 = 4.5 > c = 3."""
    samples, prompts, sizes = build(model_dir, [[(1.0, 3), (0.0, 7), (0.5, 4), (-0.5, 5)]])
    shifts = [0.0, 1.5, 0.0, 0.5]  # grpo advantages: +, -, +, - (the second and fourth below the mean)
    shifted = [replace(s, logprobs=s.logprobs - d) for s, d in zip(samples, shifts)]
    m = train(model_dir, TrainerConfig(algorithm="grpo", dual_clip=3.0), shifted, prompts, sizes)
    assert m["clipfrac_lower"] == pytest.approx(7 / 19, abs=1e-6)  # the second sample's 7 tokens of 19
    assert m["seq_reward_max"] == 1.0 and m["seq_reward_min"] == -0.5


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_empty_iteration_reports_zeros(model_dir, algorithm):
    """No sample (none sent, or every one refused): every new metric is 0.0, never +-inf."""
    samples, prompts, sizes = build(model_dir, [[(1.0, 3), (0.0, 4)]])
    keys = NEW_KEYS + (StatSums.CRITIC + ("vf_explained_var",) if algorithm == "ppo" else ())
    w = TrainerWorker(TrainerConfig(algorithm=algorithm), model_dir, KnownRewardTask(), device="cpu")
    for it, batch in enumerate(([], [replace(s, output_ids=torch.zeros(0, dtype=torch.long)) for s in samples])):
        w.begin_iteration(it, prompts, sizes)
        w.receive(batch)
        m = w.step().metrics
        assert m["num_samples"] == 0 and m["skipped_samples"] == len(batch)
        assert {k: m[k] for k in keys} == {k: 0.0 for k in keys}


# rank 0: the largest reward, the longest response, the largest advantage; rank 1: the smallest
DP_GROUPS = [[(2.0, 9), (0.5, 4), (0.5, 5)], [(0.0, 3), (0.0, 6), (-1.0, 2)]]


def _dp_rank(rank: int, world: int, model_dir: str, data) -> list[dict[str, float]]:
    """Iteration 0: rank r trains group r; iteration 1: rank 0 trains group 0, rank 1 nothing."""
    samples, prompts, sizes = data
    w = TrainerWorker(TrainerConfig(algorithm="grpo", max_tokens_per_microbatch=16), model_dir, KnownRewardTask(),
                      rank=rank, world_size=world, device="cpu")
    out = []
    for it in range(2):
        w.begin_iteration(it, prompts, sizes)
        w.receive([s for s in samples if s.group_id == rank and (it == 0 or rank == 0)])
        out.append(w.step().metrics)
    return out


def test_extremes_are_global_over_data_parallel_ranks(model_dir):
    data = build(model_dir, DP_GROUPS)
    ranks = run_local(2, _dp_rank, model_dir, data)
    big, small = grpo_reference([2.0, 0.5, 0.5]), grpo_reference([0.0, 0.0, -1.0])
    for it0, it1 in ranks:  # both ranks report the same, global, numbers
        assert (it0["reward_max"], it0["reward_min"]) == (2.0, -1.0)
        assert (it0["response_len_max"], it0["response_len_min"]) == (9.0, 2.0)
        assert it0["advantage_max"] == pytest.approx(max(big), rel=1e-6)
        assert it0["advantage_min"] == pytest.approx(min(small), rel=1e-6)
        assert it0["num_samples"] == 6
        # rank 1 had nothing: the extremes are rank 0's, not 0 or -inf
        assert (it1["reward_max"], it1["reward_min"]) == (2.0, 0.5)
        assert (it1["response_len_max"], it1["response_len_min"]) == (9.0, 4.0)
        assert it1["advantage_min"] == pytest.approx(min(big), rel=1e-6) and it1["num_samples"] == 3
    # the tokens each rank took (verl's global_seqlen/max, min): rank 1 none in iteration 1
    samples = data[0]
    took = [sum(s.prompt_ids.numel() + s.output_ids.numel() for s in samples if s.group_id == r) for r in (0, 1)]
    assert took[0] != took[1]
    for it0, it1 in ranks:
        assert (it0["rank_tokens_max"], it0["rank_tokens_min"]) == (max(took), min(took))
        assert (it1["rank_tokens_max"], it1["rank_tokens_min"]) == (took[0], 0.0)


def test_reward_std_from_summed_stats():
    from types import SimpleNamespace

    from workers.trainer.stat_sums import StatSums

    stats = StatSums(torch.device("cpu"))
    for score in (0.0, 1.0, 1.0, 0.0):
        stats.add_sample(SimpleNamespace(score=score, reward=score, num_tokens=3, prompt_ids=torch.zeros(2),
                                         weight_version=0, overlong=0.0, reward_kl=0.0, correction={},
                                         turns=1, observation_tokens=0, env_reward=0.0), version=0)
    m = stats.metrics(stats.packed(), "token_mean")
    assert m["reward_mean"] == pytest.approx(0.5) and m["reward_std"] == pytest.approx(0.5)


def test_the_time_in_the_reward_is_reported(model_dir, monkeypatch):
    # a slow reward took a run from ~600 to 4.9 samples/s and no metric showed where (a plugin-author review);
    # score_s is verl's timing_s/reward. A fake clock (each reading 0.5 s after the last): no wall-clock here
    from types import SimpleNamespace

    import time

    from workers.tasks import reward_pool

    samples, prompts, sizes = build(model_dir, GRPO_GROUPS)
    ticks = iter(range(1000))  # read by the one reward thread only (reward_workers: 1)
    monkeypatch.setattr(reward_pool, "time", SimpleNamespace(perf_counter=lambda: 0.5 * next(ticks),
                                                             monotonic=time.monotonic))
    m = train(model_dir, TrainerConfig(algorithm="grpo"), samples, prompts, sizes)
    assert m["score_s"] == pytest.approx(0.5 * len(samples))  # one score call per sample, each 0.5 s
    assert m["score_wait_s"] >= 0.0  # the trainer's wait for scores past its forwards (a real clock)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_uniform_group_fraction(model_dir, algorithm):
    """The share of groups whose samples all scored the same (advantage 0 under grpo: what DAPO's
    dynamic sampling would drop); a group of one counts as a group, not as uniform. Reported for
    the grouped algorithms only."""
    groups = [[(1.0, 3), (1.0, 4), (1.0, 2)], [(0.0, 3), (0.5, 3)], [(0.0, 2), (0.0, 5)], [(0.3, 4)]]
    samples, prompts, sizes = build(model_dir, groups)
    w = TrainerWorker(TrainerConfig(algorithm=algorithm), model_dir, KnownRewardTask(), device="cpu")
    w.begin_iteration(0, prompts, sizes)
    w.receive(samples)
    m = w.step().metrics
    if algorithm == "grpo":
        assert m["uniform_group_frac"] == pytest.approx(2 / 4)
    else:
        assert "uniform_group_frac" not in m
