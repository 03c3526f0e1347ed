"""Multi-turn rollouts' config (the ``multi_turn`` section and what it refuses), its wiring
(``make_engine``, ``GenerationInstance``) and the built-in ``calculator`` environment."""
import json
from pathlib import Path

import pytest
import torch

from controller.config import ConfigError, MultiTurnSection, from_dict
from controller.instance import GenerationInstance
from runtime_helpers import LocalRRef, SinkTrainer, tiny_model  # noqa: F401  (tiny_model: session-wide model folder)
from workers.generation.config import EngineConfig
from workers.generation.factory import make_engine
from workers.generation.multi_turn import MultiTurnEngine
from workers.tasks.envs import ENVS, load_env
from workers.tasks.envs.calculator import calculator_env, evaluate
from workers.types import Request, SamplingParams, TaskPrompt

ON = {"multi_turn": {"env": "calculator"}}


def _error(d: dict) -> str:
    with pytest.raises(ConfigError) as e:
        from_dict(d)
    return str(e.value)


def test_single_turn_is_the_default_and_the_section_reads_its_keys():
    cfg = from_dict({})
    assert cfg.multi_turn == MultiTurnSection(env="", max_turns=4, max_observation_tokens=256, workers=4)
    assert not cfg.multi_turn.on
    cfg = from_dict({"multi_turn": {"env": "calculator", "max_turns": 2, "max_observation_tokens": 8, "workers": 1}})
    assert cfg.multi_turn.on and cfg.multi_turn.max_turns == 2 and cfg.multi_turn.max_observation_tokens == 8
    assert cfg.multi_turn.observation_truncate_side == "middle"  # verl's default
    cfg = from_dict({"multi_turn": {"env": "calculator", "observation_truncate_side": "left"}})
    assert cfg.multi_turn.observation_truncate_side == "left"
    assert "multi_turn.observation_truncate_side" in _error({"multi_turn": {"observation_truncate_side": "top"}})
    assert "multi_turn.observation_truncate_side" in _error({"tool_response_truncate_side": "left"})  # verl's name


@pytest.mark.parametrize("key", ["max_turns", "max_observation_tokens", "workers"])
def test_bad_values_are_named(key):
    assert _error({"multi_turn": {key: 0}}).startswith(f"multi_turn.{key} must be an int >= 1")


def test_an_env_that_does_not_load_is_named(tmp_path):
    assert "multi_turn.env: 'nope' is not one of ['calculator']" in _error({"multi_turn": {"env": "nope"}})
    assert "multi_turn.env" in _error({"multi_turn": {"env": f"{tmp_path / 'missing.py'}:env"}})
    (tmp_path / "broken.py").write_text("raise RuntimeError('no')\n")
    assert "multi_turn.env: loading" in _error({"multi_turn": {"env": f"{tmp_path / 'broken.py'}:env"}})
    (tmp_path / "envs.py").write_text("env = 3\n\ndef ok(task, messages):\n    return None\n")
    assert "multi_turn.env" in _error({"multi_turn": {"env": f"{tmp_path / 'envs.py'}:env"}})  # not callable
    assert from_dict({"multi_turn": {"env": f"{tmp_path / 'envs.py'}:ok"}}).multi_turn.on
    assert "multi_turn.bogus: unknown key" in _error({"multi_turn": {"bogus": 1}})


def test_an_env_that_cannot_take_task_and_messages_is_refused_at_load(tmp_path):
    """``def env(messages)`` loaded, then failed every tool call: each sample skipped and the run
    ended with exit 0 (review, s55). Refused at load, naming what it takes; a trajectory keyword
    and a class's ``__call__`` are accepted."""
    (tmp_path / "envs.py").write_text(
        "def one(messages):\n    return None\n\n\ndef needs(task, messages, budget):\n    return None\n\n\n"
        "def traj(task, messages, trajectory):\n    return None\n\n\ndef star(*args, **kw):\n    return None\n\n\n"
        "class Narrow:\n    def __call__(self, messages):\n        return None\n\n\n"
        "class Static:\n    @staticmethod\n    def __call__(task, messages):\n        return None\n\n\n"
        "import functools\n\n\ndef with_client(fn):\n    @functools.wraps(fn)\n"
        "    def wrapper(task, messages):\n        return fn(None, task, messages)\n    return wrapper\n\n\n"
        "@with_client\ndef injected(client, task, messages):\n    return None\n\n\n"
        "async def coro(task, messages):\n    return None\n\n\n"
        "def passing_on(fn):\n    @functools.wraps(fn)\n    def wrapper(*a, **kw):\n        return fn(*a, **kw)\n"
        "    return wrapper\n\n\n@passing_on\ndef logged_one(messages):\n    return None\n\n\n"
        "@passing_on\ndef logged(task, messages):\n    return None\n\n\n"
        "@with_client\ndef injected_traj(client, task, messages, trajectory=None):\n    return None\n\n\n"
        "static_instance = Static()\n")
    env = f"{tmp_path / 'envs.py'}"
    assert "multi_turn.env: '" + env + ":one' takes (messages): " in _error({"multi_turn": {"env": f"{env}:one"}})
    assert "takes (task, messages, budget)" in _error({"multi_turn": {"env": f"{env}:needs"}})
    assert "takes (messages)" in _error({"multi_turn": {"env": f"{env}:Narrow"}})
    # a wrapper that passes *args on is read by what it wraps; one given trajectory= by what it
    # wraps must take it (MultiTurnEngine passes it then) (diff reviews, s55)
    assert "takes (messages)" in _error({"multi_turn": {"env": f"{env}:logged_one"}})
    assert "takes (client, task, messages, trajectory)" in _error({"multi_turn": {"env": f"{env}:injected_traj"}})
    for fine in ("traj", "star", "Static", "injected", "coro", "logged", "static_instance"):
        assert from_dict({"multi_turn": {"env": f"{env}:{fine}"}}).multi_turn.on


