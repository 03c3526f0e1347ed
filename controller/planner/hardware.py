"""Analytic profiles for GPUs and models we cannot run here (roofline estimates).

GPU numbers are the vendors' published dense BF16 tensor FLOP/s, HBM bandwidth and size,
and NVLink bandwidth. Generation: one decode step reads the weights once and every running
sequence's KV cache, and does 2 * params FLOPs per sequence; its time is the larger of the
two over the instance's GPUs at an efficiency, plus a fixed per-step overhead, plus (tp > 1)
the tensor-parallel all-reduces. Training: FLOPs per
token from the RL algorithm's model passes at a model FLOPs utilisation (MFU). Every
constant is a field with its default here and is explained in docs/planner.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from controller.planner.profile import TrainProfile
from controller.scheduling import PTLProfile


def check_number(where: str, x, *, integer: bool = False, lo: float = 0.0, strict: bool = True):
    """``x`` as an int (``integer``) or float that is > ``lo`` (``strict``) or >= ``lo``; else a
    ValueError naming ``where``. Numbers written as strings are accepted (YAML 1.1 reads 7e9,
    without a dot and an exponent sign, as the string '7e9')."""
    v = x
    if isinstance(v, str):
        try:
            v = float(v.strip())
        except ValueError:
            v = x
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and v not in (float("inf"), -float("inf"))
    if ok and integer:
        ok = float(v).is_integer()
    if ok:
        v = int(v) if integer else float(v)
        ok = v > lo if strict else v >= lo
    if not ok:
        kind = "a whole number" if integer else "a number"
        raise ValueError(f"{where} must be {kind} {'>' if strict else '>='} {lo:g}, got {x!r}")
    return v


@dataclass(frozen=True)
class GPUSpec:
    """bf16_tflops: dense BF16 tensor TFLOP/s; hbm_tb_s: HBM TB/s; hbm_gb: HBM GB;
    nvlink_gb_s: NVLink GB/s per GPU, both directions together (the datasheet's figure)."""

    name: str
    bf16_tflops: float
    hbm_tb_s: float
    hbm_gb: float
    nvlink_gb_s: float


# Published datasheet numbers (SXM parts; dense, i.e. without 2:4 sparsity). The H800 is
# the H100 with its NVLink cut to 400 GB/s.
GPUS: dict[str, GPUSpec] = {
    "H800": GPUSpec("H800", 989.0, 3.35, 80.0, 400.0),
    "H100": GPUSpec("H100", 989.0, 3.35, 80.0, 900.0),
    "H200": GPUSpec("H200", 989.0, 4.8, 141.0, 900.0),
    "H20": GPUSpec("H20", 148.0, 4.0, 96.0, 900.0),
    "A100": GPUSpec("A100", 312.0, 2.039, 80.0, 600.0),
}


def gpu(name: str) -> GPUSpec:
    if name not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; known: {sorted(GPUS)}")
    return GPUS[name]


@dataclass(frozen=True)
class ModelSpec:
    """Decoder shape for the cost model; params in units of 1 (not billions). num_heads:
    attention (query) heads, 0 for hidden // head_dim (true of the Qwen2.5 models); they and
    num_kv_heads decide which tensor-parallel sizes can split the model."""

    name: str
    params: float
    num_layers: int
    hidden: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    num_heads: int = 0

    @property
    def heads(self) -> int:
        return self.num_heads or max(1, self.hidden // self.head_dim)

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def __post_init__(self):
        where = f"model {self.name!r}"
        object.__setattr__(self, "params", check_number(f"{where}: params", self.params))
        for k in ("num_layers", "hidden", "num_kv_heads", "head_dim", "dtype_bytes"):
            object.__setattr__(self, k, check_number(f"{where}: {k}", getattr(self, k), integer=True))
        object.__setattr__(self, "num_heads", check_number(f"{where}: num_heads", self.num_heads, integer=True,
                                                           strict=False))
        if self.num_kv_heads > self.heads:
            raise ValueError(f"{where}: num_kv_heads {self.num_kv_heads} is more than the attention heads "
                             f"({self.heads}{'' if self.num_heads else ' = hidden // head_dim'}); KV heads are "
                             "shared by groups of query heads, never more of them")

    @classmethod
    def from_dict(cls, d: dict, where: str = "model", name: str = "hf-model") -> "ModelSpec":
        """Accepts this class's fields, or a Hugging Face config.json of a dense decoder (params
        estimated; named by its ``name``, else ``_name_or_path``, else ``name``: the loader passes
        the config's folder name; ``torch_dtype`` sets the bytes per parameter, bf16 if absent).
        Mixture-of-experts configs are refused (the dense count would miss the experts). Every
        problem is a ValueError naming ``where`` and the key."""
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a mapping of ModelSpec fields or an HF config, got {type(d).__name__}")
        try:
            if "num_hidden_layers" in d:  # HF config
                moe = [k for k in HF_MOE_KEYS if d.get(k) not in (None, 0, 1)]
                if moe:
                    raise ValueError(f"{moe[0]}: {d[moe[0]]!r}: a mixture-of-experts config; the planner's cost model "
                                     "is for dense models (its parameter count would leave out the experts); write a "
                                     "model YAML of ModelSpec fields with the total params instead")
                hf = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
                missing = [k for k in hf if k not in d]
                if missing:
                    raise ValueError(f"HF config without {missing}")
                dkey = "torch_dtype" if "torch_dtype" in d else "dtype"
                dtype = d.get(dkey) or "bfloat16"
                if dtype not in HF_DTYPE_BYTES:
                    raise ValueError(f"{dkey}: {dtype!r} is not one of {sorted(HF_DTYPE_BYTES)}")
                h, L, heads, inter, vocab = (check_number(k, d[k], integer=True) for k in hf)
                kvh = check_number("num_key_value_heads", d.get("num_key_value_heads", heads), integer=True)
                hd = check_number("head_dim", d.get("head_dim") or h // heads, integer=True)
                emb = vocab * h * (1 if d.get("tie_word_embeddings") else 2)
                params = L * (h * hd * heads * 2 + 2 * h * hd * kvh + 3 * h * inter) + emb
                return cls(str(d.get("name") or d.get("_name_or_path") or name), float(params), L, h, kvh, hd,
                           dtype_bytes=HF_DTYPE_BYTES[dtype], num_heads=heads)
            known = set(cls.__dataclass_fields__)
            unknown = set(d) - known
            if unknown:
                raise ValueError(f"unknown keys {sorted(map(str, unknown))}; expected {sorted(known)} or an HF config")
            missing = known - set(d) - {"dtype_bytes", "num_heads"}
            if missing:
                raise ValueError(f"missing keys {sorted(missing)}")
            return cls(**{**d, "name": str(d["name"])})
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


# HF config keys of mixture-of-experts models (Mixtral, Qwen-MoE / OLMoE, DeepSeek, DBRX-style);
# a value above 1 is refused: the dense parameter formula would count one MLP, not the experts
HF_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "n_experts")
# an HF config's torch_dtype (or dtype) -> bytes per weight and KV element; absent: bf16
HF_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# Qwen2.5 dense models (shapes from their config.json files; params rounded).
MODELS: dict[str, ModelSpec] = {
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", 7.6e9, 28, 3584, 4, 128),
    "qwen2.5-14b": ModelSpec("qwen2.5-14b", 14.7e9, 48, 5120, 8, 128),
    "qwen2.5-32b": ModelSpec("qwen2.5-32b", 32.8e9, 64, 5120, 8, 128),
    "qwen2.5-72b": ModelSpec("qwen2.5-72b", 72.7e9, 80, 8192, 8, 128),
}


@dataclass(frozen=True)
class CostAssumptions:
    """Efficiencies of the roofline model (see docs/planner.md)."""

    bw_efficiency: float = 0.75  # achieved / peak HBM bandwidth in decode
    flops_efficiency: float = 0.5  # achieved / peak FLOP/s in decode GEMMs
    step_overhead_s: float = 0.004  # per decode step: launches, sampling (TP all-reduces: below)
    # Tensor parallelism (tp > 1): each forward pass all-reduces the hidden state twice per layer
    # (attention and MLP outputs), tokens * hidden * dtype bytes each, as a ring: latency +
    # 2 (tp - 1) / tp * bytes / (one-way NVLink bandwidth * efficiency). Both set from vLLM's
    # custom all-reduce on 8 x H100 as sglang PR #2904 timed it without CUDA graphs (tp 2-8,
    # sizes read as bf16 elements: 9-12 us up to 64 KB, 13-24 us at 0.5 MB, 27-45 us at 2 MB;
    # this model: 15-16, 17-19 and 24-31 us). A decode step's message is BS * hidden * 2 bytes
    # (72B at BS 64: 1 MB).
    allreduce_latency_s: float = 15e-6  # per all-reduce, whatever its size
    nvlink_efficiency: float = 0.5  # achieved / one-way datasheet NVLink bandwidth
    kv_memory_fraction: float = 0.9  # of HBM the engine may use (weights + KV)
    train_mfu: float = 0.35  # model FLOPs utilisation of the trainer
    train_memory_fraction: float = 0.8  # of HBM the trainer may use for states
    train_state_bytes_per_param: float = 16.0  # bf16 weights + grads, fp32 Adam m, v, master


DEFAULT_ASSUMPTIONS = CostAssumptions()

# Model passes per token of each RL algorithm, in units of 2 * params FLOPs (one forward):
# a trained model costs 3 (forward + backward), a forward-only one 1.
PASSES = {
    "ppo": 3 + 3 + 1 + 1 + 1,  # actor, critic trained; reference, old log-probs, values forward
    "grpo": 3 + 1 + 1,  # actor trained; reference, old log-probs forward
}
TRAINED_MODELS = {"ppo": 2, "grpo": 1}
# the critic-free algorithms cost what grpo does (their advantages are arithmetic on the rewards;
# remax's greedy sample is generation work only: sample_workloads' greedy_group, docs/planner.md)
for _name in ("rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "grpo_passk", "gpg", "remax"):
    PASSES[_name], TRAINED_MODELS[_name] = PASSES["grpo"], TRAINED_MODELS["grpo"]


def generation_tp(model: ModelSpec, g: GPUSpec, a: CostAssumptions = DEFAULT_ASSUMPTIONS) -> int:
    """Smallest power-of-two tensor-parallel size whose weights take <= half the usable HBM."""
    tp = 1
    while model.weight_bytes / tp > 0.5 * a.kv_memory_fraction * g.hbm_gb * 1e9:
        tp *= 2
    return tp


def tp_problem(model: ModelSpec, g: GPUSpec, tp: int, node_gpus: int,
               a: CostAssumptions = DEFAULT_ASSUMPTIONS) -> str:
    """Why ``tp`` GPUs of one node cannot form a generation instance of ``model`` ('' if they
    can): a power of two, at most ``node_gpus``, weights in at most half the usable HBM, and
    the heads split as vLLM requires (query heads % tp == 0; KV heads a multiple of tp, or tp
    a multiple of them, each then replicated)."""
    if tp < 1 or tp & (tp - 1):
        return f"{tp} is not a power of two (1, 2, 4, 8, ...)"
    if tp > node_gpus:
        return (f"{tp} GPUs are more than one node's ({node_gpus}, gpus_per_node); tensor parallelism "
                "across nodes is not modelled")
    need = generation_tp(model, g, a)
    if tp < need:
        return (f"{tp} x {g.name} cannot hold {model.name} for generation: its {model.weight_bytes / 1e9:.0f} GB "
                f"of weights need tp >= {need} (at most half of the usable HBM per GPU)")
    kvh = model.num_kv_heads
    if model.heads % tp or (kvh % tp if tp <= kvh else tp % kvh):
        return (f"{model.name}'s {model.heads} attention heads ({kvh} KV heads) do not split over {tp} GPUs "
                "(vLLM needs heads % tp == 0, and KV heads % tp == 0 or tp % KV heads == 0)")
    return ""


def tp_candidates(model: ModelSpec, g: GPUSpec, node_gpus: int, a: CostAssumptions = DEFAULT_ASSUMPTIONS) -> list[int]:
    """The tensor-parallel sizes a vLLM user would try: powers of two from the smallest that
    holds the weights up to one node (``tp_problem`` tells which the model's heads rule out)."""
    tp, out = generation_tp(model, g, a), []
    while tp <= node_gpus:
        out.append(tp)
        tp *= 2
    return out


def tp_allreduce_s(model: ModelSpec, g: GPUSpec, tp: int, tokens: float, latency: bool = True,
                   a: CostAssumptions = DEFAULT_ASSUMPTIONS) -> float:
    """The TP all-reduces of one forward pass over ``tokens`` tokens (0 at tp 1): 2 per layer,
    each latency (``latency``) + ring bytes over NVLink (CostAssumptions)."""
    if tp == 1:
        return 0.0
    ring_bytes = 2 * (tp - 1) / tp * model.hidden * tokens * model.dtype_bytes
    link = g.nvlink_gb_s / 2 * 1e9 * a.nvlink_efficiency  # one direction
    return 2 * model.num_layers * ((a.allreduce_latency_s if latency else 0.0) + ring_bytes / link)


def analytic_ptl_profile(model: ModelSpec, g: GPUSpec, tp: int | None = None,
                         batch_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
                         a: CostAssumptions = DEFAULT_ASSUMPTIONS, block_size: int = 16) -> PTLProfile:
    """PTL(BS) of one generation instance (``tp`` GPUs) with an empty KV cache:
    max(weight-read time, GEMM time) + overhead + TP all-reduces; each cached token adds its
    KV read time (``kv_s_per_token``, ``ref_context`` 0), so the instance model charges long
    contexts. With more GPUs than KV heads each KV head is stored (and read) on tp / KV heads
    GPUs, as vLLM replicates them. Prefill: GEMM time + all-reduce bytes per prompt token."""
    tp = tp or generation_tp(model, g, a)
    bw = tp * g.hbm_tb_s * 1e12 * a.bw_efficiency
    flops = tp * g.bf16_tflops * 1e12 * a.flops_efficiency
    kv_bytes = tp * g.hbm_gb * 1e9 * a.kv_memory_fraction - model.weight_bytes
    if kv_bytes <= 0:
        raise ValueError(f"{model.name} does not fit {tp} x {g.name} for generation")
    kv_shards = min(tp, model.num_kv_heads)  # GPUs holding distinct KV heads
    kv_tokens = int(kv_bytes // (model.kv_bytes_per_token * tp / kv_shards))
    ptl = [max(model.weight_bytes / bw, 2 * model.params * bs / flops) + a.step_overhead_s
           + tp_allreduce_s(model, g, tp, bs, a=a) for bs in batch_sizes]
    prefill = 2 * model.params / flops + tp_allreduce_s(model, g, tp, 1, latency=False, a=a)
    return PTLProfile(list(batch_sizes), ptl, kv_tokens, block_size, 0, prefill,
                      f"{model.name}@{tp}x{g.name}", meta={"source": "analytic", "tp": tp},
                      kv_s_per_token=model.kv_bytes_per_token / (bw / tp * kv_shards), ref_context=0.0)


def trainer_min_gpus(model: ModelSpec, g: GPUSpec, algorithm: str = "ppo",
                     a: CostAssumptions = DEFAULT_ASSUMPTIONS, reference: bool = True) -> int:
    """GPUs needed to hold the trained models' states (ZeRO-3 style sharding) and the frozen ones
    (``reference``: the reference model, bf16; none without a KL coefficient)."""
    trained = TRAINED_MODELS[algorithm]
    frozen = 1 if reference else 0
    need = model.params * (trained * a.train_state_bytes_per_param + frozen * model.dtype_bytes)
    return max(1, math.ceil(need / (g.hbm_gb * 1e9 * a.train_memory_fraction)))


def analytic_train_profile(model: ModelSpec, g: GPUSpec, gpus: int, algorithm: str = "ppo",
                           a: CostAssumptions = DEFAULT_ASSUMPTIONS, reference: bool = True) -> TrainProfile:
    """Roofline trainer: seconds per token = passes * 2 * params / (gpus * peak * MFU); without a
    ``reference`` (no KL coefficient) one forward a token fewer."""
    if algorithm not in PASSES:
        raise ValueError(f"algorithm {algorithm!r} is not one of {sorted(PASSES)}")
    passes = PASSES[algorithm] - (0 if reference else 1)
    s = passes * 2 * model.params / (gpus * g.bf16_tflops * 1e12 * a.train_mfu)
    return TrainProfile(s, 0.0, gpus, "analytic")
