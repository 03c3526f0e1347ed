"""Translation between StreamRL's engine types and vLLM's: EngineConfig -> EngineArgs keywords,
Request -> (vLLM SamplingParams keywords, priority). Per-request validation, shared with
the native engine, is ``request_check.refusal``.

Pure functions (no vLLM import), so the mapping is testable where vLLM is absent.
"""
from __future__ import annotations

import math

import torch

from workers.generation.config import EngineConfig, context_too_long, engine_context
from workers.generation.sampler import cpu_seed
from workers.model import ModelConfig, resolve_device
from workers.types import GREEDY_BELOW, Request

# vLLM's CPU attention backend (0.32): supported head sizes, and block sizes must be a multiple of 32
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
CPU_BLOCK_MULTIPLE = 32
# max_num_seqs sizes vLLM's model runner once; VLLMEngine's own admission cap
# (set_max_batch_size) may move anywhere in [1, max_num_seqs] without a restart.
DEFAULT_MAX_NUM_SEQS = 256
_PRIORITY_SCALE = 1e6  # est_len -> int priority (vLLM admits smaller priority first)
_PRIORITY_LIMIT = 2 ** 62
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def resolve_device_dtype(cfg: EngineConfig) -> tuple[str, str]:
    """("cpu"|"cuda", dtype name): as the native engine, CUDA+bf16 when a GPU is present, else CPU+fp32."""
    device = cfg.device.split(":")[0] if cfg.device else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = cfg.dtype or ("bfloat16" if device == "cuda" else "float32")
    return device, dtype


def context_problem(cfg: EngineConfig) -> str | None:
    """A configured ``max_model_len`` vLLM's blocks cannot hold (on CPU they are rounded up to 32
    tokens: one block fewer than the native engine's), said at config load, not as each
    instance is built; else None."""
    block = vllm_block_size(cfg, resolve_device_dtype(cfg)[0])
    kv_len = max((_num_blocks(cfg, block) - 1) * block, block)
    if cfg.max_model_len > kv_len:
        return context_too_long(cfg.max_model_len, _num_blocks(cfg, block), block, kv_len, "vLLM")
    return None


def max_model_len(cfg: EngineConfig, mc: ModelConfig) -> int:
    """As the native engine: the config's (or the model's) context, capped so that one
    sequence always fits the KV cache (all blocks but one; vLLM refuses to start otherwise),
    counted in vLLM's blocks: on CPU those are rounded up to a multiple of 32 tokens, so a
    small cache can give a shorter context than the native engine's (one block less)."""
    problem = context_problem(cfg)  # the native engine's message (vLLM would refuse to start)
    if problem:
        raise ValueError(problem)
    block = vllm_block_size(cfg, resolve_device_dtype(cfg)[0])
    kv_len = max((_num_blocks(cfg, block) - 1) * block, block)
    return engine_context(cfg, mc.max_position_embeddings, kv_len)


def _num_blocks(cfg: EngineConfig, block: int) -> int:
    """The native engine's KV token count in vLLM blocks."""
    return max(2, math.ceil(cfg.total_blocks * cfg.block_size / block))


def vllm_block_size(cfg: EngineConfig, device: str) -> int:
    """cfg.block_size, rounded up to a multiple of 32 on CPU (vLLM's CPU attention needs it)."""
    if device == "cpu":
        return CPU_BLOCK_MULTIPLE * math.ceil(cfg.block_size / CPU_BLOCK_MULTIPLE)
    return cfg.block_size


def gpu_memory_utilization(device: str, most: float = 0.9) -> float:
    """vLLM's ``gpu_memory_utilization`` for a GPU whose KV cache is sized already
    (``kv_cache_memory_bytes``): vLLM then uses it only to refuse to start when less than that
    share of the GPU is free, so it is the share free now (95% of it), at most ``most``: a GPU
    shared with a colocated trainer, or any other tenant, holding over 10% failed the start at
    vLLM's 0.9. ``engine.backend_options.gpu_memory_utilization`` overrides it."""
    if not torch.cuda.is_available():  # (args read where no GPU is: vLLM would not start there anyway)
        return most
    free, total = torch.cuda.mem_get_info(resolve_device(device))
    return max(0.01, round(min(most, 0.95 * free / total), 4))  # (0 is refused as a config error)


