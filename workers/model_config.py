"""ModelConfig: the shape and options of a Qwen2 / Llama decoder, and its HF ``config.json``.

``from_hf`` reads a config.json as transformers does and refuses what would change the forward
without being implemented (naming the file and key); ``to_hf`` writes one transformers reads
back. Checked at construction: sizes, head counts, the biases each architecture can express,
the RoPE scaling kinds ``workers.model`` implements.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from workers.finite import finite_number

ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM")
# config.json without "architectures": transformers goes by model_type; and the
# max_position_embeddings each class defaults to when the key is absent (Qwen2Config, LlamaConfig)
BY_MODEL_TYPE = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
DEFAULT_MAX_POSITIONS = {"Qwen2ForCausalLM": 32768, "LlamaForCausalLM": 2048}
# RoPE scalings workers.model implements, with the keys each needs in rope_scaling
ROPE_KEYS = {"default": (), "linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def rope_kind(scaling: dict | None) -> str:
    """A RoPE scaling's kind: transformers' ``rope_type``, or the older ``type``; none: default."""
    s = scaling or {}
    return s.get("rope_type", s.get("type", "default"))


# the keys config.json must give (the others have transformers' defaults)
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# config.json's values by type (null: the key's default, where transformers has one)
INTS = {"vocab_size": False, "hidden_size": False, "intermediate_size": False, "num_hidden_layers": False,
        "num_attention_heads": False, "max_position_embeddings": False, "num_key_value_heads": True,
        "head_dim": True, "sliding_window": True, "max_window_layers": True}
FLOATS = {"rms_norm_eps": False, "rope_theta": False}
BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")
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
            kind = rope_kind(self.rope_scaling)
            if kind not in ROPE_KEYS:
                raise ValueError(f"model.rope_scaling type {kind!r} is not one of {sorted(ROPE_KEYS)}")
            missing = [k for k in ROPE_KEYS[kind] if k not in self.rope_scaling]
            if missing:
                raise ValueError(f"model.rope_scaling type {kind!r} needs {', '.join(missing)}")
            for k in ROPE_KEYS[kind]:  # a factor 0 made the frequencies inf: NaN cos / sin, attention zeroed
                v = finite_number(self.rope_scaling[k])
                if v is None or v <= 0:
                    raise ValueError(f"model.rope_scaling {k} must be a number > 0, got {self.rope_scaling[k]!r}")
            if kind == "llama3" and self.rope_scaling["high_freq_factor"] <= self.rope_scaling["low_freq_factor"]:
                raise ValueError(f"model.rope_scaling high_freq_factor {self.rope_scaling['high_freq_factor']} must be "
                                 f"above low_freq_factor {self.rope_scaling['low_freq_factor']}")
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
        _check_types(d, source)
        arch = (d.get("architectures") or [BY_MODEL_TYPE.get(d.get("model_type"), "Qwen2ForCausalLM")])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"{source}: architecture {arch!r} is not supported ({ARCHITECTURES})")
        qwen = arch == "Qwen2ForCausalLM"
        missing = [k for k in REQUIRED if k not in d]
        if missing:
            raise ValueError(f"{source}: missing {', '.join(map(repr, missing))}: a {arch} config.json gives them")

        def refuse(key: str, why: str):
            raise ValueError(f"{source}: {key} {d.get(key)!r}: {why}; this model implements "
                             f"{arch} without it, and would compute other logits than transformers")

        act = d.get("hidden_act", "silu")
        if act not in SILU_NAMES:
            refuse("hidden_act", f"only {' / '.join(SILU_NAMES)} is implemented")
        if d.get("quantization_config"):
            refuse("quantization_config", "quantized weights are not supported")
        max_pos = d.get("max_position_embeddings", DEFAULT_MAX_POSITIONS[arch])
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
        # no top-level rope_theta / rope_scaling (older folders, e.g. Qwen2.5's, have those). As its
        # convert_rope_params_to_dict reads them: a (non-empty) rope_scaling replaces
        # rope_parameters altogether, and the rope_theta in the one used wins over a top-level one
        for name in ("rope_scaling", "rope_parameters"):
            if d.get(name) and not isinstance(d[name], dict):
                raise ValueError(f"{source}: {name} must be an object ({{\"rope_type\": ..., \"factor\": ...}}), "
                                 f"got {d[name]!r:.60}")
        scaling = d.get("rope_scaling") or None
        rope = scaling if scaling is not None else (d.get("rope_parameters") or {})
        key = "rope_scaling"
        if scaling is None and rope_kind(rope) != "default":
            scaling, key = {k: v for k, v in rope.items() if k != "rope_theta"}, "rope_parameters"
        if scaling is not None:  # what transformers' standardize_rope_params adds to a scaling
            scaling = dict(scaling)
            if "partial_rotary_factor" in d:  # (the default RoPE of Qwen2 / Llama ignores it)
                scaling.setdefault("partial_rotary_factor", d["partial_rotary_factor"])
            if rope_kind(scaling) == "llama3":
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
                rope_theta=rope.get("rope_theta", d.get("rope_theta", 10000.0)),
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


def _check_types(d: dict, source) -> None:
    """config.json's values of the wrong type, named with the key: a string or float where a
    count goes (``"vocab_size": "266"``, ``266.0``), a null where no default is, a string where
    a flag goes (``"tie_word_embeddings": "false"`` read as true) (review, s55)."""
    def wrong(key: str, want: str):
        raise ValueError(f"{source}: {key} must be {want}, got {d[key]!r:.60}")

    for key, nullable in INTS.items():
        v = d.get(key)
        if key in d and not (v is None and nullable) and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            wrong(key, "a whole number >= 0" + (" or null" if nullable else ""))
    for key, nullable in FLOATS.items():
        v = d.get(key)
        if key in d and not (v is None and nullable) and not (finite_number(v) or 0) > 0:
            wrong(key, "a positive number")
    for key in BOOLS:
        if key in d and not isinstance(d[key], bool):
            wrong(key, "true or false")
    arch = d.get("architectures")
    if arch is not None and not (isinstance(arch, list) and all(isinstance(a, str) for a in arch)):
        wrong("architectures", 'a list of names (["Qwen2ForCausalLM"])')
