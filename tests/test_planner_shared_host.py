"""Simulator "shared host" terms: a stage's measured slowdown applies only where stages overlap."""
import pytest

from controller.planner.profile import TrainProfile
from controller.planner.simulator import SimConfig, Workload, _covered, scaled_profile, simulate
from controller.scheduling import PTLProfile

FLAT = PTLProfile([1], [1.0], kv_tokens=1000)  # 1 s per decode step
TRAIN = TrainProfile(s_per_token=1.0, fixed_s=0.5)
WL = Workload(out_lens=[2, 4], prompt_lens=[0, 0])


def run(mode, iters=3, gen_instances=1, **kw):
    cfg = SimConfig(mode, gen_instances, FLAT, TRAIN, sync_s=1.0, minibatch_size=1, microbatch_tokens=0, **kw)
    return simulate(cfg, [WL] * iters)


def test_covered_share_of_an_interval():
    assert _covered((0.0, 10.0), []) == 0.0
    assert _covered((0.0, 10.0), [(2.0, 4.0), (3.0, 5.0), (9.0, 20.0)]) == pytest.approx(0.4)
    assert _covered((0.0, 10.0), [(-5.0, 50.0)]) == 1.0


def test_no_overlap_no_slowdown():
    # batch: generation, training and sync strictly in sequence -> the factors never apply
    assert run("batch", gen_shared_slowdown=2.0, train_shared_slowdown=3.0).iteration_s == \
        pytest.approx([10.5, 11.5, 11.5])


def test_colocated_dp_ranks_always_share_the_host():
    # two trainer DP ranks train at the same time: the whole 6.5 s of training takes 2x
    r = run("colocated", train_ranks=2, train_shared_slowdown=2.0)
    assert r.iteration_s == pytest.approx([4 + 13.0, 1 + 4 + 13.0, 18.0])


def test_overlapping_stages_slow_down_by_the_overlapped_share():
    # no factor: generation 4 s; the 2-token sample trains (2 s) while it runs, the 4-token one
    # after it (4 s), then the step (0.5 s) and the sync (1 s): 4 + 4 + 0.5 + 1
    base = run("stream").iteration_s[-1]
    assert base == pytest.approx(9.5)
    # generation x2 over the share the first sample's 2 s of training covers: its length D is the
    # fixed point of D = 4 (1 + 2 / D), i.e. 2 + 2 sqrt(3); the rest as above
    gen_only = run("stream", gen_shared_slowdown=2.0).iteration_s[-1]
    assert gen_only == pytest.approx(2 + 2 * 3 ** 0.5 + 4 + 0.5 + 1, rel=1e-3)
    # two DP ranks share the host all the time: training x2 throughout (4 s, 8 s, 1 s), and
    # generation covered by it for half its 6 s: 4 (1 + 0.5); 6 + 8 + 1 + 1 (the first sample's
    # training ends 1 s after generation, delaying the second)
    full = run("stream", train_ranks=2, gen_shared_slowdown=2.0, train_shared_slowdown=2.0).iteration_s[-1]
    assert full == pytest.approx(17.0)
    slow = run("stream", gen_shared_slowdown=2.0, train_shared_slowdown=2.0).iteration_s[-1]
    assert gen_only < slow < full  # training slowed only over its share beside generation


def test_scaled_profile_stretches_every_time_term():
    p = PTLProfile([1, 4], [1.0, 2.0], kv_tokens=100, prefill_step_s=0.5, prefill_s_per_token=0.1, kv_s_per_token=0.01)
    q = scaled_profile(p, 3.0)
    assert q.ptl_s == [3.0, 6.0] and q.prefill_step_s == 1.5 and q.prefill_s_per_token == pytest.approx(0.3)
    assert q.kv_s_per_token == pytest.approx(0.03) and scaled_profile(p, 1.0) is p
    with pytest.raises(ValueError, match="gen_shared_slowdown"):
        SimConfig("stream", 1, FLAT, TRAIN, gen_shared_slowdown=0.5)


def test_colocated_dp_ranks_train_their_groups_then_step_together():
    # request 0 (2 tokens, group 0) -> rank 0, request 1 (4 tokens, group 1) -> rank 1; each
    # rank starts when its own samples are in (gen steps: 1 s each, both requests from t = 0)
    cfg = SimConfig("colocated", 1, FLAT, TRAIN, train_ranks=2, colocated_dp=True)
    r = simulate(cfg, [WL])
    train = sorted((sp.worker, sp.start, sp.end) for sp in r.spans if sp.stage == "train")
    # rank 0: its sample at 2 s, trains 2 s; rank 1: at 4 s, trains 4 s; both step 0.5 s at 8
    assert train == [("train0", 2.0, 4.0), ("train0", 4.0, 8.5), ("train1", 4.0, 8.0), ("train1", 8.0, 8.5)]
    assert r.train_end == [8.5]
    same_group = simulate(cfg, [Workload([2, 4], [0, 0], groups=[1, 1])])
    assert same_group.train_end == [4.0 + 6.0 + 0.5]  # rank 1 trains both, rank 0 has nothing
