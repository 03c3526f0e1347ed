"""Cluster simulator: hand-computed timelines of every pipeline mode on a tiny workload,
Chrome-trace output, the planner CLI end to end on the real length trace."""
import json

import pytest

from controller.planner.profile import StageProfiles, TrainProfile
from controller.planner.simulator import MODES, SimConfig, Workload, simulate, sync_time_s
from controller.scheduling import PTLProfile
from controller.timeline import to_chrome_trace

# One instance, 1 s per decode step at any batch size; samples of 2 and 4 tokens, no prompt.
# Trainer: 1 s per token + 0.5 s per step; weight sync 1 s.
FLAT = PTLProfile([1], [1.0], kv_tokens=1000)
TRAIN = TrainProfile(s_per_token=1.0, fixed_s=0.5)
WL = Workload(out_lens=[2, 4], prompt_lens=[0, 0])


def run(mode, iters=3, **kw):
    cfg = SimConfig(mode, 1, FLAT, TRAIN, sync_s=1.0, minibatch_size=1, microbatch_tokens=0, **kw)
    return simulate(cfg, [WL] * iters)


@pytest.mark.parametrize("mode,expected", [
    ("batch", [10.5, 11.5, 11.5]),  # gen 4 + train 6.5 + sync 1, strictly in sequence
    ("colocated", [10.5, 11.5, 11.5]),
    ("stream", [8.5, 9.5, 9.5]),  # training of the 2-token sample overlaps generation
    ("minibatch", [8.5, 9.5, 9.5]),  # minibatch of 1 sample = stream here
    ("async_stream", [8.5, 6.5, 6.5]),  # trainer bound: 6 tokens + step, sync hidden
    ("async_batch", [10.5, 7.5, 7.5]),  # trainer bound: step(i) waits for the push of step(i-1) (1 s)
])
def test_modes_hand_computed(mode, expected):
    assert run(mode).iteration_s == pytest.approx(expected)


@pytest.mark.parametrize("mode,like", [("stream", "batch"), ("minibatch", "batch"), ("async_stream", "async_batch")])
def test_whitened_ppo_trains_after_the_last_sample(mode, like):
    """PPO with whitened advantages (the runtime's default): the trainer does every
    forward/backward after the iteration's last sample, so a streaming mode's timeline is its
    batch counterpart's (generation still overlaps as the mode says)."""
    assert run(mode, train_at_end=True).iteration_s == pytest.approx(run(like).iteration_s)
    assert run(mode, train_at_end=True).iteration_s != pytest.approx(run(mode).iteration_s)


def test_planner_whitens_ppo_by_default():
    from controller.planner.cluster import Cluster, Datacenter
    from controller.planner.hardware import MODELS
    from controller.planner.planner import Planner
    from controller.planner.workloads import Trace, sample_workloads
    wl = sample_workloads(Trace([300, 40, 60, 2000] * 16, [64] * 64), 64, 2, 0)
    cluster = Cluster("c", [Datacenter("a", "H800", 16, 2.0)])
    assert Planner(cluster, MODELS["qwen2.5-7b"], wl).whiten is True
    assert Planner(cluster, MODELS["qwen2.5-7b"], wl, algorithm="grpo").whiten is False
    with pytest.raises(ValueError, match="whiten: advantage whitening is PPO's"):
        Planner(cluster, MODELS["qwen2.5-7b"], wl, algorithm="grpo", whiten=True)
    # REINFORCE++ whitens as PPO does, and trains what grpo trains (no critic)
    rfpp = Planner(cluster, MODELS["qwen2.5-7b"], wl, algorithm="reinforce_plus_plus")
    assert rfpp.whiten is True
    assert rfpp.train_min == Planner(cluster, MODELS["qwen2.5-7b"], wl, algorithm="grpo").train_min
    # gpg's scale counts the whole step: it trains at the iteration's end, unwhitened
    gpg = Planner(cluster, MODELS["qwen2.5-7b"], wl, algorithm="gpg")
    assert (gpg.whiten, gpg.train_at_end) == (False, True)
    assert Planner(cluster, MODELS["qwen2.5-7b"], wl, algorithm="grpo").train_at_end is False


