"""Model-folder behaviour one-line mutations changed unnoticed (mutation review, session 57).
The HF-equivalence tests load one saved folder into both models, so what our writer loses, or a
config.json transformers never writes, passed them: a saved model keeps its RoPE scaling,
missing keys take transformers' defaults, the special RoPE keys, shard sizes, the dtype named."""
import json

import pytest
import torch

from workers.model import CausalLM, ModelConfig, init_weights, load_pretrained, save_pretrained

transformers = pytest.importorskip("transformers", reason="transformers is the test-only reference")

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
SCALINGS = [{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 64},
            {"rope_type": "linear", "factor": 2.0}]


@pytest.mark.parametrize("scaling", SCALINGS, ids=["llama3", "linear"])
def test_a_saved_model_keeps_its_rope_scaling(tmp_path, scaling):
    """The HF-equivalence test loads the saved folder into both models, so a config.json that
    lost rope_scaling passes it: compare the reloaded model with the one that was saved."""
    model = init_weights(CausalLM(ModelConfig(architecture="LlamaForCausalLM", **BASE, rope_scaling=scaling)),
                         seed=1, std=0.1).eval()
    save_pretrained(model, tmp_path / "m")
    back = load_pretrained(tmp_path / "m", device="cpu", dtype=torch.float32).eval()
    assert back.config.rope_scaling == scaling
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back.forward_packed([ids]), model.forward_packed([ids]), rtol=0, atol=0)


@pytest.mark.parametrize("arch, cls", [("LlamaForCausalLM", "LlamaConfig"), ("Qwen2ForCausalLM", "Qwen2Config")])
def test_keys_a_config_json_leaves_out_take_transformers_defaults(arch, cls):
    """A minimal config.json (only the required keys): each default is transformers' own."""
    d = dict(architectures=[arch], vocab_size=97, hidden_size=64, intermediate_size=96,
             num_hidden_layers=2, num_attention_heads=4)
    ours = ModelConfig.from_hf(dict(d))
    hf = getattr(transformers, cls).from_dict(dict(d))
    assert ours.rms_norm_eps == hf.rms_norm_eps
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert ours.rope_scaling is None and hf.rope_parameters["rope_type"] == "default"
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.mlp_bias == bool(getattr(hf, "mlp_bias", False))


def test_a_top_level_original_max_position_embeddings_wins_as_in_transformers(tmp_path):
    """transformers gives a config.json's top-level original_max_position_embeddings priority over
    rope_scaling's (standardize_rope_params, Phi3-style configs): same logits as its model."""
    scaling = dict(SCALINGS[0])
    model = init_weights(CausalLM(ModelConfig(architecture="LlamaForCausalLM", **BASE, rope_scaling=scaling)),
                         seed=1, std=0.1)
    save_pretrained(model, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "original_max_position_embeddings": 32}))
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32,
                                                        attn_implementation="eager").eval()
    ours = load_pretrained(tmp_path / "m", device="cpu", dtype=torch.float32).eval()
    assert ours.config.rope_scaling["original_max_position_embeddings"] == 32
    ids = torch.randint(0, 97, (60,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_packed([ids]), ref(ids[None]).logits[0], rtol=1e-4, atol=1e-4)


def test_shards_hold_to_max_shard_bytes(tmp_path):
    """Each shard stays within max_shard_bytes (one tensor larger than it alone excepted)."""
    from safetensors import safe_open

    model = init_weights(CausalLM(ModelConfig(**BASE)), seed=3)
    limit = 40_000
    save_pretrained(model, tmp_path / "s", max_shard_bytes=limit)
    index = json.loads((tmp_path / "s" / "model.safetensors.index.json").read_text())
    for name in set(index["weight_map"].values()):
        with safe_open(str(tmp_path / "s" / name), "pt") as f:
            sizes = [f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys()]
        assert sum(sizes) <= limit or len(sizes) == 1, (name, sizes)


def test_config_json_names_the_dtype_of_the_weights(tmp_path):
    """torch_dtype is what transformers' dtype="auto" and vLLM's dtype "auto" load a folder in."""
    model = init_weights(CausalLM(ModelConfig(**BASE)), seed=0).to(torch.bfloat16)
    save_pretrained(model, tmp_path / "b")
    assert json.loads((tmp_path / "b" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b", dtype="auto")
    assert hf.dtype == torch.bfloat16


def test_llama3_scaling_without_original_max_takes_max_position_embeddings():
    """A config.json whose llama3 rope_scaling names no original_max_position_embeddings (transformers
    writes one back, so a folder it saved never tests this): transformers takes max_position_embeddings."""
    d = dict(architectures=["LlamaForCausalLM"], vocab_size=97, hidden_size=32, intermediate_size=48,
             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    hf = transformers.LlamaConfig.from_dict(json.loads(json.dumps(d))).rope_parameters
    ours = ModelConfig.from_hf(json.loads(json.dumps(d)))
    assert ours.rope_scaling["original_max_position_embeddings"] == hf["original_max_position_embeddings"] == 64
