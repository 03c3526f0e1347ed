"""Planner: the generation tensor-parallel size. Searched over powers of two up to a node (each
evaluated with the planner's own allocation model, the best kept), or fixed by the cluster
file's ``gen_tp`` and checked; the TP all-reduce cost per decode step."""
import json

import numpy as np
import pytest

from controller.planner.__main__ import main
from controller.planner.allocation import allocate_brute_force
from controller.planner.cluster import Cluster, Datacenter
from controller.planner.planner import Planner
from controller.planner.workloads import Trace, sample_workloads
from controller.planner.hardware import (DEFAULT_ASSUMPTIONS as A, MODELS, ModelSpec, analytic_ptl_profile, gpu,
                                         tp_allreduce_s, tp_candidates, tp_problem)


def _workloads(batch=64, seed=0, iterations=1):
    rng = np.random.default_rng(seed)
    lens = [int(x) for x in np.clip(np.exp(rng.normal(6.5, 1.0, size=400)), 16, 4000)]
    return sample_workloads(Trace(lens, [64] * len(lens)), batch, iterations, seed)


def _brute_force_s(p: Planner) -> tuple[float, int]:
    """(iteration s, GPUs) of the best allocation of ``p``'s stage model, every (x, y) tried."""
    sm = p.stage_model
    if p.cluster.cross_dc:
        m, n = p.cluster.dc("generation").gpus, p.cluster.dc("trainer").gpus
        return min((max(sm.gen(x), sm.train(y)), x + y) for x in range(sm.gen_unit, m + 1, sm.gen_unit)
                   for y in range(sm.train_unit, n + 1, sm.train_unit) if y >= sm.train_min)
    a = allocate_brute_force(sm, p.cluster.datacenters[0].gpus)
    return a.iteration_s, a.gen_gpus + a.train_gpus


CASES = [  # (model, datacenters): single DC and cross DC, bandwidth- and capacity-bound sizes
    ("qwen2.5-7b", [Datacenter("a", "H800", 24, 2.0)]),
    ("qwen2.5-14b", [Datacenter("a", "H20", 32, 0.7)]),
    ("qwen2.5-72b", [Datacenter("a", "H200", 32, 2.0)]),
    ("qwen2.5-32b", [Datacenter("g", "H20", 16, 0.7, "generation"), Datacenter("t", "H800", 16, 2.0, "trainer")]),
]


@pytest.mark.parametrize("model, dcs", CASES)
def test_chosen_tp_minimises_the_planners_own_iteration_time(model, dcs):
    wl = _workloads(iterations=2)  # the planner's objective: mean stage times over both batches
    p = Planner(Cluster("c", dcs, trainer_unit=8, gen_unit=8), MODELS[model], wl, algorithm="grpo")
    tps = tp_candidates(MODELS[model], p.g_gen, 8)
    assert [o.tp for o in p.tp_options] == tps and tps[-1] == 8
    # brute force: every usable tp fixed in the cluster, every allocation (x, y) tried
    best = {}
    for tp in tps:
        if tp_problem(MODELS[model], p.g_gen, tp, 8):
            continue
        q = Planner(Cluster("c", dcs, trainer_unit=8, gen_unit=8, gen_tp=tp), MODELS[model], wl, algorithm="grpo")
        assert q.tp == tp and q.gen_profile.meta["tp"] == tp
        best[tp] = _brute_force_s(q)
    assert len(best) >= 2
    t, gpus, tp = min((t, gpus, tp) for tp, (t, gpus) in best.items())  # ties: fewer GPUs, then smaller tp
    assert p.tp == tp and p.allocate().iteration_s == pytest.approx(t)
    assert p.allocate().gen_gpus + p.allocate().train_gpus == gpus
    tried = {o.tp: o.summary() for o in p.tp_options}
    for k, (t_k, _) in best.items():
        assert tried[k]["iteration_s"] == pytest.approx(t_k, abs=0.006)


def test_72b_on_h200_is_no_slower_than_on_h800():
    # the H200 has more HBM bandwidth and as many FLOP/s; with the smallest tp that fits
    # (4 on H200, 8 on H800) its instances decoded long samples more slowly (80 vs 63 s)
    wl = _workloads(batch=128, iterations=2)
    plans = {g: Planner(Cluster(g, [Datacenter("a", g, 128, 2.0)]), MODELS["qwen2.5-72b"], wl)
             for g in ("H800", "H200")}
    h800, h200 = plans["H800"], plans["H200"]
    assert (h800.tp, h200.tp) == (8, 8)
    assert [o.tp for o in h200.tp_options] == [4, 8]
    assert h200.allocate().iteration_s <= h800.allocate().iteration_s
    sim = {g: p.simulate_modes(p.allocate(), ["async_stream"]).modes["async_stream"]["iteration_s"]
           for g, p in plans.items()}
    assert sim["H200"] <= sim["H800"], sim
    # and why: the H200 at tp 4 (the old choice) is slower than the H800 at tp 8
    h200_tp4 = Planner(Cluster("H200", [Datacenter("a", "H200", 128, 2.0)], gen_tp=4), MODELS["qwen2.5-72b"], wl)
    assert h200_tp4.allocate().iteration_s > h800.allocate().iteration_s


def test_fixed_tp_is_respected():
    wl = _workloads(batch=32)
    c = Cluster("c", [Datacenter("a", "H800", 24, 2.0)], gen_tp=2)
    p = Planner(c, MODELS["qwen2.5-7b"], wl, algorithm="grpo")
    assert p.tp == 2 and p.tp_fixed and [o.tp for o in p.tp_options] == [2]
    a = p.allocate()
    assert a.gen_instances == a.gen_gpus // 2
    assert p.simulate_modes(a, ["batch"]).tp == 2


