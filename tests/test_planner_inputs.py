"""Planner inputs a user gets wrong (cluster, model, profile files, CLI values): one clear error
naming the file and key, exit code 2; and the allocation's sanity on real (analytic) stage
models: planned on every simulated batch, brute-force optimal, never slower with more GPUs."""
import json
import os

import numpy as np
import pytest

from controller.planner.__main__ import main
from controller.planner.allocation import allocate_cross_dc, generation_time_model
from controller.planner.cluster import Cluster, Datacenter, load_cluster, load_model
from controller.planner.planner import Planner
from controller.planner.workloads import Trace, sample_workloads
from controller.planner.colocated import ColocatedGenProfile
from controller.planner.hardware import MODELS, ModelSpec, analytic_train_profile
from controller.planner.profile import StageProfiles, TrainProfile
from controller.scheduling import PTLProfile

DC = "datacenters:\n  - {name: a, gpu: H800, gpus: 16, price_per_gpu_hour: 2.0}\n"
TWO = ("datacenters:\n  - {name: g, gpu: H20, gpus: 8, price_per_gpu_hour: 0.7, role: generation}\n"
       "  - {name: t, gpu: H800, gpus: 16, price_per_gpu_hour: 2.0, role: trainer}\n")


def _plan(tmp_path, capsys, cluster_text=DC, model="qwen2.5-7b", extra=()):
    (tmp_path / "c.yaml").write_text(cluster_text)
    (tmp_path / "trace.json").write_text(json.dumps([50, 80, 120, 300, 900, 60, 70, 200]))
    main(["plan", "--cluster", str(tmp_path / "c.yaml"), "--model", model, "--trace", str(tmp_path / "trace.json"),
          "--batch", "16", "--iterations", "4", *extra])
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("text, said", [
    ("datacenters: [\n  {name: a", "c.yaml: not a readable cluster file"),
    (DC + "intra_gbps: 0\n", "intra_gbps must be a number > 0, got 0"),
    (TWO + "link_gbps: -1\n", "link_gbps must be a number > 0, got -1"),
    (DC + "trainer_unit: 0\n", "trainer_unit must be a whole number > 0, got 0"),
    (DC + "gen_unit: -8\n", "gen_unit must be a whole number > 0, got -8"),
    (DC.replace("gpus: 16", "gpus: -8"), "datacenters[0]: datacenter 'a': gpus must be a whole number > 0"),
    (DC.replace("gpus: 16", "gpus: 16.5"), "gpus must be a whole number > 0, got 16.5"),
    (DC.replace("gpus: 16", "gpus: many"), "gpus must be a whole number > 0, got 'many'"),
    (DC.replace("gpu: H800", "gpu: V100"), "datacenters[0]: datacenter 'a': gpu: unknown GPU 'V100'"),
    (DC.replace("2.0}", "2.0, colour: red}"), "datacenters[0]: unknown keys ['colour']"),
    (DC.replace("name: a, ", ""), "datacenters[0]: missing keys ['name']"),
    (DC + "link_gbps: fast\n", "link_gbps must be a number > 0, got 'fast'"),
    (TWO.replace("role: trainer", "role: generation"), "need the roles 'generation' and 'trainer'"),
    (DC + "gen_tp: 3\n", "gen_tp must be a power of two (1, 2, 4, 8, ...), got 3"),
    (DC + "gen_tp: 0\n", "gen_tp must be a whole number > 0, got 0"),
    (DC + "gen_tp: 16\n", "gen_tp 16 is more than one node's GPUs (gpus_per_node 8)"),
    (DC + "gpus_per_node: 4\ngen_tp: 8\n", "gen_tp 8 is more than one node's GPUs (gpus_per_node 4)"),
    (DC + "gpus_per_node: 0\n", "gpus_per_node must be a whole number > 0, got 0"),
    (DC.replace("2.0}", "2.0, role: trainer}"), "one datacenter runs both stages: its role must be 'any'"),
    (TWO.replace("name: t", "name: g"), "two datacenters named 'g'"),
])
def test_bad_cluster_file_is_one_line_naming_file_and_key(tmp_path, capsys, text, said):
    with pytest.raises(SystemExit) as e:
        _plan(tmp_path, capsys, text)
    err = capsys.readouterr().err
    assert e.value.code == 2 and said in err and str(tmp_path / "c.yaml") in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("name, text, said", [
    ("m.yaml", "name: m\nparams: -7.0e+9\nnum_layers: 28\nhidden: 3584\nnum_kv_heads: 4\nhead_dim: 128\n",
     "params must be a number > 0"),
    ("m.yaml", "name: m\nparams: 7.6e+9\nnum_layers: 28\nhidden: 3584\nnum_kv_heads: 4\nhead_dim: 0\n",
     "head_dim must be a whole number > 0, got 0"),
    ("m.yaml", "name: m\nparams: 7.6e+9\nnum_layers: 28\nhidden: 3584\nnum_kv_heads: 4\nhead_dim: 128\n"
               "dtype_bytes: 0\n", "dtype_bytes must be a whole number > 0"),
    ("m.yaml", "- 1\n- 2\n", "expected a mapping"),
    ("m.yaml", "name: [m\n", "not a readable model file"),
    ("m.json", '{"num_hidden_layers": 28, "hidden_size": 3584}', "HF config without ['num_attention_heads'"),
    ("m.json", "{bad", "not a readable model file"),
])
def test_bad_model_file_is_one_line_naming_file_and_key(tmp_path, capsys, name, text, said):
    (tmp_path / name).write_text(text)
    with pytest.raises(SystemExit) as e:
        _plan(tmp_path, capsys, model=str(tmp_path / name))
    err = capsys.readouterr().err
    assert e.value.code == 2 and said in err and str(tmp_path / name) in err, err


