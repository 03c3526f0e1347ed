"""A model folder's weights and tokenizer checked by the controller before any worker loads
them (workers/model_check.py, controller/preflight.py): each broken folder is one config error
naming the file and the tensor. Each of these was a traceback from every worker rank."""
import json
import shutil

import pytest
import torch

from controller.config import ConfigError
from controller.preflight import check_model_folder
from workers.model import CausalLM, ModelConfig, init_weights, load_pretrained, save_pretrained
from workers.model_check import check_weights
from workers.tokenizer import train_bpe

CFG = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    p = tmp_path_factory.mktemp("m") / "model"
    save_pretrained(init_weights(CausalLM(CFG)), p, max_shard_bytes=20_000)  # sharded, with an index
    train_bpe(["1 + 2 = 3", "4 + 5 = 9"] * 10, vocab_size=300).save(p)
    return p


def broken(folder, tmp_path, change):
    p = tmp_path / "broken"
    shutil.copytree(folder, p)
    change(p)
    with pytest.raises(ConfigError) as e:
        check_model_folder(p)
    return str(e.value).replace(str(p), "DIR")


def edit_config(**kw):
    def change(p):
        c = json.loads((p / "config.json").read_text())
        (p / "config.json").write_text(json.dumps({**c, **kw}))
    return change


def test_a_good_folder_passes_and_loads(folder):
    check_model_folder(folder)
    check_weights(folder)
    assert load_pretrained(folder, "cpu").config.hidden_size == 32


def test_missing_weights(folder, tmp_path):
    def drop(p):
        for f in p.glob("*.safetensors*"):
            f.unlink()
    assert broken(folder, tmp_path, drop) == ("model.path: DIR: no *.safetensors files (and no "
                                              "model.safetensors.index.json)")


def test_a_shard_the_index_names_is_gone(folder, tmp_path):
    def drop(p):
        sorted(p.glob("model-*.safetensors"))[1].unlink()
    assert "model-00002-of-" in broken(folder, tmp_path, drop) and "named by model.safetensors.index.json but " \
        "not there" in broken(folder, tmp_path / "b", drop)


def test_a_truncated_shard(folder, tmp_path):
    def cut(p):
        f = sorted(p.glob("model-*.safetensors"))[0]
        f.write_bytes(f.read_bytes()[:-100])
    said = broken(folder, tmp_path, cut)
    assert said.startswith("model.path: DIR/model-00001-of-") and "unreadable safetensors file" in said


@pytest.mark.parametrize("change,said", [
    (dict(vocab_size=320), "shapes: model.embed_tokens.weight [300, 32] in model-00001-of-"),
    (dict(num_hidden_layers=3), "missing ['model.layers.2."),
    (dict(num_hidden_layers=1), "unexpected ['model.layers.1."),
    (dict(intermediate_size=48), "model.layers.0.mlp.gate_proj.weight [64, 32]"),
])
def test_a_config_json_that_does_not_match_the_weights(folder, tmp_path, change, said):
    msg = broken(folder, tmp_path, edit_config(**change))
    assert msg.startswith("model.path: DIR: the weights do not match config.json: ") and said in msg, msg


def test_a_broken_tokenizer_json(folder, tmp_path):
    said = broken(folder, tmp_path, lambda p: (p / "tokenizer.json").write_text('{"model" 1}'))
    assert said.startswith("model.path: DIR/tokenizer.json: not a tokenizer the tokenizers library reads (")


def test_untied_weights_need_lm_head(folder, tmp_path):
    assert "missing ['lm_head.weight']" in broken(folder, tmp_path, edit_config(tie_word_embeddings=False))


def test_model_safetensors_wins_over_other_files_and_an_index(folder, tmp_path):
    """transformers loads model.safetensors alone (a Mistral consolidated.safetensors or an adapter
    beside it is not the model's) and prefers it over an index; so do check_weights and load_pretrained."""
    from safetensors.torch import save_file

    single = save_pretrained(init_weights(CausalLM(CFG)), tmp_path / "single")
    train_bpe(["1 + 2 = 3", "4 + 5 = 9"] * 10, vocab_size=300).save(single)
    assert (single / "model.safetensors").is_file()
    save_file({"layers.0.attention.wq.weight": torch.zeros(4, 4)}, str(single / "consolidated.safetensors"))
    check_weights(single)
    check_model_folder(single)
    assert load_pretrained(single, "cpu").config.hidden_size == 32
    # model.safetensors beside a sharded index: the single file is read, the index ignored
    both = tmp_path / "both"
    shutil.copytree(folder, both)
    shutil.copy(single / "model.safetensors", both / "model.safetensors")
    sorted(both.glob("model-*.safetensors"))[0].unlink()
    check_weights(both)
    assert load_pretrained(both, "cpu").config.hidden_size == 32


