"""Per-turn rewards of a multi-turn environment (verl's tool rewards / turn scores): a dict answer's
``reward`` is kept on the sample (``Sample.env_rewards``, in call order; ``done: true`` ends the
trajectory with a last one) and never rendered into the observation; a bad reward or ``done`` is
the sample's error naming it; a restart after new weights drops the old attempt's rewards. The
trainer adds their sum to the task's score: ``reward_mean``, the group advantages and the group
filter all see it, ``env_reward_mean`` reports it, and a sample whose rewards are not finite
numbers is refused naming it."""
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from test_multi_turn_engine import (MODEL, OBS, Script, _past_first_turn, first_stop, req, run, run_on,
                                    two_stops, wrap)

from workers.generation.observations import observation_message
from workers.tasks.reward_pool import RewardPool
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer.rollout import rollout
from workers.trainer.sample_checks import bad_sample_reason
from workers.types import TaskPrompt
from tests.trainer_helpers import LengthRewardTask, synthetic_task, tiny_config, tiny_model_dir

torch.set_num_threads(1)


def test_a_turns_reward_is_kept_and_not_rendered():
    eos, turn1 = two_stops()
    [plain] = run(wrap(eos, Script(OBS, None)), [req()])
    [s] = run(wrap(eos, Script({"role": "tool", "content": OBS, "reward": 0.25}, {"done": True, "reward": -1})),
              [req()])
    assert torch.equal(s.output_ids, plain.output_ids) and s.turns == plain.turns == 2
    assert s.env_rewards == (0.25, -1.0) and plain.env_rewards == ()
    assert s.finish_reason == "stop"


def test_done_with_a_reward_ends_the_trajectory_after_one_turn():
    eos, turn1 = first_stop()
    env = Script({"done": True, "reward": 1.5})
    [s] = run(wrap(eos, env), [req()])
    assert s.output_ids.tolist() == turn1 and s.turns == 1 and s.env_rewards == (1.5,) and len(env.calls) == 1


def test_a_reward_with_no_room_left_still_counts():
    eos, turn1 = first_stop()
    long_obs = " ".join(["obs one result: 7"] * 20)
    [s] = run(wrap(eos, Script({"role": "tool", "content": long_obs, "reward": 0.5}), max_observation_tokens=500),
              [req(max_tokens=len(turn1) + 5)])
    assert s.finish_reason == "length" and s.output_ids.tolist() == turn1 and s.env_rewards == (0.5,)


@pytest.mark.parametrize("answer,said", [
    ({"role": "tool", "content": OBS, "reward": float("nan")}, "reward nan"),
    ({"role": "tool", "content": OBS, "reward": "1"}, "reward '1'"),
    ({"role": "tool", "content": OBS, "reward": True}, "reward True"),
    ({"done": "yes"}, "done 'yes'"),
    ({"reward": 1.0}, "without 'role' and 'content'"),
    # a number's content was never cut to max_observation_tokens, and 0 rendered as nothing (s51)
    ({"role": "tool", "content": 0}, "content is a int ('0'); an observation's content is text"),
])
def test_a_bad_reward_or_done_is_the_samples_error(answer, said):
    eng = wrap(first_stop()[0], Script(answer))
    [s] = run(eng, [req()])
    assert s.finish_reason == "error" and "sample 1 after turn 1" in s.error and said in s.error, s.error
    assert not eng.has_work()


def test_observation_message_reads_numpy_rewards_and_keeps_other_keys():
    np = pytest.importorskip("numpy")
    msg, reward = observation_message({"role": "tool", "content": "x", "name": "calc", "reward": np.float32(0.5)})
    assert msg == {"role": "tool", "content": "x", "name": "calc"} and reward == 0.5 and type(reward) is float
    assert observation_message("x") == ({"role": "tool", "content": "x"}, None)
    parts = {"role": "tool", "content": [{"type": "text", "text": "4"}, {"type": "text", "text": "2"}]}
    assert observation_message(parts) == ({"role": "tool", "content": "42"}, None)  # as a data row's parts
    assert observation_message(None) == (None, None)
    assert observation_message({"done": True}) == (None, None)