@pytest.mark.parametrize("over,keys", [
    ({"train": {"min_tokens": 2}}, ("train.min_tokens", "multi_turn.env")),
    ({"trainer": {"rollout_bypass": True}}, ("trainer.rollout_bypass", "multi_turn.env")),
    ({"trainer": {"policy_loss": "clip_cov"}}, ("trainer.policy_loss: clip_cov", "multi_turn.env")),
    ({"trainer": {"policy_loss": "kl_cov"}}, ("trainer.policy_loss: kl_cov", "multi_turn.env")),
    ({"trainer": {"policy_loss": "gspo", "loss_agg": "seq_mean"}}, ("trainer.policy_loss: gspo", "multi_turn.env")),
    ({"trainer": {"policy_loss": "geo_mean", "loss_agg": "seq_mean"}}, ("trainer.policy_loss: geo_mean",)),
    ({"trainer": {"policy_loss": "sapo", "loss_agg": "seq_mean"}}, ("trainer.policy_loss: sapo",)),
])
def test_what_multi_turn_cannot_do_is_refused_naming_both_keys(over, keys):
    msg = _error({**ON, **over})
    assert msg.startswith(keys[0]) and all(k in msg for k in keys) and "multi_turn.env" in msg
    from_dict(over)  # single-turn: fine


