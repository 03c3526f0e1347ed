"""A user's verl advantage estimator (``trainer.algorithm: "file.py:fn"``): called as verl's
``compute_advantage`` calls a registered one, and a transcription of verl's GRPO estimator
(core_algos, b178a3c) written as such a plugin trains exactly as ``algorithm: grpo``; bad
plugins are refused naming the key; and a real run (torchrun) loads it on the trainer rank."""
import textwrap
from dataclasses import replace

import numpy as np
import pytest
import torch

from controller.config import ConfigError, load_config
from controller.config_notes import config_notes
from tests.runtime_helpers import iterations, tiny_model, torchrun, write_config  # noqa: F401
from tests.test_trainer_stats import KnownRewardTask, build, model_dir  # noqa: F401
from workers.tasks.plugins import load_plugin
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer.custom_advantage import AlgoConfig, canonical, identity

torch.set_num_threads(1)

VERL_GRPO = '''
from collections import defaultdict

import torch

CALLS = []


def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                   norm_adv_by_std_in_grpo=True, config=None):
    """verl's, transcribed: the sum of token rewards, minus its uid's mean, over its std."""
    CALLS.append({"rewards": token_level_rewards.clone(), "mask": response_mask.clone(), "index": list(index),
                  "config": config})
    if config is not None:
        norm_adv_by_std_in_grpo = config.get("norm_adv_by_std_in_grpo", True)
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    with torch.no_grad():
        for i in range(scores.shape[0]):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
            else:
                t = torch.stack(id2score[idx])
                id2mean[idx], id2std[idx] = torch.mean(t), torch.std(t)
        for i in range(scores.shape[0]):
            if norm_adv_by_std_in_grpo:
                scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
            else:
                scores[i] = scores[i] - id2mean[index[i]]
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def advantages_only(token_level_rewards, response_mask, **kwargs):
    return token_level_rewards.flip(-1).cumsum(-1).flip(-1) * response_mask


def wrong_shape(token_level_rewards, response_mask, index, config):
    return token_level_rewards[:, :1]


def too_few(token_level_rewards, response_mask):
    return token_level_rewards


def zero_std(token_level_rewards, response_mask, index, config):
    scores = token_level_rewards.sum(-1)
    return (scores / 0.0).unsqueeze(-1) * response_mask  # 0 / 0 and x / 0: NaN and inf


def raises(token_level_rewards, response_mask, index, config):
    raise KeyError("uid")


def nan_off_the_mask(token_level_rewards, response_mask, index, config):
    scores = token_level_rewards.sum(-1, keepdim=True)
    return scores * response_mask / response_mask  # NaN where the mask is 0 (0 / 0)
'''

# per group: (reward, response length) of each sample
GROUPS = [[(1.0, 3), (0.0, 5), (1.0, 2), (0.5, 4)], [(0.2, 2), (0.7, 6)], [(0.0, 2), (0.0, 3)]]


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugin") / "my_estimators.py"
    path.write_text(textwrap.dedent(VERL_GRPO))
    return path


def _step(model_dir, algorithm, **kw):  # noqa: F811
    samples, prompts, sizes = build(model_dir, GROUPS)
    w = TrainerWorker(TrainerConfig(algorithm=algorithm, lr=1e-2, **kw), model_dir, KnownRewardTask(), device="cpu")
    w.begin_iteration(0, prompts, sizes)
    w.receive(samples)
    m = w.step().metrics
    return m, {k: v.detach().clone() for k, v in w.actor.state_dict().items()}


@pytest.mark.parametrize("normalize", [True, False])
def test_verl_s_grpo_as_a_plugin_trains_as_our_grpo(model_dir, plugin, normalize):  # noqa: F811
    m0, w0 = _step(model_dir, "grpo", grpo_std_normalize=normalize)
    m1, w1 = _step(model_dir, f"{plugin}:compute_grpo_outcome_advantage", grpo_std_normalize=normalize)
    for k in ("advantage_max", "advantage_min", "advantage_mean", "pg_loss", "grad_norm", "num_tokens"):
        assert m1[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-6), k
    assert all(torch.allclose(w0[k], w1[k], atol=1e-5) for k in w0)  # Adam divides ~1e-9 gradients: 2e-6 apart
    assert m0["grad_norm"] > 0 and any(not torch.equal(w1[k], w1[k] * 0) for k in w1)


