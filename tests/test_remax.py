"""ReMax (``trainer.algorithm: remax``): the numbers of verl's ``compute_remax_outcome_advantage``
(core_algos, b178a3c), transcribed here independently of workers/trainer/remax.py; the greedy
baseline sample scored and never trained; a group whose baseline is refused is skipped; the
controller's greedy request per prompt; and a real run (torchrun: controller, engine, trainer)."""
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from controller.config import ConfigError, DispatchSection, MultiTurnSection, load_config
from controller.program import Program
from tests.runtime_helpers import iterations, tiny_model, torchrun, write_config  # noqa: F401
from tests.test_trainer_stats import KnownRewardTask, build, model_dir  # noqa: F401
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer.step_math import group_advantages, prepare_batch
from workers.types import SAMPLE_STRIDE, GREEDY_BELOW, TaskPrompt

torch.set_num_threads(1)


def verl_remax(token_level_rewards: torch.Tensor, reward_baselines: torch.Tensor, response_mask: torch.Tensor):
    """verl's: the reversed cumulative sum of the masked token rewards, minus the baseline."""
    returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    return returns - reward_baselines.unsqueeze(-1) * response_mask


# per group: the sampled members (reward, length), then the greedy baseline's (reward, length)
GROUPS = [([(1.0, 3), (0.0, 5), (1.0, 2)], (0.5, 4)), ([(0.2, 2), (0.7, 6)], (0.7, 3)), ([(0.0, 2)], (1.0, 2))]


def _samples(model_dir, groups=GROUPS):  # noqa: F811
    """The members then the baseline of each group, the baseline flagged (Sample.baseline)."""
    flat = [members + [base] for members, base in groups]
    samples, prompts, sizes = build(model_dir, flat)
    first = 0
    for (members, _), n in zip(groups, map(len, flat)):
        samples[first + len(members)] = replace(samples[first + len(members)], baseline=True)
        first += n
    return samples, prompts, sizes


def _worker(model_dir, **kw):  # noqa: F811
    return TrainerWorker(TrainerConfig(algorithm="remax", lr=1e-3, **kw), model_dir, KnownRewardTask(), device="cpu")


def test_advantages_equal_verl_s_with_the_kl_in_the_reward(model_dir):  # noqa: F811
    """kl_mode reward: each token's return (score at the last, -beta x KL per token) minus the
    group's greedy reward, per token, as verl's; the baseline carries no KL."""
    samples, prompts, _ = _samples(model_dir)
    w = _worker(model_dir, kl_coef=0.3, kl_mode="reward", recompute_old_logprobs=True)
    w._prompts = prompts
    with torch.no_grad():  # the reference is the initial actor: move the actor off it, so KL(old || ref) > 0
        for t in w.actor.parameters():
            t.add_(0.05 * torch.randn_like(t))
    members = [p for p, s in zip(prepare_batch(w, samples), samples) if not s.baseline][:3]  # group 0
    scores = [r for r, _ in GROUPS[0][0]]
    for p, score in zip(members, scores):
        assert p.token_rewards[:-1].abs().min() > 0  # -beta x KL on every token
        assert p.token_rewards.sum() == pytest.approx(p.reward, abs=1e-5) and p.reward < score
    group_advantages(w.cfg, members, 0.5)
    for p in members:
        want = verl_remax(p.token_rewards[None], torch.tensor([0.5]), torch.ones(1, p.num_tokens))[0]
        assert torch.allclose(p.adv, want, atol=1e-5)
        assert not torch.allclose(p.adv, p.adv[-1].expand_as(p.adv))  # per token: the KL makes them differ


def test_prepare_batch_leaves_the_undiscounted_returns(model_dir):  # noqa: F811
    samples, prompts, _ = _samples(model_dir)
    w = _worker(model_dir, recompute_old_logprobs=True)
    w._prompts = prompts
    p = prepare_batch(w, samples[:1])[0]
    assert torch.equal(p.adv, torch.full((3,), 1.0))  # score 1.0 at the last token, gamma 1: 1.0 everywhere


def test_a_step_trains_the_sampled_members_only(model_dir):  # noqa: F811
    """No KL: a member's advantage is its score minus its group's greedy score; the baseline
    samples are neither trained nor counted; their mean reward is reported."""
    samples, prompts, sizes = _samples(model_dir)
    w = _worker(model_dir)
    w.begin_iteration(0, prompts, sizes)
    w.receive(samples[::-1])  # a baseline may arrive before its group's samples
    m = w.step().metrics
    expect = [r - base[0] for members, base in GROUPS for r, _ in members]
    assert m["num_samples"] == 6 and m["num_tokens"] == sum(n for members, _ in GROUPS for _, n in members)
    assert m["advantage_max"] == pytest.approx(max(expect), abs=1e-6)
    assert m["advantage_min"] == pytest.approx(min(expect), abs=1e-6)
    assert m["baseline_reward_mean"] == pytest.approx((0.5 + 0.7 + 1.0) / 3)
    assert m["groups_without_baseline"] == 0 and m["skipped_samples"] == 0
    assert m["reward_max"] == 1.0 and m["response_len_max"] == 6  # the members': group 0's baseline is 4 long
    assert m["grad_norm"] > 0