def engine_args(cfg: EngineConfig, model_dir: str, mc: ModelConfig) -> dict:
    """Keyword arguments of ``vllm.EngineArgs`` for one instance. ``cfg.backend_options`` may
    override any of them (e.g. ``gpu_memory_utilization``, ``max_num_seqs``, ``enforce_eager``).

    KV memory: the same token count as the native engine (``cfg.total_blocks * cfg.block_size``),
    given to vLLM as a block count (``num_gpu_blocks_override``) and the matching byte size."""
    device, dtype = resolve_device_dtype(cfg)
    if device == "cpu" and mc.dim_head not in CPU_HEAD_SIZES:
        raise ValueError(f"{model_dir}/config.json: head_dim {mc.dim_head} is not supported by "
                         f"vLLM's CPU attention (supported: {CPU_HEAD_SIZES})")
    block = vllm_block_size(cfg, device)
    num_blocks = _num_blocks(cfg, block)
    if device == "cpu" and cfg.kv_cache_dtype != "auto":
        raise ValueError(f"engine.kv_cache_dtype: vLLM's CPU attention takes only 'auto' (and fp8 "
                         f"on AVX-512 CPUs), got {cfg.kv_cache_dtype!r}")
    kv_dtype = dtype if cfg.kv_cache_dtype == "auto" else cfg.kv_cache_dtype
    bytes_per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.dim_head * _DTYPE_BYTES[kv_dtype]
    opts = dict(cfg.backend_options)
    opts.pop("multiprocess", None)  # VLLMEngine's choice, not an EngineArgs field
    max_num_seqs = int(opts.pop("max_num_seqs", max(cfg.max_batch_size, DEFAULT_MAX_NUM_SEQS)))
    if max_num_seqs < cfg.max_batch_size:
        raise ValueError(f"engine.backend_options.max_num_seqs ({max_num_seqs}) must be >= "
                         f"engine.max_batch_size ({cfg.max_batch_size})")
    # vLLM 0.32 rewinds a seeded request's generator when it splits its prompt over steps
    # (Generator.set_offset), which CPU generators refuse: "CPU Generator does not use offset" failed
    # the round of any batch of seeded prompts past one step's budget (every training request is
    # seeded; review, s54). On CPU it runs unchunked, each prompt prefilled in one step.
    chunked = cfg.enable_chunked_prefill and device != "cpu"
    args = dict(
        model=model_dir,
        skip_tokenizer_init=True,  # token ids in, token ids out
        dtype=dtype,
        kv_cache_dtype=cfg.kv_cache_dtype,
        seed=cfg.seed,
        max_model_len=max_model_len(cfg, mc),
        max_num_seqs=max_num_seqs,
        # vLLM without chunking never splits a prompt, so its step budget must hold the longest
        # (it refuses a smaller one); the native engine admits such a prompt alone, whole
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=max(cfg.max_prefill_tokens, max_num_seqs, 0 if chunked else max_model_len(cfg, mc)),
        block_size=block,
        num_gpu_blocks_override=num_blocks,
        kv_cache_memory_bytes=num_blocks * block * bytes_per_token,
        enable_prefix_caching=cfg.prefix_sharing or cfg.prefix_caching,  # vLLM's APC serves both
        scheduling_policy="priority" if cfg.admission == "lpt" else "fcfs",
        logprobs_mode="processed_logprobs",  # same as the native sampler: after T, top-k, top-p
        gpu_memory_utilization=0.1 if device == "cpu" else (opts.get("gpu_memory_utilization") or
                                                            gpu_memory_utilization(cfg.device)),
        enforce_eager=device == "cpu" or cfg.enforce_eager,
        disable_log_stats=False,  # per-request timings and preemption counts
    )
    args.update(opts)
    if not chunked and args.get("enable_chunked_prefill"):
        raise ValueError("engine.backend_options.enable_chunked_prefill: vLLM 0.32 on CPU fails the step of a "
                         "seeded request whose prompt it chunks (\"CPU Generator does not use offset\"), and every "
                         "training request is seeded: on CPU it runs unchunked; drop the key")
    if not chunked and args["max_num_batched_tokens"] < args["max_model_len"]:
        raise ValueError(f"engine.backend_options.max_num_batched_tokens: {args['max_num_batched_tokens']} is below "
                         f"max_model_len {args['max_model_len']}; vLLM without chunked prefill (on CPU always) "
                         "prefills each prompt in one step and refuses a smaller step budget: raise it or drop it")
    return args