def test_model_yaml_numbers_pyyaml_reads_as_strings_are_numbers(tmp_path):
    # YAML 1.1 (PyYAML) reads 7.6e9 (no exponent sign) as the string '7.6e9'
    (tmp_path / "m.yaml").write_text("name: m\nparams: 7.6e9\nnum_layers: 28\nhidden: 3584\nnum_kv_heads: 4\n"
                                     "head_dim: 128\n")
    m = load_model(str(tmp_path / "m.yaml"))
    assert m.params == 7.6e9 and m.weight_bytes == 15.2e9
    assert m == ModelSpec("m", 7.6e9, 28, 3584, 4, 128)


@pytest.mark.parametrize("flag, value", [("--batch", "0"), ("--iterations", "0"), ("--len-scale", "-1"),
                                         ("--max-len", "0"), ("--batch", "x"), ("--len-scale", "inf"),
                                         ("--len-scale", "nan"), ("--len-scale", "-inf")])
def test_bad_cli_values_exit_2(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        _plan(tmp_path, capsys, extra=[flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}" in err and "Traceback" not in err


@pytest.mark.parametrize("args", [["--models", "qwen2.5-8b"], ["--mode", "colocated"], ["--unit", "0"],
                                  ["--link-gbps", "0"], ["--gpus", "-8"], ["--link-gbps", "inf"],
                                  ["--h800-price", "-1"], ["--h20-price", "nan"], ["--h800-price", "inf"]])
def test_report_refuses_bad_arguments(capsys, args):
    with pytest.raises(SystemExit) as e:
        main(["report", "--trace", "x.json", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {args[0]}" in err and "Traceback" not in err


def test_cluster_file_that_is_a_directory_or_missing(tmp_path):
    with pytest.raises(ValueError, match="not a file"):
        load_cluster(tmp_path)
    with pytest.raises(ValueError, match="nope.yaml: no such file"):
        load_cluster(tmp_path / "nope.yaml")


def test_free_gpus_give_no_samples_per_dollar_instead_of_a_crash(tmp_path, capsys):
    out = _plan(tmp_path, capsys, DC.replace("price_per_gpu_hour: 2.0", "price_per_gpu_hour: 0"))
    assert all(m["dollars_per_hour"] == 0 and m["samples_per_dollar"] is None and m["samples_per_s"] > 0
               for m in out["recommended"].values())


def test_every_simulated_iteration_must_fit_the_kv_cache():
    # iteration 0 draws only short samples; a later one draws the one too long for a tp-1 KV cache
    c = Cluster("c", [Datacenter("a", "H800", 16, 2.0)], gen_tp=1)
    kv = Planner(c, MODELS["qwen2.5-7b"], sample_workloads(Trace([100], [10]), 4, 1)).gen_profile.kv_tokens
    wl = sample_workloads(Trace([100, 100], [10, 10]), 4, 3)
    wl.iterations[2].out_lens[1] = kv + 1
    with pytest.raises(ValueError, match=r"1 samples \(up to \d+ tokens with the prompt\) do not fit one instance's KV"
                                         r" cache \(\d+ tokens on 1 x H800\)"):
        Planner(c, MODELS["qwen2.5-7b"], wl)
    # searched, tp 1 is passed over for it (a larger instance holds it), and said why
    p = Planner(Cluster("c", [Datacenter("a", "H800", 16, 2.0)]), MODELS["qwen2.5-7b"], wl)
    assert p.tp > 1 and "do not fit one instance's KV cache" in p.tp_options[0].summary()["skipped"]
    wl.iterations[2].out_lens[1] = 10 ** 7  # too long for every tp: the largest one's reason
    with pytest.raises(ValueError, match=r"do not fit one instance's KV cache \(\d+ tokens on 4 x H800\)"):
        Planner(Cluster("c", [Datacenter("a", "H800", 16, 2.0)]), MODELS["qwen2.5-7b"], wl)


# ---- saved profiles ---------------------------------------------------------------------------

def _profiles():
    ptl = PTLProfile([1, 2, 4], [0.01, 0.011, 0.013], 1000, 16, 8, 1e-5, "x", {"source": "measured"},
                     prefill_step_s=0.002, kv_s_per_token=1e-7, ref_context=20.0)
    return ptl, StageProfiles(ptl, TrainProfile(1e-4, 0.1, 2), 123.0, {"host": "h"}), \
        ColocatedGenProfile([0.1, 0.2], [0.15, 0.3], 1.5, {"cpu": 0.5}, {"cpu": 0.4}, {"n": 2})


def test_saved_profiles_reload_identically_and_leave_no_temp_file(tmp_path):
    for obj in _profiles():
        path = tmp_path / f"{type(obj).__name__}.json"
        obj.save(path)
        obj.save(path)  # over an existing file
        assert type(obj).load(path) == obj
    assert sorted(os.listdir(tmp_path)) == ["ColocatedGenProfile.json", "PTLProfile.json", "StageProfiles.json"]


def test_corrupted_profile_files_are_refused_naming_the_file(tmp_path):
    for obj in _profiles():
        cls, good = type(obj), tmp_path / "good.json"
        obj.save(good)
        text = good.read_text()
        d = json.loads(text)
        first = next(iter(d))
        bad = {"truncated": text[: len(text) // 2], "empty": "", "binary": "\x00\x01\x02", "null": "null",
               "list": "[1, 2]", "missing key": json.dumps({k: v for k, v in d.items() if k != first}),
               "unknown key": json.dumps({**d, "colour": 1})}
        if cls is PTLProfile:
            bad["wrong type"] = json.dumps({**d, "kv_tokens": "many"})
            bad["infinite cost"] = text.replace('"kv_s_per_token": 1e-07', '"kv_s_per_token": Infinity')
        if cls is StageProfiles:
            bad["bad generation"] = json.dumps({**d, "generation": {"batch_sizes": [1]}})
            bad["bad trainer"] = json.dumps({**d, "trainer": {"s_per_token": -1}})
        for what, content in bad.items():
            path = tmp_path / "p.json"
            path.write_text(content)
            with pytest.raises(ValueError) as e:
                cls.load(path)
            assert str(path) in str(e.value), (cls.__name__, what, str(e.value))


# ---- Algorithm 1 on real stage models --------------------------------------------------------

def _planner(cluster: Cluster, model="qwen2.5-7b", seed=0, iterations=1) -> Planner:
    rng = np.random.default_rng(seed)
    lens = [int(x) for x in np.clip(np.exp(rng.normal(6.5, 1.0, size=400)), 16, 6000)]
    return Planner(cluster, MODELS[model], sample_workloads(Trace(lens, [64] * len(lens)), 128, iterations, seed),
                   algorithm="grpo")


def test_algorithm1_plans_on_every_simulated_batch():
    # each stage's time is its mean over every iteration's batch (those the plan's simulation
    # runs and reports), not the first draw's
    p = _planner(Cluster("c", [Datacenter("a", "H800", 48, 1.0)]), iterations=3)
    sm, its = p.stage_model, p.workloads.iterations
    per_batch = [generation_time_model(p.gen_profile, w.out_lens, w.prompt_lens, p.dispatcher) for w in its]
    for x in (8, 16, 48):
        k = x // p.tp
        assert sm.gen(x) == pytest.approx(sum(g(k) for g in per_batch) / 3)
    assert len({round(g(16 // p.tp), 6) for g in per_batch}) == 3  # three different draws
    for y in (8, 24):
        train = [analytic_train_profile(p.model, p.g_train, y, "grpo").time(t)
                 for t in p.workloads.tokens_per_iteration]
        assert sm.train(y) == pytest.approx(sum(train) / 3)
    assert p.workloads.tokens_per_iteration[0] != pytest.approx(p.workloads.tokens)


@pytest.mark.parametrize("model, gpu, n", [("qwen2.5-7b", "H800", 48), ("qwen2.5-32b", "H20", 64)])
def test_single_dc_split_minimises_the_modelled_iteration_time(model, gpu, n):
    c = Cluster("c", [Datacenter("a", gpu, n, 1.0)])
    p = _planner(c, model, iterations=2)  # the objective: mean stage times over both batches
    sm = p.stage_model
    a = p.allocate()
    brute = min((max(sm.gen(x), sm.train(y)), x + y) for x in range(sm.gen_unit, n + 1, sm.gen_unit)
                for y in range(sm.train_unit, n - x + 1, sm.train_unit) if y >= sm.train_min)
    assert (a.iteration_s, a.gen_gpus + a.train_gpus) == pytest.approx(brute)
    assert a.gen_gpus + a.train_gpus + a.released_train == n


def test_more_gpus_never_give_a_slower_plan():
    single = [_planner(Cluster("c", [Datacenter("a", "H800", n, 2.0)])).allocate().iteration_s
              for n in range(16, 97, 8)]
    assert all(b <= a + 1e-9 for a, b in zip(single, single[1:])), single
    for m in (8, 16, 32):
        cross = [_planner(Cluster("c", [Datacenter("g", "H20", m, 0.7, "generation"),
                                        Datacenter("t", "H800", n, 2.0, "trainer")])).allocate().iteration_s
                 for n in (8, 16, 32)]
        assert all(b <= a + 1e-9 for a, b in zip(cross, cross[1:])), (m, cross)


def test_cross_dc_gives_back_generation_gpus_that_do_not_help():
    # tail-bound generation: beyond a few instances the longest sample sets the time, so the
    # generation DC's other GPUs are released even when generation is the slower stage
    c = Cluster("c", [Datacenter("g", "H20", 64, 0.7, "generation"), Datacenter("t", "H800", 64, 2.0, "trainer")])
    p = _planner(c)
    a = p.allocate()
    sm = p.stage_model
    assert a.gen_time_s >= a.train_time_s  # generation is the slower stage
    assert a.gen_gpus < 64 and a.released_gen == 64 - a.gen_gpus
    assert sm.gen(a.gen_gpus) == pytest.approx(sm.gen(64))  # the same time as all 64
    assert sm.gen(a.gen_gpus - sm.gen_unit) > a.iteration_s  # one node less would be slower
    assert allocate_cross_dc(sm, 64, 64) == a


def test_a_cluster_whose_even_split_cannot_hold_the_trainer_is_still_planned(tmp_path, capsys):
    """72B PPO needs >= 40 trainer GPUs: on 64 H800 Algorithm 1 gives 24 + 40, but the even-split
    baseline (32 + 32) raised and `plan` / `report` refused the whole cluster (review, session 50)."""
    out = _plan(tmp_path, capsys, DC.replace("gpus: 16", "gpus: 64") + "gen_tp: 8\n", model="qwen2.5-72b")
    assert out["even_split"] == {"skipped": out["even_split"]["skipped"]}
    assert "even split: 32 GPUs cannot hold the trainer" in out["even_split"]["skipped"]
    a = out["recommended"]["async_stream"]
    assert (a["gen"], a["train"]) == ("24 x H800 (3 instances)", "40 x H800")
    main(["report", "--trace", str(tmp_path / "trace.json"), "--batch", "16", "--iterations", "4", "--gpus", "64",
          "--models", "qwen2.5-72b"])
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert row["alloc_vs_even_throughput"] is None and "cannot hold the trainer" in row["even_h800"]["skipped"]


@pytest.mark.parametrize("key, value, said", [
    ("kv_tokens", float("nan"), "PTLProfile.kv_tokens must be a whole number, got nan"),
    ("kv_tokens", float("inf"), "PTLProfile.kv_tokens must be a whole number, got inf"),
    ("kv_tokens", 1000.5, "PTLProfile.kv_tokens must be a whole number, got 1000.5"),
    ("block_size", float("nan"), "PTLProfile.block_size must be a whole number"),
    ("max_batch_size", True, "PTLProfile.max_batch_size must be a whole number, got True"),
    ("batch_sizes", [1.5, 1.7], "PTLProfile.batch_sizes must be whole numbers"),
    ("ptl_s", [True, True], "PTLProfile.ptl_s must be numbers"),
])
def test_a_profile_with_counts_that_are_not_whole_numbers_is_refused(tmp_path, key, value, said):
    """NaN passed the `< 1` checks: skew_paper then planned every instance at batch size 1, and a
    NaN block_size failed later without naming the file (review, session 50)."""
    d = {"batch_sizes": [1, 4], "ptl_s": [0.01, 0.02], "kv_tokens": 4096, "block_size": 16, key: value}
    (tmp_path / "p.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=f"p.json: .*{said}"):
        PTLProfile.load(tmp_path / "p.json")


def test_a_profile_count_written_as_a_float_is_taken_as_a_whole_number():
    p = PTLProfile([1, 4.0], [0.01, 0.02], kv_tokens=4096.0, block_size=16.0)
    assert (p.kv_tokens, p.block_size, p.batch_sizes) == (4096, 16, [1, 4]) and type(p.kv_tokens) is int


@pytest.mark.parametrize("value", [-1e9, "nan", float("inf")])
def test_stage_profiles_refuse_weight_bytes_that_are_not_a_size(tmp_path, value):
    gen = {"batch_sizes": [1], "ptl_s": [0.01], "kv_tokens": 4096}
    (tmp_path / "s.json").write_text(json.dumps({"generation": gen, "trainer": {"s_per_token": 0.001},
                                                 "weight_bytes": value}))
    with pytest.raises(ValueError, match="s.json: weight_bytes must be a number >= 0"):
        StageProfiles.load(tmp_path / "s.json")


@pytest.mark.parametrize("flag, knob", [("--filter-groups", "filter_groups"),
                                        ("--is-batch-normalize", "rollout_is_batch_normalize")])
def test_knobs_that_make_the_trainer_wait_for_the_step_make_the_plan_train_at_end(tmp_path, capsys, flag, knob):
    """The group filter and the IS batch normalisation make the trainer train at step() (its
    ``trains_at_step``); the planner simulated grpo with them as streaming training, its
    train_at_end knew only whitening and gpg (style review, session 55). One rule now."""
    from workers.trainer.config import TrainerConfig
    extra = {"rollout_is": "token"} if knob == "rollout_is_batch_normalize" else {}
    assert TrainerConfig(algorithm="grpo", **extra, **{knob: True}).trains_at_step
    plain = _plan(tmp_path, capsys, extra=("--algorithm", "grpo"))
    held = _plan(tmp_path, capsys, extra=("--algorithm", "grpo", flag))
    assert (plain["train_at_end"], held["train_at_end"]) == (False, True)
    assert held[flag.removeprefix("--").replace("-", "_")] is True
    stream = [out["recommended"]["async_stream"]["iteration_s"] for out in (plain, held)]
    assert stream[1] > stream[0]  # training no longer overlaps the iteration's generation