def test_load_pretrained_names_the_shard_of_a_wrong_tensor_itself(folder, tmp_path):
    """A worker or script loading a folder the controller never checked got torch's size-mismatch
    RuntimeError naming no file (review, session 52)."""
    p = tmp_path / "m"
    shutil.copytree(folder, p)
    edit_config(intermediate_size=48)(p)
    with pytest.raises(ValueError, match=r"the weights do not match config.json: shapes: model.layers.0.mlp.gate_proj"
                                         r".weight \[64, 32\] in model-0000\d-of-"):
        load_pretrained(p, "cpu")


def test_a_bf16_load_matches_the_fp32_one_cast(folder):
    """Built in its dtype (no fp32 model beside the bf16 one while loading): the same weights as an
    fp32 load cast to bf16, tied as before, RoPE's frequencies fp32."""
    a, b = load_pretrained(folder, "cpu", torch.bfloat16), load_pretrained(folder, "cpu", torch.float32)
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert x.dtype == torch.bfloat16 and torch.equal(x, y.to(torch.bfloat16)), name
    assert a.lm_head.weight is a.model.embed_tokens.weight
    assert a.model.rotary_emb.inv_freq.dtype == torch.float32


@pytest.mark.parametrize("rope,said", [
    ({"rope_type": "linear", "factor": 0}, "rope_scaling factor must be a number > 0, got 0"),
    ({"rope_type": "linear", "factor": -2.0}, "rope_scaling factor must be a number > 0, got -2.0"),
    ({"rope_type": "linear", "factor": "4"}, "rope_scaling factor must be a number > 0, got '4'"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 64}, "rope_scaling high_freq_factor 1.0 must be above low_freq_factor 4.0"),
    ("linear", "rope_scaling must be an object"),
])
def test_a_rope_scaling_that_would_break_attention_is_refused(folder, tmp_path, rope, said):
    """A factor 0 gave inf frequencies, NaN cos / sin, and CPU attention returned zeros: finite,
    wrong logits, no word (review, session 52)."""
    p = tmp_path / "m"
    shutil.copytree(folder, p)
    edit_config(rope_scaling=rope)(p)
    with pytest.raises(ValueError, match="config.json: " + said.replace("(", r"\(")):
        load_pretrained(p, "cpu")


def test_a_config_json_without_a_required_key_names_it(folder, tmp_path):
    p = tmp_path / "m"
    shutil.copytree(folder, p)
    c = json.loads((p / "config.json").read_text())
    del c["hidden_size"], c["num_hidden_layers"]
    (p / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match=r"config.json: missing 'hidden_size', 'num_hidden_layers': a "
                                         r"Qwen2ForCausalLM config.json gives them"):
        load_pretrained(p, "cpu")


@pytest.mark.parametrize("key, value, said", [
    ("vocab_size", 300.0, "vocab_size must be a whole number >= 0, got 300.0"),
    ("vocab_size", "300", "vocab_size must be a whole number >= 0, got '300'"),
    ("head_dim", "8", "head_dim must be a whole number >= 0 or null, got '8'"),
    ("max_position_embeddings", None, "max_position_embeddings must be a whole number >= 0, got None"),
    ("rms_norm_eps", None, "rms_norm_eps must be a positive number, got None"),
    ("rope_theta", None, "rope_theta must be a positive number, got None"),
    ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false, got 'false'"),
    ("architectures", "Qwen2ForCausalLM", 'architectures must be a list of names (["Qwen2ForCausalLM"]), '
                                          "got 'Qwen2ForCausalLM'"),
])
def test_config_json_values_of_the_wrong_type_are_named_with_the_key(folder, tmp_path, key, value, said):
    """A string or a float where a count goes was blamed on tokenizer.json, or accepted and left to
    fail on the workers (``max_position_embeddings: null``); ``"tie_word_embeddings": "false"``
    read as true (review, s55)."""
    assert broken(folder, tmp_path, edit_config(**{key: value})) == f"model.path: DIR/config.json: {said}"


def test_a_config_json_that_is_no_object_or_a_folder_is_named(folder, tmp_path):
    assert broken(folder, tmp_path / "a", lambda p: (p / "config.json").write_text("[1, 2]")) == \
        "model.path: DIR/config.json: expected a JSON object, got list"

    def folder_named_config(p):
        (p / "config.json").unlink()
        (p / "config.json").mkdir()
    assert broken(folder, tmp_path / "b", folder_named_config).startswith("model.path: DIR/config.json: cannot be read as JSON")
