"""The request validation every engine backend shares (workers/generation/request_check.py)."""
import math
import re

import pytest
import torch

from workers.generation.request_check import check_weights, refusal
from workers.types import Request, SamplingParams

OK = dict(sample_id=1, prompt_ids=torch.tensor([1, 2]), max_tokens=3)


def test_a_valid_request_passes():
    assert refusal(Request(**OK), 128, 512, set()) is None
    assert refusal(Request(**OK, min_tokens=3, sampling=SamplingParams(temperature=0.0, top_k=0)), 128, 512, set()) is None
    # top_k -1 is off, as 0 (vLLM: "quietly accept -1 as disabled"; its default for years)
    assert refusal(Request(**OK, sampling=SamplingParams(top_k=-1)), 128, 512, set()) is None


@pytest.mark.parametrize("change, why", [
    (dict(prompt_ids=torch.tensor([], dtype=torch.int64)), "empty prompt"),
    (dict(prompt_ids=torch.tensor([1.0, 2.0])), "prompt_ids must be a 1-D integer tensor, got shape (2,) torch.float32"),
    (dict(prompt_ids=torch.tensor([[1, 2]])), "prompt_ids must be a 1-D integer tensor, got shape (1, 2) torch.int64"),
    (dict(prompt_ids=[1, 2]), "prompt_ids must be a 1-D integer tensor, got list"),
    (dict(prompt_ids=torch.tensor([1, 2], device="meta")), "prompt_ids is on the meta device"),
    (dict(sample_id=[1]), "sample_id must be an int, got list [1]"),
    # a str, float or bool id was served (True and 1 one key) though the message said int (s60)
    (dict(sample_id="a"), "sample_id must be an int, got str 'a'"),
    (dict(sample_id=2.5), "sample_id must be an int, got float 2.5"),
    (dict(sample_id=True), "sample_id must be an int, got bool True"),
    (dict(group_id=None), "group_id must be an int >= 0 (-1: no group), got None"),
    (dict(group_id="g"), "group_id must be an int >= 0 (-1: no group), got 'g'"),
    (dict(group_id=-5), "group_id must be an int >= 0 (-1: no group), got -5"),  # was taken as ungrouped
    (dict(sampling=None), "sampling must be a SamplingParams, got NoneType None"),
    (dict(sampling={"temperature": 0.5}), "sampling must be a SamplingParams, got dict"),
    (dict(prompt_ids=torch.tensor([1, 128])), "token id 128 is outside the vocabulary [0, 128)"),
    (dict(prompt_ids=torch.tensor([-1, 2])), "token id -1 is outside"),
    (dict(prompt_ids=torch.zeros(512, dtype=torch.int64)), "prompt of 512 tokens does not fit the context"),
    (dict(max_tokens=0), "max_tokens must be an int >= 1, got 0"),
    (dict(max_tokens=2.0), "max_tokens must be an int >= 1, got 2.0"),
    (dict(min_tokens=5), "min_tokens must be in [0, max_tokens=3], got 5"),
    (dict(min_tokens=1.5), "min_tokens must be in [0, max_tokens=3], got 1.5"),
    (dict(min_tokens=-1), "got -1"),
    (dict(sampling=SamplingParams(top_p=0.0)), "sampling top_p must be in (0, 1], got 0.0"),
    (dict(sampling=SamplingParams(top_p=1.5)), "top_p must be in (0, 1], got 1.5"),
    (dict(sampling=SamplingParams(temperature=-0.1)), "sampling temperature must be a finite number >= 0, got -0.1"),
    (dict(sampling=SamplingParams(temperature=math.nan)), "temperature must be a finite number >= 0, got nan"),
    (dict(sampling=SamplingParams(temperature=math.inf)), "got inf"),
    (dict(sampling=SamplingParams(temperature=2.5)), "temperature 2.5 is outside the served range"),
    (dict(sampling=SamplingParams(temperature=1e30)), "temperature 1e+30 is outside"),
    (dict(sampling=SamplingParams(temperature=1e-5)), "temperature 1e-05 is outside"),
    (dict(sampling=SamplingParams(temperature=0.005)), "below 1e-05 (greedy) or in [0.01, 2]"),
    (dict(prompt_ids=torch.tensor([True, False])), "prompt_ids must be a 1-D integer tensor"),
    (dict(sampling=SamplingParams(top_k=-2)), "sampling top_k must be an int >= -1 (0 or -1: off), got -2"),
    (dict(sampling=SamplingParams(top_k=2.5)), "top_k must be an int >= -1 (0 or -1: off), got 2.5"),
    (dict(sampling=SamplingParams(top_k=True)), "top_k must be an int >= -1 (0 or -1: off), got True"),
    (dict(sampling=SamplingParams(seed=1.5)), "sampling seed must be None or an int in [0, 2**63), got 1.5"),
    (dict(sampling=SamplingParams(seed="x")), "got 'x'"),
    (dict(sampling=SamplingParams(seed=True)), "got True"),
    (dict(sampling=SamplingParams(seed=2 ** 70)), "got 1180591620717411303424"),
    (dict(sampling=SamplingParams(seed=-1)), "got -1"),
    (dict(est_len=None), "est_len must be a finite number >= 0, got None"),
    (dict(est_len="5"), "got '5'"),
    (dict(est_len=math.nan), "got nan"),
    (dict(est_len=-1.0), "got -1.0"),
    (dict(est_len=10 ** 400), "est_len must be a finite number >= 0, got 1000"),
])
def test_each_problem_is_named(change, why):
    msg = refusal(Request(**{**OK, **change}), 128, 512, set())
    assert msg is not None and why in msg


