"""ModelConfig only takes what the architecture's HF config.json can say (biases), and
``from_hf`` refuses what changes transformers' forward pass and is not implemented here, naming
the file and the key, instead of computing other logits."""
import json
from dataclasses import asdict, replace

import pytest
import torch

from test_model import hf_model
from workers.model import CausalLM, ModelConfig, init_weights, load_pretrained, save_pretrained

transformers = pytest.importorskip("transformers", reason="transformers is the test-only reference")
torch.set_num_threads(1)

BASE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
SEQS = [torch.tensor([3, 14, 15, 92, 65, 35, 89, 79, 32, 38]), torch.tensor([2, 71, 82])]


def randomized(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if "norm" in n else 0.0))
    return model


def ours_logits(m):
    with torch.no_grad():
        return m.forward_packed(SEQS)


def hf_logits(m):
    with torch.no_grad():
        return torch.cat([m(input_ids=s[None]).logits[0] for s in SEQS])


def test_llama_defaults_save_a_folder_both_load(tmp_path):
    """ModelConfig(architecture=Llama) kept Qwen2's qkv_bias=True, o_bias=False and saved
    attention_bias: true; load_pretrained then refused its own folder (no o_proj.bias)."""
    cfg = ModelConfig(**BASE, architecture="LlamaForCausalLM")
    assert (cfg.has_qkv_bias, cfg.has_o_bias, cfg.mlp_bias) == (False, False, False)
    m = randomized(CausalLM(cfg)).eval()
    folder = save_pretrained(m, tmp_path / "llama")
    assert json.loads((folder / "config.json").read_text())["attention_bias"] is False
    back = load_pretrained(folder, "cpu", torch.float32).eval()
    assert torch.equal(ours_logits(back), ours_logits(m))
    torch.testing.assert_close(hf_logits(hf_model(folder)), ours_logits(m), atol=1e-4, rtol=1e-4)


def test_llama_attention_bias_covers_qkv_and_o(tmp_path):
    one = ModelConfig(**BASE, architecture="LlamaForCausalLM", qkv_bias=True)
    assert (one.has_qkv_bias, one.has_o_bias) == (True, True)
    cfg = ModelConfig(**BASE, architecture="LlamaForCausalLM", qkv_bias=True, o_bias=True, mlp_bias=True)
    m = randomized(CausalLM(cfg)).eval()
    folder = save_pretrained(m, tmp_path / "llama_bias")
    d = json.loads((folder / "config.json").read_text())
    assert (d["attention_bias"], d["mlp_bias"]) == (True, True)
    assert ModelConfig.from_hf(d) == replace(cfg, head_dim=cfg.dim_head)
    torch.testing.assert_close(hf_logits(hf_model(folder)), ours_logits(m), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours_logits(load_pretrained(folder, "cpu", torch.float32)), ours_logits(m))


@pytest.mark.parametrize("arch,kw,names", [
    ("LlamaForCausalLM", dict(qkv_bias=True, o_bias=False), "qkv_bias=True with o_bias=False"),
    ("LlamaForCausalLM", dict(qkv_bias=False, o_bias=True), "qkv_bias=False with o_bias=True"),
    ("Qwen2ForCausalLM", dict(mlp_bias=True), "mlp_bias=True"),
    ("Qwen2ForCausalLM", dict(o_bias=True), "o_bias=True"),
    ("Qwen2ForCausalLM", dict(qkv_bias=False), "qkv_bias=False"),
])
def test_bias_combinations_hf_cannot_express_are_refused(arch, kw, names):
    """Qwen2 with mlp_bias=True saved a folder transformers loaded without the MLP biases
    (logits 4.5 apart); Llama with q/k/v but no o bias could not be loaded back."""
    with pytest.raises(ValueError, match=names):
        ModelConfig(**BASE, architecture=arch, **kw)


def test_a_config_copied_with_another_architecture_takes_its_defaults():
    """controller/bootstrap.py builds ``ModelConfig(**{**asdict(TINY), **model.init})``: a run
    config's ``model.init: {architecture: LlamaForCausalLM}`` must get Llama's biases, not
    Qwen2's (whose folder the trainer then failed to load)."""
    qwen = ModelConfig(**BASE)
    assert (qwen.has_qkv_bias, qwen.has_o_bias) == (True, False)
    assert qwen == ModelConfig(**BASE, qkv_bias=True, o_bias=False)  # a default given is the default
    for llama in (ModelConfig(**{**asdict(qwen), "architecture": "LlamaForCausalLM"}),
                  replace(qwen, architecture="LlamaForCausalLM")):
        assert (llama.has_qkv_bias, llama.has_o_bias, llama.mlp_bias) == (False, False, False)
    biased = ModelConfig(**BASE, architecture="LlamaForCausalLM", qkv_bias=True)
    with pytest.raises(ValueError, match="Qwen2ForCausalLM"):  # an explicit non-default stays
        replace(biased, architecture="Qwen2ForCausalLM")


