"""Byte-level BPE trained in-process, save/load, eos/pad, chat template vs transformers."""
import json

import pytest

from workers.tokenizer import Tokenizer, train_bpe

TEXTS = ["sum 3 5 2", "3+5=8; 8+2=10; answer=10", "hello world", "count 9 by 3"] * 20
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tok():
    return train_bpe(TEXTS, vocab_size=300, special_tokens=("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"))


def test_roundtrip_and_special_ids(tok):
    for text in ["sum 3 5 2", "unseen ✓ text", ""]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.eos_id == tok.tok.token_to_id("<|endoftext|>")
    assert tok.pad_id == tok.tok.token_to_id("<|pad|>") != tok.eos_id
    assert tok.decode(tok.encode("ab") + [tok.eos_id]) == "ab"  # special tokens skipped
    assert 256 < tok.vocab_size <= 300
    assert len(tok.encode("answer=10")) < len("answer=10")  # merges learned


def test_save_load(tok, tmp_path):
    tok.save(tmp_path)
    back = Tokenizer.load(tmp_path)
    assert back.encode("8+2=10") == tok.encode("8+2=10")
    assert (back.eos_id, back.pad_id) == (tok.eos_id, tok.pad_id)
    assert back.format_prompt("hi") == "hi\n"


def test_plain_template(tok):
    t = Tokenizer(tok.tok, prompt_template="Q: {prompt}\nA:")
    assert t.format_prompt("2+2") == "Q: 2+2\nA:"
    with pytest.raises(ValueError, match="prompt_template"):
        Tokenizer(tok.tok, prompt_template="no placeholder")


def test_missing_files_and_tokens(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.load(tmp_path / "nope")
    with pytest.raises(ValueError, match="eos_token"):
        Tokenizer(tok.tok, eos_token="<|missing|>")
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(TEXTS, vocab_size=100)


def test_chat_template_matches_transformers(tok, tmp_path):
    transformers = pytest.importorskip("transformers")
    tok.chat_template = TEMPLATE
    tok.save(tmp_path)
    ours = Tokenizer.load(tmp_path)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                                              eos_token="<|endoftext|>", pad_token="<|pad|>")
    hf.chat_template = TEMPLATE
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sum 3 5"}]
    for gen in (True, False):
        assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == hf.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=gen)
    assert ours.format_prompt("sum 3 5") == hf.apply_chat_template(
        [{"role": "user", "content": "sum 3 5"}], tokenize=False, add_generation_prompt=True)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_transformers_tokenizes_a_saved_model_folder_as_we_do(tok, tmp_path, model_type):
    """transformers 5 loads a ``model_type: qwen2`` folder's tokenizer as Qwen2Tokenizer, which
    imposes Qwen2's normalizer and split over tokenizer.json's: our BPE uses the same pipeline,
    so a saved policy is tokenized alike by transformers and vLLM (it split "12" as one token
    and transformers as two before). Llama folders load as tokenizer.json says."""
    transformers = pytest.importorskip("transformers")
    from workers.model import CausalLM, ModelConfig, init_weights, save_pretrained

    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    folder = save_pretrained(init_weights(CausalLM(cfg), seed=0), tmp_path / "m")
    meta = json.loads((folder / "config.json").read_text())
    meta["model_type"] = model_type
    (folder / "config.json").write_text(json.dumps(meta))
    tok.save(folder)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    for text in ["1 + 2 = 12", "what is 123 + 7 ?  x", "héllo\nworld", "it's 3.14!!\r\n\tok", "e\u0301 café"]:
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text), text