@pytest.mark.parametrize("mode,train_at_end", [("async_batch", False), ("async_stream", True)])
def test_a_step_held_back_starts_after_the_push_of_the_last(mode, train_at_end):
    """The runtime calls step(i) once the push of step(i-1)'s weights ended (they are the push's
    source): the simulator let it train during that push, hiding the sync (4, 9, 4, 9 s where
    the runtime takes 9 s an iteration)."""
    cfg = SimConfig(mode, 1, FLAT, TrainProfile(s_per_token=0.5), sync_s=5.0, minibatch_size=1,
                    microbatch_tokens=0, train_at_end=train_at_end)
    r = simulate(cfg, [Workload(out_lens=[4, 4], prompt_lens=[0, 0])] * 6)
    trains = [s for s in r.spans if s.stage == "train"]
    assert all(s.start >= r.sync_end[s.iteration - 1] for s in trains if s.iteration >= 1)
    assert r.iteration_s[2:] == pytest.approx([9.0] * 4)


def test_async_generation_waits_for_weights_two_versions_back():
    r = run("async_stream")
    assert r.gen_start == pytest.approx([0.0, 4.0, 9.5])  # gen(2) waits for sync(0) to end at 9.5
    assert r.sync_end[0] == pytest.approx(9.5)


@pytest.mark.parametrize("iters", [3, 4, 5, 8])
def test_async_steady_time_averages_whole_periods(iters):
    # generation 4 s, training 4 s, sync 5 s: gen(i) waits for sync(i - 2) and step(i) for
    # sync(i - 1), so after the warm-up the iterations alternate 5 s and 8 s: 6.5 s each in the
    # long run. A mean over an odd count of them is off (5.67 s at 4 iterations, 4 s at 2)
    cfg = SimConfig("async_stream", 1, FLAT, TrainProfile(s_per_token=0.5), sync_s=5.0, minibatch_size=1,
                    microbatch_tokens=0)
    r = simulate(cfg, [Workload(out_lens=[4, 4], prompt_lens=[0, 0])] * iters)
    assert r.iteration_s == pytest.approx(([8.0, 5.0] * iters)[:iters])
    assert r.steady_iteration_s() == pytest.approx(6.5)
    assert run("batch", iters).steady_iteration_s() == pytest.approx(11.5)  # lag 0: every iteration after the first


def test_minibatch_hand_over_in_arrival_order():
    cfg = SimConfig("minibatch", 1, FLAT, TRAIN, sync_s=0.0, minibatch_size=2)
    r = simulate(cfg, [Workload([1, 5, 2, 3], [0, 0, 0, 0])])
    trains = [s for s in r.spans if s.stage == "train"]
    # arrivals at 1, 2, 3, 5: minibatch {1, 2} (3 tokens) ready at 2, {3, 5} (8) ready at 5
    assert [(s.start, s.end) for s in trains] == [(2.0, 5.0), (5.0, 13.0), (13.0, 13.5)]
    assert r.train_end == [13.5]


def test_spans_are_a_chrome_trace():
    r = run("stream", iters=2)
    workers = {s.worker for s in r.spans}
    assert workers == {"gen0", "trainer"}
    assert {s.stage for s in r.spans} == {"generate", "train", "weight_sync"}
    trace = to_chrome_trace(r.spans)
    assert len([e for e in trace["traceEvents"] if e["ph"] == "X"]) == len(r.spans)
    json.dumps(trace)


def test_sync_time_bandwidth_model():
    assert sync_time_s(145e9, 80) == pytest.approx(14.5)
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        sync_time_s(1.0, 0)


def test_bad_mode_is_named():
    with pytest.raises(ValueError, match="mode 'turbo' is not one of"):
        SimConfig("turbo", 1, FLAT, TRAIN)
    assert len(MODES) == 6


def test_stage_profiles_roundtrip(tmp_path):
    sp = StageProfiles(FLAT, TRAIN, weight_bytes=123.0, meta={"host": "x"})
    sp.save(tmp_path / "s.json")
    assert StageProfiles.load(tmp_path / "s.json") == sp


