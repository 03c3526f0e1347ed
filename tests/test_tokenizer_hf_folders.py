"""Tokenizer.load on HF folders laid out as transformers 5 reads them: special tokens kept only in
special_tokens_map.json, and folders that transformers loads as Qwen2Tokenizer whatever their
tokenizer.json's pipeline."""
import json

import pytest
from tokenizers import Tokenizer as HFTok
from tokenizers import models, pre_tokenizers

from workers.tokenizer import Tokenizer, train_bpe, uses_qwen2_tokenizer

TEXTS = ["sum 12345 678 2", "3+5=8; 8+2=10; answer=10", "hello world 2024", "count 9 by 3"] * 20
SPECIALS = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<s>")
CHAT = "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
# digits, runs of spaces, newlines, punctuation, composed and decomposed accents, CJK, emoji
SAMPLES = ["sum 12345 678 2\nhello  world", "3+5=8;   8+2=10\n\n answer=10 ", "café cafe\u0301 naïve",
           "日本語 テキスト 123", "emoji 🙂 x", "  leading and trailing  ", "it's 1,000,000!"]


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(TEXTS, vocab_size=320, special_tokens=SPECIALS)


@pytest.fixture(scope="module")
def gpt2_bpe():
    return train_bpe(TEXTS, vocab_size=320, special_tokens=SPECIALS, split="gpt2")


def make_folder(tok, path, model_type="llama", special_tokens_map=None, drop=(), **cfg_extra):
    """A folder saved by ``tok.save`` with config.json's ``model_type``, tokenizer_config.json
    without the keys in ``drop`` and with ``cfg_extra``, and optionally a special_tokens_map.json."""
    tok.save(path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg = {k: v for k, v in {**cfg, **cfg_extra}.items() if k not in drop}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    if special_tokens_map is not None:
        (path / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
    return path


def auto_tokenizer(path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path))


# ---- special_tokens_map.json -------------------------------------------------------------------
def test_special_tokens_map_names_the_tokens_tokenizer_config_lacks(bpe, tmp_path):
    """A folder keeping its special tokens only in special_tokens_map.json (string and AddedToken
    dict forms) had EOS '<|endoftext|>' invented and no BOS/PAD: the chat rendered 'sum 3 5<|endoftext|>'
    where transformers renders '<s>sum 3 5<|im_end|>'."""
    folder = make_folder(bpe, tmp_path / "m", drop=("eos_token", "bos_token", "pad_token"), chat_template=CHAT,
                         special_tokens_map={"bos_token": "<s>", "pad_token": "<|pad|>",
                                             "eos_token": {"content": "<|im_end|>", "lstrip": False,
                                                           "rstrip": False, "normalized": False,
                                                           "single_word": False}})
    ours = Tokenizer.load(folder)
    assert (ours.eos_token, ours.bos_token, ours.pad_token) == ("<|im_end|>", "<s>", "<|pad|>")
    assert ours.eos_id == bpe.tok.token_to_id("<|im_end|>")
    msgs = [{"role": "user", "content": "sum 3 5"}]
    assert ours.format_prompt("sum 3 5") == "<s>sum 3 5<|im_end|>"
    hf = auto_tokenizer(folder)
    assert (hf.eos_token, hf.bos_token, hf.pad_token) == (ours.eos_token, ours.bos_token, ours.pad_token)
    assert ours.format_prompt("sum 3 5") == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.encode_prompt("sum 3 5") == hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True,
                                                                   return_dict=False)


@pytest.mark.parametrize("with_added_tokens_decoder", [False, True])
def test_special_tokens_map_wins_unless_tokenizer_config_has_added_tokens_decoder(
        bpe, tmp_path, with_added_tokens_decoder):
    """As transformers: special_tokens_map.json's entries (even null) override tokenizer_config.json's
    in a folder without ``added_tokens_decoder``; with one, the map is not read."""
    extra = {"added_tokens_decoder": {}} if with_added_tokens_decoder else {}
    folder = make_folder(bpe, tmp_path / "m", special_tokens_map={"eos_token": "<|im_end|>", "pad_token": None},
                         **extra)
    ours = Tokenizer.load(folder)
    want = ("<|endoftext|>", "<|pad|>") if with_added_tokens_decoder else ("<|im_end|>", None)
    assert (ours.eos_token, ours.pad_token) == want
    hf = auto_tokenizer(folder)
    assert (hf.eos_token, hf.pad_token) == want


