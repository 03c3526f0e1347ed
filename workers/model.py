"""Decoder-only transformer of the Qwen2 / Llama family, HF-format load and save (its config,
and config.json, in ``workers.model_config``).

The forward is written once over *packed* tokens (``[T]`` ids of several sequences laid
end to end, ``[T]`` positions). How attention sees the other tokens is decided by the
``AttentionBackend`` it is handed: ``CausalAttention`` (training, reference, recompute:
each sequence attends causally to itself) or the engine's paged-KV backend (decoding).
Module and parameter names equal Hugging Face's, so ``state_dict()`` keys are HF keys.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Iterable, Protocol

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from workers.atomic import atomic_dir
from workers.model_check import check_weights
from workers.model_config import ROPE_KEYS, ModelConfig, rope_kind


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
assert _ROPE_SCALINGS.keys() == ROPE_KEYS.keys()


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.dim_head
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        self.register_buffer("inv_freq", _ROPE_SCALINGS[rope_kind(cfg.rope_scaling)](cfg, inv_freq), persistent=False)

    def _apply(self, fn, recurse=True):
        """A dtype cast (``model.to(torch.bfloat16)``) leaves the frequencies fp32, as
        ``load_pretrained`` builds them: rounded, an in-memory bf16 model's logits differed from
        the same weights loaded from disk by up to 0.05 at 300 tokens (review, s53)."""
        kept = self.inv_freq
        out = super()._apply(fn, recurse)
        if not kept.is_meta and not self.inv_freq.is_meta and self.inv_freq.dtype != kept.dtype:
            self.inv_freq = kept.to(self.inv_freq.device)
        return out

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


def resolve_device(spec: str | torch.device | None) -> torch.device:
    """A configured device: None or "" is this rank's (``rank_device``), and so is "cuda" with no
    index: torch reads that as the calling thread's current GPU, and the threads torch RPC runs
    a worker's calls on start on GPU 0 (``pick_device`` sets only the main thread's). Anything
    else as given."""
    if not spec:
        return rank_device()
    device = torch.device(spec)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return rank_device()
    return device


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` the calling thread's current GPU for a block (nothing off CUDA): Triton
    launches and CUDA-graph captures follow the thread's current GPU, not their tensors'."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def rank_device(local_rank: int | None = None) -> torch.device:
    """This process's device: GPU ``local_rank`` (default ``LOCAL_RANK``, as the launcher gave it)
    modulo the GPUs there, or the CPU. Not the calling thread's current device: a thread the
    process starts (a reward pool's, torch RPC's) begins on GPU 0. Outside a launcher (no
    ``LOCAL_RANK``: a script, a notebook) the calling thread's current device, as
    ``torch.cuda.set_device`` left it (on another thread: give the device, ``cuda:N``)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank is None:
        if "LOCAL_RANK" not in os.environ:
            return torch.device("cuda", torch.cuda.current_device())
        local_rank = int(os.environ["LOCAL_RANK"])
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_state(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a HF folder: ``model.safetensors`` or sharded with an index."""
    from safetensors.torch import load_file

    from workers.model_check import safetensors_files

    folder = Path(folder)
    state: dict[str, torch.Tensor] = {}
    for f in safetensors_files(folder):
        try:
            state.update(load_file(str(folder / f)))
        except FileNotFoundError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors' errors name no file: a truncated copy, a bad header
            raise ValueError(f"{folder / f}: unreadable safetensors file ({type(e).__name__}: {e})") from None
    return state


def stop_ids(folder: str | os.PathLike, tokenizer_eos: int | None) -> list[int]:
    """The ids that end an answer: the tokenizer's EOS and the ``eos_token_id`` of the folder's
    config.json and generation_config.json (an instruct model often lists two, e.g. Qwen's
    <|im_end|> and <|endoftext|>), as HF ``generate`` and vLLM stop on. The engines stop on them,
    and ``min_tokens`` masks them in the sampler and the trainer alike."""
    from workers.tokenizer_folders import _read_json

    ids = [] if tokenizer_eos is None else [int(tokenizer_eos)]
    vocab = _read_json(Path(folder) / "config.json").get("vocab_size")
    vocab = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None  # (its own check names it)
    if vocab is not None and ids and ids[0] >= vocab:  # a token tokenizer.json lacks gets a new id past it
        raise ValueError(f"{Path(folder) / 'tokenizer_config.json'}: the eos_token has id {ids[0]}, outside the "
                         f"model's vocabulary [0, {vocab}) (config.json's vocab_size): tokenizer.json does not "
                         "hold that token")
    for name in ("config.json", "generation_config.json"):
        path = Path(folder) / name
        e = _read_json(path).get("eos_token_id")  # (a bad file named, not a bare JSONDecodeError)
        for i in ([] if e is None else e if isinstance(e, list) else [e]):
            if isinstance(i, bool) or not isinstance(i, int) or i < 0 or (vocab is not None and i >= vocab):
                raise ValueError(f"{path}: eos_token_id must be a token id of the model's vocabulary "
                                 f"[0, {vocab}) or a list of them, got {e!r}" if vocab is not None else
                                 f"{path}: eos_token_id must be a token id or a list of them, got {e!r}")
            if i not in ids:
                ids.append(i)
    return ids


def load_pretrained(folder: str | os.PathLike, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> CausalLM:
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{cfg_path} not found: a model folder needs config.json")
    cfg = ModelConfig.from_hf(json.loads(cfg_path.read_text()), cfg_path)
    check_weights(folder, cfg)  # names, shapes and the shard holding a wrong one (headers only)
    device = resolve_device(device)
    dtype = dtype or default_dtype(device)
    with torch.device("meta"):  # materialised in its dtype: no transient fp32 copy of a bf16 model
        model = CausalLM(cfg).to(dtype)
    model = model.to_empty(device=device)
    state = {k: v for k, v in load_state(folder).items() if "rotary_emb" not in k}
    if cfg.tie_word_embeddings:
        head, embed = state.pop("lm_head.weight", None), state.get("model.embed_tokens.weight")
        if head is not None and embed is not None and not torch.equal(head, embed):
            raise ValueError(f"{folder}: config.json ties the embeddings (tie_word_embeddings true) but the weights "
                             "hold an lm_head.weight other than model.embed_tokens.weight (transformers loads it "
                             "untied): set tie_word_embeddings to false in config.json if that lm_head is meant")
    model.load_state_dict(state, strict=False)  # (check_weights said what is missing or unexpected)
    del state
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # after the dtype: RoPE's frequencies stay fp32 in a bf16 model, as transformers keeps them
    # (bf16 ones put cos/sin off by up to ~1 at positions in the thousands at rope_theta 1e6)
    model.model.rotary_emb = RotaryEmbedding(cfg).to(device)
    return model


def save_pretrained(model: CausalLM, folder: str | os.PathLike, max_shard_bytes: int = 0,
                    extra_files: Iterable[str | os.PathLike] = (),
                    state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``config.json`` + safetensors (sharded with an index when ``max_shard_bytes``) and
    copies of ``extra_files`` (files, or folders copied whole) under their names, atomically: into
    a temp dir beside ``folder``, then renamed over it. ``state``: the HF-named tensors to write
    (default ``model.hf_state_dict()``; a trainer's LoRA-merged weights)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    state = {k: v.detach().contiguous().cpu()
             for k, v in (state if state is not None else model.hf_state_dict()).items()}
    with atomic_dir(folder) as tmp:  # a failed save (a full disk, a clashing extra file) leaves no temp dir
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
        for f in extra_files:
            f = Path(f)
            if f.name in ("config.json", *(p.name for p in tmp.iterdir())):
                raise ValueError(f"save_pretrained: extra file {f} would replace the {f.name} written here")
            if f.is_dir():
                shutil.copytree(f, tmp / f.name)
            else:
                shutil.copyfile(f, tmp / f.name)
    return folder

