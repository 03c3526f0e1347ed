"""The request validation every engine backend shares (workers/generation/request_check.py)."""
import math

import pytest
import torch

from workers.generation.request_check import refusal
from workers.types import Request, SamplingParams

OK = dict(sample_id=1, prompt_ids=torch.tensor([1, 2]), max_tokens=3)


def test_a_valid_request_passes():
    assert refusal(Request(**OK), 128, 512, set()) is None
    assert refusal(Request(**OK, min_tokens=3, sampling=SamplingParams(temperature=0.0, top_k=0)), 128, 512, set()) is None
    # top_k -1 is off, as 0 (vLLM: "quietly accept -1 as disabled"; its default for years)
    assert refusal(Request(**OK, sampling=SamplingParams(top_k=-1)), 128, 512, set()) is None


@pytest.mark.parametrize("change, why", [
    (dict(prompt_ids=torch.tensor([], dtype=torch.int64)), "empty prompt"),
    (dict(prompt_ids=torch.tensor([1.0, 2.0])), "prompt_ids must be a 1-D integer tensor"),
    (dict(prompt_ids=torch.tensor([[1, 2]])), "prompt_ids must be a 1-D integer tensor"),
    (dict(prompt_ids=[1, 2]), "prompt_ids must be a 1-D integer tensor"),
    (dict(prompt_ids=torch.tensor([1, 128])), "token id 128 is outside the vocabulary [0, 128)"),
    (dict(prompt_ids=torch.tensor([-1, 2])), "token id -1 is outside"),
    (dict(prompt_ids=torch.zeros(512, dtype=torch.int64)), "prompt of 512 tokens does not fit the context"),
    (dict(max_tokens=0), "max_tokens must be an int >= 1, got 0"),
    (dict(max_tokens=2.0), "max_tokens must be an int >= 1, got 2.0"),
    (dict(min_tokens=5), "min_tokens must be in [0, max_tokens=3], got 5"),
    (dict(min_tokens=1.5), "min_tokens must be in [0, max_tokens=3], got 1.5"),
    (dict(min_tokens=-1), "got -1"),
    (dict(sampling=SamplingParams(top_p=0.0)), "top_p=0.0"),
    (dict(sampling=SamplingParams(top_p=1.5)), "top_p=1.5"),
    (dict(sampling=SamplingParams(temperature=-0.1)), "temperature=-0.1"),
    (dict(sampling=SamplingParams(temperature=math.nan)), "temperature=nan"),
    (dict(sampling=SamplingParams(temperature=math.inf)), "temperature=inf"),
    (dict(sampling=SamplingParams(top_k=-2)), "top_k=-2"),
    (dict(sampling=SamplingParams(top_k=2.5)), "top_k=2.5"),
    (dict(sampling=SamplingParams(top_k=True)), "top_k=True"),
    (dict(sampling=SamplingParams(seed=1.5)), "sampling seed must be None or an int in [0, 2**63), got 1.5"),
    (dict(sampling=SamplingParams(seed="x")), "got 'x'"),
    (dict(sampling=SamplingParams(seed=True)), "got True"),
    (dict(sampling=SamplingParams(seed=2 ** 70)), "got 1180591620717411303424"),
    (dict(sampling=SamplingParams(seed=-1)), "got -1"),
    (dict(est_len=None), "est_len must be a finite number >= 0, got None"),
    (dict(est_len="5"), "got '5'"),
    (dict(est_len=math.nan), "got nan"),
    (dict(est_len=-1.0), "got -1.0"),
])
def test_each_problem_is_named(change, why):
    msg = refusal(Request(**{**OK, **change}), 128, 512, set())
    assert msg is not None and why in msg


def test_a_live_sample_id_is_refused():
    assert refusal(Request(**OK), 128, 512, {1}) == "sample_id 1 is already queued or running"
