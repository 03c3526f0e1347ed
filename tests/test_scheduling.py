"""Dispatchers (Algorithm 2), LPT order and the PTL profile: LPT within 4/3 of the optimum,
the dispatcher picks its own cost model's best split, the paper's Figure 6 example."""
import itertools
import math

import numpy as np
import pytest

from controller.planner.engine_sim import simulate_instance, simulate_plan
from controller.dispatch_cost import instance_latency
from controller.scheduling import (DISPATCHERS, BinnedPosterior, PTLProfile, calibrate_by_bins, calibrate_by_rank,
                                   lpt_order, lpt_schedule, make_dispatcher, spread_evenly)

BS = [1, 2, 4, 8, 16, 32, 64, 128]


def linear_profile(a=1.0, b=1.0 / 64, kv_tokens=10**6, block_size=1, max_batch_size=0) -> PTLProfile:
    return PTLProfile(BS, [a + b * x for x in BS], kv_tokens, block_size, max_batch_size)


def brute_force_makespan(durations, machines):
    best = math.inf
    for assign in itertools.product(range(machines), repeat=len(durations)):
        load = [0.0] * machines
        for d, j in zip(durations, assign):
            load[j] += d
        best = min(best, max(load))
    return best


def test_lpt_within_four_thirds_of_optimum():
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(60):
        machines = int(rng.integers(2, 4))
        jobs = [float(x) for x in rng.integers(1, 50, size=int(rng.integers(machines + 1, 8)))]
        ratio = lpt_schedule(jobs, machines) / brute_force_makespan(jobs, machines)
        assert ratio <= 4 / 3 - 1 / (3 * machines) + 1e-9
        worst = max(worst, ratio)
    assert worst > 1.0  # the instances are not all trivially optimal


def test_instance_sim_with_flat_ptl_is_lpt_list_scheduling():
    # Constant PTL and no memory limit: each batch slot is a P||Cmax machine.
    rng = np.random.default_rng(1)
    lens = [int(x) for x in rng.integers(1, 100, size=23)]
    prof = PTLProfile([1], [0.5], kv_tokens=10**6)
    run = simulate_instance(sorted(lens, reverse=True), prof, cap=4)
    assert run.makespan_s == pytest.approx(0.5 * lpt_schedule(lens, 4))
    assert run.max_batch == 4


def test_instance_sim_respects_kv_memory():
    prof = PTLProfile([1], [1.0], kv_tokens=64, block_size=16)
    run = simulate_instance([30, 30, 30, 30], prof, cap=100, prompt_lens=[2] * 4, alloc="reserve")
    assert run.max_batch == 2  # 32 tokens = 2 blocks each, 4 blocks in all
    assert run.makespan_s == pytest.approx(60.0)
    # lazy allocation admits all four on their prompts, then preempts the latest as they grow
    lazy = simulate_instance([30, 30, 30, 30], prof, cap=100, prompt_lens=[2] * 4, alloc="lazy")
    assert lazy.max_batch == 4 and lazy.makespan_s > 60.0
    assert sorted(lazy.finish_s) == lazy.finish_s  # admission order kept through preemptions
    with pytest.raises(ValueError, match="request 0 needs 80 KV tokens"):
        simulate_instance([70], prof, cap=1, prompt_lens=[5])


def test_lazy_sim_without_memory_pressure_equals_reserve():
    rng = np.random.default_rng(7)
    lens = [int(x) for x in rng.integers(1, 200, size=40)]
    prof = PTLProfile([1, 8, 64], [1.0, 1.5, 4.0], kv_tokens=10**6, block_size=16, prefill_step_s=0.3,
                      prefill_s_per_token=0.01)
    a = simulate_instance(lens, prof, cap=8, prompt_lens=[10] * 40, alloc="lazy")
    b = simulate_instance(lens, prof, cap=8, prompt_lens=[10] * 40, alloc="reserve")
    assert a.finish_s == pytest.approx(b.finish_s)


