"""Analytic profiles for GPUs and models we cannot run here (roofline estimates).

GPU numbers are the vendors' published dense BF16 tensor FLOP/s, HBM bandwidth and size.
Generation: one decode step reads the weights once and every running sequence's KV cache,
and does 2 * params FLOPs per sequence; its time is the larger of the two over the
instance's GPUs at an efficiency, plus a fixed per-step overhead. Training: FLOPs per
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
    """bf16_tflops: dense BF16 tensor TFLOP/s; hbm_tb_s: HBM TB/s; hbm_gb: HBM GB."""

    name: str
    bf16_tflops: float
    hbm_tb_s: float
    hbm_gb: float


# Published datasheet numbers (SXM parts; dense, i.e. without 2:4 sparsity).
GPUS: dict[str, GPUSpec] = {
    "H800": GPUSpec("H800", 989.0, 3.35, 80.0),
    "H100": GPUSpec("H100", 989.0, 3.35, 80.0),
    "H200": GPUSpec("H200", 989.0, 4.8, 141.0),
    "H20": GPUSpec("H20", 148.0, 4.0, 96.0),
    "A100": GPUSpec("A100", 312.0, 2.039, 80.0),
}


def gpu(name: str) -> GPUSpec:
    if name not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; known: {sorted(GPUS)}")
    return GPUS[name]


@dataclass(frozen=True)
class ModelSpec:
    """Decoder shape for the cost model; params in units of 1 (not billions)."""

    name: str
    params: float
    num_layers: int
    hidden: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

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

    @classmethod
    def from_dict(cls, d: dict, where: str = "model") -> "ModelSpec":
        """Accepts this class's fields, or a Hugging Face config.json (params estimated).
        Every problem is a ValueError naming ``where`` and the key."""
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a mapping of ModelSpec fields or an HF config, got {type(d).__name__}")
        try:
            if "num_hidden_layers" in d:  # HF config
                hf = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
                missing = [k for k in hf if k not in d]
                if missing:
                    raise ValueError(f"HF config without {missing}")
                h, L, heads, inter, vocab = (check_number(k, d[k], integer=True) for k in hf)
                kvh = check_number("num_key_value_heads", d.get("num_key_value_heads", heads), integer=True)
                hd = check_number("head_dim", d.get("head_dim") or h // heads, integer=True)
                emb = vocab * h * (1 if d.get("tie_word_embeddings") else 2)
                params = L * (h * hd * heads * 2 + 2 * h * hd * kvh + 3 * h * inter) + emb
                return cls(str(d.get("name", d.get("_name_or_path", "hf-model"))), float(params), L, h, kvh, hd)
            known = set(cls.__dataclass_fields__)
            unknown = set(d) - known
            if unknown:
                raise ValueError(f"unknown keys {sorted(map(str, unknown))}; expected {sorted(known)} or an HF config")
            missing = known - set(d) - {"dtype_bytes"}
            if missing:
                raise ValueError(f"missing keys {sorted(missing)}")
            return cls(**{**d, "name": str(d["name"])})
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


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
    step_overhead_s: float = 0.004  # per decode step: launches, sampling, TP all-reduces
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


def generation_tp(model: ModelSpec, g: GPUSpec, a: CostAssumptions = DEFAULT_ASSUMPTIONS) -> int:
    """Smallest power-of-two tensor-parallel size whose weights take <= half the usable HBM."""
    tp = 1
    while model.weight_bytes / tp > 0.5 * a.kv_memory_fraction * g.hbm_gb * 1e9:
        tp *= 2
    return tp


def analytic_ptl_profile(model: ModelSpec, g: GPUSpec, tp: int | None = None,
                         batch_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
                         a: CostAssumptions = DEFAULT_ASSUMPTIONS, block_size: int = 16) -> PTLProfile:
    """PTL(BS) of one generation instance (``tp`` GPUs) with an empty KV cache:
    max(weight-read time, GEMM time) + overhead; each cached token adds its KV read time
    (``kv_s_per_token``, ``ref_context`` 0), so the instance model charges long contexts."""
    tp = tp or generation_tp(model, g, a)
    bw = tp * g.hbm_tb_s * 1e12 * a.bw_efficiency
    flops = tp * g.bf16_tflops * 1e12 * a.flops_efficiency
    kv_bytes = tp * g.hbm_gb * 1e9 * a.kv_memory_fraction - model.weight_bytes
    if kv_bytes <= 0:
        raise ValueError(f"{model.name} does not fit {tp} x {g.name} for generation")
    kv_tokens = int(kv_bytes // model.kv_bytes_per_token)
    ptl = [max(model.weight_bytes / bw, 2 * model.params * bs / flops) + a.step_overhead_s for bs in batch_sizes]
    return PTLProfile(list(batch_sizes), ptl, kv_tokens, block_size, 0, 2 * model.params / flops,
                      f"{model.name}@{tp}x{g.name}", meta={"source": "analytic", "tp": tp},
                      kv_s_per_token=model.kv_bytes_per_token / bw, ref_context=0.0)


def trainer_min_gpus(model: ModelSpec, g: GPUSpec, algorithm: str = "ppo",
                     a: CostAssumptions = DEFAULT_ASSUMPTIONS) -> int:
    """GPUs needed to hold the trained models' states (ZeRO-3 style sharding) and the frozen ones."""
    trained = TRAINED_MODELS[algorithm]
    frozen = 1  # reference model, bf16
    need = model.params * (trained * a.train_state_bytes_per_param + frozen * model.dtype_bytes)
    return max(1, math.ceil(need / (g.hbm_gb * 1e9 * a.train_memory_fraction)))


def analytic_train_profile(model: ModelSpec, g: GPUSpec, gpus: int, algorithm: str = "ppo",
                           a: CostAssumptions = DEFAULT_ASSUMPTIONS) -> TrainProfile:
    """Roofline trainer: seconds per token = passes * 2 * params / (gpus * peak * MFU)."""
    if algorithm not in PASSES:
        raise ValueError(f"algorithm {algorithm!r} is not one of {sorted(PASSES)}")
    s = PASSES[algorithm] * 2 * model.params / (gpus * g.bf16_tflops * 1e12 * a.train_mfu)
    return TrainProfile(s, 0.0, gpus, "analytic")
