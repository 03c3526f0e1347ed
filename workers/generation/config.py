"""EngineConfig: the settings of one generation instance, validated once at construction."""
from __future__ import annotations

from dataclasses import dataclass, field

from workers.config_schema import SEEDS, Range, check_fields, ranged
from workers.generation.admission import ADMISSION_POLICIES, valid_name
from workers.tasks.plugins import is_plugin

BACKEND_NAMES = ("native", "vllm")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")
DTYPES = ("", "float32", "bfloat16", "float16")
CPU_HALF_COMPUTE = ("auto", "native", "float32")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")  # vLLM's kv_cache_dtype names (no fp8 here)


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine.

    KV memory: ``num_blocks`` blocks of ``block_size`` tokens; when ``num_blocks`` is 0 it is
    ``kv_cache_tokens // block_size``. ``max_model_len`` 0 means the model's
    ``max_position_embeddings``. ``max_prefill_tokens`` bounds the new tokens one prefill step
    computes; with ``enable_chunked_prefill`` (vLLM's name and default) a prompt longer than
    what is left of it is computed in chunks over several steps, the running batch decoding
    between them; without, a sequence longer than it is admitted alone, whole. ``device``/``dtype`` ""
    pick CUDA+bf16 when a GPU is present, else CPU+fp32. ``eos_ids`` None means the model
    config's ``eos_token_id``. ``seed`` seeds sampling of requests without their own seed.
    ``cpu_half_compute``: with a bf16/fp16 ``dtype`` on a CPU, "float32" rounds the weights to
    ``dtype`` but computes in fp32 (much faster where the CPU has no bf16/fp16 matmul units);
    "native" computes in ``dtype``; "auto" picks "native" only when the CPU has them (AVX512-BF16
    or AMX). ``attention_backend``: "auto" ("triton" on CUDA when triton is installed, the KV
    cache is in the model's dtype and ``block_size`` is a multiple of 16, the sizes the kernel
    is tested with; else "torch"), "torch" (portable), "triton" (CUDA decode kernel of kernels/),
    "cpu" (C++ kernel compiled on first use; fastest on CPU). ``kv_cache_dtype`` (as vLLM's):
    "auto" stores K/V in the compute dtype; "bfloat16"/"float16" store them in 16 bits under an
    fp32 model (half the KV memory and memory traffic; attention still computes in fp32, so
    outputs differ from "auto" by the rounding of K/V). ``enforce_eager`` (as vLLM's): with the
    "triton" backend on CUDA, decode steps replay CUDA graphs unless this is True (prefill
    and the other backends always run eagerly); the vLLM backend passes it to vLLM, which uses
    CUDA graphs on GPUs the same way. ``cpu_prepack``: the CPU forward's GEMMs against
    weights packed once (docs/engine.md, "Prepacked GEMMs"): fp32 in the project's panel
    layout (``panel_gemm.py``), other dtypes in oneDNN's; "auto" where the CPU has AVX-512 and
    the packer runs for the compute dtype; true forces it (refused at start where it
    cannot run); false keeps the plain GEMMs (less memory: o, down and lm_head are not held
    twice). ``backend``: "native", "vllm", or your own engine (``module:Name`` / ``file.py:Name``,
    ``factory.py``). ``prefix_sharing``: the samples of a GRPO group share their prompt's
    blocks (``PrefixCache``). ``prefix_caching`` (vLLM's ``enable_prefix_caching``): every full
    KV block is kept by a hash of its tokens, for any request, and reused by any later one
    with the same leading tokens until its memory is needed (a multi-turn conversation's next
    turn computes only its new tokens); the vLLM backend has one mechanism for both and turns
    it on when either is true. ``backend_options`` holds backend-specific settings (e.g. vLLM's
    ``gpu_memory_utilization``; your engine's own).
    """

    backend: str = "native"
    max_batch_size: int = ranged(64, Range(1))
    block_size: int = ranged(16, Range(1))
    kv_cache_tokens: int = ranged(65536, Range(0))
    num_blocks: int = ranged(0, Range(0, note="0: kv_cache_tokens // block_size"))
    max_model_len: int = ranged(0, Range(0, note="0: the model's max_position_embeddings"))
    max_prefill_tokens: int = ranged(8192, Range(1))
    enable_chunked_prefill: bool = True
    attention_backend: str = "auto"
    admission: str = "fcfs"
    prefix_sharing: bool = True
    prefix_caching: bool = True
    device: str = ""
    dtype: str = ""
    seed: int = ranged(0, SEEDS)
    eos_ids: tuple[int, ...] | None = None
    cpu_half_compute: str = "auto"
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False
    cpu_prepack: str | bool = "auto"
    backend_options: dict = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self):
        def bad(key: str, why: str):
            raise ValueError(f"engine.{key}: {why}, got {getattr(self, key)!r}")

        if self.backend not in BACKEND_NAMES and not (isinstance(self.backend, str) and is_plugin(self.backend)):
            bad("backend", f"must be one of {BACKEND_NAMES}, or module:Name / file.py:Name of your own engine")
        if self.attention_backend not in ATTENTION_BACKENDS:
            bad("attention_backend", f"must be one of {ATTENTION_BACKENDS}")
        if not valid_name(self.admission):
            bad("admission", f"must be one of {ADMISSION_POLICIES}, or module:fn / file.py:fn of your own")
        if self.dtype not in DTYPES:
            bad("dtype", f"must be one of {DTYPES}")
        if self.cpu_half_compute not in CPU_HALF_COMPUTE:
            bad("cpu_half_compute", f"must be one of {CPU_HALF_COMPUTE}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad("kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}")
        if self.kv_cache_dtype != "auto" and self.attention_backend == "triton":
            bad("kv_cache_dtype", "must be 'auto' with attention_backend 'triton' (its kernel reads "
                                  "caches of the model's dtype)")
        check_fields(self, "engine")  # "false" for a switch is truthy: it would switch it on
        if self.cpu_prepack != "auto" and not isinstance(self.cpu_prepack, bool):
            bad("cpu_prepack", "must be 'auto', true or false")
        if self.total_blocks < 2:  # one sequence's blocks plus a copy-on-write block of its group
            key = "num_blocks" if self.num_blocks else "kv_cache_tokens"
            bad(key, f"must give at least two blocks of {self.block_size} tokens")
        if self.kv_len < 2:  # every prompt (>= 1 token) would be refused: no room for an output
            key = "num_blocks" if self.num_blocks else "kv_cache_tokens"
            bad(key, f"must hold a sequence of 2 tokens (a prompt token and an output); {self.total_blocks} "
                     f"blocks of {self.block_size} hold {self.kv_len}")
        if self.max_model_len == 1:
            bad("max_model_len", "must be 0 (the model's) or >= 2: a prompt token and an output")
        if self.max_model_len > self.kv_len:  # as vLLM, which refuses to start: not a silent cut
            raise ValueError(context_too_long(self.max_model_len, self.total_blocks, self.block_size, self.kv_len))
        kind, _, index = self.device.partition(":")
        if self.device and (kind not in ("cpu", "cuda") or _ and not index.isdigit()):
            bad("device", "must be '', 'cpu', 'cuda' or 'cuda:N'")
        if self.backend == "native" and self.backend_options:
            bad("backend_options", "is read by the vllm backend (vLLM's own EngineArgs) and by your own engine; "
                                   "the native engine's settings are engine.* keys (docs/engine.md)")
        if self.eos_ids is not None and not all(e >= 0 for e in self.eos_ids):
            bad("eos_ids", "must be None or a tuple of non-negative ints")

    @property
    def total_blocks(self) -> int:
        return self.num_blocks or self.kv_cache_tokens // self.block_size

    @property
    def kv_len(self) -> int:
        """The longest sequence the cache always holds: all blocks but one (a group's pinned
        copy-on-write block)."""
        return max((self.total_blocks - 1) * self.block_size, self.block_size)


def context_too_long(max_model_len: int, blocks: int, block_size: int, kv_len: int, kind: str = "") -> str:
    """The message for a configured ``max_model_len`` that ``blocks`` KV blocks (of ``kind``:
    "vLLM" for the vLLM backend's own blocks) cannot hold."""
    return (f"engine.max_model_len: {max_model_len} tokens do not fit the KV cache, whose {blocks} "
            f"{kind + ' ' if kind else ''}blocks of {block_size} tokens hold at most {kv_len} tokens of one sequence "
            f"(all blocks but one); raise engine.kv_cache_tokens (or num_blocks) or lower max_model_len")


def engine_context(cfg: EngineConfig, model_positions: int, kv_len: int) -> int:
    """An engine's ``max_model_len``: the configured one (or the model's
    ``max_position_embeddings``), within what the cache holds. One set past the model's context
    is refused (ValueError naming ``engine.max_model_len``), as vLLM refuses it at start; it was
    cut to the model's silently (engine review, s60)."""
    if cfg.max_model_len > model_positions:
        raise ValueError(f"engine.max_model_len: {cfg.max_model_len} is past the model's context "
                         f"(max_position_embeddings {model_positions} in its config.json); set it to at most "
                         f"{model_positions}, or leave it unset (0) for the model's")
    return min(cfg.max_model_len or model_positions, model_positions, kv_len)