def test_a_folder_naming_no_eos_token_is_refused(bpe, tmp_path):
    """No EOS in tokenizer_config.json nor special_tokens_map.json: refused naming both files, not
    defaulted to '<|endoftext|>' (a token the folder never named as its EOS)."""
    folder = make_folder(bpe, tmp_path / "m", drop=("eos_token",), special_tokens_map={"bos_token": "<s>"})
    with pytest.raises(ValueError, match=r"no eos_token in .*tokenizer_config\.json or .*special_tokens_map\.json"):
        Tokenizer.load(folder)
    (folder / "special_tokens_map.json").unlink()
    with pytest.raises(ValueError, match="special_tokens_map.json"):
        Tokenizer.load(folder)


def test_a_broken_special_tokens_map_is_named(bpe, tmp_path):
    folder = make_folder(bpe, tmp_path / "m")
    (folder / "special_tokens_map.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"special_tokens_map\.json: not valid JSON"):
        Tokenizer.load(folder)


# ---- folders transformers loads as Qwen2Tokenizer ----------------------------------------------------
@pytest.mark.parametrize("tokenizer_class", [None, "PreTrainedTokenizerFast", "GPT2TokenizerFast",
                                             "LlamaTokenizerFast", "Qwen2TokenizerFast"])
def test_qwen2_folder_with_a_gpt2_split_tokenizes_as_transformers(gpt2_bpe, tmp_path, tokenizer_class):
    """transformers 5 loads any ``model_type: qwen2`` folder as Qwen2Tokenizer, imposing NFC and
    Qwen2's split over tokenizer.json's: with a GPT-2 split tokenizer.json we kept "12345" whole
    where transformers (and vLLM) split it digit by digit."""
    folder = make_folder(gpt2_bpe, tmp_path / "m", model_type="qwen2", tokenizer_class=tokenizer_class,
                         drop=("tokenizer_class",) if tokenizer_class is None else ())
    ours = Tokenizer.load(folder)
    digits = ours.encode("12345")
    assert len(digits) == 5 and ours.decode(digits) == "12345"
    hf = auto_tokenizer(folder)
    assert type(hf).__name__ == "Qwen2Tokenizer"
    for text in SAMPLES:
        assert ours.encode(text, add_special_tokens=True) == hf(text)["input_ids"], text
        assert ours.decode(ours.encode(text)) == hf.decode(hf(text)["input_ids"]), text


@pytest.mark.parametrize("model_type,tokenizer_class,expected", [
    ("qwen2", "GPT2TokenizerFast", True), ("qwen2", None, True), ("qwen3", None, True),
    ("qwen3", "PreTrainedTokenizerFast", False), ("llama", "Qwen2TokenizerFast", True),
    ("llama", None, False), ("llama", "PreTrainedTokenizerFast", False)])
def test_which_folders_load_as_qwen2_tokenizer(gpt2_bpe, tmp_path, model_type, tokenizer_class, expected):
    folder = make_folder(gpt2_bpe, tmp_path / "m", model_type=model_type, tokenizer_class=tokenizer_class,
                         drop=("tokenizer_class",) if tokenizer_class is None else ())
    assert uses_qwen2_tokenizer(folder) is expected
    ours, hf = Tokenizer.load(folder), auto_tokenizer(folder)
    assert (type(hf).__name__ == "Qwen2Tokenizer") is expected
    for text in SAMPLES[:3]:
        assert ours.encode(text, add_special_tokens=True) == hf(text)["input_ids"], text


def test_qwen2_folder_with_a_non_bpe_tokenizer_is_refused(tmp_path):
    tok = HFTok(models.WordLevel({"<|endoftext|>": 0, "[UNK]": 1, "a": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    make_folder(Tokenizer(tok, pad_token=None), tmp_path / "m", model_type="qwen2")
    with pytest.raises(ValueError, match=r"tokenizer\.json: a WordLevel model.*Qwen2Tokenizer"):
        Tokenizer.load(tmp_path / "m")