@pytest.mark.parametrize("model, g, tp, said", [
    ("qwen2.5-72b", "H800", 4, "gen_tp: 4 x H800 cannot hold qwen2.5-72b for generation: its 145 GB of weights "
                               "need tp >= 8"),
    ("qwen2.5-7b", "H800", 8, "gen_tp: qwen2.5-7b's 28 attention heads (4 KV heads) do not split over 8 GPUs"),
])
def test_fixed_tp_that_cannot_serve_the_model_is_refused_naming_the_key(model, g, tp, said):
    with pytest.raises(ValueError, match="^cluster 'c', model") as e:
        Planner(Cluster("c", [Datacenter("a", g, 32, 2.0)], gen_tp=tp), MODELS[model], _workloads(batch=16))
    assert said in str(e.value)


def test_plan_cli_fixed_and_bad_tp(tmp_path, capsys):
    (tmp_path / "trace.json").write_text(json.dumps([50, 80, 120, 300, 900, 60, 70, 200]))
    dc = "datacenters:\n  - {name: a, gpu: H800, gpus: 16, price_per_gpu_hour: 2.0}\n"
    args = ["--trace", str(tmp_path / "trace.json"), "--batch", "16", "--iterations", "4"]
    (tmp_path / "c.yaml").write_text(dc + "gen_tp: 2\n")
    main(["plan", "--cluster", str(tmp_path / "c.yaml"), "--model", "qwen2.5-7b", *args])
    out = json.loads(capsys.readouterr().out)
    assert out["tp_from"] == "gen_tp (cluster file)"
    assert out["tp"] == 2 and all(r["gen_tp"] == 2 for r in out["recommended"].values())
    assert [t["tp"] for t in out["tp_tried"]] == [2]
    with pytest.raises(SystemExit) as e:
        main(["plan", "--cluster", str(tmp_path / "c.yaml"), "--model", "qwen2.5-72b", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "cluster 'c', model 'qwen2.5-72b': gen_tp: 2 x H800 cannot hold" in err
    assert len(err.strip().splitlines()) == 1


def test_a_model_too_big_for_one_node_is_refused():
    big = ModelSpec("big", 400e9, 126, 16384, 8, 128)  # 800 GB: tp 32 on H800
    with pytest.raises(ValueError, match=r"no generation instance fits one node of 8 x H800 \(gpus_per_node\): "
                                         r"8 x H800 cannot hold big"):
        Planner(Cluster("c", [Datacenter("a", "H800", 64, 2.0)]), big, _workloads(batch=16))


def test_tp_allreduce_cost():
    m, h100 = MODELS["qwen2.5-72b"], gpu("H100")
    # tp 1: no all-reduce, the profile as before (weights / bandwidth + 4 ms; GEMM time bound above)
    p1 = analytic_ptl_profile(MODELS["qwen2.5-7b"], h100, 1)
    assert p1.ptl(1) == pytest.approx(15.2e9 / (3.35e12 * A.bw_efficiency) + A.step_overhead_s)
    assert p1.prefill_s_per_token == pytest.approx(2 * 7.6e9 / (989e12 * A.flops_efficiency))
    assert tp_allreduce_s(m, h100, 1, 64) == 0.0
    # tp 8, BS 64: 160 all-reduces of 64 * 8192 * 2 bytes, ring 2 * 7 / 8, over 450 GB/s * 0.5
    one = A.allreduce_latency_s + 1.75 * 64 * 8192 * 2 / (450e9 * A.nvlink_efficiency)
    assert tp_allreduce_s(m, h100, 8, 64) == pytest.approx(160 * one)
    p8 = analytic_ptl_profile(m, h100, 8)
    assert p8.ptl(64) == pytest.approx(max(m.weight_bytes / (8 * 3.35e12 * A.bw_efficiency),
                                           2 * m.params * 64 / (8 * 989e12 * A.flops_efficiency))
                                       + A.step_overhead_s + 160 * one)
    # the H800's NVLink is 400 GB/s against the H100's 900: its all-reduces move bytes 2.25x slower
    assert tp_allreduce_s(m, gpu("H800"), 8, 64, latency=False) == pytest.approx(
        2.25 * tp_allreduce_s(m, h100, 8, 64, latency=False))
    assert 0.002 < 160 * one < 0.006  # 2-6 ms a step: comparable to the weight read, not negligible


def test_kv_heads_are_replicated_beyond_their_count():
    # 16 query heads, 2 KV heads: at tp 8 each KV head is stored on 4 GPUs (vLLM replicates)
    m = ModelSpec("small", 3e9, 36, 2048, 2, 128)
    g = gpu("H800")
    p2, p8 = analytic_ptl_profile(m, g, 2), analytic_ptl_profile(m, g, 8)
    usable = lambda tp: tp * 80e9 * A.kv_memory_fraction - m.weight_bytes  # noqa: E731
    assert p2.kv_tokens == int(usable(2) // m.kv_bytes_per_token)
    assert p8.kv_tokens == int(usable(8) // (4 * m.kv_bytes_per_token))
    assert p8.kv_s_per_token == pytest.approx(p2.kv_s_per_token)  # each GPU reads one head per token
    assert tp_problem(m, g, 8, 8) == "" and "not a power of two" in tp_problem(m, g, 6, 8)
    assert "more than one node's" in tp_problem(m, g, 16, 8)