def test_run_config_model_init_llama_trains(tmp_path):
    """The run-config path end to end: controller.bootstrap.ensure_model with model.init
    {architecture: LlamaForCausalLM} builds a folder the trainer loads."""
    from controller.bootstrap import ensure_model
    from workers.trainer import TrainerConfig, TrainerWorker
    from tests.trainer_helpers import synthetic_task

    init = {"architecture": "LlamaForCausalLM", "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64}
    out = ensure_model(str(tmp_path / "llama_init"), init, "synthetic",
                       {"max_terms": 3, "num_train": 32, "num_test": 8}, sft_steps=0, sft_lr=1e-3, seed=0)
    assert json.loads((tmp_path / "llama_init" / "config.json").read_text())["attention_bias"] is False
    TrainerWorker(TrainerConfig(), out["path"], synthetic_task(), device="cpu")


def hf_folder(tmp_path, name, arch, **cfg_kw):
    cls = getattr(transformers, arch)
    conf = (transformers.Qwen2Config if arch.startswith("Qwen2") else transformers.LlamaConfig)(**BASE, **cfg_kw)
    torch.manual_seed(0)
    m = randomized(cls(conf)).eval()
    m.save_pretrained(tmp_path / name)
    return tmp_path / name, m


@pytest.mark.parametrize("name,arch,kw,key", [
    ("qwen2_sliding", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=4, max_window_layers=0),
     "use_sliding_window"),
    ("llama_gelu", "LlamaForCausalLM", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    ("llama_yarn", "LlamaForCausalLM", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                          "original_max_position_embeddings": 32}),
     "rope_parameters type 'yarn'"),
    ("llama_dynamic", "LlamaForCausalLM", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
     "rope_parameters type 'dynamic'"),
])
def test_forward_changing_keys_are_refused_naming_file_and_key(tmp_path, name, arch, kw, key):
    """A Qwen2 sliding window shorter than the context ran as full attention (logits 12.8 from
    transformers'); Llama's gelu ran as SiLU (2.44)."""
    folder, _ = hf_folder(tmp_path, name, arch, **kw)
    with pytest.raises(ValueError, match=f"{folder / 'config.json'}: {key}"):
        load_pretrained(folder, "cpu", torch.float32)


@pytest.mark.parametrize("name,arch,kw", [
    ("qwen2_window_off", "Qwen2ForCausalLM", dict(use_sliding_window=False, sliding_window=4)),
    ("qwen2_window_no_layer", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=4, max_window_layers=2)),
    ("qwen2_window_long", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=64, max_window_layers=0)),
    ("llama_swish", "LlamaForCausalLM", dict(hidden_act="swish")),
    ("llama_pretraining_tp", "LlamaForCausalLM", dict(pretraining_tp=2)),
    ("llama3_no_original_max", "LlamaForCausalLM", dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})),
])
def test_keys_that_leave_the_forward_alone_load_and_match(tmp_path, name, arch, kw):
    folder, hf = hf_folder(tmp_path, name, arch, **kw)
    ours = load_pretrained(folder, "cpu", torch.float32).eval()
    torch.testing.assert_close(ours_logits(ours), hf_logits(hf), atol=1e-4, rtol=1e-4)


def test_qwen2_ignores_bias_keys_as_transformers_does():
    d = {**BASE, "architectures": ["Qwen2ForCausalLM"], "attention_bias": False, "mlp_bias": True}
    cfg = ModelConfig.from_hf(d)
    assert (cfg.has_qkv_bias, cfg.has_o_bias, cfg.mlp_bias) == (True, False, False)


def test_quantized_config_refused():
    d = {**BASE, "architectures": ["LlamaForCausalLM"], "quantization_config": {"quant_method": "gptq", "bits": 4}}
    with pytest.raises(ValueError, match="x/config.json: quantization_config"):
        ModelConfig.from_hf(d, "x/config.json")


def test_save_pretrained_copies_extra_folders_and_refuses_clobbering(tmp_path):
    m = init_weights(CausalLM(ModelConfig(**BASE)), seed=0)
    extra = tmp_path / "src"
    (extra / "additional_chat_templates").mkdir(parents=True)
    (extra / "additional_chat_templates" / "rag.jinja").write_text("RAG")
    (extra / "generation_config.json").write_text("{}")
    out = save_pretrained(m, tmp_path / "out", extra_files=[extra / "additional_chat_templates",
                                                           extra / "generation_config.json"])
    assert (out / "additional_chat_templates" / "rag.jinja").read_text() == "RAG"
    assert (out / "generation_config.json").read_text() == "{}"
    (extra / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="config.json"):
        save_pretrained(m, tmp_path / "out2", extra_files=[extra / "config.json"])
    assert not (tmp_path / "out2").exists() and not list(tmp_path.glob(".out2.tmp*"))