def test_a_group_whose_baseline_is_refused_is_skipped(model_dir):  # noqa: F811
    samples, prompts, sizes = _samples(model_dir)
    bad = 3  # group 0's baseline: a token outside the vocabulary
    samples[bad] = replace(samples[bad], output_ids=torch.tensor([10 ** 6, 15, 16, 17]))
    w = _worker(model_dir)
    w.begin_iteration(0, prompts, sizes)
    w.receive(samples)
    m = w.step().metrics
    assert m["groups_without_baseline"] == 1
    assert m["skipped_samples"] == 1  # the baseline
    # group 0's three members were prepared (num_samples: reward_mean's population) but not trained
    assert m["num_samples"] == 6 and m["num_seqs"] == 3
    with pytest.raises(ValueError, match="outside"):  # on_bad_sample: error stops on the baseline itself
        w = _worker(model_dir, on_bad_sample="error")
        w.begin_iteration(0, prompts, sizes)
        w.receive(samples)


def test_a_baseline_sample_for_another_algorithm_is_a_caller_bug(model_dir):  # noqa: F811
    samples, prompts, sizes = _samples(model_dir)
    w = TrainerWorker(TrainerConfig(algorithm="grpo"), model_dir, KnownRewardTask(), device="cpu")
    w.begin_iteration(0, prompts, sizes)
    with pytest.raises(ValueError, match="greedy baseline sample .* only remax"):
        w.receive(samples)


def test_config():
    assert TrainerConfig(algorithm="remax").grouped and TrainerConfig(algorithm="remax").token_returns
    assert not TrainerConfig(algorithm="remax").whiten
    with pytest.raises(ValueError, match="trainer.gamma"):
        TrainerConfig(algorithm="remax", gamma=0.99)
    with pytest.raises(ValueError, match="trainer.grpo_std_normalize"):
        TrainerConfig(algorithm="remax", grpo_std_normalize=False)


def _program(algorithm: str, group_size: int) -> Program:
    train = SimpleNamespace(seed=3, batch_prompts=2, group_size=group_size, max_tokens=8, min_tokens=0,
                            temperature=0.9, top_k=-1, top_p=1.0, overlong_prompts="error", max_prompt_tokens=0)
    pipeline = SimpleNamespace(mode="stream", minibatch_size=0, stream_window_s=0.02, balance_batch=False)
    cfg = SimpleNamespace(pipeline=pipeline,
                          train=train, trainer=SimpleNamespace(algorithm=algorithm), multi_turn=MultiTurnSection(),
                          dispatch=DispatchSection())
    world = SimpleNamespace(sgs=SimpleNamespace(stream_window_s=0))
    task = SimpleNamespace(prompts=lambda split: [TaskPrompt(f"{i} + 1 =", str(i + 1), "sum") for i in range(4)])
    tok = SimpleNamespace(encode_prompt=lambda text, messages=(): list(range(1, len(text) + 1)))
    return Program(cfg, world, tok, task)


def test_the_controller_adds_one_greedy_request_per_prompt():
    reqs = _program("remax", 2).make_batch(5).requests
    assert len(reqs) == 2 * 3
    assert [r.sample_id - 5 * SAMPLE_STRIDE for r in reqs] == list(range(6))
    assert [r.group_id - 5 * SAMPLE_STRIDE for r in reqs] == [0, 0, 0, 1, 1, 1]
    assert [r.baseline for r in reqs] == [False, False, True] * 2
    assert [r.sampling.temperature < GREEDY_BELOW for r in reqs] == [False, False, True] * 2
    assert all(r.sampling.temperature == 0.9 for r in reqs if not r.baseline)
    grpo = _program("grpo", 2).make_batch(5).requests
    assert len(grpo) == 4 and not any(r.baseline for r in grpo)


def _run_cfg(tmp_path, tiny_model, **over):  # noqa: F811
    over = {"trainer__algorithm": "remax", "train__iterations": 2, "train__eval_every": 0, **over}
    return write_config(tmp_path, tiny_model, **over)