def test_it_gets_verl_s_inputs(model_dir, plugin):  # noqa: F811
    fn = load_plugin(f"{plugin}:compute_grpo_outcome_advantage", "test")  # the module loaded once
    _step(model_dir, f"{plugin}:compute_grpo_outcome_advantage", gamma=0.9)
    call = fn.__globals__["CALLS"][-1]
    lengths = [n for group in GROUPS for _, n in group]
    rewards, mask = call["rewards"], call["mask"]
    assert rewards.shape == (8, 6) and mask.dtype == torch.int64
    assert mask.sum(1).tolist() == lengths  # right-padded to the longest response
    # the score at each sample's last token, nothing elsewhere (no KL in the reward)
    assert rewards.sum(1).tolist() == pytest.approx([r for group in GROUPS for r, _ in group])
    assert all(rewards[i, n - 1] == rewards[i].sum() for i, n in enumerate(lengths))
    assert call["index"] == ["0"] * 4 + ["1"] * 2 + ["2"] * 2  # verl's uid: one per prompt
    cfg = call["config"]
    assert isinstance(cfg, AlgoConfig) and cfg.gamma == 0.9 and cfg["lam"] == TrainerConfig().gae_lambda and cfg.get("nope", 3) == 3
    assert cfg.adv_estimator.endswith(":compute_grpo_outcome_advantage") and not cfg.use_kl_in_reward


def test_advantages_alone_and_per_token(model_dir, plugin):  # noqa: F811
    m, _ = _step(model_dir, f"{plugin}:advantages_only")
    # each token's return: the score on every token of its sample (no KL): extremes 1.0 and 0.0
    assert (m["advantage_max"], m["advantage_min"]) == (1.0, 0.0)


def test_a_wrong_shape_is_said(model_dir, plugin):  # noqa: F811
    with pytest.raises(ValueError, match=r"trainer.algorithm: .*wrong_shape.* shape \(8, 1\) in iteration 0, expected a tensor of shape "
                                         r"\(8, 6\)"):
        _step(model_dir, f"{plugin}:wrong_shape")


def test_non_finite_advantages_and_errors_name_the_key(model_dir, plugin):  # noqa: F811
    with pytest.raises(ValueError, match=r"trainer.algorithm: .*zero_std.* non-finite advantages in iteration 0 "
                                         r"on 27 response tokens, groups \[0, 1, 2\]"):
        _step(model_dir, f"{plugin}:zero_std")
    with pytest.raises(RuntimeError, match=r"trainer.algorithm: .*raises.* raised in iteration 0: KeyError: 'uid'"):
        _step(model_dir, f"{plugin}:raises")


