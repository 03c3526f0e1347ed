"""The model's logits equal transformers' Qwen2/Llama on random tiny configs (same weights,
fp32); HF folders round-trip, single-file and sharded."""
import json

import pytest
import torch

from workers.model import CausalLM, CausalAttention, ModelConfig, init_weights, load_pretrained, save_pretrained

transformers = pytest.importorskip("transformers", reason="transformers is the test-only reference")

CASES = [
    dict(architecture="Qwen2ForCausalLM", qkv_bias=True, tie_word_embeddings=True),
    dict(architecture="Qwen2ForCausalLM", qkv_bias=True, tie_word_embeddings=False, num_key_value_heads=1),
    dict(architecture="LlamaForCausalLM", qkv_bias=False, tie_word_embeddings=False),
    dict(architecture="LlamaForCausalLM", qkv_bias=True, o_bias=True, tie_word_embeddings=False,
         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    dict(architecture="LlamaForCausalLM", qkv_bias=False, num_key_value_heads=4,
         rope_scaling={"rope_type": "linear", "factor": 2.0}),
]


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                max_position_embeddings=256)
    base.update(kw)
    return ModelConfig(**base)


def hf_model(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cls = {"Qwen2ForCausalLM": transformers.Qwen2ForCausalLM,
           "LlamaForCausalLM": transformers.LlamaForCausalLM}[cfg["architectures"][0]]
    return cls.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("case", range(len(CASES)))
def test_logits_match_transformers(tmp_path, case):
    torch.manual_seed(case)
    model = init_weights(CausalLM(tiny(**CASES[case])), seed=case, std=0.1)
    save_pretrained(model, tmp_path / "m")
    ref = hf_model(tmp_path / "m")
    ours = load_pretrained(tmp_path / "m", device="cpu", dtype=torch.float32).eval()
    seqs = [torch.randint(0, 97, (n,)) for n in (7, 1, 33)]
    with torch.no_grad():
        packed = ours.forward_packed(seqs)
        off = 0
        for s in seqs:
            want = ref(s[None]).logits[0]
            torch.testing.assert_close(packed[off:off + len(s)], want, rtol=1e-4, atol=1e-4)
            off += len(s)


def test_sharded_roundtrip_and_tied_head(tmp_path):
    model = init_weights(CausalLM(tiny(tie_word_embeddings=True)), seed=3)
    save_pretrained(model, tmp_path / "s", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "s" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "lm_head.weight" not in index["weight_map"]  # tied: as HF writes Qwen2.5-0.5B
    back = load_pretrained(tmp_path / "s", device="cpu", dtype=torch.float32)
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 97, (12,))
    pos = torch.arange(12)
    with torch.no_grad():
        a = model.logits(model(ids, pos, CausalAttention([0, 12])))
        b = back.logits(back(ids, pos, CausalAttention([0, 12])))
    assert torch.equal(a, b)
    ref = hf_model(tmp_path / "s")
    with torch.no_grad():
        torch.testing.assert_close(b, ref(ids[None]).logits[0], rtol=1e-4, atol=1e-4)


def test_save_is_atomic_over_existing(tmp_path):
    m1 = init_weights(CausalLM(tiny()), seed=1)
    m2 = init_weights(CausalLM(tiny()), seed=2)
    save_pretrained(m1, tmp_path / "m")
    save_pretrained(m2, tmp_path / "m")
    back = load_pretrained(tmp_path / "m", device="cpu", dtype=torch.float32)
    assert torch.equal(back.model.norm.weight, m2.model.norm.weight)
    assert torch.equal(back.model.embed_tokens.weight, m2.model.embed_tokens.weight)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temp dirs left behind


def test_bad_config_and_folder_errors(tmp_path):
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tiny(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="architecture"):
        tiny(architecture="GPT2LMHeadModel")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(tmp_path, device="cpu")


@pytest.mark.parametrize("arch, rope", [
    ("Qwen2ForCausalLM", {"rope_theta": 1e6}),
    ("LlamaForCausalLM", {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                             "original_max_position_embeddings": 64}}),
])
def test_folders_written_by_transformers_load_as_they_are(tmp_path, arch, rope):
    # transformers >= 5 writes RoPE as "rope_parameters" (no top-level rope_theta): a folder it
    # saved once loaded with the default theta 10000, logits off by ~4e-3, silently
    cls = {"Qwen2ForCausalLM": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "LlamaForCausalLM": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}[arch]
    cfg = cls[0](vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, **rope)
    torch.manual_seed(0)
    ref = cls[1](cfg).eval()
    ref.save_pretrained(tmp_path / "hf", max_shard_size="100KB")  # sharded, as big checkpoints are
    ours = load_pretrained(tmp_path / "hf", device="cpu", dtype=torch.float32).eval()
    assert ours.config.rope_theta == rope["rope_theta"]
    ids = torch.randint(0, 97, (40,))
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_packed([ids]), ref(ids[None]).logits[0], rtol=1e-5, atol=1e-5)


