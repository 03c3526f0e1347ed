"""Decoder-only transformer of the Qwen2 / Llama family, HF-format load and save.

The forward is written once over *packed* tokens (``[T]`` ids of several sequences laid
end to end, ``[T]`` positions). How attention sees the other tokens is decided by the
``AttentionBackend`` it is handed: ``CausalAttention`` (training, reference, recompute:
each sequence attends causally to itself) or the engine's paged-KV backend (decoding).
Module and parameter names equal Hugging Face's, so ``state_dict()`` keys are HF keys.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Protocol

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from workers.atomic import replace_dir

ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM")
# activations transformers' ACT2FN maps to SiLU, the only one the MLP implements
SILU_NAMES = ("silu", "swish")


def _biases(arch: str, qkv: bool | None, o: bool | None) -> tuple[bool, bool]:
    """(qkv_bias, o_bias) with None filled in: Qwen2 (True, False); Llama one flag for both (False)."""
    if arch == "Qwen2ForCausalLM":
        return (True if qkv is None else bool(qkv)), (False if o is None else bool(o))
    if qkv is None and o is None:
        return False, False
    return bool(o if qkv is None else qkv), bool(qkv if o is None else o)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    # Biases, as the architecture's HF config can express them (checked in __post_init__):
    # Qwen2 on q/k/v always, on o_proj and the MLP never; Llama's attention_bias on q, k, v and
    # o_proj together (default: none), its mlp_bias on the MLP's three projections (default: none).
    # None is the architecture's default, and a value equal to it is stored as None, so that a
    # config copied with another architecture (``{**asdict(cfg), "architecture": ...}``,
    # ``dataclasses.replace``) takes that one's defaults. Read them as ``has_qkv_bias`` /
    # ``has_o_bias``. For Llama a lone qkv_bias or o_bias sets both.
    qkv_bias: bool | None = None
    o_bias: bool | None = None
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    architecture: str = "Qwen2ForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"model.architecture: {self.architecture!r} is not one of {ARCHITECTURES}")
        qkv, o = _biases(self.architecture, self.qkv_bias, self.o_bias)
        default = _biases(self.architecture, None, None)
        object.__setattr__(self, "qkv_bias", None if qkv == default[0] else qkv)
        object.__setattr__(self, "o_bias", None if o == default[1] else o)
        object.__setattr__(self, "mlp_bias", bool(self.mlp_bias))
        if self.architecture == "Qwen2ForCausalLM":
            wrong = [f"{k}={v}" for k, v, want in (("qkv_bias", qkv, True), ("o_bias", o, False),
                                                   ("mlp_bias", self.mlp_bias, False)) if v != want]
            if wrong:
                raise ValueError(
                    f"model: Qwen2ForCausalLM has biases on q/k/v and none on o_proj or the MLP (transformers' "
                    f"Qwen2 config cannot say otherwise), got {', '.join(wrong)}; use LlamaForCausalLM "
                    "(attention_bias, mlp_bias) for other biases")
        elif qkv != o:
            raise ValueError(
                f"model: LlamaForCausalLM's attention_bias puts biases on q, k, v and o_proj together, got "
                f"qkv_bias={qkv} with o_bias={o}; give both the same value (or only one)")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if not self.head_dim and self.hidden_size % self.num_attention_heads:
            raise ValueError("model.hidden_size must be a multiple of num_attention_heads "
                             "when head_dim is not given")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in _ROPE_SCALINGS:
                raise ValueError(f"model.rope_scaling type {kind!r} is not one of {sorted(_ROPE_SCALINGS)}")
            missing = [k for k in _ROPE_KEYS[kind] if k not in self.rope_scaling]
            if missing:
                raise ValueError(f"model.rope_scaling type {kind!r} needs {', '.join(missing)}")
            if float(self.rope_scaling.get("partial_rotary_factor", 1.0)) != 1.0:
                raise ValueError(f"model.rope_scaling partial_rotary_factor "
                                 f"{self.rope_scaling['partial_rotary_factor']} is not supported (only 1.0: "
                                 "RoPE on the whole head)")

    @property
    def has_qkv_bias(self) -> bool:
        """Whether q_proj, k_proj and v_proj have biases (``qkv_bias`` resolved)."""
        return _biases(self.architecture, self.qkv_bias, self.o_bias)[0]

    @property
    def has_o_bias(self) -> bool:
        """Whether o_proj has a bias (``o_bias`` resolved)."""
        return _biases(self.architecture, self.qkv_bias, self.o_bias)[1]

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def eos_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        return () if e is None else (tuple(e) if isinstance(e, (list, tuple)) else (e,))

    # ---- HF config.json ------------------------------------------------------------------
    @classmethod
    def from_hf(cls, d: dict, source: str | os.PathLike = "config.json") -> "ModelConfig":
        """The config of a HF ``config.json`` (``d``; ``source`` names it in errors). What changes
        the forward pass and is not implemented here is refused naming the key (an activation
        other than SiLU, a sliding window shorter than the context, an unsupported RoPE scaling,
        a quantized checkpoint), rather than run as something else. Keys that do not change it
        are ignored: attention_dropout (training-time dropout; this model has none),
        pretraining_tp (transformers 5 ignores it; older versions split the same matmuls)."""
        arch = (d.get("architectures") or ["Qwen2ForCausalLM"])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"{source}: architecture {arch!r} is not supported ({ARCHITECTURES})")
        qwen = arch == "Qwen2ForCausalLM"

        def refuse(key: str, why: str):
            raise ValueError(f"{source}: {key} {d.get(key)!r}: {why}; this model implements "
                             f"{arch} without it, and would compute other logits than transformers")

        act = d.get("hidden_act", "silu")
        if act not in SILU_NAMES:
            refuse("hidden_act", f"only {' / '.join(SILU_NAMES)} is implemented")
        if d.get("quantization_config"):
            refuse("quantization_config", "quantized weights are not supported")
        max_pos = d.get("max_position_embeddings", 4096)
        # Qwen2 as transformers reads it: a window only with use_sliding_window, on the layers
        # layer_types names (else those from max_window_layers on); a window at least as long as
        # the context (sequences are held to max_position_embeddings) changes nothing
        window = d.get("sliding_window", 4096) if qwen and d.get("use_sliding_window", False) else None
        if window is not None and window < max_pos:
            n = d["num_hidden_layers"]
            types = d.get("layer_types") or ["sliding_attention" if i >= d.get("max_window_layers", 28)
                                             else "full_attention" for i in range(n)]
            sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
            if sliding:
                refuse("use_sliding_window", f"sliding-window attention (sliding_window {window} < "
                       f"max_position_embeddings {max_pos}, on layers {sliding}) is not implemented")
        # transformers >= 5 writes RoPE as "rope_parameters" {rope_theta, rope_type, ...} and
        # no top-level rope_theta / rope_scaling (older folders, e.g. Qwen2.5's, have those)
        rope = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling")
        key = "rope_scaling"
        if scaling is None and rope.get("rope_type", rope.get("type", "default")) != "default":
            scaling, key = {k: v for k, v in rope.items() if k != "rope_theta"}, "rope_parameters"
        if scaling is not None:  # what transformers' standardize_rope_params adds to a scaling
            scaling = dict(scaling)
            if "partial_rotary_factor" in d:  # (the default RoPE of Qwen2 / Llama ignores it)
                scaling.setdefault("partial_rotary_factor", d["partial_rotary_factor"])
            if scaling.get("rope_type", scaling.get("type")) == "llama3":
                if "original_max_position_embeddings" in d:
                    scaling["original_max_position_embeddings"] = d["original_max_position_embeddings"]
                scaling.setdefault("original_max_position_embeddings", max_pos)
        attn_bias = bool(d.get("attention_bias", False))
        try:
            return cls(
                vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=d["num_attention_heads"],
                num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
                head_dim=d.get("head_dim") or 0,
                max_position_embeddings=max_pos,
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=d.get("rope_theta", rope.get("rope_theta", 10000.0)),
                rope_scaling=scaling,
                # transformers' Qwen2 has q/k/v biases and no others whatever the file says
                qkv_bias=True if qwen else attn_bias, o_bias=False if qwen else attn_bias,
                mlp_bias=False if qwen else bool(d.get("mlp_bias", False)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), architecture=arch,
                bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"))
        except ValueError as e:  # e.g. "model.rope_scaling type 'yarn' ...": say which file and key
            msg = str(e)
            if msg.startswith("model.rope_scaling"):
                msg = key + msg.removeprefix("model.rope_scaling")
            raise ValueError(f"{source}: {msg}") from None

    def to_hf(self, torch_dtype: str = "float32") -> dict:
        qwen = self.architecture == "Qwen2ForCausalLM"
        d = {
            "architectures": [self.architecture],
            "model_type": "qwen2" if qwen else "llama",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.dim_head,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling, "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings, "torch_dtype": torch_dtype,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
        }
        if not qwen:  # Qwen2's biases are fixed (__post_init__ holds them to it)
            d["attention_bias"] = self.has_qkv_bias  # == has_o_bias
            d["mlp_bias"] = self.mlp_bias
        return d


# ---- RoPE ----------------------------------------------------------------------------------
def _rope_default(cfg: ModelConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    return inv_freq


def _rope_linear(cfg: ModelConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    return inv_freq / float(cfg.rope_scaling["factor"])


def _rope_llama3(cfg: ModelConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    s = cfg.rope_scaling
    factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
    return torch.where(is_mid, mid, scaled)


_ROPE_SCALINGS = {"default": _rope_default, "linear": _rope_linear, "llama3": _rope_llama3}
_ROPE_KEYS = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.dim_head
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        kind = "default" if cfg.rope_scaling is None else cfg.rope_scaling.get(
            "rope_type", cfg.rope_scaling.get("type", "default"))
        self.register_buffer("inv_freq", _ROPE_SCALINGS[kind](cfg, inv_freq), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, 1, Dh]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, Dh]; rotate-half convention (HF)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# ---- attention backends --------------------------------------------------------------------
class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, Dh], k/v: [T, Hkv, Dh] (already rotated) -> out [T, H, Dh]."""