def test_ptl_profile_interpolates_and_roundtrips(tmp_path):
    prof = PTLProfile([1, 4, 8], [1.0, 1.3, 2.1], kv_tokens=1000, block_size=16, max_batch_size=32)
    assert prof.ptl(1) == 1.0 and prof.ptl(0.5) == 1.0
    assert prof.ptl(2) == pytest.approx(1.1)
    assert prof.ptl(16) == pytest.approx(2.1 + 0.2 * 8)  # last slope extended
    assert prof.max_batch_for_len(100) == 1000 // 112
    assert prof.max_batch_for_len(1) == 32  # capped by max_batch_size
    assert prof.max_batch_for_len(5000) == 1
    prof.save(tmp_path / "p.json")
    assert PTLProfile.load(tmp_path / "p.json") == prof
    (tmp_path / "bad.json").write_text('{"batch_sizes": [1], "ptl_s": [1], "kv_tokens": 5, "colour": 1}')
    with pytest.raises(ValueError, match="bad.json: unknown PTLProfile keys \\['colour'\\]"):
        PTLProfile.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="batch_sizes must be increasing"):
        PTLProfile([4, 2], [1, 1], 10)


@pytest.mark.parametrize("name", ["random", "round_robin"])
def test_chunk_dispatchers_partition(name):
    est = [float(x) for x in np.random.default_rng(2).integers(1, 500, size=37)]
    profs = [linear_profile(max_batch_size=8)] * 4
    plan = make_dispatcher(name).plan(est, profs, seed=3)
    flat = sorted(i for g in plan.per_instance for i in g)
    assert flat == list(range(37))
    assert max(map(len, plan.per_instance)) - min(map(len, plan.per_instance)) <= 1
    assert all(g == sorted(g) for g in plan.per_instance)  # FCFS
    assert plan.batch_caps == [8] * 4 and plan.kind == name
    lpt = make_dispatcher(name, order="lpt").plan(est, profs, seed=3)
    assert [sorted(g) for g in lpt.per_instance] == plan.per_instance
    assert all(g == lpt_order(g, est) for g in lpt.per_instance)
    assert make_dispatcher(name).plan(est, profs, seed=3) == plan  # deterministic