def test_a_config_without_architectures_or_max_positions_reads_as_transformers():
    """No "architectures": transformers goes by model_type (a llama folder was read as Qwen2
    and failed on missing q/k/v biases); no max_position_embeddings: each class's default
    (Llama 2048, Qwen2 32768; 4096 here changed llama3 RoPE's logits)."""
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)
    llama = ModelConfig.from_hf({**base, "model_type": "llama"})
    assert llama.architecture == "LlamaForCausalLM" and llama.max_position_embeddings == 2048
    qwen = ModelConfig.from_hf({**base, "model_type": "qwen2"})
    assert qwen.architecture == "Qwen2ForCausalLM" and qwen.max_position_embeddings == 32768
    assert transformers.LlamaConfig().max_position_embeddings == 2048
    assert transformers.Qwen2Config().max_position_embeddings == 32768


def test_a_damaged_safetensors_file_is_named(tmp_path):
    save_pretrained(init_weights(CausalLM(tiny()), seed=0), tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])  # a truncated copy
    with pytest.raises(ValueError, match=r"model.safetensors: unreadable safetensors file \(SafetensorError"):
        load_pretrained(tmp_path / "m", device="cpu")


@pytest.mark.parametrize("rope", [
    # both a top-level rope_theta and rope_parameters' (a v5 config edited by hand): rope_parameters' wins
    dict(rope_theta=1e6, rope_parameters={"rope_theta": 1e4, "rope_type": "default"}),
    dict(rope_theta=1e6, rope_parameters={"rope_theta": 2e4, "rope_type": "linear", "factor": 2.0}),
    # a rope_scaling replaces rope_parameters altogether (its theta, its type)
    dict(rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 2.0},
         rope_parameters={"rope_theta": 5e5, "rope_type": "yarn", "factor": 4.0}),
    dict(rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 3e4},
         rope_parameters={"rope_theta": 5e5, "rope_type": "default"}),
    dict(rope_scaling={}, rope_parameters={"rope_theta": 5e5, "rope_type": "linear", "factor": 3.0}),
])
def test_rope_theta_and_scaling_are_read_as_transformers_reads_them(rope):
    d = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **rope)
    hf = transformers.LlamaConfig.from_dict(json.loads(json.dumps(d))).rope_parameters
    ours = ModelConfig.from_hf(json.loads(json.dumps(d)))
    assert ours.rope_theta == hf["rope_theta"]
    kind = "default" if ours.rope_scaling is None else ours.rope_scaling.get("rope_type")
    assert kind == hf["rope_type"]
    if ours.rope_scaling is not None:
        assert ours.rope_scaling["factor"] == hf["factor"]


def test_a_cast_model_keeps_ropes_frequencies_in_fp32():
    """``CausalLM(cfg).to(torch.bfloat16)`` rounded inv_freq to bf16: its logits differed from the
    same weights loaded from disk (whose RoPE is rebuilt in fp32) by up to 0.05 (review, s53)."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, rope_theta=1e6)
    model = CausalLM(cfg)
    want = model.model.rotary_emb.inv_freq.clone()
    cast = model.to(torch.bfloat16)
    assert cast.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(cast.model.rotary_emb.inv_freq, want) and cast.model.embed_tokens.weight.dtype == torch.bfloat16