class CausalAttention:
    """Full causal attention within each packed sequence (``cu_seqlens``: int [B+1])."""

    def __init__(self, cu_seqlens: torch.Tensor | list[int]):
        self.cu = [int(c) for c in cu_seqlens]
        self._mask: torch.Tensor | None = None

    def mask(self, device: torch.device) -> torch.Tensor | None:
        if len(self.cu) <= 2:
            return None
        if self._mask is None:
            t = self.cu[-1]
            seq = torch.repeat_interleave(torch.arange(len(self.cu) - 1),
                                          torch.tensor(self.cu).diff())
            pos = torch.arange(t)
            self._mask = ((seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :])).to(device)
        return self._mask

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        mask = self.mask(q.device)
        q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, H, T, Dh]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out[0].transpose(0, 1)


# ---- layers --------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.h, self.hkv, self.dh = layer, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.dim_head
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.dh, bias=cfg.has_qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.hkv * self.dh, bias=cfg.has_qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.hkv * self.dh, bias=cfg.has_qkv_bias)
        self.o_proj = nn.Linear(self.h * self.dh, cfg.hidden_size, bias=cfg.has_o_bias)

    def forward(self, x, cos, sin, attn: AttentionBackend):
        t = x.shape[0]  # x: [T, D]
        q = apply_rotary(self.q_proj(x).view(t, self.h, self.dh), cos, sin)
        k = apply_rotary(self.k_proj(x).view(t, self.hkv, self.dh), cos, sin)
        v = self.v_proj(x).view(t, self.hkv, self.dh)
        return self.o_proj(attn(self.layer, q, k, v).reshape(t, self.h * self.dh))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attn):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)
        # grad-enabled forwards only (trainer.activation_checkpointing): keep each layer's input
        # and run the layer again in backward. Kept: one [T, D] input per layer, plus one layer's
        # inside at a time in backward; cost: one more forward of every layer (docs/trainer.md)
        self.checkpoint_layers = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, D]
        cos, sin = self.rotary_emb(positions, x.dtype)
        recompute = self.checkpoint_layers and torch.is_grad_enabled()
        for layer in self.layers:
            if recompute:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, attn, use_reentrant=False)
            else:
                x = layer(x, cos, sin, attn)
        return self.norm(x)