def test_group_size_one_is_enough_for_remax(tmp_path, tiny_model):  # noqa: F811
    assert load_config(str(_run_cfg(tmp_path, tiny_model, train__group_size=1)), 3).train.group_size == 1
    with pytest.raises(ConfigError, match="train.group_size: grpo needs >= 2"):
        load_config(str(_run_cfg(tmp_path, tiny_model, train__group_size=1, trainer__algorithm="grpo")), 3)


def test_a_remax_run_streams_and_trains_the_sampled_responses(tmp_path, tiny_model):  # noqa: F811
    """The real processes: the engine generates group_size + 1 responses a prompt, the trainer
    trains group_size of them and reports the greedy baseline's mean reward."""
    p = torchrun(_run_cfg(tmp_path, tiny_model, pipeline__mode="async_stream"), timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = iterations(tmp_path / "run")
    assert [r["iteration"] for r in rows] == [0, 1]
    for r in rows:
        assert r["num_samples"] == 4 * 2  # batch_prompts x group_size: the baselines are not trained
        assert r["metrics"]["groups_without_baseline"] == 0
        assert 0.0 <= r["metrics"]["baseline_reward_mean"] <= 1.0
        assert sum(r["per_instance"].values()) == 4 * 3  # the engine generated the greedy ones too


def test_the_bench_generates_the_same_work_both_ways(capsys, monkeypatch):
    """bench/remax_baseline.py: beside and second_pass force the same tokens, one greedy response
    a prompt (its run() asserts both), and the summary compares them."""
    from tests.bench_loading import load_bench

    out = load_bench("remax_baseline", monkeypatch).main(["--quick", "--prompts", "2", "--cap", "16", "--threads", "1"])
    assert out["summary"] and out["beside_s"] > 0 and out["second_pass_s"] > 0
    runs = [line for line in capsys.readouterr().out.splitlines() if '"run"' in line]
    assert len(runs) == 2 and all('"tokens": ' in r for r in runs)


def test_uniform_means_the_members_scored_as_the_greedy_response(model_dir):  # noqa: F811
    """A group whose samples all score 1 learns from a greedy 0 (advantage +1 each): not uniform;
    one whose samples and greedy response all score 0.7 is."""
    groups = [([(1.0, 3), (1.0, 2)], (0.0, 2)), ([(0.7, 2), (0.7, 3)], (0.7, 4))]
    samples, prompts, sizes = _samples(model_dir, groups)
    w = _worker(model_dir)
    w.begin_iteration(0, prompts, sizes)
    w.receive(samples)
    m = w.step().metrics
    assert m["uniform_group_frac"] == 0.5 and m["advantage_max"] == pytest.approx(1.0)


def test_filter_groups_is_refused_with_remax(tmp_path, tiny_model):  # noqa: F811
    with pytest.raises(ConfigError, match="trainer.filter_groups .* remax"):
        load_config(str(_run_cfg(tmp_path, tiny_model, trainer__filter_groups=True)), 3)


def test_requests_per_prompt_counts_the_greedy_response(tmp_path, tiny_model):  # noqa: F811
    """What Program's sample ids and the id limit's check (controller/config_checks.py) both use."""
    from controller.config_checks import requests_per_prompt

    assert requests_per_prompt(load_config(str(_run_cfg(tmp_path, tiny_model)), 3)) == 2 + 1
    assert requests_per_prompt(load_config(str(_run_cfg(tmp_path, tiny_model, trainer__algorithm="grpo")), 3)) == 2


def test_an_iteration_with_no_baseline_at_all_stops_the_run():
    """Every group lost its greedy response: nothing trained, and the run says why."""
    from controller.batch import IterationResult
    from controller.session import RunStopped, Session

    res = IterationResult(3, 3, 3, {"num_samples": 8.0, "num_seqs": 0.0, "groups_without_baseline": 4.0,
                                    "skipped_samples": 4.0}, 8, 0, 1.0, 1.0, 2.0, 0, 0.0)
    saved = []
    fake = SimpleNamespace(program=SimpleNamespace(drain_spans=lambda: []),
                           metrics=SimpleNamespace(log_iteration=lambda res, spans: {}),
                           save_checkpoint=lambda it: saved.append(it) or f"RUN/checkpoints/iter_{it:06d}")
    fake._stop_untrained = lambda res, why: Session._stop_untrained(fake, res, why)
    with pytest.raises(RunStopped, match="step 3: nothing was trained, and 4 groups got no greedy baseline"
                                         r".*; the checkpoint RUN/checkpoints/iter_000003 retries step 3"):
        Session._on_iteration(fake, res)
    assert saved == [3]  # the step is retried from there (its trainers' state is the step before's)