def test_the_kl_penalty_and_rejection_reach_the_estimator(model_dir, plugin):  # noqa: F811
    """kl_mode reward: each row sums to the sample's reward (score - beta x its KL), every token
    carrying its -beta x KL; rollout_rs: the rejected tokens are 0 in response_mask."""
    from workers.trainer.custom_advantage import batch_inputs
    from workers.trainer.step_math import prepare_batch

    samples, prompts, _ = build(model_dir, GROUPS)
    w = TrainerWorker(TrainerConfig(algorithm=f"{plugin}:advantages_only", kl_coef=0.5, kl_mode="reward",
                                    rollout_rs="token_k1", rollout_rs_threshold="0.6_1.5"),
                      model_dir, KnownRewardTask(), device="cpu")
    w._prompts = prompts
    with torch.no_grad():  # the reference off the actor: KL(old || ref) > 0
        for t in w.ref.parameters():
            t.add_(0.05 * torch.randn_like(t))
    # the sampler 0.8 below the trainer on every other token: a ratio of e^0.8 (or e^-0.8), outside [0.6, 1.5]
    shifted = [replace(s, logprobs=s.logprobs - 0.8 * (torch.arange(len(s.logprobs)) % 2 == 0)) for s in samples]
    items = prepare_batch(w, shifted)
    rewards, mask, _ = batch_inputs(items)
    for i, p in enumerate(items):
        n = p.num_tokens
        assert rewards[i, :n].sum() == pytest.approx(p.reward, abs=1e-5) and p.reward < p.score
        assert (rewards[i, :n - 1] < 0).all()  # -beta x KL, KL(old || ref) > 0 here
        assert mask[i, :n].tolist() == p.keep.long().tolist() and mask[i, n:].sum() == 0
    assert mask.sum() == sum(n // 2 for n in (p.num_tokens for p in items))  # the odd tokens kept


def test_bad_plugins_are_refused_naming_the_key(plugin, tmp_path):
    with pytest.raises(ValueError, match="trainer.algorithm: .*must take verl's estimator keywords"):
        TrainerConfig(algorithm=f"{plugin}:too_few")
    with pytest.raises(ValueError, match="trainer.algorithm: .*has no attribute 'nope'"):
        TrainerConfig(algorithm=f"{plugin}:nope")
    with pytest.raises(ValueError, match="trainer.algorithm: .*is not a file"):
        TrainerConfig(algorithm=f"{tmp_path}/missing.py:fn")
    with pytest.raises(ValueError, match="trainer.algorithm: 'grpoo' is not one of .* or a verl estimator of yours"):
        TrainerConfig(algorithm="grpoo")
    for verl, ours in (("gae", "ppo"), ("grpo_vectorized", "grpo"), ("rloo_vectorized", "rloo")):
        with pytest.raises(ValueError, match=f"trainer.algorithm: '{verl}' is verl's name; here it is '{ours}'"):
            TrainerConfig(algorithm=verl)
    with pytest.raises(ValueError, match="trainer.critic_lr"):  # no critic
        TrainerConfig(algorithm=f"{plugin}:advantages_only", critic_lr=1e-3)
    cfg = TrainerConfig(algorithm=f"{plugin}:advantages_only", gamma=0.9, gae_lambda=0.8)  # passed in config
    assert cfg.trains_at_step and not cfg.grouped and not cfg.whiten and not cfg.use_critic


def test_a_run_loads_the_plugin_on_the_trainer_rank(tmp_path, tiny_model, plugin):  # noqa: F811
    cfg = write_config(tmp_path, tiny_model, trainer__algorithm=f"{plugin}:compute_grpo_outcome_advantage",
                       train__iterations=2, train__eval_every=0, pipeline__mode="stream")
    loaded = load_config(str(cfg), 3)
    assert loaded.trainer.algorithm.endswith(":compute_grpo_outcome_advantage")
    assert any("a verl estimator sees the iteration's samples at once" in n for n in config_notes(loaded))
    p = torchrun(cfg, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = iterations(tmp_path / "run")
    assert [r["iteration"] for r in rows] == [0, 1] and all(r["num_samples"] == 8 for r in rows)
    bad = write_config(tmp_path, tiny_model, trainer__algorithm=f"{plugin}:too_few")
    with pytest.raises(ConfigError, match="trainer.algorithm"):
        load_config(str(bad), 3)


def test_index_is_an_object_array(model_dir, plugin):  # noqa: F811
    from workers.trainer.custom_advantage import batch_inputs
    from workers.trainer.step_math import prepare_batch

    samples, prompts, _ = build(model_dir, GROUPS)
    w = TrainerWorker(TrainerConfig(algorithm=f"{plugin}:advantages_only"), model_dir, KnownRewardTask(), device="cpu")
    w._prompts = prompts
    _, _, index = batch_inputs(prepare_batch(w, samples))
    assert isinstance(index, np.ndarray) and index.dtype == object and index[0] == "0"


def test_a_checkpoint_resumes_under_another_spelling_and_says_when_the_file_changed(model_dir, plugin, tmp_path,
                                                                                    monkeypatch, caplog):  # noqa: F811
    """``./file.py:fn`` and ``/abs/file.py:fn`` are the same estimator; an edited file is said."""
    import shutil

    own = tmp_path / "est.py"
    shutil.copy(plugin, own)
    monkeypatch.chdir(tmp_path)
    samples, prompts, sizes = build(model_dir, GROUPS)
    w = TrainerWorker(TrainerConfig(algorithm=f"{own}:advantages_only"), model_dir, KnownRewardTask(), device="cpu")
    w.begin_iteration(0, prompts, sizes)
    w.receive(samples)
    w.step()
    w.save_checkpoint(str(tmp_path / "ckpt"))
    again = TrainerWorker(TrainerConfig(algorithm="./est.py:advantages_only"), model_dir, KnownRewardTask(),
                          device="cpu")
    again.load_checkpoint(str(tmp_path / "ckpt"))  # the same file, spelled relative
    assert again.version == w.version and "has changed" not in caplog.text
    own.write_text(own.read_text() + "\n# edited\n")
    again.load_checkpoint(str(tmp_path / "ckpt"))
    assert "has changed since this checkpoint was saved" in caplog.text
    other = TrainerWorker(TrainerConfig(algorithm="./est.py:compute_grpo_outcome_advantage"), model_dir,
                          KnownRewardTask(), device="cpu")
    with pytest.raises(ValueError, match="checkpoint is for trainer.algorithm .*est.py:advantages_only"):
        other.load_checkpoint(str(tmp_path / "ckpt"))


def test_a_non_finite_advantage_where_the_mask_is_0_leaves_the_update_alone(model_dir, plugin):  # noqa: F811
    """``x * mask / mask``: NaN on the tokens rollout_rs rejects (mask 0) stayed out of the loss
    but not of its gradient (where()'s zero x NaN): every update was skipped (review, s53)."""
    samples, prompts, sizes = build(model_dir, GROUPS)
    # the sampler 0.8 below the trainer on every other token: those are rejected (mask 0)
    shifted = [replace(s, logprobs=s.logprobs - 0.8 * (torch.arange(len(s.logprobs)) % 2 == 0)) for s in samples]
    w = TrainerWorker(TrainerConfig(algorithm=f"{plugin}:nan_off_the_mask", lr=1e-2, rollout_rs="token_k1",
                                    rollout_rs_threshold="0.6_1.5"), model_dir, KnownRewardTask(), device="cpu")
    w.begin_iteration(0, prompts, sizes)
    w.receive(shifted)
    m = w.step().metrics
    assert m["step_skipped"] == 0.0 and m["grad_norm"] > 0


def test_the_advantages_of_an_advantages_returns_pair_are_what_trains(model_dir, tmp_path):  # noqa: F811
    """verl's estimators return (advantages, returns), and for most the two differ (reinforce++'s
    returns are not whitened, GAE's add the values): the first trains, never the second."""
    f = tmp_path / "pair_estimators.py"
    f.write_text(textwrap.dedent('''
        def alone(token_level_rewards, response_mask, **kwargs):
            return token_level_rewards.flip(-1).cumsum(-1).flip(-1) * response_mask

        def pair(token_level_rewards, response_mask, **kwargs):
            adv = alone(token_level_rewards, response_mask)
            return adv, -3.0 * adv + 1.0
    '''))
    _, w_alone = _step(model_dir, f"{f}:alone")
    _, w_pair = _step(model_dir, f"{f}:pair")
    for k in w_alone:
        assert torch.equal(w_alone[k], w_pair[k]), k


# ---- mutation review, session 59 ------------------------------------------------------------
def test_the_estimators_config_says_when_the_kl_is_in_the_reward(model_dir, plugin):  # noqa: F811
    """kl_mode reward: verl's algorithm.use_kl_in_reward is True, and an estimator may branch on it."""
    fn = load_plugin(f"{plugin}:compute_grpo_outcome_advantage", "test")
    _step(model_dir, f"{plugin}:compute_grpo_outcome_advantage", kl_coef=0.1, kl_mode="reward")
    assert fn.__globals__["CALLS"][-1]["config"].use_kl_in_reward is True
    _step(model_dir, f"{plugin}:compute_grpo_outcome_advantage", kl_coef=0.1, kl_mode="loss")
    assert fn.__globals__["CALLS"][-1]["config"].use_kl_in_reward is False


# ---- mutation review, session 59 ------------------------------------------------------------
def test_an_estimator_needing_an_argument_verl_does_not_pass_is_refused_at_load(tmp_path):
    """verl passes exactly token_level_rewards, response_mask, config, index: an estimator with one
    more required parameter fails at its first call, so it is refused when the config loads
    (TrainerConfig), not after the iteration's generation, at step()."""
    f = tmp_path / "est.py"
    f.write_text(textwrap.dedent('''
        def needs_eps(token_level_rewards, response_mask, config, index, epsilon):
            return token_level_rewards

        def defaulted_eps(token_level_rewards, response_mask, config, index, epsilon=1e-6):
            return token_level_rewards
    '''))
    with pytest.raises(ValueError, match=r"trainer.algorithm: .*needs_eps.* must take verl's estimator keywords"):
        TrainerConfig(algorithm=f"{f}:needs_eps")
    TrainerConfig(algorithm=f"{f}:defaulted_eps")  # a defaulted extra is fine (verl's own grpo has one)


def test_a_module_estimator_is_recorded_as_its_module_not_a_path(tmp_path, monkeypatch):
    """canonical / identity: only a file plugin's path is resolved (and digested); a module plugin
    ``pkg.mod:fn`` is recorded as written, so a checkpoint resumes from any working folder."""
    pkg = tmp_path / "estpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("def fn(token_level_rewards, response_mask, config, index):\n"
                                "    return token_level_rewards\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert TrainerConfig(algorithm="estpkg.mod:fn").trains_at_step
    assert canonical("estpkg.mod:fn") == "estpkg.mod:fn"
    assert identity("estpkg.mod:fn") == ("estpkg.mod:fn", None)
    assert canonical("grpo") == "grpo"