class CausalLM(nn.Module):
    """``forward(ids [T], positions [T], attn) -> hidden [T, D]``; ``logits(hidden) -> [T, V]``.
    Keeping the head separate lets the engine project only the last token of each sequence."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, attn: AttentionBackend) -> torch.Tensor:
        return self.model(input_ids, positions, attn)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward_packed(self, seqs: list[torch.Tensor]) -> torch.Tensor:
        """Convenience for training/reference: logits [sum(len), V] of packed sequences."""
        ids = torch.cat(seqs)
        pos = torch.cat([torch.arange(len(s), device=s.device) for s in seqs])
        cu = [0]
        for s in seqs:
            cu.append(cu[-1] + len(s))
        return self.logits(self(ids, pos, CausalAttention(cu)))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named tensors as a checkpoint holds them (tied lm_head omitted)."""
        sd = {k: v for k, v in self.state_dict().items() if "rotary_emb" not in k}
        if self.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        return sd


# ---- HF folders ----------------------------------------------------------------------------
def init_weights(model: CausalLM, seed: int = 0, std: float = 0.02) -> CausalLM:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_state(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a HF folder: ``model.safetensors`` or sharded with an index."""
    from safetensors.torch import load_file

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files (and no model.safetensors.index.json)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(folder / f)))
    return state


def stop_ids(folder: str | os.PathLike, tokenizer_eos: int | None) -> list[int]:
    """The ids that end an answer: the tokenizer's EOS and the ``eos_token_id`` of the folder's
    config.json and generation_config.json (an instruct model often lists two, e.g. Qwen's
    <|im_end|> and <|endoftext|>), as HF ``generate`` and vLLM stop on. The engines stop on them,
    and ``min_tokens`` masks them in the sampler and the trainer alike."""
    ids = [] if tokenizer_eos is None else [int(tokenizer_eos)]
    for name in ("config.json", "generation_config.json"):
        path = Path(folder) / name
        if not path.exists():
            continue
        e = json.loads(path.read_text()).get("eos_token_id")
        for i in ([] if e is None else e if isinstance(e, list) else [e]):
            if int(i) not in ids:
                ids.append(int(i))
    return ids


def load_pretrained(folder: str | os.PathLike, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> CausalLM:
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{cfg_path} not found: a model folder needs config.json")
    cfg = ModelConfig.from_hf(json.loads(cfg_path.read_text()), cfg_path)
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device=device)
    state = {k: v for k, v in load_state(folder).items() if "rotary_emb" not in k}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{folder}: checkpoint does not match config.json: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = RotaryEmbedding(cfg).to(device)
    return model.to(dtype)


def save_pretrained(model: CausalLM, folder: str | os.PathLike, max_shard_bytes: int = 0,
                    extra_files: Iterable[str | os.PathLike] = ()) -> Path:
    """Write ``config.json`` + safetensors (sharded with an index when ``max_shard_bytes``) and
    copies of ``extra_files`` (files, or folders copied whole) under their names, atomically: into
    a temp dir beside ``folder``, then renamed over it."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp", dir=folder.parent))
    state = {k: v.detach().contiguous().cpu() for k, v in model.hf_state_dict().items()}
    dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(model.config.to_hf(dtype), indent=2))
    if max_shard_bytes <= 0:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    else:
        shards, cur, size = [], {}, 0
        for k, v in state.items():
            nb = v.numel() * v.element_size()
            if cur and size + nb > max_shard_bytes:
                shards.append(cur)
                cur, size = {}, 0
            cur[k], size = v, size + nb
        shards.append(cur)
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
        total = sum(v.numel() * v.element_size() for v in state.values())
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    try:
        for f in extra_files:
            f = Path(f)
            if f.name in ("config.json", *(p.name for p in tmp.iterdir())):
                raise ValueError(f"save_pretrained: extra file {f} would replace the {f.name} written here")
            if f.is_dir():
                shutil.copytree(f, tmp / f.name)
            else:
                shutil.copyfile(f, tmp / f.name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, folder)
    return folder