def test_formula_dispatcher_picks_its_cost_models_best_split():
    rng = np.random.default_rng(4)
    for trial in range(6):
        est = [float(x) for x in np.exp(rng.normal(4.5, 1.0, size=int(rng.integers(20, 80))))]
        n = int(rng.integers(2, 6))
        profs = [linear_profile(1.0, 1 / 16, kv_tokens=4096, block_size=16)] * n
        d = make_dispatcher("skew_paper", quantile_of="class")
        plan = d.plan(est, profs)
        # Brute force, independently: every (N_l, N_r), the paper's formula per instance.
        order = sorted(range(len(est)), key=lambda i: -est[i])
        n_long = math.ceil(0.2 * len(est))
        long_idx, reg_idx = order[:n_long], order[n_long:]
        best = math.inf
        for n_l in range(1, n):
            groups = spread_evenly(long_idx, est, n_l) + spread_evenly(reg_idx, est, n - n_l)
            cost = 0.0
            for j, g in enumerate(groups):
                cls, q = (long_idx, 0.9) if j < n_l else (reg_idx, 0.5)
                l_avg = float(np.quantile([est[i] for i in cls], q))
                bs = min(len(g), max(1, 4096 // (math.ceil(l_avg / 16) * 16)))
                cost = max(cost, (1 + bs / 16) * l_avg * math.ceil(len(g) / bs) if g else 0.0)
            best = min(best, cost)
        assert max(plan.predicted_s) == pytest.approx(best)
        assert sorted(i for g in plan.per_instance for i in g) == list(range(len(est)))
        assert 1 <= sum(plan.long_tail) <= n - 1


def test_simulate_dispatcher_picks_min_over_its_splits():
    est = [float(x) for x in np.exp(np.random.default_rng(5).normal(4.0, 1.2, size=120))]
    profs = [linear_profile(1.0, 1 / 32, kv_tokens=8192, block_size=16)] * 3
    d = make_dispatcher("skew")
    costs = d.split_costs(est, profs)
    assert len(costs) == len(d.alphas) * 2 + 1  # N_l = 1, 2 per alpha, and all mixed
    assert (d.alphas[0], 0) in costs
    plan = d.plan(est, profs)
    assert max(plan.predicted_s) == pytest.approx(min(c[0] for c in costs.values()))
    # its prediction is what the instance model gives for the plan it returns
    runs = simulate_plan(plan, [max(1, round(x)) for x in est], profs)
    assert [r.makespan_s for r in runs] == pytest.approx(plan.predicted_s)


def figure6_workload():
    return [100.0] * 32 + [200.0] + [100.0] * 32 + [200.0]  # 64 regular, 2 long-tail (ids 32, 65)


@pytest.mark.parametrize("kw", [dict(), dict(cost="formula", quantile_of="class")])
def test_figure6_long_tail_on_its_own_instance_wins(kw):
    lens = figure6_workload()
    profs = [linear_profile(1.0, 1 / 64)] * 2  # PTL linear in BS, memory not binding
    plan = make_dispatcher("oracle", alphas=(2 / 66, 0.2), **kw).plan(lens, profs, true_lens=lens)
    long_inst = plan.long_tail.index(True)
    assert sorted(plan.per_instance[long_inst]) == [32, 65]
    mixed = make_dispatcher("round_robin").plan(lens, profs)  # one long-tail sample per instance
    t_skew = max(r.makespan_s for r in simulate_plan(plan, lens, profs))
    t_mixed = max(r.makespan_s for r in simulate_plan(mixed, lens, profs))
    # skew: max(200 * PTL(2), 100 * PTL(64)); mixed: 100 * PTL(33) + 100 * PTL(1)
    assert t_skew == pytest.approx(max(200 * (1 + 2 / 64), 100 * 2.0))
    assert t_mixed == pytest.approx(100 * (1 + 33 / 64) + 100 * (1 + 1 / 64))
    assert t_skew < t_mixed


def test_figure6_paper_alpha_keeps_long_tail_together():
    # With the paper's alpha = 20% the long-tail class is the 2 long + 12 regular samples:
    # both long ones share the small-batch instance, still faster than mixing.
    lens = figure6_workload()
    profs = [linear_profile(1.0, 1 / 64)] * 2
    plan = make_dispatcher("skew_paper", quantile_of="class").plan(lens, profs)
    long_inst = plan.long_tail.index(True)
    assert {32, 65} <= set(plan.per_instance[long_inst]) and len(plan.per_instance[long_inst]) == 14
    mixed = make_dispatcher("round_robin").plan(lens, profs)
    assert (max(r.makespan_s for r in simulate_plan(plan, lens, profs))
            < max(r.makespan_s for r in simulate_plan(mixed, lens, profs)))


@pytest.mark.parametrize("alpha, m, size", [(0.07, 100, 7), (0.07, 101, 8), (2 / 66, 66, 2), (0.2, 66, 14),
                                             (0.1, 30, 3), (0.3, 10, 3), (0.02, 50, 1), (0.05, 7, 1)])
def test_the_long_tail_class_is_ceil_alpha_m_exactly(alpha, m, size):
    # math.ceil(0.07 * 100) is 8 in floats (7.000000000000001): one sample too many in the class
    est = [float(m - i) for i in range(m)]
    costs = make_dispatcher("skew_paper", alphas=(alpha,)).split_costs(est, [linear_profile(1.0, 0.0)] * 2)
    assert costs[(alpha, 1)][1][0] == list(range(size))  # the longest `size` on the long-tail instance


def test_instance_latency_formula():
    prof = linear_profile(1.0, 0.0, kv_tokens=1000, block_size=10)
    t, bs = instance_latency(prof, m=25, l_avg=95, prompt_len=5)  # 100 tokens -> BS 10
    assert (t, bs) == (95 * 3, 10)
    assert instance_latency(prof, 0, 95) == (0.0, 1)


def test_calibrate_by_rank_keeps_order_and_restores_tail():
    est = [10.0, 12.0, 11.0, 13.0]
    cal = calibrate_by_rank(est, reference=[1, 2, 3, 1000])
    assert list(np.argsort(cal)) == list(np.argsort(est))
    assert max(cal) > 500


def test_calibrate_by_rank_gives_equal_estimates_one_length():
    # a stable argsort ranked ties by request index: [5, 5, 5, 5] became 4.4 .. 662 tokens,
    # and the dispatcher took the last request for a long-tail one
    ref = [1, 10, 100, 1000]
    assert calibrate_by_rank([5.0] * 4, ref) == [float(np.quantile(ref, 0.5))] * 4
    cal = calibrate_by_rank([3.0, 7.0, 3.0, 9.0], ref)
    assert cal[0] == cal[2] < cal[1] < cal[3]
    assert calibrate_by_rank([], ref) == []


def test_calibrate_by_bins_and_posterior():
    ref_est = list(range(40))
    ref_true = [10.0] * 20 + [100.0] * 20
    assert calibrate_by_bins([0.5, 39.0], ref_est, ref_true, bins=2) == [10.0, 100.0]
    post = BinnedPosterior(ref_est, ref_true, bins=4)
    draws = post.draw([1.0, 38.0], np.random.default_rng(0))
    assert list(draws) == [10.0, 100.0]
    with pytest.raises(ValueError, match="need >= 4 held-out"):
        BinnedPosterior([1.0], [2.0], bins=4)
    for bins in (0, -1, 2.5, True):  # bins 0 was taken, then every draw raised an IndexError
        with pytest.raises(ValueError, match="bins must be an int >= 1"):
            BinnedPosterior(ref_est, ref_true, bins=bins)
    # a NaN / inf pair was taken and its draws reached the dispatcher's cost as 1-token requests
    with pytest.raises(ValueError, match=r"BinnedPosterior: ref_true\[3\] = nan is not a finite number"):
        BinnedPosterior(ref_est, ref_true[:3] + [float("nan")] + ref_true[4:], bins=4)
    with pytest.raises(ValueError, match=r"BinnedPosterior: ref_est\[0\] = inf"):
        BinnedPosterior([float("inf")] + ref_est[1:], ref_true, bins=4)


def test_calibrate_by_bins_with_a_large_tie_group():
    """30 of 100 held-out estimates tie at 50 (true 12): the quantile edges coincided, the bins
    between them were empty and took the overall mean (pulled up by the 2,000-token tail), so
    an estimate of 50 came out as ~939 tokens."""
    ref_est = [float(x) for x in range(35)] + [50.0] * 30 + [float(x) for x in range(60, 95)]
    ref_true = [10.0] * 35 + [12.0] * 30 + [2000.0] * 35
    assert calibrate_by_bins([5.0, 40.0, 50.0, 90.0], ref_est, ref_true) == [10.0, 10.0, 12.0, 2000.0]
    assert calibrate_by_bins([0.0], [0.0] * 30 + list(range(1, 31)), [10.0] * 30 + [500.0] * 30) == [10.0]


def test_calibration_names_a_value_that_is_not_finite():
    with pytest.raises(ValueError, match=r"calibrate_by_rank: est_lens\[1\] = nan is not a finite number"):
        calibrate_by_rank([1.0, float("nan")], [1.0, 2.0])
    with pytest.raises(ValueError, match=r"calibrate_by_rank: reference\[0\] = inf"):
        calibrate_by_rank([1.0], [float("inf")])
    with pytest.raises(ValueError, match=r"calibrate_by_bins: est_lens\[0\] = nan"):
        calibrate_by_bins([float("nan")], list(range(40)), [1.0] * 40)


def test_noise_aware_skew_prefers_mixing_when_estimates_say_nothing():
    # Estimates carry no information (every true length equally likely for every bin): the
    # posterior-aware dispatcher must not trust a split built on them.
    rng = np.random.default_rng(3)
    true = [float(x) for x in np.exp(rng.normal(4.0, 1.2, size=400))]
    noise = BinnedPosterior(list(rng.permutation(400).astype(float)), true, bins=8)
    est = [float(x) for x in rng.permutation(400)]
    profs = [linear_profile(1.0, 1 / 32, kv_tokens=8192, block_size=16)] * 3
    plan = make_dispatcher("skew", noise=noise).plan(est, profs)
    assert not any(plan.long_tail)  # N_l = 0: spread evenly
    assert max(map(len, plan.per_instance)) - min(map(len, plan.per_instance)) <= 1


def test_bad_input_is_named():
    profs = [linear_profile()] * 2
    with pytest.raises(ValueError, match="dispatcher 'fastest' is not one of"):
        make_dispatcher("fastest")
    with pytest.raises(ValueError, match=r"est_lens\[1\] = nan"):
        make_dispatcher("skew").plan([1.0, float("nan")], profs)
    with pytest.raises(ValueError, match="true_lens has 1 entries, est_lens 2"):
        make_dispatcher("oracle").plan([1.0, 2.0], profs, true_lens=[1.0])
    with pytest.raises(ValueError, match="oracle dispatcher needs true_lens"):
        make_dispatcher("oracle").plan([1.0, 2.0], profs)
    with pytest.raises(ValueError, match="no generation instances"):
        make_dispatcher("random").plan([1.0], [])
    with pytest.raises(ValueError, match="alpha must be in"):
        make_dispatcher("skew", alphas=(1.5,))
    assert set(DISPATCHERS) >= {"random", "skew", "oracle", "round_robin"}


def test_equal_lengths_keep_index_order_and_equal_work_goes_to_fewer_requests():
    """lpt_order breaks length ties by index (ascending); spread_evenly breaks work ties by
    the count of requests: lens [1, 1, 1, 3, 3, 4] on 2 instances -> [5, 0, 1] and [3, 4]
    both at work 6, and the last 1 goes to instance 1 (2 requests), not to instance 0 (3)."""
    assert lpt_order([0, 1, 2, 3], [2.0, 5.0, 2.0, 2.0]) == [1, 0, 2, 3]
    assert lpt_order([3, 2, 1, 0], [1.0] * 4) == [0, 1, 2, 3]
    assert spread_evenly(range(6), [1, 1, 1, 3, 3, 4], 2) == [[5, 0, 1], [3, 4, 2]]


def test_single_instance_gets_everything_in_lpt_order():
    est = [5.0, 50.0, 20.0]
    plan = make_dispatcher("skew").plan(est, [linear_profile()])
    assert plan.per_instance == [[1, 2, 0]]


def test_instances_left_empty_are_not_simulated(monkeypatch):
    """More instances than requests (the planner tries up to N = 64 with small batches): an
    empty group costs 0 without running the cost model (88% of its calls at N = 64 before;
    the oracle took minutes for `plan --dispatcher oracle --batch 8`)."""
    import controller.scheduling as sch

    prof = PTLProfile([1, 8, 64], [0.01, 0.012, 0.02], kv_tokens=100000, block_size=16, max_batch_size=256)
    lens = [50, 900, 120, 3000, 60, 40, 700, 20]
    seen, real = [], sch.COSTS["simulate"]
    monkeypatch.setitem(sch.COSTS, "simulate", lambda p, ls, *a: seen.append(len(ls)) or real(p, ls, *a))
    plan = sch.make_dispatcher("oracle").plan(lens, [prof] * 12, true_lens=lens)
    assert seen and 0 not in seen
    assert sorted(i for g in plan.per_instance for i in g) == list(range(8))
    assert [len(g) for g in plan.per_instance].count(0) == 4 and plan.batch_caps == [1] * 12
