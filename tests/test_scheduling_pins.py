"""Dispatch behaviour the rest of the suite let through when changed by one line (mutation
review, session 56): skew's mixed fallback admits FCFS, prompt lengths count in the KV-bound
batch caps, a non-finite estimate is refused by name, a vanishing length noise changes nothing."""
import numpy as np
import pytest

from controller.dispatch_cost import instance_latency, simulated_cost
from controller.ptl_profile import PTLProfile
from controller.scheduling import make_dispatcher


def test_skew_mixed_fallback_admits_fcfs():
    """docs/scheduling.md: skew admits FCFS in the mixed fallback (measured 1-8% faster than LPT)."""
    est = [float(x) for x in np.random.default_rng(0).uniform(90, 110, size=40)]
    profs = [PTLProfile([1, 64], [1.0, 2.0], kv_tokens=1 << 16, block_size=16)] * 2
    plan = make_dispatcher("skew").plan(est, profs)
    assert not any(plan.long_tail), plan.long_tail  # no long tail in these lengths: the mixed split
    for group in plan.per_instance:
        assert group == sorted(group), group  # arrival order, not longest first


def test_the_formula_batch_fits_prompt_and_output_tokens():
    """25 sequences of 50 prompt + 50 output tokens on 1,000 KV tokens: 10 fit at once, not 20."""
    prof = PTLProfile([1, 64], [1.0, 1.0], kv_tokens=1000, block_size=10)
    _, batch = instance_latency(prof, m=25, l_avg=50, prompt_len=50)
    assert batch == 10


def test_dispatch_caps_count_the_prompt_lengths():
    """200-token sequences (100 prompt + 100 output) on 2,000 KV tokens: caps of at most 10 (sized
    on outputs alone they were 16, and the instance preempted)."""
    profs = [PTLProfile([1, 64], [1.0, 1.0], kv_tokens=2000, block_size=10)] * 2
    plan = make_dispatcher("skew_paper").plan([100.0] * 20, profs, prompt_lens=[100] * 20)
    assert max(plan.batch_caps) <= 10, plan.batch_caps


def test_an_infinite_estimate_is_refused_by_name():
    profs = [PTLProfile([1, 64], [1.0, 1.0], kv_tokens=2000, block_size=10)] * 2
    with pytest.raises(ValueError, match="not a finite length"):
        make_dispatcher("skew").plan([1.0, float("inf"), 3.0], profs)


def test_a_vanishing_length_noise_gives_the_noiseless_cost():
    """The log-normal draws are mean-one: a noise of 1e-6 costs what no noise does."""
    prof = PTLProfile([1, 64], [1.0, 2.0], kv_tokens=1 << 14, block_size=16)
    lens = [float(x) for x in range(50, 450, 10)]
    exact = simulated_cost(prof, lens, 0.0, 8.0)[0]
    assert simulated_cost(prof, lens, 0.0, 8.0, noise=1e-6, draws=4)[0] == pytest.approx(exact, rel=1e-3)
