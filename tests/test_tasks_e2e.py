"""A file task under torchrun (3 processes), as the audit ran it: an ``async def`` verl-style
reward (every sample used to be skipped: 'coroutine ... never awaited'), its options from
``task.kwargs.verifier_kwargs``, and the data as one JSON array in a ``.json`` file."""
import json

import pytest

from tests import runtime_helpers
from tests.runtime_helpers import iterations, last_json, torchrun, write_config

tiny_model = runtime_helpers.tiny_model  # the fixture

ASYNC_REWARD = '''
import asyncio

async def compute_score(data_source, solution_str, ground_truth, extra_info=None, floor=0.0):
    await asyncio.sleep(0)
    return {"score": max(floor, float(ground_truth in solution_str)), "pred": solution_str}
'''


@pytest.mark.slow  # a torchrun run (~45 s); async rewards are covered by test_tasks_verifiers in the default tier
def test_an_async_reward_with_options_trains(tmp_path, tiny_model):
    data = tmp_path / "train.json"
    data.write_text(json.dumps([{"data_source": "toy", "prompt": f"sum {i} {i}",
                                 "reward_model": {"ground_truth": str(2 * i)}} for i in range(1, 9)], indent=2))
    reward = tmp_path / "reward.py"
    reward.write_text(ASYNC_REWARD)
    kwargs = {"files": str(data), "answer_key": "reward_model.ground_truth",
              "verifier": f"{reward}:compute_score", "verifier_kwargs": {"floor": 0.5}}
    r = torchrun(write_config(tmp_path, tiny_model, task__name="jsonl", task__kwargs=kwargs, train__iterations=2,
                              train__eval_every=0))
    assert r.returncode == 0, r.stderr[-3000:]
    assert last_json(r.stdout)["skipped_samples"] == 0 and "never awaited" not in r.stderr
    for row in iterations(tmp_path / "run"):
        assert 0.5 <= row["metrics"]["reward_mean"] <= 1.0, row  # the floor reached the function
    bad = {**kwargs, "verifier_kwargs": {"flor": 0.5}}
    r = torchrun(write_config(tmp_path, tiny_model, task__name="jsonl", task__kwargs=bad, train__iterations=1,
                              train__eval_every=0, logging__logdir=str(tmp_path / "bad")))
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("config error:")]
    assert len(errors) == 1 and "task.kwargs.verifier_kwargs" in errors[0] and "'flor'" in errors[0], r.stderr[-3000:]