def test_plan_cli_on_small_clusters(tmp_path, capsys):
    from controller.planner.__main__ import main

    (tmp_path / "trace.json").write_text(json.dumps([50, 80, 120, 300, 900, 2000, 60, 70] * 8))
    (tmp_path / "one.yaml").write_text(
        "datacenters:\n  - {name: a, gpu: H800, gpus: 16, price_per_gpu_hour: 2.0}\n")
    (tmp_path / "two.yaml").write_text(
        "link_gbps: 80\ndatacenters:\n"
        "  - {name: g, gpu: H20, gpus: 8, price_per_gpu_hour: 0.7, role: generation}\n"
        "  - {name: t, gpu: H800, gpus: 16, price_per_gpu_hour: 2.0, role: trainer}\n")
    common = ["--model", "qwen2.5-7b", "--trace", str(tmp_path / "trace.json"), "--batch", "32",
              "--iterations", "4", "--algorithm", "grpo"]
    main(["plan", "--cluster", str(tmp_path / "one.yaml"), *common])
    out = json.loads(capsys.readouterr().out)
    rec = out["recommended"]
    assert set(rec) == set(MODES) and out["tp"] == rec["async_stream"]["gen_tp"] and out["tp_from"] == "searched"
    tried = {t["tp"]: t for t in out["tp_tried"]}  # 7B: 28 heads do not split over 8 GPUs
    assert sorted(tried) == [1, 2, 4, 8] and "28 attention heads" in tried[8]["skipped"]
    assert out["tp"] == min((t["iteration_s"], t["gen_gpus"] + t["train_gpus"], k)
                            for k, t in tried.items() if "iteration_s" in t)[2]
    assert rec["async_stream"]["samples_per_s"] >= rec["batch"]["samples_per_s"]
    main(["plan", "--cluster", str(tmp_path / "two.yaml"), *common])
    out = json.loads(capsys.readouterr().out)
    assert "colocated" not in out["recommended"] and "even_split" not in out
    assert all(r["train"].endswith("x H800") and "H20" in r["gen"] for r in out["recommended"].values())
    (tmp_path / "bad.yaml").write_text("datacenters:\n  - {name: a, gpu: V100, gpus: 8, price_per_gpu_hour: 1}\n")
    with pytest.raises(SystemExit):
        main(["plan", "--cluster", str(tmp_path / "bad.yaml"), *common])
    assert "unknown GPU 'V100'" in capsys.readouterr().err


def test_plan_cli_bad_inputs_name_the_file(tmp_path, capsys):
    from controller.planner.__main__ import main

    one = tmp_path / "one.yaml"
    one.write_text("datacenters:\n  - {name: a, gpu: H800, gpus: 16, price_per_gpu_hour: 2.0}\n")
    (tmp_path / "dc.yaml").write_text("datacenters: 5\n")
    (tmp_path / "t.jsonl").write_text('{"question": "q", "resp_words": [3]}\n{"question": "q"}\n')
    (tmp_path / "t.json").write_text("not json")
    (tmp_path / "neg.json").write_text("[5, -1]")
    base = ["--model", "qwen2.5-7b", "--batch", "8", "--iterations", "4"]
    cases = [
        (["--cluster", str(tmp_path / "dc.yaml"), "--trace", str(tmp_path / "neg.json")],
         f"{tmp_path / 'dc.yaml'}: datacenters must be a list of mappings"),
        (["--cluster", str(one), "--trace", str(tmp_path / "t.jsonl")], f"{tmp_path / 't.jsonl'}:2: "),
        (["--cluster", str(one), "--trace", str(tmp_path / "t.json")],
         f"{tmp_path / 't.json'}: neither a length trace"),
        (["--cluster", str(one), "--trace", str(tmp_path / "neg.json")],
         f"{tmp_path / 'neg.json'}: entry 1 (-1) is not an output length"),
        (["--cluster", str(one), "--trace", str(tmp_path / "missing.json")], f"{tmp_path / 'missing.json'}: no such file"),
    ]
    for args, said in cases:
        with pytest.raises(SystemExit) as e:
            main(["plan", *args, *base])
        err = capsys.readouterr().err
        assert e.value.code == 2 and said in err, (said, err)