def test_a_restart_after_new_weights_drops_the_old_attempts_rewards():
    eos, _ = two_stops()
    env = Script({"role": "tool", "content": OBS, "reward": 1.0}, {"done": True, "reward": 2.0})
    eng = wrap(eos, env)
    eng.add([req()])
    _past_first_turn(eng, 1)
    assert eng._traj[1].env_rewards == [1.0]
    eng.load_weights(MODEL.hf_state_dict().items(), version=1)
    env.answers = ({"role": "tool", "content": OBS, "reward": 3.0}, {"done": True, "reward": 4.0})
    [s] = run_on(eng)
    assert s.weight_version == 1 and s.env_rewards == (3.0, 4.0)


# ---- the trainer ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """3 groups x 3 samples of 12 tokens from the tiny model."""
    model_dir, task = tiny_model_dir(tmp_path_factory, tiny_config()), LengthRewardTask(synthetic_task())
    w = TrainerWorker(TrainerConfig(), model_dir, task, device="cpu")
    samples, prompts, groups = rollout(w.actor, w.tokenizer, task.prompts("train")[:3], 3, 12, seed=1)
    return model_dir, task, samples, prompts, groups


def step(setup, samples, **cfg):
    model_dir, task, _, prompts, groups = setup
    w = TrainerWorker(TrainerConfig(algorithm="grpo", **cfg), model_dir, task, device="cpu")
    w.begin_iteration(0, prompts, groups)
    w.receive(samples)
    return w.step()


def test_the_trainer_adds_the_environment_rewards_to_the_tasks_score(setup):
    _, _, samples, _, _ = setup
    extra = [(0.5 * (i % 3), -0.25) if i % 2 else () for i in range(len(samples))]
    sums = [sum(e) for e in extra]
    plain = step(setup, samples).metrics
    shaped = step(setup, [replace(s, env_rewards=e) for s, e in zip(samples, extra)]).metrics
    n = len(samples)
    assert shaped["reward_mean"] == pytest.approx(plain["reward_mean"] + sum(sums) / n)
    assert shaped["env_reward_mean"] == pytest.approx(sum(sums) / n) and plain["env_reward_mean"] == 0.0
    assert shaped["pg_loss"] != pytest.approx(plain["pg_loss"])  # the advantages saw them


def test_the_group_advantage_is_of_score_plus_environment_rewards(setup):
    """A group whose task scores tie but whose environment rewards differ is not uniform: it trains."""
    model_dir, _, samples, prompts, groups = setup
    task = SimpleNamespace(prompts=lambda split: [], score=lambda prompt, completion: 1.0)
    w = TrainerWorker(TrainerConfig(algorithm="grpo"), model_dir, task, device="cpu")
    w.begin_iteration(0, prompts, groups)
    w.receive([replace(s, env_rewards=(float(i),)) for i, s in enumerate(samples)])
    m = w.step().metrics
    assert m["reward_mean"] == pytest.approx(1.0 + sum(range(len(samples))) / len(samples))
    assert m["reward_std"] > 0 and m["pg_loss"] != 0.0


def test_reward_pool_plus_adds_to_a_score_and_leaves_a_failure():
    class Task:
        def score(self, prompt, completion):
            if completion == "bad":
                raise RuntimeError("no")
            return 0.5

    pool = RewardPool(Task())
    item = TaskPrompt("q", "a", "t")
    ok, bad = pool.submit(item, "good", "s0"), pool.submit(item, "bad", "s1")
    assert pool.result(pool.plus(ok, 0.25)).score == 0.75
    assert pool.plus(ok, 0.0) is ok
    failed = pool.result(pool.plus(bad, 0.25))
    assert math.isnan(failed.score) and "raised" in failed.why
    pool.close()


@pytest.mark.parametrize("rewards", [(float("nan"),), (1.0, float("inf")), ("1",), [True], None, (1e308, 1e308)])
def test_environment_rewards_that_are_not_finite_numbers_are_refused(setup, rewards):
    s = setup[2][0]
    model = SimpleNamespace(vocab_size=300, max_position_embeddings=4096)
    why = bad_sample_reason(replace(s, env_rewards=rewards), 0, TrainerConfig(), model)
    assert why is not None and why.startswith(f"sample {s.sample_id}: env_rewards"), why
    assert bad_sample_reason(replace(s, env_rewards=(0.5, -1)), 0, TrainerConfig(), model) is None
