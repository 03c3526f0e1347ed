"""bench/kernels.py's measurement code, run on CPU with the kernel in triton's interpreter and
a fake timer (the real one, triton.testing.do_bench, needs CUDA events: not on this machine).
Catches bugs in the benchmark before a GPU run spends its time on them; no timing asserted."""
import importlib.util
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
triton = pytest.importorskip("triton", reason="triton not installed (pip install streamrl[kernels])")

import kernels  # noqa: E402

pytestmark = [pytest.mark.triton,
              pytest.mark.skipif(not kernels.interpreting(), reason="CPU dry run only; "
                                 "bench/gpu_check.sh runs the real benchmark on CUDA")]
if kernels.interpreter_mismatch():
    pytest.skip(kernels.interpreter_mismatch(), allow_module_level=True)

BENCH = Path(__file__).resolve().parents[1] / "bench" / "kernels.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_kernels", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fake_timer(ms: list[float]):
    """A stand-in for do_bench (CUDA events: not on this machine): runs ``fn`` once and
    returns the next of ``ms`` (the implementations are timed in a fixed order)."""
    it = iter(ms)
    return lambda fn, warmup=0, rep=0: (fn(), next(it))[1]


def test_bench_rows_and_summary_on_cpu(monkeypatch, capsys):
    bk = load_bench()
    # shape 1: triton, torch_paged, sdpa_dense; shape 2 (ragged): triton, torch_paged
    monkeypatch.setattr(triton.testing, "do_bench", fake_timer([1e-5, 4e-5, 2e-5, 2e-5, 2e-5]))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    cpu = torch.device("cpu")
    rows = bk.bench_shape(("toy", 4, 2, 64), 2, 40, torch.float32, cpu, 1000.0, None)
    rows += bk.bench_shape(("toy", 4, 2, 64), 3, 40, torch.float32, cpu, 1000.0, None, ragged=True)
    assert [r["impl"] for r in rows] == ["triton", "torch_paged", "sdpa_dense", "triton", "torch_paged"]
    assert [r["us"] for r in rows] == [0.01, 0.04, 0.02, 0.02, 0.02]
    for r in rows:
        assert r["gbps"] > 0 and "error" not in r
        assert r.get("max_err", 0.0) < 1e-5  # every paged implementation agrees with the reference
    # bytes: K+V of 80 tokens x 2 kv heads x 64 x 4 B, plus q and out, plus the [2, 3] table
    assert rows[0]["gbps"] == round((2 * 80 * 2 * 64 * 4 + 2 * 2 * 4 * 64 * 4 + 6 * 4) / 1e-8 / 1e9, 1)
    assert rows[0]["pct_peak"] == round(100 * rows[0]["gbps"] / 1000.0, 1)
    # t(other) / t(triton), geometric mean over shapes: sqrt(4 x 1) for torch_paged, 2 for sdpa
    assert bk.geomean_speedup(rows, "torch_paged") == 2.0
    assert bk.geomean_speedup(rows, "sdpa_dense") == 2.0
    assert bk.geomean_speedup(rows, "vllm_triton") is None
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, warmup=0, rep=0: (fn(), 1e-5)[1])
    ew = bk.bench_norm_rope(3, 64, 4, 32, torch.bfloat16, cpu, None)
    assert [(r["op"], r["impl"]) for r in ew] == [
        ("rms_norm_residual", "triton"), ("rms_norm_residual", "torch_eager"),
        ("rotary", "triton"), ("rotary", "torch_eager")]
    assert all(r["max_err"] < 0.05 and r["pct_peak"] is None for r in ew)
    assert bk.op_speedup(ew, "rotary") == 1.0 and bk.geomean_speedup(ew, "torch_paged") is None
    assert bk.peak_gbps("NVIDIA H100 80GB HBM3") == 3350 and bk.peak_gbps("NVIDIA H200") == 4800
    assert bk.peak_gbps("NVIDIA H100 PCIe") == 2000 and bk.peak_gbps("Some GPU") is None
    assert bk.peak_gbps("NVIDIA GH200 480GB") == 4000  # "GH200" holds "H200" (review, s55)
    keys = [k for k, _ in bk.PEAK_GBPS]  # no entry is shadowed by an earlier one it contains
    assert not [(a, b) for i, b in enumerate(keys) for a in keys[:i] if a in b]


def test_wide_table_rows_on_cpu(monkeypatch):
    """The wide-table comparison: three launches over the same contexts, all equal to the
    reference; the old capacity-sized pieces are rebuilt with the same split count."""
    bk = load_bench()
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, warmup=0, rep=0: (fn(), 1e-5)[1])
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", fake_timer([2e-5, 6e-5, 1e-5]))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    rows = bk.bench_wide_table(("toy", 4, 2, 64), 2, 200, 1024, torch.float32, torch.device("cpu"), None)
    assert [r["impl"] for r in rows] == ["triton", "triton_capacity_pieces", "triton_tight"]
    assert all(r["max_err"] < 1e-5 and r["table_tokens"] == 1024 for r in rows)
    assert rows[0]["splits"] == rows[1]["splits"]
    assert [r["us_graph"] for r in rows] == [0.02, 0.06, 0.01]
    assert bk.geomean_speedup(rows, "triton_capacity_pieces", "us_graph") == 3.0
    assert bk.geomean_speedup(rows, "triton_tight", "us_graph") == 0.5


def test_bench_skips_without_cuda(monkeypatch, capsys):
    bk = load_bench()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["kernels.py", "--quick"])
    assert bk.main() == 0
    assert '"skipped": "no CUDA device' in capsys.readouterr().out


def test_launch_sweep_on_cpu(monkeypatch, capsys):
    """--sweep: every candidate launch gives the reference's result; the line names the
    heuristic's pick and the best one (fake timer: the slower the more splits)."""
    bk = load_bench()
    from kernels import _paged_decode_triton

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    seen = []
    real = _paged_decode_triton.launch

    def launch(*args):
        seen.append(args[-1])
        return real(*args)

    monkeypatch.setattr(_paged_decode_triton, "launch", launch)
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph",
                        lambda fn, rep=0: (fn(), 1e-3 * seen[-1].num_splits)[1])
    rec, = bk.sweep_launch(("toy", 4, 2, 64), 2, 40, torch.float32, torch.device("cpu"))
    out = capsys.readouterr().out
    assert '"error"' not in out and rec["tried"] >= 4
    assert rec["best"]["splits"] == 1 and rec["best"]["us"] == 1.0
    assert rec["heuristic_over_best"] == rec["heuristic"]["splits"]
    assert len(rec["all"]) == rec["tried"] and [1, 32, 4, 1.0] in rec["all"]