def test_a_length_trace_is_refused(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("{}\n")
    msg = _error({**ON, "train": {"length_trace": str(trace)}})
    assert msg.startswith("train.length_trace") and "multi_turn.env" in msg


def test_make_engine_wraps_only_with_an_env(tiny_model):  # noqa: F811
    cfg = EngineConfig(device="cpu", kv_cache_tokens=256)
    assert not isinstance(make_engine(cfg, tiny_model, multi_turn=MultiTurnSection()), MultiTurnEngine)
    eng = make_engine(cfg, tiny_model, multi_turn=MultiTurnSection(env="calculator", max_turns=2))
    assert isinstance(eng, MultiTurnEngine) and eng.max_turns == 2 and eng.env is calculator_env
    assert eng.max_model_len == eng.inner.max_model_len
    eng.close()


def test_an_instance_streams_multi_turn_samples_with_their_mask(tiny_model, tmp_path):  # noqa: F811
    torch.set_num_threads(1)
    (tmp_path / "env.py").write_text("def env(task, messages):\n"
                                     "    turns = sum(m['role'] == 'assistant' for m in messages)\n"
                                     "    return 'seven' if turns == 1 else None\n")
    vocab = json.loads((Path(tiny_model) / "config.json").read_text())["vocab_size"]
    section = MultiTurnSection(env=f"{tmp_path / 'env.py'}:env", max_turns=3)
    inst = GenerationInstance(1, EngineConfig(device="cpu", kv_cache_tokens=1024), tiny_model,
                              list(range(vocab // 2)), section)  # half the vocabulary ends a turn
    sink = SinkTrainer()
    inst.trainers = [LocalRRef(sink)]
    reqs = [Request(i, torch.arange(3, 9) + i, 24, group_id=i, sampling=SamplingParams(temperature=0.0),
                    task=TaskPrompt("1 + 6", "7", "sum")) for i in range(3)]
    report = inst.generate(0, reqs, 0)
    assert sorted(report.sample_ids) == [0, 1, 2] and len(sink.samples) == 3
    for s in sink.samples:
        assert s.loss_mask is not None and len(s.loss_mask) == len(s.output_ids) and s.instance == 1
        assert s.turns == 2 and (~s.loss_mask).sum() > 0
    inst.close()


def test_the_calculator_answers_the_last_turns_tool_call():
    def chat(text):
        return [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]

    def call(args):
        return chat(f"let me compute <tool_call>{json.dumps({'name': 'calculator', 'arguments': args})}</tool_call>")

    assert ENVS["calculator"] is calculator_env and load_env("calculator") is calculator_env
    assert calculator_env(None, call({"expression": "3*(4+5)"})) == "27"
    assert calculator_env(None, call({"expression": "7 // 2 + 7 % 3 - 2 ** 2 + 1 / 4"})) == "0.25"
    assert calculator_env(None, call(json.dumps({"expression": "2**10"}))) == "1024"  # arguments as a JSON string
    assert calculator_env(None, chat("the answer is 27")) is None  # no tool call: done
    bad_json = calculator_env(None, chat("<tool_call>{not json</tool_call>"))
    assert bad_json.startswith("Error: the tool call is not valid JSON")
    assert calculator_env(None, call({"expression": "__import__('os')"})).startswith("Error: ")
    assert calculator_env(None, call({"expression": "1/0"})) == "Error: division by zero"
    assert calculator_env(None, call({"expression": "9**9**9"})).endswith("is too large")
    # a complex intermediate was answered as a number, then raised (a TypeError: the run stopped)
    for expr, base in (("(-8)**0.5", "(-8)"), ("(-8)**0.5 // 1", "(-8)"), ("(-1)**0.5 % 2", "(-1)")):
        assert calculator_env(None, call({"expression": expr})) == f"Error: '{base} ** 0.5' is not a real number"
    assert calculator_env(None, call({"expr": "1"})).startswith("Error: the calculator takes")
    bad_name = chat('<tool_call>{"name": "search", "arguments": {}}</tool_call>')
    assert calculator_env(None, bad_name) == "Error: unknown tool 'search' (the one tool is 'calculator')"
    assert evaluate("-(2.5 * 2)") == -5.0
    for bad in ("x + 1", "abs(-1)", "[1]", "'a' * 3", "True + 1"):
        with pytest.raises(ValueError):
            evaluate(bad)


def test_a_calls_nesting_or_size_is_an_error_answer_not_a_failed_round():
    """A run of dashes (a few BPE tokens at temperature 1) or a deep JSON body raised a
    RecursionError, an integer of 5000 digits json's ValueError: the environment failed and the
    round with it (review, session 51). Each is an "Error: ..." answer now, as other bad calls."""
    def call(body):
        return [{"role": "assistant", "content": f"<tool_call>{body}</tool_call>"}]

    expr = lambda e: call(json.dumps({"name": "calculator", "arguments": {"expression": e}}))  # noqa: E731
    assert calculator_env(None, expr("abs(" + "-" * 340 + "1)")).startswith("Error: ")
    assert calculator_env(None, expr("-" * 990 + "1")) == "Error: the expression is nested too deeply"
    assert calculator_env(None, call("[" * 5000)).startswith("Error: the tool call is not valid JSON")
    huge = '{"name": "calculator", "arguments": {"expression": "1", "n": ' + "9" * 5000 + "}}"
    assert calculator_env(None, call(huge)).startswith("Error: the tool call is not valid JSON")


def test_the_examples_reward_evaluates_the_call_not_the_text_after_it():
    """configs/example_multi_turn.yaml's reward read the number after </tool_call> in the decoded
    response; without a chat template the tool's answer runs into the policy's next turn: a right
    call followed by "." scored 0, a wrong one followed by the policy's own "56" scored 1."""
    from configs.example_data.calculator_reward import compute_score

    ref = '<tool_call>{"name": "calculator", "arguments": {"expression": "7*8"}}</tool_call>'
    task = TaskPrompt("What is 7 times 8?", ref, "calc")
    right, wrong = ref, ref.replace("7*8", "7+8")
    assert compute_score(task, right + "56" + ". 56") == 1.0  # turn 1, the tool's 56, turn 2
    assert compute_score(task, wrong + "56 " + "15") == 0.0
    assert compute_score(task, "no call at all: 56") == 0.0


def test_a_class_env_is_checked_at_load_and_built_once_per_engine(tiny_model, tmp_path):  # noqa: F811
    (tmp_path / "envs.py").write_text("class Env:\n    def __call__(self, task, messages):\n        return None\n\n\n"
                                      "class Bare:\n    pass\n")
    assert from_dict({"multi_turn": {"env": f"{tmp_path / 'envs.py'}:Env"}}).multi_turn.on
    assert "is a class without __call__" in _error({"multi_turn": {"env": f"{tmp_path / 'envs.py'}:Bare"}})
    cfg = EngineConfig(device="cpu", kv_cache_tokens=256)
    section = MultiTurnSection(env=f"{tmp_path / 'envs.py'}:Env")
    a, b = (make_engine(cfg, tiny_model, multi_turn=section) for _ in range(2))
    assert type(a.env).__name__ == "Env" and a.env is not b.env  # one instance per generation instance
    a.close()
    b.close()