@pytest.mark.parametrize("t", [0.0, 1e-45, 9.9e-6, 0.01, 1.0, 2.0])
def test_served_temperatures(t):
    # the range both backends serve: greedy below 1e-5, sampled in [0.01, 2] (vLLM's range)
    assert refusal(Request(**OK, sampling=SamplingParams(temperature=t)), 128, 512, set()) is None


def test_integer_prompt_dtypes_pass():
    for dt in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        assert refusal(Request(**{**OK, "prompt_ids": torch.tensor([1, 2], dtype=dt)}), 128, 512, set()) is None


SHAPES = {"a": (2, 3), "b": (3,)}
GOOD = [("a", torch.ones(2, 3)), ("b", torch.ones(3, dtype=torch.bfloat16))]


def test_check_weights_passes_and_returns_the_version():
    assert check_weights(GOOD, SHAPES, 3)[0] == 3
    assert check_weights([], SHAPES, torch.tensor(4))[0] == 4  # an int-like 0-d tensor
    assert check_weights([("a", torch.ones(2, 3, dtype=torch.float64))], SHAPES, 0)[0] == 0


def test_check_weights_casts_to_the_engine_dtype_before_checking():
    a64 = torch.ones(2, 3, dtype=torch.float64)
    v, staged = check_weights([("a", a64), GOOD[1]], SHAPES, 1, torch.float32)
    assert [t.dtype for _, t in staged] == [torch.float32, torch.float32]
    f32 = torch.ones(3)
    assert check_weights([("b", f32)], SHAPES, 1, torch.float32)[1][0][1].data_ptr() == f32.data_ptr()  # no copy
    # finite in float64, infinite once rounded to the engine's dtype: refused, naming it
    with pytest.raises(ValueError, match=r"'a' has NaN or infinite values once rounded to torch.float32"):
        check_weights([("a", torch.full((2, 3), 1e300, dtype=torch.float64))], SHAPES, 1, torch.float32)


@pytest.mark.parametrize("items, version, why", [
    (GOOD, "v2", "version must be an int >= 0, got 'v2'"),
    (GOOD, "3", "got '3'"),
    (GOOD, 2.0, "got 2.0"),
    (GOOD, True, "got True"),
    (GOOD, -1, "got -1"),
    (GOOD + [("c", torch.ones(1))], 1, "unknown tensor 'c'"),
    ([("a", torch.ones(3, 2))], 1, "tensor 'a' has shape (3, 2), expected (2, 3)"),
    ([("a", [[1.0] * 3] * 2)], 1, "tensor 'a' has shape list"),
    ([("b", torch.ones(3)), ("a", torch.empty(2, 3, device="meta"))], 1, "'a' is on the meta device"),
    ([("a", torch.ones(2, 3, dtype=torch.int64))], 1, "'a' has dtype torch.int64; weights must be floating"),
    ([("a", torch.ones(2, 3, dtype=torch.bool))], 1, "dtype torch.bool"),
    ([("a", torch.ones(2, 3, dtype=torch.complex64))], 1, "dtype torch.complex64"),
    ([("b", torch.ones(3)), ("a", torch.full((2, 3), math.nan))], 1, "'a' has NaN or infinite values"),
    ([("b", torch.tensor([1.0, math.inf, -math.inf]))], 1, "'b' has NaN or infinite values"),
    ([("b", torch.tensor([1.0, math.inf, 0.0], dtype=torch.bfloat16))], 1, "'b' has NaN"),
])
def test_check_weights_names_each_problem(items, version, why):
    with pytest.raises(ValueError, match="load_weights: .*" + re.escape(why)):
        check_weights(items, SHAPES, version)


def test_check_weights_takes_a_state_dict_and_refuses_what_is_not_pairs():
    pairs = check_weights({"a": torch.ones(2, 3), "b": torch.ones(3)}, SHAPES, 1)[1]
    assert [n for n, _ in pairs] == ["a", "b"]
    assert check_weights(iter(GOOD), SHAPES, 1)[1][0][0] == GOOD[0][0]  # a generator, read once
    for bad, why in [(torch.ones(3), "got Tensor"), ("a", "got str"), (5, "got int"),
                     (["a", "b"], "item 0 is 'a', not a (name, tensor) pair"),
                     ([("a", torch.ones(2, 3), 1)], "item 0 is"),
                     ([(torch.ones(1), "a")], "item 0 is (tensor([1.]), 'a')"),
                     ([torch.ones(4, 4)], "item 0 is a tensor of shape (4, 4)"),
                     ([(torch.ones(64, 64), "a")], "item 0 is a tuple")]:
        with pytest.raises(ValueError, match="load_weights: .*" + re.escape(why)):
            check_weights(bad, SHAPES, 1)


def test_a_live_sample_id_is_refused():
    assert refusal(Request(**OK), 128, 512, {1}) == "sample_id 1 is already queued or running"
