"""Bench command lines: a bad argument is refused before any work, by argparse (exit code 2, one
line on stderr naming the flag and the value, stdout empty: it is reserved for the JSON lines),
explicit flags win over --quick's defaults, and a bench's stdout is JSON lines ending with a
flat summary (``"summary": true``). Nothing here runs a benchmark, but for one --quick run of
the cheapest (trainer_throughput, ~10 s)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from bench_loading import load_bench, refused

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"

# one bad argument per bench with a command line: (script, argv, what stderr must say)
REFUSED = [
    ("engine_throughput", ["--workloads", "x"], "argument --workloads: unknown 'x'"),
    ("skew_dispatch", ["--prompts", "0"], "argument --prompts: must be an integer >= 1, got '0'"),
    ("pipeline_modes", ["--iterations", "-1"], "argument --iterations: must be an integer >= 1, got '-1'"),
    ("colocated_probe", ["--repeat", "0"], "argument --repeat: must be an integer >= 1, got '0'"),
    ("scale_out", ["--group", "1"], "argument --group: must be an integer >= 2, got '1'"),
    ("planner_accuracy", ["--segments", "-1"], "argument --segments: must be an integer >= 1, got '-1'"),
    ("trainer_throughput", ["--threads", "0"], "argument --threads: must be an integer >= 1, got '0'"),
    ("cpu_gemm", ["--threads", "0"], "argument --threads: must be an integer >= 1, got '0'"),
    ("kernels", ["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    ("weight_sync", ["--reps", "0"], "--reps must be >= 1, got 0"),
    ("reward_pool", ["--samples", "0"], "argument --samples: must be an integer >= 1, got '0'"),
    ("trainer_memory", ["--ranks", "1"], "argument --ranks: must be an integer >= 2, got '1'"),
    ("remax_baseline", ["--group-size", "0"], "argument --group-size: must be an integer >= 1, got '0'"),
    ("multi_turn_prefix", ["--turns", "0"], "argument --turns: must be an integer >= 1, got '0'"),
]


def _run(script: str, argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / f"{script}.py"), *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def refused_runs() -> dict[str, subprocess.CompletedProcess]:
    # each script in a process of its own, as ``python bench/<script>.py ARGV``, forked after the
    # imports they share (tests/bench_refusals.py): 12 processes each importing torch and the
    # project took ~25 s of the 2-core CI's time, the forks take ~5 s
    p = subprocess.run([sys.executable, str(Path(__file__).with_name("bench_refusals.py"))], cwd=ROOT,
                       input=json.dumps([[script, argv] for script, argv, _ in REFUSED]), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    argvs = {script: argv for script, argv, _ in REFUSED}
    return {script: subprocess.CompletedProcess([script, *argvs[script]], code, out, err)
            for script, (code, out, err) in json.loads(p.stdout).items()}


def test_every_bench_with_a_command_line_is_covered():
    with_cli = {f.stem for f in BENCH.glob("*.py")
                if any(s in f.read_text() for s in ("ArgumentParser(", "pm.parse_args("))}
    assert with_cli == {script for script, _, _ in REFUSED}


@pytest.mark.parametrize("script, argv, said", REFUSED, ids=[s for s, _, _ in REFUSED])
def test_bad_argument_is_refused_before_any_work(refused_runs, script, argv, said):
    p = refused_runs[script]
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stdout == ""
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{script}.py: error: ") and said in last, p.stderr[-2000:]
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("script, argv, said", [
    ("engine_throughput", ["--repeats", "0"], "argument --repeats: must be an integer >= 1, got '0'"),
    ("engine_throughput", ["--threads", "0"], "argument --threads: must be an integer >= 1, got '0'"),
    ("engine_throughput", ["--workloads", "a,,d"], "argument --workloads: unknown 'd' in 'a,,d' (known: a, b, c)"),
    ("engine_throughput", ["--workloads", "a,a"], "argument --workloads: 'a' given twice"),
    ("engine_throughput", ["--competitors", "native,vllmm"], "argument --competitors: unknown 'vllmm'"),
    ("skew_dispatch", ["--repeats", "0"], "argument --repeats: must be an integer >= 1, got '0'"),
    ("skew_dispatch", ["--instances", "0"], "argument --instances: must be an integer >= 1, got '0'"),
    ("skew_dispatch", ["--quick", "--kv-tokens", "8"], "argument --kv-tokens: must be an integer >= 16, got '8'"),
    # (review, session 50: 16 failed in the engine after the workload line, 32 after the profiling)
    ("skew_dispatch", ["--quick", "--kv-tokens", "32"], "argument --kv-tokens: 32 cannot hold a sequence of "
                                                        "--prompt-cap 32 + --len-cap 512 tokens (blocks of 16, "
                                                        "one spare): at least 560"),
    ("skew_dispatch", ["--threads", "0"], "argument --threads: must be an integer >= 1, got '0'"),
    ("skew_dispatch", ["--hidden", "36"], "argument --hidden: must be a multiple of 8"),
    ("skew_dispatch", ["--seed", "-1"], "argument --seed: must be an integer >= 0, got '-1'"),
    ("skew_dispatch", ["--ranker", "gbm"], "argument --ranker: invalid choice: 'gbm'"),
    ("pipeline_modes", ["--quick", "--prompts", "1"], "argument --prompts: must be an integer >= 2, got '1'"),
    ("pipeline_modes", ["--scale", "inf"], "argument --scale: must be a finite number > 0, got 'inf'"),
    ("pipeline_modes", ["--max-len", "0"], "argument --max-len: must be an integer >= 1, got '0'"),
    ("pipeline_modes", ["--modes", "batch,strem"], "argument --modes: unknown 'strem'"),
    ("pipeline_modes", ["--repeat", "-2"], "argument --repeat: must be an integer >= 1, got '-2'"),
    ("scale_out", ["--iterations", "0"], "argument --iterations: must be an integer >= 1, got '0'"),
    ("scale_out", ["--prompts", "0"], "argument --prompts: must be an integer >= 1, got '0'"),
    ("scale_out", ["--mode", "colocated"], "argument --mode: invalid choice: 'colocated'"),
    ("scale_out", ["--start-len", "64", "--end-len", "32"], "argument --end-len: must be >= --start-len (64)"),
    ("scale_out", ["--profile", "no/such/ptl.json"], "argument --profile: no such file:"),
    ("planner_accuracy", ["--quick", "--segments", "0"], "argument --segments: must be an integer >= 1, got '0'"),
    ("planner_accuracy", ["--measured", "no/such/measured.jsonl"], "argument --measured: no such file:"),
    ("trainer_throughput", ["--threads", "-1"], "argument --threads: must be an integer >= 1, got '-1'"),
    ("cpu_gemm", ["--threads", "two"], "argument --threads: must be an integer >= 1, got 'two'"),
    ("reward_pool", ["--threads", "0"], "argument --threads: must be an integer >= 1, got '0'"),
    ("reward_pool", ["--arrival", "x"], "argument --arrival: must be an integer >= 1, got 'x'"),
    ("trainer_memory", ["--iterations", "1"], "argument --iterations: must be an integer >= 2, got '1'"),
])
def test_bad_values_name_the_flag(script, argv, said, monkeypatch, capsys):
    bench = load_bench(script, monkeypatch)
    assert said in refused(bench.parse_args, argv, capsys)


def test_planner_accuracy_measured_is_one_segment(monkeypatch, capsys, tmp_path):
    pa = load_bench("planner_accuracy", monkeypatch)
    measured = tmp_path / "measured.jsonl"
    measured.write_text("")
    assert "--measured is one segment, got 3" in refused(pa.parse_args, ["--measured", str(measured),
                                                                         "--segments", "3"], capsys)
    assert pa.parse_args(["--measured", str(measured)]).segments == 1


def test_planner_accuracy_predicts_the_workload_its_measured_file_ran(monkeypatch, tmp_path):
    # a --quick file read without --quick was predicted as the full workload (48 prompts x 12
    # iterations against 24 x 4), 2x off, and its timelines read from another run (review, s54)
    pa = load_bench("planner_accuracy", monkeypatch)
    measured = tmp_path / "measured.jsonl"
    measured.write_text('{"mode": "batch"}\n{"summary": true, "quick": true, "iterations": 4, "prompts": 24}\n')
    with pytest.raises(SystemExit, match="its summary line names no scale, max_len, logdir"):
        pa.measured_run(str(measured))
    measured.write_text('{"summary": true, "iterations": 4, "prompts": 24, "scale": 8.0, "max_len": 80, '
                        '"logdir": "/x/pm"}\n')
    assert pa.measured_run(str(measured)) == ["--iterations", "4", "--prompts", "24", "--scale", "8.0",
                                              "--max-len", "80", "--logdir", "/x/pm"]


def test_planner_accuracy_reads_each_segments_own_timelines(monkeypatch, tmp_path):
    # every segment ran in one logdir, so measured_0's timelines were the last segment's; each
    # segment's are copied beside its lines and named in its summary (diff review, s54)
    pa = load_bench("planner_accuracy", monkeypatch)
    measured = tmp_path / "m.jsonl"
    measured.write_text('{"mode": "batch", "iteration_s": 1.0}\n{"summary": true, "logdir": "/x/pm"}\n')
    a = pa.parse_args(["--measured", str(measured), "--out", str(tmp_path)])
    assert pa.measured_rows(a, "pm")[1] == Path("/x/pm")  # a plain pipeline_modes run: its logdir
    measured.write_text('{"mode": "batch"}\n{"summary": true, "logdir": "/x/pm", "timelines": "/y/seg0"}\n')
    rows, timelines = pa.measured_rows(a, "pm")
    assert rows == {"batch": {"mode": "batch"}} and timelines == Path("/y/seg0")


def test_planner_accuracy_refuses_timelines_a_later_run_rewrote(monkeypatch, tmp_path):
    # a later pipeline_modes run into the same --logdir rewrote the timelines, and --measured
    # read its stage times as the file's run's (review, s55): the summary's digests are checked
    pa = load_bench("planner_accuracy", monkeypatch)
    pm = load_bench("pipeline_modes", monkeypatch)
    run = tmp_path / "pm"
    run.mkdir()
    (run / "timeline_batch.json").write_text('{"traceEvents": [1]}')
    measured = tmp_path / "m.jsonl"
    digests = {"batch": pm.file_digest(run / "timeline_batch.json")}
    measured.write_text('{"mode": "batch"}\n' + json.dumps({"summary": True, "logdir": str(run),
                                                             "timeline_digests": digests}) + "\n")
    a = pa.parse_args(["--measured", str(measured), "--out", str(tmp_path)])
    assert pa.measured_rows(a, "pm")[1] == run
    (run / "timeline_batch.json").write_text('{"traceEvents": [2]}')  # another run's
    with pytest.raises(SystemExit, match=r"timeline_batch.json is not the timeline of the run .*m.jsonl holds"):
        pa.measured_rows(a, "pm")


def test_explicit_flags_win_over_quick(monkeypatch):
    # --quick used to overwrite --prompts / --kv-tokens / --len-cap (skew_dispatch) and --segments
    # (planner_accuracy) whatever the command line said
    skew = load_bench("skew_dispatch", monkeypatch)
    a = skew.parse_args(["--quick", "--prompts", "100"])
    assert (a.prompts, a.kv_tokens, a.len_cap) == (100, 2048, 512)
    a = skew.parse_args(["--kv-tokens", "4096", "--quick"])
    assert (a.prompts, a.kv_tokens, a.len_cap) == (256, 4096, 512)
    a = skew.parse_args([])
    assert (a.prompts, a.kv_tokens, a.len_cap, a.repeats) == (1024, 8192, 1024, 2)
    pa = load_bench("planner_accuracy", monkeypatch)
    assert [pa.parse_args(argv).segments for argv in ([], ["--quick"], ["--quick", "--segments", "2"])] == [3, 1, 2]
    pm = load_bench("pipeline_modes", monkeypatch)
    a = pm.parse_args(["--quick", "--iterations", "7"])
    assert (a.iterations, a.prompts, a.max_len, a.repeat) == (7, 24, 80, 1)
    a = pm.parse_args(["--modes", " batch, stream "])
    assert (a.modes, a.iterations, a.repeat) == (["batch", "stream"], 12, 4)
    et = load_bench("engine_throughput", monkeypatch)
    a = et.parse_args(["--workloads", "c,a"])
    assert (a.workloads, a.competitors[:2], a.repeats) == (["c", "a"], ["native", "native_bf16kv"], 1)


def test_no_bench_nests_its_summary():
    # skew_dispatch and planner_accuracy printed {"summary": {...}}, the others a flat line
    # marked "summary": true; readers of the JSON lines look for that mark
    for f in sorted(BENCH.glob("*.py")):
        text = f.read_text()
        assert not re.search(r"""["']summary["']\s*:\s*(\{|summary\b)""", text), f"{f.name} nests its summary"
        assert "summary=True" in text or re.search(r"""["']summary["']\s*:\s*True""", text) or \
            f.stem in {"argcheck", "jsonline", "engine_competitors", "roofline", "planner_profiles",
                       "colocated_probe"}, f.name  # helpers; the probe runs pipeline_modes' controller


def test_missing_vllm_is_said_once_on_stderr(monkeypatch, capsys, tmp_path):
    comp = load_bench("engine_competitors", monkeypatch)
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # run_vllm sets it otherwise
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    assert comp.run_vllm(tmp_path, [], "float32", 4) is None
    assert comp.run_vllm_default(tmp_path, [], "float32", 4) is None
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "vLLM is not installed" in err and "are null" in err, err


def test_quick_run_prints_json_lines_ending_with_the_flat_summary():
    p = _run("trainer_throughput", ["--quick"])
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [json.loads(line) for line in p.stdout.splitlines()]  # every line: JSON
    assert len(lines) >= 2 and all(isinstance(d, dict) for d in lines)
    assert lines[-1]["summary"] is True and "padded_over_packed" in lines[-1]
    assert not any(d.get("summary") for d in lines[:-1])


def test_kernels_summary_keys_are_documented():
    # docs/benchmarks.md listed 10 of the kernel bench's 16 summary keys (not dtype, *_graph, wide_table_*)
    import ast

    tree = ast.parse((BENCH / "kernels.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "dict"]
    summary = next(c for c in calls if {"bench", "summary"} <= {k.arg for k in c.keywords}
                   and any(k.arg == "bench" and getattr(k.value, "value", "") == "kernels" for k in c.keywords))
    extra = next(n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                 and getattr(n.targets[0], "id", "") == "extra")
    keys = {k.arg for k in summary.keywords + extra.keywords if k.arg} - {"bench", "summary"}
    assert len(keys) == 16
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    section = doc.split("## bench/kernels.py", 1)[1].split("\n## ", 1)[0]
    words = set(section.replace("`", " ").replace(",", " ").split())
    assert keys <= words, sorted(keys - words)


def test_pipeline_modes_merges_rounds_by_their_own_keys(monkeypatch):
    # colocated: bubbles are per device (rank1), busy seconds per span worker (gen1, train1); the
    # merge took the bubble keys for both and wrote 0.0 busy seconds, and kept only CPU totals
    merge_rounds = load_bench("pipeline_modes", monkeypatch).merge_rounds

    def row(busy, cpu):
        return {"mode": "colocated", "samples_per_s": 1.0, "seconds": 2.0, "samples": 2, "tokens": 10, "iterations": 1,
                "bubble": {"rank1": 0.5}, "staleness_max": 0, "busy_s": busy, "cpu_s": cpu}

    m = merge_rounds([row({"gen1": 0.5, "train1": 0.25}, {"worker1": {"total": 1.0, "MainThread": 0.5}}),
                      row({"gen1": 0.25, "train1": 0.5}, {"worker1": {"total": 2.0, "rpc": 0.75}})])
    assert m["busy_s"] == {"gen1": 0.75, "train1": 0.75} and m["bubble"] == {"rank1": 0.5}
    assert m["cpu_s"] == {"worker1": {"MainThread": 0.5, "rpc": 0.75, "total": 3.0}}


def test_reward_pool_runs_each_competitor_once(monkeypatch):
    # --threads 1 listed threads_1 twice: two lines of one name, the second overwriting the first (review, s55)
    rp = load_bench("reward_pool", monkeypatch)
    for threads in (1, 8):
        names = [c[0] for c in rp.competitors(threads, 2, 8)]
        assert len(names) == len(set(names)) and names[0] == "threads_1", names
    assert [c[0] for c in rp.competitors(1, 2)] == ["threads_1", "processes_2"]