def priority(req: Request, admission: str) -> int:
    """vLLM priority (smaller first): LPT admits the longest estimate first; FCFS uses 0."""
    if admission != "lpt":
        return 0
    p = -float(req.est_len) * _PRIORITY_SCALE  # clamped before rounding: round(1e303 * 1e6) is inf
    return round(max(-_PRIORITY_LIMIT, min(_PRIORITY_LIMIT, p)))


def sampling_kwargs(req: Request, eos_ids: tuple[int, ...], on_cpu: bool = False) -> dict:
    """Keyword arguments of ``vllm.SamplingParams`` for one sample (n=1): EOS ids as stop ids
    (the tokenizer is skipped), ``min_tokens`` suppresses them, log-prob of the sampled token;
    ``on_cpu``: the seed as the native sampler folds it for torch's CPU generator (``cpu_seed``).
    A temperature below ``GREEDY_BELOW`` is sent as 0: greedy with log-probs at T = 1, as the
    native sampler (vLLM would raise it to 0.01 and report log-probs at 0.01; the trainer
    takes greedy samples' log-probs at T = 1)."""
    s = req.sampling
    temperature = float(s.temperature) if s.temperature >= GREEDY_BELOW else 0.0
    # counts past any context are held below 2**62 (the same cut: a child's msgpack encodes no int
    # past 2**64); a top_k that large keeps every token, as off does
    return dict(n=1, temperature=temperature, top_p=float(s.top_p),
                top_k=int(s.top_k) if 0 < s.top_k < 1 << 62 else 0,
                seed=cpu_seed(s.seed) if on_cpu and s.seed is not None else s.seed,
                max_tokens=min(int(req.max_tokens), 1 << 62), min_tokens=min(int(req.min_tokens), 1 << 62),
                stop_token_ids=list(eos_ids), ignore_eos=not eos_ids, logprobs=0,
                detokenize=False, skip_special_tokens=False)


def fused_module(name: str) -> str:
    """The vLLM module a HF parameter lands in (q/k/v -> qkv_proj, gate/up -> gate_up_proj)."""
    for part, fused in ((".q_proj.", ".qkv_proj."), (".k_proj.", ".qkv_proj."), (".v_proj.", ".qkv_proj."),
                        (".gate_proj.", ".gate_up_proj."), (".up_proj.", ".gate_up_proj.")):
        name = name.replace(part, fused)
    return name.rsplit(".", 1)[0]


def incomplete_modules(names: set[str], all_names: set[str]) -> dict[str, list[str]]:
    """vLLM reloads a module only from all of its tensors: for each module that ``names``
    touches but does not cover, the HF names missing (empty when every module is whole)."""
    touched = {fused_module(n) for n in names}
    missing: dict[str, list[str]] = {}
    for n in sorted(all_names - names):
        if fused_module(n) in touched:
            missing.setdefault(fused_module(n), []).append(n)
    return missing
